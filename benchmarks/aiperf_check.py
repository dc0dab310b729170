"""aiperf against `python -m minicore serve`, as a vLLM user runs it: `aiperf profile` with
--reset-kv-cache (POST /reset_prefix_cache before the run) and its server-metrics collection
(on by default: it scrapes the server's /metrics). Checks that every request succeeded, that the
reset endpoint was hit (the server's log), that the server-metrics views aiperf builds from
vLLM's metric names have data, and that the server's request and token counters, summed over
engines, equal aiperf's own counts (so --serve-args '--data-parallel-size 2' checks DP sums);
prints a summary and exits 1 when a check fails. No vLLM counterpart: vLLM is measured with
aiperf the same way.

aiperf lives in a venv of its own (about 140 packages, ~2 min to install; its pins, e.g. pandas<3,
differ from minicore's test environment). With --install the script makes one when missing:

    python -m venv ~/.cache/minicore/aiperf-venv
    ~/.cache/minicore/aiperf-venv/bin/pip install aiperf==0.13.0

    python benchmarks/aiperf_check.py [--install] [--aiperf PATH] [--request-count 16]
        [--serve-args '--data-parallel-size 2']
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_disagg import Processes

from minicore.model.loader import resolve_model_dir

AIPERF_VERSION = "0.13.0"
DEFAULT_VENV = Path(os.environ.get("MINICORE_CACHE", "~/.cache/minicore")).expanduser() / \
    "aiperf-venv"
# aiperf's live server row (ServerMetricsAccumulator.realtime_snapshot) and the panels of vLLM's
# example Grafana dashboard, each with the vLLM metrics it is computed from.
VIEWS = {
    "prefix cache hit rate": ["vllm:prefix_cache_hits", "vllm:prefix_cache_queries"],
    "KV cache usage": ["vllm:kv_cache_usage_perc"],
    "running / waiting requests": ["vllm:num_requests_running", "vllm:num_requests_waiting"],
    "preemptions": ["vllm:num_preemptions"],
    "server token throughput": ["vllm:prompt_tokens", "vllm:generation_tokens"],
    "TTFT, ITL, TPOT, E2E latency": [
        "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
        "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds"],
    "queue / prefill / decode / inference time": [
        "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds"],
    "per-request prompt / generation tokens": [
        "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
        "vllm:request_max_num_generation_tokens"],
    "finished requests": ["vllm:request_success"],
}
# Scraped but rightly 0 in a short run on an idle server: nothing is preempted or waits.
MAY_STAY_ZERO = {"vllm:num_preemptions", "vllm:num_requests_waiting"}


def aiperf_path(args) -> Path:
    path = Path(args.aiperf) if args.aiperf else DEFAULT_VENV / "bin" / "aiperf"
    if path.exists():
        return path
    if not args.install or args.aiperf:
        sys.exit(f"no aiperf at {path}: pass --install (or --aiperf PATH); see this file's doc")
    subprocess.run([sys.executable, "-m", "venv", str(DEFAULT_VENV)], check=True)
    subprocess.run([str(DEFAULT_VENV / "bin" / "pip"), "install", "-q",
                    f"aiperf=={AIPERF_VERSION}"], check=True)
    return path


def has_data(name: str, metric: dict) -> bool:
    """A metric aiperf can show: counters that moved, histograms that observed something; gauges
    and the MAY_STAY_ZERO metrics scraped at all."""
    stats = [series["stats"] for series in metric.get("series", [])]
    if name in MAY_STAY_ZERO or metric["type"] == "gauge":
        return bool(stats)
    if metric["type"] == "counter":
        return any(s.get("total", 0) > 0 for s in stats)
    if metric["type"] == "histogram":
        return any(s.get("count", 0) > 0 for s in stats)
    return False


def check_views(export: dict) -> list[str]:
    metrics = export["metrics"]
    failures = []
    print(f"server metrics scraped by aiperf: {len(metrics)} "
          f"({sum(name.startswith('vllm:') for name in metrics)} vllm:)")
    for view, names in VIEWS.items():
        missing = [n for n in names if n not in metrics or not has_data(n, metrics[n])]
        print(f"  {'ok ' if not missing else 'NO '} {view}" +
              (f" (no data: {', '.join(missing)})" if missing else ""))
        if missing:
            failures.append(f"view {view!r} empty: {missing}")
    return failures


def check_totals(export: dict, summary: dict) -> list[str]:
    """The server's counters summed over every series (engines, finish reasons) equal what aiperf
    counted on the client: nothing counted twice under data parallelism, nothing missed."""
    failures = []
    pairs = [("vllm:request_success", summary["request_count"]["avg"]),
             ("vllm:prompt_tokens", summary["total_usage_prompt_tokens"]["avg"]),
             ("vllm:generation_tokens", summary["total_usage_completion_tokens"]["avg"])]
    for name, client in pairs:
        server = sum(series["stats"]["total"] for series in export["metrics"][name]["series"])
        print(f"  {name}: {server:.0f} on the server, {client:.0f} seen by aiperf")
        if server != client:
            failures.append(f"{name} sums to {server}, aiperf counted {client}")
    return failures


def run_aiperf(aiperf: Path, url: str, artifacts: Path, args) -> None:
    command = [
        str(aiperf), "profile", "--model", args.model, "--tokenizer", str(resolve_model_dir()),
        "--url", url, "--endpoint-type", "chat", "--streaming",
        "--request-count", str(args.request_count), "--concurrency", str(args.concurrency),
        "--isl", "64", "--osl", "16", "--random-seed", "0", "--reset-kv-cache",
        "--no-gpu-telemetry", "--ui-type", "none", "--output-artifact-dir", str(artifacts)]
    print("$", " ".join(command))
    with open(artifacts / "aiperf_stdout.log", "w") as out:
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=True,
                       timeout=args.timeout)


def check_results(artifacts: Path, server_log: str, request_count: int) -> list[str]:
    failures = []
    summary = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    completed = summary["request_count"]["avg"]
    errors = summary["error_summary"]
    print(f"requests: {completed:.0f} completed, errors: {errors or 0}, "
          f"request throughput {summary['request_throughput']['avg']:.2f} req/s, "
          f"TTFT p50 {summary['time_to_first_token']['p50']:.0f} ms")
    cached = summary.get("total_usage_prompt_cache_read_tokens", {}).get("avg")
    print(f"prompt tokens read from the prefix cache (usage.prompt_tokens_details): {cached}")
    if completed != request_count or errors:
        failures.append(f"{completed} of {request_count} requests, errors {errors}")
    resets = server_log.count('"POST /reset_prefix_cache HTTP/1.1" 200')
    print(f"POST /reset_prefix_cache answered 200: {resets} time(s)")
    if not resets:
        failures.append("aiperf's --reset-kv-cache never reached POST /reset_prefix_cache")
    export = json.loads((artifacts / "server_metrics_export.json").read_text())
    return failures + check_views(export) + check_totals(export, summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--aiperf", help="the aiperf executable (default: in the cache's venv)")
    parser.add_argument("--install", action="store_true", help="make aiperf's venv if missing")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="served model name")
    parser.add_argument("--request-count", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=900, help="aiperf's limit (s)")
    parser.add_argument("--serve-args", default="", help="more serve flags, e.g. "
                        "'--metrics-prefix minicore' (then the views must come out empty)")
    args = parser.parse_args()
    aiperf = aiperf_path(args)
    artifacts = Path(tempfile.mkdtemp(prefix="aiperf-check-"))
    procs = Processes()
    try:
        url = procs.start("serve", "--served-model-name", args.model, "--max-model-len", "1024",
                          "--enable-prompt-tokens-details", *shlex.split(args.serve_args))
        procs.wait_healthy(url)
        started = time.monotonic()
        run_aiperf(aiperf, url, artifacts, args)
        print(f"aiperf ran {time.monotonic() - started:.0f} s; artifacts in {artifacts}")
        server_log = Path(procs.procs[0][0]).read_text(errors="replace")
    finally:
        print("exit status (serve):", procs.stop())
    failures = check_results(artifacts, server_log, args.request_count)
    for failure in failures:
        print("FAILED:", failure)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
