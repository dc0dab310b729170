"""Worker extensions for tests/engine/test_worker_extension.py, importable by name as vLLM's
worker_extension_cls is given: written as an RL framework writes one for vLLM."""


class Probe:
    """Reaches the runner as self.model_runner, as vLLM's extensions do."""

    def probe(self, factor: int) -> list:
        runner = self.model_runner
        return [runner is self, factor * 2, runner.vocab_size > 0]


class Clashing:
    def execute_model(self, scheduler_output):
        return None
