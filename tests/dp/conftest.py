"""Fixtures of the data-parallel tests: tiny random mixture-of-experts models that can be served
(tests/model/moe_models.py), built once per session and family."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from moe_models import build_served_moe


@pytest.fixture(scope="session")
def moe_model_dir(tmp_path_factory):
    """moe_model_dir(family): the directory of a servable tiny model of that family."""
    built: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in built:
            path = tmp_path_factory.mktemp(f"served-{family}")
            built[family] = str(build_served_moe(family, path))
        return built[family]

    return get
