"""Start-up and stop time of a DP server on each backend: mp against Ray.

Starts `python -m minicore serve --data-parallel-size N` on the default model (float32) with
`--data-parallel-backend mp`, with `ray` against a Ray cluster already running (a one-node
ray.cluster_utils.Cluster made here, as `ray start --head` would: RAY_ADDRESS), and with `ray`
alone (the server starts a local Ray instance and stops it on exit); the configurations
alternate, --repeats times each. For each start: seconds from the command to /health 200, and
from SIGTERM to exit. Prints the CPU model and flags and a table of medians; writes
benchmarks/results/bench_dp_startup.json.

    python benchmarks/bench_dp_startup.py [--data-parallel-size 2] [--repeats 3]
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from ray.cluster_utils import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import cpu_description  # noqa: E402

from minicore.ports import free_port, free_port_pair  # noqa: E402

CONFIGS = ("mp", "ray, running cluster", "ray, local instance")


def start_and_stop(backend: str, dp: int, env: dict) -> tuple[float, float]:
    """(seconds to /health 200, seconds from SIGTERM to exit)."""
    port = free_port()
    args = [sys.executable, "-m", "minicore", "serve", "--port", str(port), "--dtype", "float32",
            "--max-model-len", "512", "--kv-cache-memory", "64M",
            "--data-parallel-size", str(dp), "--data-parallel-backend", backend,
            "--data-parallel-rpc-port", str(free_port_pair())]
    started = time.perf_counter()
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{backend}: the server exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        ready = time.perf_counter() - started
        stopping = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        return ready, time.perf_counter() - stopping
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-parallel-size", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" /
                                          "bench_dp_startup.json"))
    args = ap.parse_args()
    dp = args.data_parallel_size

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": dp})
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    envs = {"mp": ("mp", base), "ray, running cluster": ("ray", {**base, "RAY_ADDRESS":
                                                                 cluster.address}),
            "ray, local instance": ("ray", base)}
    samples = {name: [] for name in CONFIGS}
    try:
        for _ in range(args.repeats):
            for name in CONFIGS:
                backend, env = envs[name]
                samples[name].append(start_and_stop(backend, dp, env))
    finally:
        cluster.shutdown()

    rows = [{"config": name, "ready_s": [r for r, _ in samples[name]],
             "stop_s": [s for _, s in samples[name]],
             "ready_median_s": statistics.median(r for r, _ in samples[name]),
             "stop_median_s": statistics.median(s for _, s in samples[name])}
            for name in CONFIGS]
    print(f"CPU: {cpu_description()}; {os.cpu_count()} CPUs")
    print(f"DP={dp}, default model (float32), {args.repeats} starts each, alternating")
    print(f"{'backend':<22} {'ready s (median)':>16} {'min':>6} {'max':>6} {'stop s':>7}")
    for r in rows:
        print(f"{r['config']:<22} {r['ready_median_s']:>16.1f} {min(r['ready_s']):>6.1f} "
              f"{max(r['ready_s']):>6.1f} {r['stop_median_s']:>7.1f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"cpu": cpu_description(), "cpus": os.cpu_count(),
                                           "data_parallel_size": dp, "repeats": args.repeats,
                                           "results": rows}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
