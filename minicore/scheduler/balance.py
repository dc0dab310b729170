"""BalanceScheduler: hold back admission on every DP rank while any rank is (nearly) full.

Mirrors vllm-ascend's balance-scheduling patch (PR #5212; seed 000): BalanceScheduler.schedule's
gate and balance_gather. Lockstep DP runs every step at the pace of the slowest rank, so admitting
on an idle rank while another is saturated only lengthens the decode steps that rank's requests
wait on. Ranks exchange len(running) once per step; while the largest reaches the threshold, no
rank admits, and the full ranks drain. Left out: nothing of the gate; the gather's placement in the
DP busy loop lives in minicore/dp/.
"""

from minicore.config import CacheConfig, SchedulerConfig
from minicore.scheduler.scheduler import Scheduler


class BalanceScheduler(Scheduler):
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, dp_size: int = 1):
        super().__init__(scheduler_config, cache_config)
        # len(running) of every DP rank, as gathered after the previous step. A plain list so that
        # tests can set it by hand.
        self.balance_counts = [0] * dp_size
        full = self.max_num_running_reqs
        # "seed": the patch as merged (>= max_num_seqs - 1); "full": vllm-ascend's later fix that
        # admits until a rank is exactly full, after a first-token latency regression.
        self.balance_limit = full - 1 if scheduler_config.balance_threshold == "seed" else full

    def _admission_gated(self) -> bool:
        return max(self.balance_counts) >= self.balance_limit

    def balance_gather(self, group) -> None:
        """All-gather len(running) over the DP group; every rank must call it at the same point."""
        import torch
        import torch.distributed as dist

        gathered = [torch.zeros(1, dtype=torch.int64) for _ in self.balance_counts]
        dist.all_gather(gathered, torch.tensor([len(self.running)], dtype=torch.int64), group=group)
        self.balance_counts = [int(t.item()) for t in gathered]
