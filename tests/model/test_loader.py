"""Model loading: clear errors, models whose attention minicore cannot run refused by name, the
crash-safe GGUF conversion cache (announced in the log when made), and what survives the cache."""

import pytest
import torch

from minicore.model import loader
from minicore.model.attention import use_paged_attention
from minicore.model.loader import ModelLoadError, cached_conversion, load_model


@pytest.mark.parametrize("kind", ["missing", "empty_dir", "bad_gguf"])
def test_unloadable_model_is_one_clear_error(tmp_path, kind):
    path = tmp_path / {"missing": "nope", "empty_dir": "d", "bad_gguf": "m.gguf"}[kind]
    if kind == "empty_dir":
        path.mkdir()
    elif kind == "bad_gguf":
        path.write_bytes(b"not a gguf")
    with pytest.raises(ModelLoadError, match=str(path)):
        load_model(path, cache_dir=tmp_path / "cache")
    assert not any((tmp_path / "cache").glob("*")), "a failed conversion left files behind"


def test_conversion_crash_leaves_no_cache_entry(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")

    def crash(src, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, "_convert_in_subprocess", crash)
    with pytest.raises(KeyboardInterrupt):
        cached_conversion(gguf, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_conversion_is_cached_and_keyed_by_file(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    calls = []

    def convert(src, out):
        calls.append(src)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(loader, "_convert_in_subprocess", convert)
    first = cached_conversion(gguf, tmp_path / "cache")
    assert cached_conversion(gguf, tmp_path / "cache") == first and len(calls) == 1
    gguf.write_bytes(b"xy")  # a changed file gets a new entry
    assert cached_conversion(gguf, tmp_path / "cache") != first and len(calls) == 2


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        load_model(dtype="int8")


@pytest.mark.model
def test_cache_round_trip_keeps_eos_and_chat_template(hf_model_and_tokenizer):
    model, tokenizer = hf_model_and_tokenizer
    assert not model.training and model.dtype == torch.float32
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    assert model.generation_config.eos_token_id == 2
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


_TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def _tiny_on_meta(family: str, **overrides):
    """A tiny model of ``family`` on the meta device: its class and parameter names, no weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **{**_TINY, **overrides})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family,overrides,feature", [
    # DeepSeek-V2/V3's runs (mla.py); another family's latent attention is its own code.
    ("minicpm3", {}, "multi-head latent attention .* outside deepseek_v2 and deepseek_v3"),
    ("gpt_oss", dict(num_local_experts=2, num_experts_per_tok=1), "attention sinks"),
    ("bloom", dict(n_head=4, n_layer=2), "outside transformers' AttentionInterface"),
    ("llama4_text", {}, "chunked local attention"),
    ("qwen3_next", {}, r"layer_types \['linear_attention'\]"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "bidirectional"),
    ("gpt2", dict(add_cross_attention=True, n_head=4, n_layer=2), "cross-attention"),
])
def test_unsupported_attention_is_refused(family, overrides, feature):
    model = _tiny_on_meta(family, **overrides)
    with pytest.raises(ModelLoadError, match=rf"'{family}' \(\w+\) uses .*{feature}"):
        loader.check_attention_supported(model)
    # A model loaded by the caller (LLM(model, tokenizer=...)) is refused as well.
    with pytest.raises(ModelLoadError, match=feature):
        use_paged_attention(model)


@pytest.mark.parametrize("family,overrides", [
    ("llama", {}), ("gemma2", dict(head_dim=8)), ("gemma3_text", dict(head_dim=8)),
    ("deepseek_v3", dict(n_routed_experts=4, kv_lora_rank=16, q_lora_rank=16)),
    ("qwen3_moe", dict(num_experts=2, num_experts_per_tok=1)), ("gpt2", dict(n_head=4)),
])
def test_supported_attention_passes(family, overrides):
    loader.check_attention_supported(_tiny_on_meta(family, **overrides))


def test_gguf_conversion_is_announced(tmp_path, monkeypatch, caplog):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    monkeypatch.setattr(loader, "_convert_in_subprocess",
                        lambda src, out: (out / "config.json").write_text("{}"))
    with caplog.at_level("INFO", logger=loader.__name__):
        target = cached_conversion(gguf, tmp_path / "cache")
        cached_conversion(gguf, tmp_path / "cache")
    announced = [r.getMessage() for r in caplog.records if "Converting" in r.getMessage()]
    assert len(announced) == 1, "only the first load converts"
    assert str(gguf) in announced[0] and str(target) in announced[0]


def test_refused_before_weights_are_read(tmp_path):
    """A MiniCPM3 directory with its config only: refused by name, not 'weights missing'."""
    from transformers import AutoConfig

    AutoConfig.for_model("minicpm3", architectures=["MiniCPM3ForCausalLM"]).save_pretrained(
        tmp_path)
    with pytest.raises(ModelLoadError,
                       match=r"'minicpm3' \(MiniCPM3ForCausalLM\) uses multi-head latent"):
        load_model(tmp_path, device="cpu")
