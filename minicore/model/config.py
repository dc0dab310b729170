"""ModelConfig: which model the engine runs, how it loads it, and the model side's defaults.

Mirrors vllm/config/model.py (ModelConfig: model, tokenizer, dtype, seed, max_logprobs,
generation_config, try_get_generation_config, get_diff_sampling_param) with minicore's --runner
(the model runner, from minicore/model/registry.py) and the simulated runner's cost. Pure Python,
a part of EngineConfig (minicore/config.py). Left out: quantization, hf_overrides, tokenizer modes,
revision pinning, multimodal settings.
"""

import os
from dataclasses import dataclass, field
from typing import Literal, get_args

from minicore.arg_utils import (
    RUNTIME,
    check_generation_config,
    diff_sampling_param,
    flag,
    read_generation_config,
    resolve_chat_template,
)
from minicore.model.registry import MODEL_RUNNERS, runner_info

# vLLM's switch for batch invariance (vllm/envs.py), the default of --batch-invariant here.
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
# --runner's choices: the registry's names (minicore/model/registry.py).
ModelRunnerKind = Literal[tuple(MODEL_RUNNERS)]
# vLLM's --dtype choices; "auto" is resolved where torch is (minicore.model.loader,
# resolve_auto_dtype), since this module stays pure Python.
ModelDType = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]


@dataclass(slots=True)
class SimulatedCost:
    """The simulated runner's step time in seconds: step_s + prefill_token_s per prefill token +
    decode_seq_s per decoding request. All 0: every step returns at once."""
    step_s: float = 0.0
    prefill_token_s: float = 0.0
    decode_seq_s: float = 0.0

    def __post_init__(self):
        for name in ("step_s", "prefill_token_s", "decode_seq_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")


@dataclass(slots=True)
class ModelConfig:
    model: str | None = flag(
        None, "safetensors directory or .gguf file (default: SmolLM2-135M-Instruct)")
    # The model as the user named it, kept by resolve_model when it makes `model` this machine's
    # directory (a GGUF's conversion): a Ray rank on another node resolves it there.
    model_source: str | None = field(default=None, metadata=RUNTIME)
    tokenizer: str | None = flag(
        None, "a local tokenizer directory, when not the model's own (default: the model's)")
    dtype: ModelDType = flag(
        "auto", "the weights' dtype; auto: bfloat16 on CUDA and on CPUs with native bfloat16 (AMX "
                "or AVX512-BF16), else float32; half is float16, "
                "float is float32")
    device: str | None = flag(None, "cpu, cuda or cuda:N (default: CUDA when available)")
    seed: int = flag(0, "seeds the engine's random state, as vLLM's --seed: requests that bring "
                         "no seed of their own sample from it, so a fresh engine repeats them")
    max_logprobs: int = flag(
        20, "most logprobs (and prompt logprobs) one request may ask for per token, as vLLM's "
            "--max-logprobs; -1: no bound (the whole vocabulary)")
    chat_template: str | None = flag(
        None, "the chat template: a file's path, or the template itself (default: the "
              "tokenizer's)")
    generation_config: str = flag(
        "auto", "where unset sampling fields take their defaults from, as vLLM's flag: auto: the "
                "model's generation_config.json (temperature, top_p, top_k, min_p, penalties, "
                "max_new_tokens); vllm: vLLM's neutral defaults; or a folder holding a "
                "generation_config.json. Its eos_token_id list adds stop ids in every mode")
    trust_remote_code: bool = flag(
        False, "accepted for vLLM's command lines; no effect: minicore runs only the model "
               "classes built into transformers and never runs a model's own code")
    enforce_eager: bool = flag(
        False, "accepted for vLLM's command lines; no effect: minicore always runs eagerly (it "
               "captures no CUDA graphs)")
    enable_sleep_mode: bool = flag(
        False, "accepted for vLLM's command lines; no effect: sleep and wake_up always work here "
               "(vLLM needs it to allocate through its CuMemAllocator; minicore releases and "
               "restores the tensors themselves)")
    batch_invariant: bool | None = flag(
        None, "a request's tokens and logprobs are a function of the request alone, bit for bit, "
              "whatever else is in the batch, however its prompt is chunked, with drafts or "
              "without (vLLM's VLLM_BATCH_INVARIANT=1 or 0 sets the default): every linear "
              "layer runs minicore's kernel and every token's attention the decode kernel, each "
              "summing in one order; needs those kernels (a C compiler); not on CUDA. Default: "
              "on for CPU where the kernels build (a long prompt's prefill costs more, "
              "docs/BENCHMARKS.md), off on CUDA")
    runner: ModelRunnerKind = flag(
        "transformers", "; ".join(f"{name}: {info.help}" for name, info in MODEL_RUNNERS.items()))
    simulated_cost: SimulatedCost = field(default_factory=SimulatedCost, metadata={
        "help": "the simulated runner's step time, e.g. "
                '\'{"step_s": 0.01, "prefill_token_s": 1e-5, "decode_seq_s": 1e-4}\''})

    def __post_init__(self):
        runner_info(self.runner)  # an unknown runner: ValueError naming the choices
        if self.batch_invariant is None and os.environ.get(BATCH_INVARIANT_ENV, ""):
            self.batch_invariant = os.environ[BATCH_INVARIANT_ENV] != "0"
        if self.dtype not in get_args(ModelDType):
            raise ValueError(f"dtype must be one of {', '.join(get_args(ModelDType))}, "
                             f"got {self.dtype!r}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= -1, got {self.max_logprobs}")
        check_generation_config(self.generation_config)
        resolve_chat_template(self.chat_template)  # a file that cannot be read: refused now

    def try_get_generation_config(self) -> dict:
        """--generation-config's generation_config.json (the model's for auto and vllm: its
        eos_token_id matters in every mode, as in vLLM), {} if there is none. The model is read
        once resolved to its directory (a GGUF's conversion), as the server and LLM do first."""
        if self.generation_config not in ("auto", "vllm"):
            return read_generation_config(self.generation_config)
        return {} if self.model is None else read_generation_config(self.model)

    def get_diff_sampling_param(self) -> dict:
        """The generation config's defaults for unset sampling fields ({} with vllm)."""
        if self.generation_config == "vllm":
            return {}
        return diff_sampling_param(self.try_get_generation_config())
