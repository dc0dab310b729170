"""Model loading: clear errors, the crash-safe GGUF conversion cache, and what survives the cache."""

import pytest
import torch

from minicore.model import loader
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

    monkeypatch.setattr(loader, "_convert_gguf", crash)
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

    monkeypatch.setattr(loader, "_convert_gguf", convert)
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
