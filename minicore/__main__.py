"""python -m minicore {generate,serve}: the command line.

Mirrors vllm/entrypoints/cli/ in spirit: one subcommand per entry point, flags with vLLM's names.
"""

import argparse
import json
import logging
import os
import sys


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="safetensors directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16, float16")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="KV cache bytes (CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    names = ("model", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
             "block_size", "kv_cache_memory", "gpu_memory_utilization", "enable_prefix_caching",
             "enable_chunked_prefill", "scheduling_policy")
    return {name: getattr(args, name) for name in names}


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
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--runner", choices=["transformers", "simulated"], default="transformers",
                        help="simulated: no weights, made-up tokens after a modelled delay "
                             "(a minicore addition, for studying the IO path and scheduling)")
    parser.add_argument("--simulated-cost", type=json.loads, default=None,
                        metavar="JSON", help='the simulated runner\'s step time, e.g. '
                        '\'{"step_s": 0.01, "prefill_token_s": 1e-5, "decode_seq_s": 1e-4}\'')
    _add_engine_args(parser)
    dp = parser.add_argument_group("data parallel")
    dp.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                    help="number of engine replicas (DP ranks), on every machine together")
    dp.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None,
                    help="DP ranks to start on this machine (default: all)")
    dp.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=0,
                    help="the first DP rank started on this machine (with --headless)")
    dp.add_argument("--data-parallel-address", "-dpa", default="127.0.0.1",
                    help="the frontend machine's address, which every rank connects to")
    dp.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=29550,
                    help="the DP group's rendezvous port; the engines' handshake is on the next")
    dp.add_argument("--headless", action="store_true",
                    help="run only this machine's DP ranks, for a frontend on another machine")
    dp.add_argument("--balance-scheduling", action="store_true",
                    help="hold back admission on every rank while one is nearly full "
                         "(vllm-ascend's balance scheduling)")
    dp.add_argument("--balance-threshold", choices=["seed", "full"], default="seed",
                    help="seed: gate at max_num_seqs - 1 running (the patch as merged); "
                         "full: at max_num_seqs")


def _serve(args: argparse.Namespace) -> None:
    import asyncio

    import uvloop

    from minicore.config import SimulatedCost, create_engine_config
    from minicore.entrypoints.api_server import run_server

    logging.basicConfig(level=logging.INFO, datefmt="%m-%d %H:%M:%S",
                        format="%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s")
    if args.model_tag is not None:
        args.model = args.model_tag
    kwargs = _engine_kwargs(args)
    kwargs["runner"] = args.runner
    for name in ("data_parallel_size", "data_parallel_size_local", "data_parallel_start_rank",
                 "data_parallel_address", "data_parallel_rpc_port", "balance_scheduling",
                 "balance_threshold"):
        kwargs[name] = getattr(args, name)
    if args.simulated_cost is not None:
        try:
            kwargs["simulated_cost"] = SimulatedCost(**args.simulated_cost)
        except TypeError as e:  # an unknown key
            raise ValueError(f"--simulated-cost: {e}") from None
    config = create_engine_config(**kwargs)
    if args.headless:
        from minicore.dp.launch import run_headless

        run_headless(config)
        return
    if config.parallel_config.data_parallel_start_rank != 0:
        raise ValueError("the frontend's machine runs the DP ranks from 0: "
                         "--data-parallel-start-rank is for --headless")
    try:
        uvloop.run(run_server(config, args))
    except asyncio.CancelledError:  # a signal while the engine was starting
        sys.exit("minicore: stopped before the server started")


def _generate(args: argparse.Namespace) -> None:
    from minicore.llm import LLM
    from minicore.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    llm = LLM(**_engine_kwargs(args))
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(args.prompts, params)
    for out in outputs:
        print(f"--- {out.prompt!r} ({out.outputs[0].finish_reason})")
        print(out.outputs[0].text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minicore")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts, offline")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--chat", action="store_true", help="format prompts with the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    _add_engine_args(gen)
    _add_serve_args(sub.add_parser("serve", help="serve the OpenAI-compatible API over HTTP"))
    args = parser.parse_args(argv)
    try:
        {"generate": _generate, "serve": _serve}[args.command](args)
    except ValueError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
