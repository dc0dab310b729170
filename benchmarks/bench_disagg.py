"""One instance against prefill/decode disaggregation: the same workload through both, side by side.

Starts `python -m minicore serve` once and runs benchmarks/bench_serve.py against it, then starts a
prefill instance, a decode instance (NixlConnector) and `python -m minicore proxy` and runs the
same bench_serve.py command against the proxy; prints TTFT, TPOT, ITL, end-to-end latency and
throughput for both and writes them to benchmarks/results/bench_disagg.json. Every process is
stopped with SIGTERM at the end of its half. No vLLM counterpart as such: vLLM measures its
disaggregated setups with `vllm bench serve` against the proxy, which is what this does.

    python benchmarks/bench_disagg.py --num-prompts 32 --random-input-len 384 \
        --random-range-ratio 0.33 --random-output-len 64 --max-concurrency 8
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BENCH_SERVE = Path(__file__).with_name("bench_serve.py")
STARTUP_TIMEOUT_S = 300
ROWS = [("Successful requests", "completed", "d"), ("Duration (s)", "duration", ".1f"),
        ("Request throughput (req/s)", "request_throughput", ".3f"),
        ("Output throughput (tok/s)", "output_throughput", ".1f"),
        ("Total throughput (tok/s)", "total_token_throughput", ".1f"),
        ("Mean TTFT (ms)", "mean_ttft_ms", ".0f"), ("Median TTFT (ms)", "median_ttft_ms", ".0f"),
        ("P99 TTFT (ms)", "p99_ttft_ms", ".0f"), ("Mean TPOT (ms)", "mean_tpot_ms", ".1f"),
        ("Median TPOT (ms)", "median_tpot_ms", ".1f"), ("P99 TPOT (ms)", "p99_tpot_ms", ".1f"),
        ("Mean ITL (ms)", "mean_itl_ms", ".1f"), ("Mean E2E latency (ms)", "mean_e2el_ms", ".0f")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """minicore commands started in their own sessions; stop() SIGTERMs them and reports each
    exit status (SIGKILL for one still running after 30 s)."""

    def __init__(self):
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, *args: str) -> str:
        port = free_port()
        log = tempfile.NamedTemporaryFile(prefix="bench-disagg-", suffix=".log", delete=False)
        proc = subprocess.Popen([sys.executable, "-m", "minicore", *args, "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((log.name, proc))
        return f"http://127.0.0.1:{port}"

    def wait_healthy(self, url: str) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise TimeoutError(f"{url} not healthy within {STARTUP_TIMEOUT_S} s")

    def stop(self) -> list[int]:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = []
        for log, proc in self.procs:
            try:
                codes.append(proc.wait(30))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                codes.append(proc.wait())
            os.unlink(log)
        return codes


def kv_config(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                       "kv_connector_extra_config": {"side_channel_port": free_port()}})


def run_bench(url: str, name: str, bench_args: list[str], result_dir: Path) -> dict:
    filename = f"bench_disagg_{name}.json"
    subprocess.run([sys.executable, str(BENCH_SERVE), "--base-url", url, *bench_args,
                    "--result-dir", str(result_dir), "--result-filename", filename], check=True)
    path = result_dir / filename
    result = json.loads(path.read_text())
    path.unlink()  # its figures go into bench_disagg.json
    result.pop("requests")
    return result


def one_instance(serve_args: list[str], bench_args, result_dir) -> dict:
    procs = Processes()
    try:
        url = procs.start("serve", *serve_args)
        procs.wait_healthy(url)
        return run_bench(url, "single", bench_args, result_dir)
    finally:
        print("exit statuses (serve):", procs.stop())


def disaggregated(serve_args: list[str], bench_args, result_dir) -> dict:
    procs = Processes()
    try:
        prefill = procs.start("serve", *serve_args, "--kv-transfer-config",
                              kv_config("kv_producer"))
        decode = procs.start("serve", *serve_args, "--kv-transfer-config", kv_config("kv_consumer"))
        for url in (prefill, decode):
            procs.wait_healthy(url)
        proxy = procs.start("proxy", "--prefill", prefill, "--decode", decode)
        procs.wait_healthy(proxy)
        return run_bench(proxy, "pd", bench_args, result_dir)
    finally:
        print("exit statuses (prefill, decode, proxy):", procs.stop())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--random-input-len", type=int, default=384)
    ap.add_argument("--random-range-ratio", type=float, default=0.33)
    ap.add_argument("--random-output-len", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--serve-args", default="--max-model-len 1024",
                    help="extra arguments of every serve process (one string)")
    ap.add_argument("--result-dir", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    bench_args = [f"--{k}" for k in ("num-prompts", "random-input-len", "random-range-ratio",
                                     "random-output-len", "max-concurrency")]
    bench_args = [a for flag in bench_args
                  for a in (flag, str(getattr(args, flag[2:].replace("-", "_"))))]
    serve_args = args.serve_args.split()
    load_before = os.getloadavg()
    results = {"single": one_instance(serve_args, bench_args, args.result_dir),
               "prefill+decode": disaggregated(serve_args, bench_args, args.result_dir)}
    print(f"\n{'':<28} {'one instance':>14} {'prefill+decode':>15}")
    for label, key, fmt in ROWS:
        print(f"{label:<28} {results['single'][key]:>14{fmt}} "
              f"{results['prefill+decode'][key]:>15{fmt}}")
    print(f"load average before: {load_before}, after: {os.getloadavg()}")
    out = args.result_dir / "bench_disagg.json"
    out.write_text(json.dumps({"bench_args": bench_args, "serve_args": serve_args,
                               "load_before": load_before, "load_after": os.getloadavg(),
                               "cpus": os.cpu_count(), **results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
