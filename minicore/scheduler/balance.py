"""BalanceScheduler: hold back admission on every DP rank while some rank is full.

Mirrors the gate of vllm-ascend's balance-scheduling patch (vllm_ascend/patch/platform/
patch_balance_schedule.py, BalanceScheduler.schedule). Lockstep DP runs every step at the pace of
the slowest rank, so admitting on an idle rank while another is saturated only lengthens the decode
steps that rank's requests wait on. While the largest len(running) over the ranks reaches the
threshold, no rank admits, and the full ranks drain. The counts are written by the DP group after
each step (see minicore/dp/group.py and minicore/dp/engine.py); this class only reads their
maximum, so the scheduler package stays free of torch.

Thresholds, and their history upstream:
  full       gate while some rank runs max_num_seqs (`== max_num_running_reqs`): the original
             patch, vllm-ascend PR #5212, the variant behind its published table (DeepSeek-V3.1,
             +18% output throughput). The default.
  one-short  gate while some rank runs max_num_seqs - 1 or more: vllm-ascend PR #7611, reverted
             to `full` in #8675 (and #8674 on v0.18.0) after a first-token latency regression on
             DeepSeek-V3.1 W4A8.
"""

from minicore.scheduler.scheduler import Scheduler


class BalanceScheduler(Scheduler):
    def __init__(self, *args, dp_size: int = 1, **kwargs):
        """Scheduler's arguments, and the DP group's size."""
        super().__init__(*args, **kwargs)
        # len(running) of every DP rank after the previous step, assigned as a plain list by the
        # DP group (or by hand in tests). Only its maximum is read, so the DP group may assign
        # just [maximum] (--balance-count-sync all-reduce-max).
        self.balance_counts = [0] * dp_size
        full = self.max_num_running_reqs
        limit = full - 1 if self.scheduler_config.balance_threshold == "one-short" else full
        # Never below 1: a limit of 0 would shut the gate for good, so with one slot per rank
        # both thresholds are 1.
        self.balance_limit = max(limit, 1)

    def _admission_gated(self) -> bool:
        return max(self.balance_counts) >= self.balance_limit
