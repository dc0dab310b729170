"""What collective_rpc may run on a worker, and how a function travels to it: a name of the
runner's public methods, save those whose effects the engine tracks itself, or a function pickled
on the wire, unpickled only where the operator allows it.

Mirrors the worker side of collective_rpc in vllm/v1/executor/abstract.py and vLLM's msgpack
handling of callables (vllm/v1/serial_utils.py, VLLM_ALLOW_INSECURE_SERIALIZATION). Left out:
vLLM's other pickled types (only a callable goes pickled here).
"""

import os
from collections.abc import Callable
from functools import partial

import msgspec

INSECURE_SERIALIZATION_ENV = "MINICORE_ALLOW_INSECURE_SERIALIZATION"
# The msgpack extension code of a pickled callable (collective_rpc's method) on the wire.
PICKLED_CALLABLE_EXT = 1


def resolve_worker_call(runner, method) -> Callable:
    """The runner's public method of that name, or method (a callable, or one pickled on the
    wire) bound to the runner."""
    if isinstance(method, PickledCallable):
        method = method.load()
    if callable(method):
        return partial(method, runner)
    if method in ENGINE_OWNED:
        raise ValueError(f"collective_rpc: {method!r} changes state the engine keeps itself; "
                         f"{ENGINE_OWNED[method]}")
    if not isinstance(method, str) or method.startswith("_") or not callable(
            getattr(runner, method, None)):
        raise ValueError(f"collective_rpc: the worker has no public method {method!r}")
    return getattr(runner, method)


# The runner's methods whose effects the engine tracks (its KV blocks, its sleep level, its
# weight version, its step): run behind its back they freed the KV cache or weights under a
# running batch, or garbled a stream. Each is refused by name, saying what to call instead.
_UPDATE = "update weights between start_weight_update and its finish (POST /update_weights)"
ENGINE_OWNED = {
    "sleep": "call the engine's sleep (POST /sleep)",
    "wake_up": "call the engine's wake_up (POST /wake_up)",
    "load_weights": _UPDATE, "update_weights": _UPDATE,
    "init_kv_cache": "the engine allocates its KV cache once, at start-up",
    "bind_weights": "the engine binds its weights itself, at start-up and wake-up",
    **dict.fromkeys(("execute_model", "execute_dummy_batch"),
                    "the engine's busy loop runs every forward"),
    "pop_step_time": "the engine reads its step times itself",
}


class PickledCallable:
    """A callable as it arrived over the socket: unpickled only where the operator allows it."""

    def __init__(self, data: bytes):
        self.data = data

    def load(self) -> Callable:
        if os.environ.get(INSECURE_SERIALIZATION_ENV) != "1":
            raise ValueError(f"collective_rpc got a pickled function, which runs arbitrary code: "
                             f"set {INSECURE_SERIALIZATION_ENV}=1 to allow it, or name a method")
        import cloudpickle

        return cloudpickle.loads(self.data)


def encode_callable(obj):
    """The frontend's msgpack enc_hook: a callable (collective_rpc's method) goes pickled."""
    if callable(obj):
        import cloudpickle

        return msgspec.msgpack.Ext(PICKLED_CALLABLE_EXT, cloudpickle.dumps(obj))
    raise NotImplementedError(f"cannot send a {type(obj).__name__} to the engine")


def decode_ext(code: int, data: memoryview):
    """The engine's msgpack ext_hook for UTILITY arguments."""
    if code != PICKLED_CALLABLE_EXT:
        raise ValueError(f"unknown msgpack extension {code}")
    return PickledCallable(bytes(data))
