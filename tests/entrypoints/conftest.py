"""A server shared by the structured-output and tool-call tests (test_structured_outputs_api.py,
test_tools_api.py): one start-up of the default model for both, with hermes tool calls on."""

import pytest
from server_helpers import ServerProcess


@pytest.fixture(scope="session")
def structured_server():
    with ServerProcess("--max-model-len", "512", "--kv-cache-memory", str(64 << 20),
                       "--max-num-seqs", "8", "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes") as s:
        yield s
