"""The DP ranks' clocks for the step trace: which ranks share one, and how far another machine's
is from rank 0's.

minicore's own (vLLM aligns no clocks across its ranks). The processes of one machine read one
wall clock; a rank on another machine measures, once, as the DP group forms, the offset of its
clock from rank 0's over the group itself: every rank reads its clock as it leaves the same
all-gather, so the measure is good to about one collective's latency (tens of microseconds on a
LAN), and the median of a few rounds is kept. Left out: drift over a long run (NTP's business).
"""

import socket
import statistics
from pathlib import Path

from minicore.tracing.step_trace import now_us

CLOCK_ROUNDS = 3


def machine_id() -> str:
    """What the processes sharing a wall clock share: the kernel's boot id (containers on one
    kernel too), else the host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def clock_offset_us(dp_group) -> float:
    """Rank 0's clock minus this rank's, in microseconds; every rank of the group calls it."""
    samples = []
    for _ in range(CLOCK_ROUNDS):
        dp_group.all_gather_json(None)  # every rank leaves it at about the same moment
        times = dp_group.all_gather_json(now_us())
        samples.append(times[0] - times[dp_group.rank])
    return statistics.median(samples)
