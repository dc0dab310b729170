"""Structured outputs (issue 27): does every output obey its constraint, and what does it cost.

Parts (--parts, default: conformance tools cost), offline `LLM` on the default model (SmolLM2-135M-
Instruct unless --model), chat-formatted prompts, async scheduling and drafts as asked
(--async-scheduling, --speculative-config), JSON whitespace bounded as minicore's default or as
asked (--max-whitespace-cnt N or none, vLLM's unbounded grammar; --disable-any-whitespace):
  conformance  --requests requests of each kind, spread over its constraints: 5 JSON schemas
               (nested objects, arrays of objects, enums, required and optional fields, bounded
               integers and numbers, strings with maxLength or a pattern; every array has a
               maxItems and every string a bound, so an output can end), 3 regexes (a phone number,
               a date, an IPv4 address) and 2 choice lists; sampled (temperature 0.8, each request
               its own seed, so outputs differ), up to --max-tokens tokens. Each JSON output must
               parse and validate with `jsonschema`, each regex output must re.fullmatch, each
               choice output must be one of the choices. Reported per constraint: valid / total and
               the finish reasons; a "length" finish (the output cut at --max-tokens) is counted
               as a failure and shown, never dropped.
  tools        --requests chats, each with tool_choice naming one of three tools (round-robin),
               built and read back by the server's code (tool_calls.py: the JSON schema the tool
               choice constrains the output to, the tool_calls parsed from it), sampled as
               above: exactly one call of the named tool whose arguments validate against its
               parameters.
  cost         output tok/s with every request structured against none: the same --requests
               chats on one engine, greedy, side by side, order alternated, --repeat runs a side,
               the prefix cache reset before each run. COST_SCHEMA asks for an order of 6 to 10
               line items (400 to 700 tokens with the default model), with bounded strings as
               real schemas have them (near a maxLength bound xgrammar's mask is at its
               costliest). Concurrency 16: all requests go to LLM.generate at once with
               max_num_seqs=16, so 16 run and a finished one is replaced at the next step, as 16
               concurrent streams would keep it (AsyncLLM would put the engine in another
               process, out of reach of the timing below); only the last requests drain. A
               structured request ends when its grammar does (EOS is then the one token allowed),
               so, to compare the same work, an untimed structured warm-up (which also compiles
               the grammar, cached for the timed runs) measures each request's length, and the
               unstructured side generates exactly that many tokens for the same request
               (max_tokens = that length, ignore_eos); tok/s counts the tokens each run actually
               generated. Per step that ran the model: the time in the engine's
               StructuredOutputManager.grammar_bitmask (in schedule()) and accept_tokens (in the
               update), wrapped on the engine's manager, as mean and p99 us, and their share of
               the step's wall time. The sampler's masking of the logits runs inside the forward:
               it shows in tok/s only. Target: structured >= 0.9x unstructured tok/s.
The CPU model and flags are printed; results go to benchmarks/results/bench_structured_outputs.json.

    python benchmarks/bench_structured_outputs.py [--parts conformance cost] [--requests 50] \
        [--repeat 2] [--max-tokens 512]
"""

import argparse
import json
import re
import sys
import time
from pathlib import Path

import jsonschema
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_spec_decode import cpu_description  # noqa: E402

from minicore.llm import LLM  # noqa: E402
from minicore.sampling_params import (
    SamplingParams,  # noqa: E402
    StructuredOutputsParams,  # noqa: E402
)
from minicore.structured_output.config import DEFAULT_MAX_WHITESPACE  # noqa: E402

CONCURRENCY = 16
TEMPERATURE = 0.8


def _string(max_length: int) -> dict:
    return {"type": "string", "maxLength": max_length}


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False}


DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"

# name -> (schema, what to ask for; "{}" is replaced by the request's subject)
SCHEMAS = {
    "person": (_object({
        "name": _string(40), "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": _string(60),
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de", "es", "zh"]},
                      "minItems": 1, "maxItems": 3}}),
        "Describe {} as a person record."),
    "order": (_object({
        "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "customer": _object({"name": _string(30), "address": _object({
            "city": _string(30), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": _object({
            "sku": _string(12), "quantity": {"type": "integer", "minimum": 1, "maximum": 20},
            "price": {"type": "number", "minimum": 0, "maximum": 1000}})},
        "status": {"enum": ["pending", "shipped", "delivered"]}}),
        "Write an online order placed by {}."),
    "weather": (_object({
        "city": _string(30), "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
        "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "storm"]},
        "hourly_c": {"type": "array", "items": {"type": "integer", "minimum": -50,
                                                "maximum": 60}, "maxItems": 6}},
        required=["city", "temperature_c", "conditions"]),
        "Give a weather report for the home town of {}."),
    "recipe": (_object({
        "title": _string(50), "servings": {"type": "integer", "minimum": 1, "maximum": 12},
        "vegetarian": {"type": "boolean"},
        "ingredients": {"type": "array", "minItems": 1, "maxItems": 6, "items": _object({
            "name": _string(30), "amount": {"type": "number", "minimum": 0, "maximum": 1000},
            "unit": {"enum": ["g", "ml", "piece", "spoon"]}})},
        "steps": {"type": "array", "items": _string(80), "minItems": 1, "maxItems": 5}}),
        "Write a recipe that {} would cook."),
    "event": (_object({
        "title": _string(50),
        "date": {"type": "string", "pattern": f"^{DATE}$"},
        "priority": {"enum": ["low", "medium", "high"]},
        "attendees": {"type": "array", "items": _string(30), "maxItems": 5},
        "notes": _string(100)},
        required=["title", "date", "priority"]),
        "Create a calendar event for a meeting with {}."),
}

REGEXES = {
    "phone": (r"\(\d{3}\) \d{3}-\d{4}", "What is the phone number of {}'s office?"),
    "date": (DATE, "On which date (YYYY-MM-DD) was {} born?"),
    "ipv4": (r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)",
             "What is the IP address of {}'s web server?"),
}

CHOICES = {
    "sentiment": (["positive", "negative", "neutral"],
                  "Is the mood of a letter from {} positive, negative or neutral?"),
    "city": (["Paris", "London", "Berlin", "Madrid", "Rome"],
             "Which of Paris, London, Berlin, Madrid or Rome would {} like best?"),
}

SUBJECTS = ["a retired sailor", "a young chemist", "a jazz pianist", "a farmer from Ohio",
            "a school teacher", "a marathon runner", "a museum curator", "a software engineer",
            "a beekeeper", "a train driver", "a city mayor", "a pastry chef", "a film director",
            "a nurse", "a mountain guide", "a librarian", "a taxi driver"]

COST_SCHEMA = _object({
    "customer": _string(30),
    "items": {"type": "array", "minItems": 6, "maxItems": 10, "items": _object({
        "product": _string(30), "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
        "unit_price": {"type": "number", "minimum": 0, "maximum": 1000},
        "category": {"enum": ["food", "tools", "books", "clothes", "toys"]}})}})
COST_MAX_TOKENS = 1024
SIDES = ("unstructured", "structured")


# ---- checks --------------------------------------------------------------------------------------

def json_error(text: str, schema: dict) -> str | None:
    """Why text is not a JSON document valid under schema; None if it is."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return None


def constraints() -> list[tuple[str, str, StructuredOutputsParams, str]]:
    """(kind, name, params, ask) of every constraint; each schema is checked to be a JSON schema
    first, so that a typo in one is not reported as a failure of the engine."""
    rows = []
    for name, (schema, ask) in SCHEMAS.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        rows.append(("json", name, StructuredOutputsParams(json=schema),
                     f"{ask} Answer in JSON with this schema: {json.dumps(schema)}"))
    rows += [("regex", name, StructuredOutputsParams(regex=regex), ask)
             for name, (regex, ask) in REGEXES.items()]
    rows += [("choice", name, StructuredOutputsParams(choice=choices), ask)
             for name, (choices, ask) in CHOICES.items()]
    return rows


def output_error(params: StructuredOutputsParams, text: str) -> str | None:
    if params.json is not None:
        return json_error(text, params.json)
    if params.regex is not None:
        return None if re.fullmatch(params.regex, text) else "no full match"
    return None if text in params.choice else "not one of the choices"


# ---- conformance ---------------------------------------------------------------------------------

def conformance_part(args, llm: LLM) -> dict:
    """Every kind's --requests requests, in one generate call, round-robin over its constraints."""
    by_kind: dict[str, list] = {}
    for row in constraints():
        by_kind.setdefault(row[0], []).append(row)
    jobs = [rows[i % len(rows)] + (i,) for rows in by_kind.values() for i in range(args.requests)]
    conversations = [[{"role": "user", "content": ask.replace("{}", SUBJECTS[i % len(SUBJECTS)])}]
                     for _, _, _, ask, i in jobs]
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=TEMPERATURE, seed=i,
                             structured_outputs=so) for _, _, so, _, i in jobs]
    outputs = llm.chat(conversations, params, use_tqdm=False)
    results: dict[str, dict] = {}
    for (kind, name, so, _, _), output in zip(jobs, outputs):
        completion = output.outputs[0]
        record(results, kind, name, completion, output_error(so, completion.text))
    return conformance_result(args, results)


def record(results: dict[str, dict], kind: str, name: str, completion, error: str | None):
    """Count one output under its constraint's row: valid, or a failure with why (a "length"
    finish is one, whatever the text)."""
    row = results.setdefault(name, {"kind": kind, "name": name, "valid": 0, "total": 0,
                                    "finish_reasons": {}, "failures": []})
    row["total"] += 1
    reason = completion.finish_reason
    row["finish_reasons"][reason] = row["finish_reasons"].get(reason, 0) + 1
    if reason == "length":
        error = f"cut at max_tokens ({len(completion.token_ids)} tokens)" + (
            "" if error is None else f"; {error}")
    if error is None:
        row["valid"] += 1
    else:
        row["failures"].append({"error": error, "text": completion.text})


def conformance_result(args, results: dict[str, dict]) -> dict:
    return {"requests_per_kind": args.requests, "max_tokens": args.max_tokens,
            "temperature": TEMPERATURE, "rows": list(results.values())}


def print_conformance(result: dict) -> None:
    print(f"conformance: {result['requests_per_kind']} requests a kind, temperature "
          f"{result['temperature']}, seeded, max_tokens {result['max_tokens']}")
    print(f"{'kind':6} {'constraint':10} {'valid':>9}  finish reasons")
    for r in result["rows"]:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["finish_reasons"].items()))
        print(f"{r['kind']:6} {r['name']:10} {r['valid']:>4}/{r['total']:<4}  {reasons}"
              + ("" if r["valid"] == r["total"] else "  <- FAILURES"))
    for r in result["rows"]:
        for failure in r["failures"][:3]:
            print(f"  {r['name']}: {failure['error']}: {failure['text'][:120]!r}")


# ---- tools ---------------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": name, "description": description, "parameters": _object(parameters)}}
    for name, description, parameters in (
        ("get_weather", "Current weather in a city",
         {"city": _string(30), "unit": {"enum": ["celsius", "fahrenheit"]}}),
        ("book_table", "Book a restaurant table",
         {"restaurant": _string(40), "people": {"type": "integer", "minimum": 1, "maximum": 12},
          "time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"}}),
        ("send_email", "Send an email",
         {"to": _string(40), "subject": _string(60), "urgent": {"type": "boolean"}}))]
TOOL_ASKS = {"get_weather": "What is the weather like where {} lives?",
             "book_table": "Book dinner for {} and friends tonight.",
             "send_email": "Email {} about tomorrow's meeting."}


def tools_part(args, llm: LLM) -> dict:
    """--requests chats with tool_choice naming one of TOOLS (round-robin), built and read back
    by the server's own code (minicore/entrypoints/tool_calls.py: the schema the tool choice
    constrains the output to, and the tool_calls parsed from it); each call's arguments must
    parse and validate against the named tool's parameters."""
    from types import SimpleNamespace

    from minicore.entrypoints.tool_calls import check_tools
    from minicore.entrypoints.tool_parsers import ToolParserManager

    parser_cls = ToolParserManager.get_tool_parser("hermes")
    rows: dict[str, dict] = {}
    jobs = []
    for i in range(args.requests):
        tool = TOOLS[i % len(TOOLS)]["function"]
        request = SimpleNamespace(tools=TOOLS, tool_choice={"type": "function",
                                                            "function": {"name": tool["name"]}},
                                  parallel_tool_calls=True, structured_outputs=None,
                                  model_fields_set={"tools", "tool_choice"})
        chat_tools = check_tools(request, parser_cls)
        params = chat_tools.sampling_params(SamplingParams(
            max_tokens=args.max_tokens, temperature=TEMPERATURE, seed=i))
        ask = TOOL_ASKS[tool["name"]].replace("{}", SUBJECTS[i % len(SUBJECTS)])
        jobs.append((tool, chat_tools, params, [{"role": "user", "content": ask}]))
    outputs = llm.chat([c for *_, c in jobs], [p for _, _, p, _ in jobs], use_tqdm=False,
                       tools=TOOLS)
    for (tool, chat_tools, _, _), output in zip(jobs, outputs):
        completion = output.outputs[0]
        calls = chat_tools.parser().parse(completion.text, completion.finish_reason)[0].tool_calls
        error = (f"{len(calls)} tool calls" if len(calls) != 1 or calls[0].function.name !=
                 tool["name"] else json_error(calls[0].function.arguments, tool["parameters"]))
        record(rows, "tool", tool["name"], completion, error)
    return conformance_result(args, rows)


# ---- cost ----------------------------------------------------------------------------------------

class StepTimes:
    """Wraps the engine's step_fn and its structured output manager's grammar_bitmask and
    accept_tokens (looked up on the instance at each call) to record, for each step that ran
    the model, (step s, grammar_bitmask s, accept_tokens s)."""

    def __init__(self, engine):
        self.steps: list[tuple[float, float, float]] = []
        self._in_step = [0.0, 0.0]
        manager = engine.structured_output_manager
        for slot, name in enumerate(("grammar_bitmask", "accept_tokens")):
            setattr(manager, name, self._timed(getattr(manager, name), slot))
        step_fn = engine.step_fn

        def step():
            self._in_step = [0.0, 0.0]
            start = time.perf_counter()
            outputs, executed = step_fn()
            if executed:
                self.steps.append((time.perf_counter() - start, *self._in_step))
            return outputs, executed

        engine.step_fn = step

    def _timed(self, method, slot: int):
        def timed(*args):
            start = time.perf_counter()
            result = method(*args)
            self._in_step[slot] += time.perf_counter() - start
            return result
        return timed


def step_stats(steps: list[tuple[float, float, float]]) -> dict:
    def mean_p99_us(values: list[float]) -> tuple[float, float]:
        ordered = sorted(values)
        return (1e6 * sum(ordered) / len(ordered),
                1e6 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))])

    stats = {"steps": len(steps), "step_ms": 1e3 * sum(s for s, _, _ in steps) / len(steps)}
    for slot, name in ((1, "bitmask"), (2, "accept")):
        stats[f"{name}_us_mean"], stats[f"{name}_us_p99"] = mean_p99_us([s[slot] for s in steps])
    stats["manager_us_mean"], stats["manager_us_p99"] = mean_p99_us([b + a for _, b, a in steps])
    stats["manager_share"] = sum(b + a for _, b, a in steps) / sum(s for s, _, _ in steps)
    return stats


def cost_prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content":
              f"List, as JSON, the shopping order number {i} of {SUBJECTS[i % len(SUBJECTS)]}: "
              f"the customer, then 6 to 10 line items with product, quantity, unit_price and "
              f"category."}] for i in range(n)]


def run_side(llm: LLM, timer: StepTimes, conversations, params) -> dict:
    llm.llm_engine.reset_prefix_cache()
    timer.steps.clear()
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    completions = [o.outputs[0] for o in outputs]
    return {"seconds": elapsed, "lengths": [len(c.token_ids) for c in completions],
            "length_finishes": sum(c.finish_reason == "length" for c in completions),
            "steps": list(timer.steps)}


def cost_part(args, llm: LLM) -> dict:
    conversations = cost_prompts(args.requests)
    structured = SamplingParams(max_tokens=COST_MAX_TOKENS, temperature=0,
                                structured_outputs=StructuredOutputsParams(json=COST_SCHEMA))
    timer = StepTimes(llm.llm_engine)
    warm = run_side(llm, timer, conversations, structured)  # compiles the grammar: untimed
    params = {"structured": structured,
              "unstructured": [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                               for n in warm["lengths"]]}
    runs = {side: [] for side in SIDES}
    for r in range(args.repeat):
        for side in (SIDES if r % 2 == 0 else reversed(SIDES)):
            runs[side].append(run_side(llm, timer, conversations, params[side]))
    result = {"requests": args.requests, "concurrency": min(CONCURRENCY, args.requests),
              "repeat": args.repeat,
              "warm_up_lengths": warm["lengths"]}
    for side, side_runs in runs.items():
        tokens = sum(sum(run["lengths"]) for run in side_runs)
        result[side] = {"output_tokens": tokens,
                        "tok_s": tokens / sum(run["seconds"] for run in side_runs),
                        "runs_tok_s": [sum(run["lengths"]) / run["seconds"] for run in side_runs],
                        **step_stats([s for run in side_runs for s in run["steps"]])}
    # The unstructured side ends at max_tokens by design; a structured one cut there failed.
    result["structured"]["length_finishes"] = sum(run["length_finishes"]
                                                  for run in runs["structured"])
    result["ratio"] = result["structured"]["tok_s"] / result["unstructured"]["tok_s"]
    return result


def print_cost(result: dict) -> None:
    print(f"cost: {result['requests']} requests at concurrency {result['concurrency']}, "
          f"greedy, {result['repeat']} runs a side (order alternated); per step that ran the "
          f"model, us: grammar_bitmask, accept_tokens, both, and both over the step's time; "
          f"cut: structured requests that reached max_tokens {COST_MAX_TOKENS} (failures)")
    print(f"{'side':12} {'out tok':>7} {'tok/s':>7} {'step ms':>7} {'bitmask':>13} "
          f"{'accept':>13} {'manager':>13} {'share':>6} {'cut':>6}")
    print(f"{'':12} {'':>7} {'':>7} {'':>7} {'mean':>6} {'p99':>6} {'mean':>6} {'p99':>6} "
          f"{'mean':>6} {'p99':>6}")
    for side in SIDES:
        r = result[side]
        print(f"{side:12} {r['output_tokens']:>7} {r['tok_s']:>7.1f} {r['step_ms']:>7.1f} "
              f"{r['bitmask_us_mean']:>6.0f} {r['bitmask_us_p99']:>6.0f} "
              f"{r['accept_us_mean']:>6.0f} {r['accept_us_p99']:>6.0f} "
              f"{r['manager_us_mean']:>6.0f} {r['manager_us_p99']:>6.0f} "
              f"{r['manager_share']:>6.2%} {r.get('length_finishes', '-'):>6}")
    print(f"structured / unstructured tok/s: {result['ratio']:.2f}x (target >= 0.9x)")


# ---- main ----------------------------------------------------------------------------------------

# name -> (run(args, llm) -> result, print(result)); each runs on the one offline engine.
PARTS = {"conformance": (conformance_part, print_conformance),
         "tools": (tools_part, print_conformance), "cost": (cost_part, print_cost)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    ap.add_argument("--model", default=None, help="model directory or .gguf (default: SmolLM2)")
    ap.add_argument("--requests", type=int, default=50,
                    help="conformance: requests of each kind; cost: requests a run")
    ap.add_argument("--max-tokens", type=int, default=512, help="conformance: each request's cap")
    ap.add_argument("--repeat", type=int, default=2, help="cost: runs of each side, alternated")
    ap.add_argument("--disable-any-whitespace", action="store_true",
                    help="compact JSON for every request (--structured-outputs-config's "
                         "disable_any_whitespace)")
    ap.add_argument("--max-whitespace-cnt", type=lambda v: None if v == "none" else int(v),
                    default=DEFAULT_MAX_WHITESPACE,
                    help="whitespace characters in a row a JSON output may write (minicore's "
                         f"default {DEFAULT_MAX_WHITESPACE}; none: vLLM's, any number)")
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--speculative-config", type=json.loads, default=None,
                    help='e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    ap.add_argument("--json", default=str(Path(__file__).parent / "results"
                                          / "bench_structured_outputs.json"))
    args = ap.parse_args()

    llm = LLM(args.model, max_model_len=2048, max_num_seqs=CONCURRENCY,
              async_scheduling=args.async_scheduling, speculative_config=args.speculative_config,
              structured_outputs_config={"disable_any_whitespace": args.disable_any_whitespace,
                                         "max_whitespace_cnt": args.max_whitespace_cnt})
    result = {"cpu": cpu_description(), "args": vars(args)}
    for name in args.parts:
        result[name] = PARTS[name][0](args, llm)

    whitespace = ("none" if args.disable_any_whitespace else "any (vLLM's)"
                  if args.max_whitespace_cnt is None else f"at most {args.max_whitespace_cnt}")
    print(f"CPU: {result['cpu']}; torch threads {torch.get_num_threads()}; JSON whitespace: "
          f"{whitespace} in a row; async scheduling {args.async_scheduling}; drafts "
          f"{args.speculative_config}")
    for name in args.parts:
        PARTS[name][1](result[name])
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
