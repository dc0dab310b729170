"""BalanceScheduler: hold back admission on every DP rank while any rank is (nearly) full.

Mirrors the gate of vllm-ascend's balance-scheduling patch (vllm-ascend PR #5212, its
BalanceScheduler.schedule). Lockstep DP runs every step at the pace of the slowest rank, so
admitting on an idle rank while another is saturated only lengthens the decode steps that rank's
requests wait on. While the largest len(running) over the ranks reaches the threshold, no rank
admits, and the full ranks drain. The counts are written by the DP group after each step (see
minicore/dp/group.py and minicore/dp/engine.py); this class only reads them, so the scheduler
package stays free of torch.
"""

from minicore.config import CacheConfig, SchedulerConfig
from minicore.scheduler.scheduler import Scheduler


class BalanceScheduler(Scheduler):
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, dp_size: int = 1):
        super().__init__(scheduler_config, cache_config)
        # len(running) of every DP rank after the previous step, assigned as a plain list by the
        # DP group (or by hand in tests).
        self.balance_counts = [0] * dp_size
        full = self.max_num_running_reqs
        # "full": admit until a rank is full (the published patch, PR #5212). "seed": stop one
        # short (>= max_num_seqs - 1, from vllm-ascend PR #7611, reverted in #8675 after a
        # first-token latency regression). Never below 1: a limit of 0 would shut the gate for
        # good, so with one slot per rank both thresholds are 1.
        limit = full - 1 if scheduler_config.balance_threshold == "seed" else full
        self.balance_limit = max(limit, 1)

    def _admission_gated(self) -> bool:
        return max(self.balance_counts) >= self.balance_limit
