"""What makes vllm-ascend's balance gate help or hurt: `python -m minicore simulate` swept around
the published experiment (vllm-ascend PR #5212; minicore/dp/sim_report.py's EXPERIMENT with the
fitted cost model), one setting changed per row, every variant of a row on the same workload.
Prints a markdown table of the gated variants' ratios to the baseline and writes the results as
JSON. SIMULATED: no model runs.

    python benchmarks/balance_sweep.py                 # every row, about 3 minutes on 2 cores
    python benchmarks/balance_sweep.py --rows seeds    # only the rows whose name starts so
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minicore.__main__ import make_parser
from minicore.dp.sim_report import EXPERIMENT, THRESHOLDS, run_variant

RESULTS = Path(__file__).resolve().parent / "results" / "balance_sweep.json"
ROWS = [
    ("experiment", ""),
    *[(f"seeds: --seed {s}", f"--seed {s}") for s in (1, 2, 3, 4)],
    ("spec off: --num-speculative-tokens 0", "--num-speculative-tokens 0"),
    ("spread: --random-range-ratio 0.25", "--random-range-ratio 0.25"),
    ("spread, spec off", "--random-range-ratio 0.25 --num-speculative-tokens 0"),
    ("concurrency 96 (below the 128 slots)", "--max-concurrency 96"),
    ("concurrency 160 (above)", "--max-concurrency 160"),
    ("concurrency 256 (above)", "--max-concurrency 256"),
    ("prefill 125 us/token", "--prefill-token-us 125"),
    ("prefill 500 us/token", "--prefill-token-us 500"),
    ("DP 2 x 64", "--data-parallel-size 2 --max-num-seqs 64"),
    ("DP 8 x 16", "--data-parallel-size 8 --max-num-seqs 16"),
    ("budget 2048 (< prompt)", "--max-num-batched-tokens 2048"),
    ("budget 8192", "--max-num-batched-tokens 8192"),
]
RATIOS = (("output_throughput", "out tok/s"), ("mean_tpot_ms", "TPOT"),
          ("mean_ttft_ms", "TTFT"))


def run_row(flags: str) -> dict:
    args = make_parser().parse_args(["simulate", *EXPERIMENT.split(), *flags.split()])
    # The per-request lists would make the file megabytes; the table needs the summaries.
    return {name or "baseline": {k: v for k, v in run_variant(args, name).items()
                                 if not isinstance(v, list)} for name in (None, *THRESHOLDS)}


def row_line(name: str, results: dict) -> str:
    base = results["baseline"]
    cells = [f"{base['output_throughput']:.0f}", f"{base['mean_tpot_ms']:.1f}",
             f"{base['mean_ttft_ms'] / 1000:.1f}"]
    for threshold in THRESHOLDS:
        r = results[threshold]
        cells += [f"{r[key] / base[key]:.3f}" for key, _ in RATIOS]
    return f"| {name} | " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", default=None, help="run the rows starting with these")
    ap.add_argument("--json", default=str(RESULTS))
    opts = ap.parse_args()
    rows = [(n, f) for n, f in ROWS if not opts.rows or any(n.startswith(p) for p in opts.rows)]
    header = ["setting", "base out tok/s", "base TPOT ms", "base TTFT s"] + [
        f"{t} {label}" for t in THRESHOLDS for _, label in RATIOS]
    print(f"SIMULATED sweep around: python -m minicore simulate {EXPERIMENT}")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    results, start = {}, time.perf_counter()
    for name, flags in rows:
        results[name] = {"flags": flags, **run_row(flags)}
        print(row_line(name, results[name]), flush=True)
    path = Path(opts.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"simulated": True, "experiment": EXPERIMENT,
                                "python": platform.python_version(),
                                "wall_s": time.perf_counter() - start, "rows": results}))
    print(f"SIMULATED; {time.perf_counter() - start:.0f} s; wrote {path}")


if __name__ == "__main__":
    main()
