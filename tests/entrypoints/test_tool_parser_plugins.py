"""Tool call parsers are plug-ins (minicore/entrypoints/tool_parsers/): a file of that package
that registers its parser with vLLM's decorator is found with the package, so a new parser is
that file and its tests. Shown with a parser written here, in a file of the package for the
test's duration: --tool-call-parser offers it and the registry builds it. A parser outside the
package loads from a --tool-parser-plugin file."""

import importlib
import subprocess
import sys
import textwrap

import httpx
from server_helpers import ServerProcess

import minicore.entrypoints.tool_parsers as tool_parsers
from minicore.entrypoints.tool_parsers import ToolParserManager

ECHO = textwrap.dedent('''
    """EchoToolParser: no calls, the output as content (a test's parser)."""
    from minicore.entrypoints.tool_parsers.abstract_tool_parser import (
        ExtractedToolCallInformation,
        ToolParser,
        ToolParserManager,
    )


    @ToolParserManager.register_module("echo_for_test")
    class EchoToolParser(ToolParser):
        def extract_tool_calls(self, model_output):
            return ExtractedToolCallInformation(False, [], model_output)
''')
def test_the_shipped_parsers_register_themselves():
    assert ToolParserManager.list_registered() == ["hermes", "llama3_json", "mistral",
                                                   "pythonic", "qwen3_coder"]


def test_a_new_parser_is_one_file(plugin_file):
    module = plugin_file(tool_parsers, "echo_for_test", ECHO, ToolParserManager.tool_parsers,
                         "echo_for_test")
    help_text = subprocess.run([sys.executable, "-m", "minicore", "serve", "--help"],
                               capture_output=True, text=True, timeout=60).stdout
    assert "tool_calls: echo_for_test, hermes," in " ".join(help_text.split())
    importlib.import_module(module)  # what importing the package does in a fresh process
    parser = ToolParserManager.get_tool_parser("echo_for_test")()
    assert parser.extract_tool_calls("no call").content == "no call"


def test_a_parser_from_a_plugin_file_serves(tmp_path):
    """--tool-parser-plugin FILE (vLLM's): the file registers its parser before
    --tool-call-parser is looked up; an unknown name is refused with the names there are."""
    plugin = tmp_path / "my_parsers.py"
    plugin.write_text(ECHO.replace("echo_for_test", "echo_plugin"))
    args = ["--runner", "simulated", "--enable-auto-tool-choice", "--tool-parser-plugin",
            str(plugin)]
    with ServerProcess(*args, "--tool-call-parser", "echo_plugin") as server:
        assert httpx.get(server.url + "/health").status_code == 200
    refused = subprocess.run([sys.executable, "-m", "minicore", "serve", *args,
                              "--tool-call-parser", "nope"], capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 1
    assert "'nope' is not a tool parser; they are echo_plugin, hermes" in refused.stderr
