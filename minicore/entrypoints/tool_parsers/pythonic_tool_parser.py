"""PythonicToolParser: calls written as a Python list, [get_weather(city="Paris", days=3),
get_time()], as Llama 3.2 and 4 write them (between <|python_start|> and <|python_end|> for 4).

Mirrors vllm/tool_parsers/pythonic_tool_parser.py: the whole output is one list of calls with
keyword arguments that are Python literals, read with ast (nothing is evaluated); anything else is
content. Streamed, the calls so far are read by closing the list. Left out: token ids.
"""

import ast

from minicore.entrypoints.tool_parsers.abstract_tool_parser import ToolParserManager
from minicore.entrypoints.tool_parsers.whole_calls import Call, WholeCallsToolParser

START, END = "<|python_start|>", "<|python_end|>"


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(WholeCallsToolParser):
    start_marker = START

    def calls_start(self, text: str) -> int | None:
        return 0 if text.lstrip().startswith((START, "[")) else None

    def parse_calls(self, text: str, final: bool) -> list[Call]:
        body = text.strip().removeprefix(START).removesuffix(END).strip()
        try:
            tree = ast.parse(body, mode="eval")
        except SyntaxError:
            if final:
                raise
            try:  # the calls so far: the list closed after the last complete one
                tree = ast.parse(body.rstrip().rstrip(",") + "]", mode="eval")
            except SyntaxError:
                return []
            return _calls(tree, complete_only=True)
        return _calls(tree, complete_only=False)


def _calls(tree: ast.Expression, complete_only: bool) -> list[Call]:
    if not isinstance(tree.body, ast.List):
        raise ValueError("the output is not a list of calls")
    calls = []
    for node in tree.body.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            if complete_only:
                break  # the call still being written
            raise ValueError(f"not a call: {ast.unparse(node)[:60]}")
        if node.args:
            raise ValueError(f"{node.func.id}: positional arguments (calls take keywords)")
        calls.append((node.func.id, {kw.arg: ast.literal_eval(kw.value)
                                     for kw in node.keywords}))
    return calls
