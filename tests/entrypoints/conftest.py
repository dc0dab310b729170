"""A server shared by the structured-output and tool-call tests (test_structured_outputs_api.py,
test_tools_api.py, test_hostile_grammars.py): one start-up of the default model for all, with
hermes tool calls on."""

import pytest
from server_helpers import ServerProcess

# The shared server's bound on compiled grammars (VLLM_XGRAMMAR_CACHE_MB): small, so that
# test_hostile_grammars.py reaches it.
GRAMMAR_CACHE_MB = 8


@pytest.fixture(scope="session")
def structured_server():
    with ServerProcess("--max-model-len", "512", "--kv-cache-memory", str(64 << 20),
                       "--max-num-seqs", "8", "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes",
                       env={"VLLM_XGRAMMAR_CACHE_MB": str(GRAMMAR_CACHE_MB)}) as s:
        yield s
