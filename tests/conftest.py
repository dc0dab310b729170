"""Shared fixtures: the real default model, loaded once per test session (fp32 on CPU)."""

import pytest


@pytest.fixture(scope="session")
def hf_model_and_tokenizer():
    from minicore.model.loader import load_model

    return load_model(dtype="float32", device="cpu")

