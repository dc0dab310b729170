"""The runner registry (minicore/model/registry.py): every runner is declared with its class and
capabilities, --runner's choices are its names, an unknown name is refused naming them, and the
engine asks the capabilities, never the name: a runner registered here for the test, with no
logits, weights or experts, is built and refused as the simulated one is. No source of minicore
but the registry tests a runner's name."""

import ast
from pathlib import Path
from typing import get_args

import pytest

import minicore.__main__ as cli
from minicore.config import create_engine_config
from minicore.engine.components import make_engine_core
from minicore.model.config import ModelRunnerKind
from minicore.model.registry import MODEL_RUNNERS, RunnerInfo, runner_info
from minicore.model.runner_base import ModelRunnerBase
from minicore.request import Request
from minicore.sampling_params import SamplingParams
from minicore.scheduler.output import EMPTY_MODEL_RUNNER_OUTPUT

PACKAGE = Path(__file__).resolve().parents[2] / "minicore"


class CountingRunner(ModelRunnerBase):
    """A runner with no capability at all: counts its calls."""
    vocab_size = 100

    def __init__(self, config):
        super().__init__()
        self.num_blocks = config.cache_config.num_blocks
        self.calls = 0

    def execute_model(self, so):
        self.calls += 1
        return EMPTY_MODEL_RUNNER_OUTPUT

    def execute_dummy_batch(self):
        self.calls += 1


@pytest.fixture
def counting(monkeypatch):
    monkeypatch.setitem(MODEL_RUNNERS, "counting", RunnerInfo(
        __name__, "CountingRunner", "counts calls", has_logits=False, needs_weights=False,
        reports_step_time=False, supports_expert_parallel=False))
    return "counting"


def test_every_runner_is_declared_with_a_class_that_has_its_capabilities():
    from minicore.model.runner import ModelRunner
    from minicore.model.simulated import SimulatedModelRunner

    classes = {name: info.load_class() for name, info in MODEL_RUNNERS.items()}
    assert classes == {"transformers": ModelRunner, "simulated": SimulatedModelRunner}
    for name, cls in classes.items():
        info = MODEL_RUNNERS[name]
        assert callable(cls.execute_model) and callable(cls.execute_dummy_batch)
        assert hasattr(cls, "pop_step_time") == info.reports_step_time, name
    assert [n for n, i in MODEL_RUNNERS.items() if i.has_logits] == ["transformers"]


def test_runner_choices_are_the_registry_names():
    assert get_args(ModelRunnerKind) == tuple(MODEL_RUNNERS)
    serve = next(a for a in cli.make_parser()._actions if a.dest == "command").choices["serve"]
    runner_flag = next(a for a in serve._actions if a.dest == "runner")
    assert tuple(runner_flag.choices) == tuple(MODEL_RUNNERS)
    assert all(name in runner_flag.help for name in MODEL_RUNNERS)


def test_an_unknown_runner_is_refused_naming_the_choices():
    message = "runner must be 'transformers' or 'simulated', got 'vllm'"
    with pytest.raises(ValueError, match=message):
        runner_info("vllm")
    with pytest.raises(ValueError, match=message):
        create_engine_config(runner="vllm")


def test_the_engine_reads_capabilities_not_names(counting):
    engine = make_engine_core(create_engine_config(runner=counting, max_model_len=64,
                                                   num_blocks=64))
    assert isinstance(engine.model_runner, CountingRunner)  # built without weights
    for name in ("logprobs", "prompt_logprobs"):
        request = Request("r", [5, 6], SamplingParams(**{name: 1}))
        with pytest.raises(ValueError, match=f"{name}: .* computes no logits"):
            engine.add_request(request)
    engine.add_request(Request("ok", [5, 6], SamplingParams(max_tokens=1)))
    engine.step()
    assert engine.model_runner.calls == 1
    with pytest.raises(ValueError, match="the counting runner has no experts to shard: "
                                         "--enable-expert-parallel needs --runner transformers"):
        create_engine_config(runner=counting, data_parallel_size=2, enable_expert_parallel=True)


def _runner_name_tests(tree: ast.AST) -> list[int]:
    """Lines of comparisons with a runner's name (`x == "simulated"`, `x in ("a", "b")`)."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        constants = [c for o in operands
                     for c in (o.elts if isinstance(o, ast.Tuple | ast.List | ast.Set) else [o])]
        if any(isinstance(c, ast.Constant) and c.value in MODEL_RUNNERS for c in constants):
            lines.append(node.lineno)
    return lines


def test_no_source_but_the_registry_tests_a_runner_name():
    found = {path.relative_to(PACKAGE).as_posix(): lines
             for path in PACKAGE.rglob("*.py") if path.name != "registry.py"
             and (lines := _runner_name_tests(ast.parse(path.read_text())))}
    assert found == {}
    # guard against a vacuous check
    assert _runner_name_tests(ast.parse('if runner in ("x", "simulated"): pass')) == [1]
