"""python -m minicore {generate,serve,simulate,proxy,trace-view}: the command line.

Mirrors vllm/entrypoints/cli/ in spirit: one subcommand per entry point, flags with vLLM's names.
"""

import argparse
import os
import re
import sys
from importlib.util import find_spec

from minicore.arg_utils import FlexibleArgumentParser, human_readable_int
from minicore.config import create_engine_config
from minicore.dp.sim_report import add_simulate_args, simulate_main
from minicore.engine.arg_utils import add_engine_cli_args, engine_kwargs_from_cli
from minicore.entrypoints.reasoning import REASONING_PARSERS
from minicore.entrypoints.tool_parsers import ToolParserManager
from minicore.logger import configure_logging
from minicore.tracing.view import add_trace_view_args, trace_view_main

# generate's LLM runs one in-process engine, which refuses data parallelism, on the transformers
# runner only (it takes the tokenizer and vocab from the loaded model); generate's own --seed seeds
# the requests' sampling, not the engine.
GENERATE_EXCLUDE = ("data parallel", "runner", "simulated_cost", "seed")


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None,
                        help="the model, as vLLM's `serve MODEL` (same as --model)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (vLLM listens on all: --host 0.0.0.0)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="the model name(s) the API answers to (default: the model's name)")
    parser.add_argument("--api-key", default=os.environ.get("MINICORE_API_KEY"),
                        help="require `Authorization: Bearer KEY` on /v1 (env MINICORE_API_KEY)")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic throughput/KV cache log line")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    parser.add_argument("--enable-server-load-tracking", action="store_true",
                        help="count the generation requests in flight for GET /load (without "
                             "it, /load answers 0, as vLLM's)")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="add usage.prompt_tokens_details.cached_tokens (the prompt tokens "
                             "found in the prefix cache) to responses, as vLLM's")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="take a chat_template given in a request (refused without it, as "
                             "vLLM's)")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="logprob tokens spelled token_id:N by default (a request's "
                             "return_tokens_as_token_ids wins), as vLLM's")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='tool_choice "auto", "required" and named (needs --tool-call-parser)'
                             ", as vLLM's")
    parser.add_argument("--tool-call-parser", metavar="NAME",
                        help="the model's tool call format, read into tool_calls: "
                             f"{', '.join(ToolParserManager.list_registered())}, or one that "
                             "--tool-parser-plugin registers")
    parser.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS),
                        help="split a thinking model's output at </think>: its reasoning in "
                             "message.reasoning (and delta.reasoning), the rest the content; a "
                             "request's structured output constrains only what follows </think>, "
                             "as vLLM's")
    parser.add_argument("--tool-parser-plugin", metavar="FILE",
                        help="a Python file that registers a tool parser "
                             "(@ToolParserManager.register_module(name), from "
                             "minicore.entrypoints.tool_parsers), as vLLM's")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--metrics-prefix", type=_metrics_prefix, default="vllm",
                        help="the /metrics names' prefix (default vllm: vLLM's names, for its "
                             "dashboards and aiperf; e.g. minicore to tell both apart)")
    _add_http_limit_args(parser.add_argument_group("HTTP limits"))
    groups = add_engine_cli_args(parser)
    groups["data parallel"].add_argument(
        "--headless", action="store_true",
        help="run only this machine's DP ranks, for a frontend on another machine")
    groups["data parallel"].add_argument(
        "--data-parallel-rank", "-dpn", type=int, default=None, dest="instance_rank",
        help="this instance's one DP rank, behind an external load balancer (vLLM's flag: sets "
             "--data-parallel-external-lb)")
    groups["data parallel"].add_argument(
        "--api-server-count", "-asc", type=_positive(int), default=1,
        help="API server processes sharing the port, each talking to every engine (vLLM's flag; "
             "vLLM defaults it to --data-parallel-size, minicore to 1)")


def _add_http_limit_args(group: argparse._ArgumentGroup) -> None:
    """What one client may hold or send (docs/COMPATIBILITY.md); defaults as vLLM's where it has
    the flag."""
    group.add_argument("--max-request-body-bytes", type=_positive(human_readable_int),
                       default=None, help="refuse (413) a request body over this many bytes, "
                       "before parsing it (default: 64 a token of --max-model-len, at least 1M)")
    group.add_argument("--h11-max-incomplete-event-size", type=_positive(human_readable_int),
                       default=4 << 20, help="most bytes of a request's line and headers, as "
                       "vLLM's (default: %(default)s)")
    group.add_argument("--h11-max-header-count", type=_positive(int), default=256,
                       help="most headers in a request (431 past it), as vLLM's "
                            "(default: %(default)s)")
    group.add_argument("--timeout-keep-alive", type=_positive(float), default=5.0,
                       help="seconds a connection may stay open with no request under way, new "
                            "or after a response (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE; "
                            "default: %(default)s)")
    group.add_argument("--timeout-request-read", type=_positive(float), default=60.0,
                       help="seconds a client has to send a whole request, line, headers and "
                            "body, once it has begun (default: %(default)s)")


def _positive(kind):
    """argparse type: kind(text), refused unless > 0."""
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be greater than 0, got {text!r}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def _metrics_prefix(text: str) -> str:
    """A Prometheus name prefix: letters, digits and underscores, not starting with a digit."""
    if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a metric name prefix (letters, digits, _; no leading digit)")
    return text


def check_local_paths(config) -> None:
    """A model or tokenizer that is not on this machine (a hub id) refused before anything starts
    (ModelLoadError, a ValueError: `error: ...`, exit status 1)."""
    from minicore.model.loader import check_local

    mc = config.model_config
    for what, path in (("model", mc.model), ("tokenizer", mc.tokenizer)):
        if path is not None:
            check_local(path, what)


def _infer_load_balancing(args: argparse.Namespace) -> None:
    """vLLM's serve rules: --data-parallel-rank R is external load balancing with rank R here;
    --data-parallel-start-rank without --headless is hybrid."""
    if args.instance_rank is not None:
        if args.headless:
            raise ValueError("--data-parallel-rank is an external load balancer's instance; "
                             "--headless ranks take --data-parallel-start-rank")
        args.data_parallel_external_lb = True
        args.data_parallel_start_rank = args.instance_rank
    elif args.data_parallel_external_lb:
        raise ValueError("`--data-parallel-external-lb` requires a data-parallel rank. Set "
                         "`--data-parallel-rank`.")
    elif args.data_parallel_start_rank and not args.headless:
        args.data_parallel_hybrid_lb = True


def _serve(args: argparse.Namespace) -> None:
    # Ctrl+C or SIGTERM during the imports below ends the process quietly, exit status 0.
    from minicore.entrypoints.utils import exit_zero_after_shutdown_signals

    exit_zero_after_shutdown_signals()
    configure_logging("MainProcess" if args.headless else "APIServer")  # vLLM's process names
    # Every check that needs no model first, before the server's imports: a bad flag fails fast.
    if args.model_tag is not None:
        args.model = args.model_tag
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if args.tool_parser_plugin:
        ToolParserManager.import_tool_parser(args.tool_parser_plugin)
    if args.tool_call_parser and args.tool_call_parser not in ToolParserManager.list_registered():
        raise ValueError(f"--tool-call-parser {args.tool_call_parser!r} is not a tool parser; "
                         f"they are {', '.join(ToolParserManager.list_registered())}")
    _infer_load_balancing(args)
    config = create_engine_config(**engine_kwargs_from_cli(args),
                                  reasoning_parser=args.reasoning_parser)
    check_local_paths(config)
    if config.parallel_config.data_parallel_backend == "ray" and not find_spec("ray"):
        raise ValueError("--data-parallel-backend ray needs Ray: pip install 'minicore[ray]'")

    import uvloop

    from minicore.engine.launch import START_METHOD_ENV
    from minicore.entrypoints.api_server import run_server

    # This process computes nothing with torch: its engines can fork (engine_start_method).
    os.environ.setdefault(START_METHOD_ENV, "fork")

    if args.headless:
        from minicore.dp.launch import run_headless

        if args.api_server_count > 1:  # vLLM's message
            raise ValueError(f"--api-server-count={args.api_server_count} cannot be used with "
                             "--headless (no API servers are started in headless mode).")
        run_headless(config)
        return
    if args.api_server_count > 1:
        from minicore.entrypoints.multi_api_server import run_multi_api_server

        try:
            run_multi_api_server(config, args)
        except (RuntimeError, TimeoutError) as e:  # a process of the service exited, or
            raise SystemExit(f"minicore: {e}") from None  # failed to start in time
        return
    uvloop.run(run_server(config, args))


def _add_proxy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="prefill instances' base URLs (http://host:port), round-robin")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="decode instances' base URLs (http://host:port), round-robin")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])


def _proxy(args: argparse.Namespace) -> None:
    from minicore.entrypoints.proxy import proxy_main

    proxy_main(args)


def _generate(args: argparse.Namespace) -> None:
    from minicore.llm import LLM
    from minicore.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    llm = LLM(**engine_kwargs_from_cli(args, GENERATE_EXCLUDE))
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(args.prompts, params)
    for out in outputs:
        print(f"--- {out.prompt!r} ({out.outputs[0].finish_reason})")
        print(out.outputs[0].text)


def make_parser() -> argparse.ArgumentParser:
    parser = FlexibleArgumentParser(prog="python -m minicore")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts, offline")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--chat", action="store_true", help="format prompts with the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None,
                     help="seed every prompt's sampling (default: unseeded)")
    add_engine_cli_args(gen, GENERATE_EXCLUDE)
    _add_serve_args(sub.add_parser("serve", help="serve the OpenAI-compatible API over HTTP"))
    add_simulate_args(sub.add_parser(
        "simulate", help="SIMULATED data-parallel ranks in lockstep on the real schedulers: "
                         "the balance gate against the baseline"))
    _add_proxy_args(sub.add_parser(
        "proxy", help="one endpoint for disaggregated prefill: prefill instances, then decode "
                      "instances (vLLM's toy proxy)"))
    add_trace_view_args(sub.add_parser(
        "trace-view", help="draw a step trace (--trace-steps) as a PNG, one lane per DP rank"))
    return parser


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    try:
        {"generate": _generate, "serve": _serve, "simulate": simulate_main,
         "proxy": _proxy, "trace-view": trace_view_main}[args.command](args)
    except ValueError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
