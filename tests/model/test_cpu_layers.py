"""transformers' RMSNorm and rotary embedding by minicore's kernels (minicore/model/cpu_layers.py):
the rotary embedding gives transformers' bits, the norm its values within a rounding and each
row's the same whatever the rows beside it; which modules take them (Llama's code, in Llama,
Qwen2, Mixtral, Qwen3-MoE) and which keep transformers' (Gemma's norm, autograd, other dtypes);
and that transformers itself is left as it was."""

import ctypes

import pytest
import torch
from test_native import native_kernel
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama import modeling_llama

from minicore.model import native
from minicore.model.cpu_layers import use_cpu_layers

DTYPES = [torch.float32, torch.bfloat16]
# A bfloat16 has 8 significant bits: one rounding step of the result.
NORM_TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2**-7}


def _cos_sin(tokens: int, dim: int, dtype: torch.dtype):
    """Llama's cos and sin ([1, tokens, dim]) at positions spread over a long context."""
    inv_freq = 1 / 10000 ** (torch.arange(0, dim, 2) / dim)
    angles = (torch.arange(tokens) * 37.0)[:, None] * inv_freq[None]
    angles = torch.cat([angles, angles], dim=-1)[None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _heads(tokens: int, heads: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[1, heads, tokens, dim] as transformers' attention has them: a projection's output viewed
    by head and transposed."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, heads * dim, generator=gen) * 4
    return x.to(dtype).view(1, tokens, heads, dim).transpose(1, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_rotary_gives_transformers_bits(dtype, tokens):
    lib = native_kernel()
    q, k = _heads(tokens, 9, 64, dtype, 0), _heads(tokens, 3, 64, dtype, 1)
    cos, sin = _cos_sin(tokens, 64, dtype)
    expected = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    for x, want in zip((q, k), expected):
        got = native.rotary(lib, x, cos, sin)
        assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 100, 7])
def test_rms_norm_is_transformers_within_a_rounding_and_the_same_for_a_row_in_any_batch(dtype,
                                                                                        dim):
    lib = native_kernel()
    gen = torch.Generator().manual_seed(dim)
    norm = modeling_llama.LlamaRMSNorm(dim, eps=1e-5)
    norm.weight.data = torch.randn(dim, generator=gen) + 1
    norm = norm.to(dtype)
    x = (torch.randn(1, 300, dim, generator=gen) * 3).to(dtype)
    with torch.inference_mode():
        expected = norm(x)
    got = native.rms_norm(lib, x, norm.weight, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), expected.float(), rtol=NORM_TOLERANCE[dtype],
                               atol=NORM_TOLERANCE[dtype])
    alone = torch.cat([native.rms_norm(lib, x[:, i:i + 1], norm.weight, 1e-5)
                       for i in range(5)], dim=1)
    assert torch.equal(got[:, :5], alone)
    assert torch.equal(native.rms_norm(lib, x[:, :70], norm.weight, 1e-5)[:, :5], alone)


def _tiny(family: str, dtype: torch.dtype, **extra):
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if family == "qwen3_moe":
        extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **extra)
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **common, **extra)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family,norms_per_layer", [
    ("llama", 2), ("qwen2", 2), ("mixtral", 2), ("qwen3_moe", 4)])
def test_llama_family_models_take_the_kernels_and_keep_their_outputs(dtype, family,
                                                                     norms_per_layer):
    """Every norm (Qwen3's per-head q/k norms too) and each attention's rotary embedding; the
    logits as transformers' within the norm's rounding; transformers' module globals untouched."""
    lib = native_kernel()
    model = _tiny(family, dtype)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = model(ids).logits.float()
    layers = model.config.num_hidden_layers
    original = modeling_llama.apply_rotary_pos_emb
    assert use_cpu_layers(model, lib) == layers * (norms_per_layer + 1) + 1
    assert modeling_llama.apply_rotary_pos_emb is original
    with torch.inference_mode():
        got = model(ids).logits.float()
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


def test_the_rotary_embedding_runs_the_kernel_and_nothing_else_changes():
    """Bound to a kernel that rotates nothing, a bound model's outputs change and an unbound one's,
    sharing transformers' module, do not."""
    lib = native_kernel()
    bound, unbound = _tiny("llama", torch.float32), _tiny("llama", torch.float32)
    ids = torch.arange(1, 20)[None]
    with torch.inference_mode():
        before = bound(ids).logits

    class NoRotation:
        def __getattr__(self, name):
            return getattr(lib, name)

        def rotary(self, *args):
            out, (heads, tokens, dim), bf16 = args[5], args[8:11], args[12]
            ctypes.memset(out, 0, heads * tokens * dim * (2 if bf16 else 4))  # rotated to zero

    use_cpu_layers(bound, NoRotation())
    with torch.inference_mode():
        assert not torch.allclose(bound(ids).logits, before)
        assert torch.equal(unbound(ids).logits, before)


def test_gemma_norm_autograd_and_other_dtypes_keep_transformers_code():
    lib = native_kernel()
    gemma = _tiny("gemma", torch.float32, head_dim=16)
    norms = [m for m in gemma.modules() if type(m).__name__ == "GemmaRMSNorm"]
    use_cpu_layers(gemma, lib)
    assert norms and all("forward" not in vars(m) for m in norms)  # (1 + weight): not Llama's
    model = _tiny("llama", torch.float32)
    use_cpu_layers(model, lib)
    ids = torch.arange(1, 10)[None]
    model(ids).logits.sum().backward()  # autograd: transformers' ops, which it can go through
    assert model.model.norm.weight.grad is not None
    half = _tiny("llama", torch.float16)
    use_cpu_layers(half, lib)
    with torch.inference_mode():
        assert half(ids).logits.dtype == torch.float16


def test_without_kernels_nothing_is_bound():
    model = _tiny("llama", torch.float32)
    assert use_cpu_layers(model, None) == 0
    assert all("forward" not in vars(m) for m in model.modules())
