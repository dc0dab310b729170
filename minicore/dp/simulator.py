"""A discrete-event simulator of N data-parallel ranks in lockstep, on the real schedulers.

Each rank is the Scheduler or BalanceScheduler the engine runs (minicore/scheduler/), stepped in
the order of DPEngineCoreProc's busy loop (minicore/dp/engine.py, after vLLM's DPEngineCoreProc in
vllm/v1/engine/core.py): take the arrived requests, schedule, run the step, update from the
model's output, and with balance scheduling set every rank's balance_counts to the running counts
after the step (the gather of vllm-ascend PR #5212). No processes, sockets or torch: the forward
is a cost model, and simulated time advances by the slowest rank's step, as an MoE model's
all-to-alls make every rank wait for the others. A rank with nothing scheduled in a running wave
runs a dummy step; a wave ends at the every-32-steps check that finds no rank with work: the
engine's own rules, imported from minicore/dp/wave.py, as the gate is BalanceScheduler's own.

The model emits made-up tokens: one when a prompt completes, and per decode step 1 +
Binomial(K, P) with K speculative tokens accepted at rate P (vLLM's speculative decoding: the
accepted drafts' KV was written in the step that verified them, so only the newest token is left
to compute). Clients send requests all at once, at a Poisson rate, and at most max_concurrency at
a time, as `vllm bench serve` does; a request goes to the rank with the lowest 4 * waiting +
running, as DPCoordinator routes (minicore/dp/coordinator.py), here from the exact counts.
Everything it reports is simulated. Left out: scheduling and IO overheads, the collectives' own
cost, stop strings, aborts, priorities.
"""

import random
from dataclasses import dataclass, field

from minicore.config import CacheConfig, SchedulerConfig
from minicore.dp.wave import is_sync_step, runs_dummy_batch
from minicore.request import Request
from minicore.sampling_params import SamplingParams
from minicore.scheduler.balance import BalanceScheduler
from minicore.scheduler.output import ModelRunnerOutput, SchedulerOutput
from minicore.scheduler.scheduler import Scheduler


@dataclass(slots=True)
class CostModel:
    """One rank's step time: step_ms + decode_seq_ms per decoding request + prefill_token_us per
    prefill token + context_token_us per token of context the step's requests attend to."""
    step_ms: float = 75.0
    decode_seq_ms: float = 2.34
    prefill_token_us: float = 250.0
    context_token_us: float = 0.0

    def __post_init__(self):
        for name in ("step_ms", "decode_seq_ms", "prefill_token_us", "context_token_us"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def step_seconds(self, num_decodes: int, num_prefill_tokens: int, num_context: int) -> float:
        return (self.step_ms / 1e3 + self.decode_seq_ms / 1e3 * num_decodes
                + self.prefill_token_us / 1e6 * num_prefill_tokens
                + self.context_token_us / 1e6 * num_context)


@dataclass(slots=True)
class SimRequest:
    """One request of the workload, and what the client saw of it (times in simulated seconds)."""
    index: int
    prompt_token_ids: list[int]
    output_len: int
    send_time: float | None = None
    rank: int = -1
    # The time of each step that gave the client tokens, and how many it gave.
    chunk_times: list[float] = field(default_factory=list)
    chunk_sizes: list[int] = field(default_factory=list)

    @property
    def num_output(self) -> int:
        return sum(self.chunk_sizes)


@dataclass(slots=True)
class StepRecord:
    """One lockstep iteration: when it ended, the balance counts the ranks scheduled with, whether
    the gate was closed, and per rank the tokens scheduled and requests admitted."""
    end_time: float
    balance_counts: list[int]
    gated: bool
    num_scheduled_tokens: list[int]
    num_admitted: list[int]
    has_prefill: bool


@dataclass(slots=True)
class SimConfig:
    data_parallel_size: int
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    cost: CostModel = field(default_factory=CostModel)
    num_speculative_tokens: int = 0
    acceptance_rate: float = 0.0
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self):
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0, got "
                             f"{self.num_speculative_tokens}")
        if not 0.0 <= self.acceptance_rate <= 1.0:
            raise ValueError(f"acceptance_rate must be in [0, 1], got {self.acceptance_rate}")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be > 0 (inf: all at once), got "
                             f"{self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")


class _Rank:
    """One DP rank: its scheduler, and the requests sent to it that its loop has not taken in."""

    def __init__(self, index: int, config: SimConfig):
        self.index = index
        cls = BalanceScheduler if config.scheduler_config.balance_scheduling else Scheduler
        kwargs = {"dp_size": config.data_parallel_size} if cls is BalanceScheduler else {}
        self.scheduler = cls(config.scheduler_config, config.cache_config, **kwargs)
        # Sent to this rank, not yet taken in by its loop.
        self.on_the_way: list[Request] = []

    def receive(self) -> None:
        for request in self.on_the_way:
            self.scheduler.add_request(request)
        self.on_the_way.clear()

    def load_score(self) -> int:
        """DPCoordinator's score: what is on the way counts as waiting."""
        return (4 * (len(self.scheduler.waiting) + len(self.on_the_way))
                + len(self.scheduler.running))


class DPSimulator:
    """Runs one workload through N simulated ranks; run() returns the requests with their times
    and the step records."""

    def __init__(self, config: SimConfig, workload: list[SimRequest]):
        self.config = config
        self.ranks = [_Rank(i, config) for i in range(config.data_parallel_size)]
        self.workload = workload
        self.by_id = {str(r.index): r for r in workload}
        self.planned = _planned_send_times(len(workload), config.request_rate, config.seed)
        # Per request, its own stream of accepted-draft counts: the same in every variant.
        self.accept_rng = {r.index: random.Random(config.seed * 1_000_003 + r.index)
                           for r in workload}
        self.now = 0.0
        self.next_to_send = 0
        self.in_flight = 0
        self.steps: list[StepRecord] = []
        self.engines_running = False
        self.step_counter = 0

    def run(self) -> tuple[list[SimRequest], list[StepRecord]]:
        while True:
            self._send_due()
            if not self.engines_running and not self._any_unfinished():
                if self.next_to_send == len(self.workload):
                    return self.workload, self.steps
                # Idle: jump to the next send (in flight is 0 here, so only its time holds it).
                self.now = max(self.now, self.planned[self.next_to_send])
                continue
            self.engines_running = True
            self._step()

    @property
    def num_preemptions(self) -> int:
        return sum(rank.scheduler.num_preemptions for rank in self.ranks)

    def _any_unfinished(self) -> bool:
        return any(rank.scheduler.has_unfinished_requests() for rank in self.ranks)

    def _send_due(self) -> None:
        """The client sends what is due and allowed; a rank takes a request at the start of its
        next step, except while the wave is paused (an idle engine waits on its input socket). So
        a request sent when a step ends misses the step that starts then, as in the engine, where
        it is still on its way through the frontend while that step runs."""
        limit = self.config.max_concurrency or len(self.workload)
        while (self.next_to_send < len(self.workload) and self.in_flight < limit
               and self.planned[self.next_to_send] <= self.now):
            sim_request = self.workload[self.next_to_send]
            self.next_to_send += 1
            self.in_flight += 1
            rank = min(self.ranks, key=_Rank.load_score)
            sim_request.send_time, sim_request.rank = self.now, rank.index
            params = SamplingParams(max_tokens=sim_request.output_len, ignore_eos=True)
            rank.on_the_way.append(Request(str(sim_request.index), sim_request.prompt_token_ids,
                                           params, arrival_time=self.now))
        if not self.engines_running:
            for rank in self.ranks:
                rank.receive()

    def _step(self) -> None:
        """One iteration of every rank's busy loop, in lockstep."""
        first = self.ranks[0].scheduler
        counts = list(getattr(first, "balance_counts", ()))
        # Every rank reads the same gathered counts, so the gate is shut on all or on none.
        gated = first._admission_gated()
        outputs = [rank.scheduler.schedule() for rank in self.ranks]
        for rank in self.ranks:
            rank.receive()
        costs = [self._step_cost(rank.scheduler, so) for rank, so in zip(self.ranks, outputs)]
        self.now += max(seconds for seconds, _ in costs)
        for rank, so in zip(self.ranks, outputs):
            self._update(rank.scheduler, so)
        if self.config.scheduler_config.balance_scheduling:
            running = [len(rank.scheduler.running) for rank in self.ranks]
            for rank in self.ranks:
                rank.scheduler.balance_counts = list(running)
        self.steps.append(StepRecord(
            self.now, counts, gated, [so.total_num_scheduled_tokens for so in outputs],
            [len(so.scheduled_new_reqs) for so in outputs],
            any(has_prefill for _, has_prefill in costs)))
        self.step_counter += 1
        if is_sync_step(self.step_counter) and not self._any_unfinished():
            self.engines_running = False
            self.step_counter = 0

    def _step_cost(self, scheduler: Scheduler, so: SchedulerOutput) -> tuple[float, bool]:
        """The rank's step time, and whether it computed prompt tokens. With nothing scheduled it
        runs a dummy step, the time of one decode."""
        executed = so.total_num_scheduled_tokens > 0
        if runs_dummy_batch(executed, scheduler.has_unfinished_requests(),
                            self.engines_running):
            return self.config.cost.step_seconds(1, 0, 0), False
        num_decodes = num_prefill = num_context = 0
        for req_id, n in so.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            if self._is_decode(request, n):
                num_decodes += 1
            else:
                num_prefill += n
            num_context += request.num_computed_tokens
        return self.config.cost.step_seconds(num_decodes, num_prefill, num_context), num_prefill > 0

    def _update(self, scheduler: Scheduler, so: SchedulerOutput) -> None:
        """The made-up model output for so, then the scheduler's update and the client's view."""
        req_ids = list(so.num_scheduled_tokens)
        sampled = [self._sample(scheduler.requests[req_id], n)
                   for req_id, n in so.num_scheduled_tokens.items()]
        output = ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)
        num_spec = self.config.num_speculative_tokens
        for out in scheduler.update_from_output(so, output):
            sim_request = self.by_id[out.request_id]
            sim_request.chunk_times.append(self.now)
            sim_request.chunk_sizes.append(len(out.new_token_ids))
            if out.finish_reason is not None:
                self.in_flight -= 1
            elif num_spec:
                # vLLM schedules a decoding request's newest token and its num_spec drafts, and
                # rolls back the rejected ones. The drafts are not tokens here, so the same
                # budget and KV slots are taken by leaving the last num_spec known tokens to
                # compute again.
                request = scheduler.requests[out.request_id]
                request.num_computed_tokens = request.num_tokens - 1 - num_spec

    def _sample(self, request: Request, num_scheduled: int) -> list[int]:
        """Nothing for a prompt chunk, one token when a prompt completes, 1 + the accepted
        drafts for a decode."""
        if request.num_computed_tokens < request.num_tokens:
            return []
        num_tokens = 1
        if self._is_decode(request, num_scheduled):
            rng, rate = self.accept_rng[int(request.request_id)], self.config.acceptance_rate
            num_tokens += sum(rng.random() < rate
                              for _ in range(self.config.num_speculative_tokens))
        return [(request.num_tokens + i) % 30000 + 100 for i in range(num_tokens)]

    def _is_decode(self, request: Request, num_scheduled: int) -> bool:
        """Scheduled (the step's num_computed_tokens already counted) for its newest token and
        the drafts, with output before: a decode. Anything else computes prompt (or, after a
        preemption, recomputed) tokens."""
        return (num_scheduled == 1 + self.config.num_speculative_tokens
                and request.num_output_tokens > 0
                and request.num_computed_tokens == request.num_tokens)


def _planned_send_times(n: int, rate: float, seed: int) -> list[float]:
    """When the client means to send each request: all at 0 for an infinite rate, else Poisson
    arrivals (exponential gaps), the first at 0, as `vllm bench serve` with burstiness 1."""
    if rate == float("inf"):
        return [0.0] * n
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def make_random_workload(num_prompts: int, input_len: int, output_len: int,
                         range_ratio: float = 0.0, vocab_size: int = 32000,
                         seed: int = 0) -> list[SimRequest]:
    """vllm bench serve's random dataset: input and output lengths uniform in
    [len * (1 - range_ratio), len * (1 + range_ratio)], prompts of random token ids (distinct, so
    the prefix cache finds nothing)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)

    def draw(length: int) -> int:
        return rng.randint(max(1, int(length * (1 - range_ratio))),
                           max(1, int(length * (1 + range_ratio))))

    workload = []
    for index in range(num_prompts):
        in_len, out_len = draw(input_len), draw(output_len)
        workload.append(SimRequest(index, [rng.randrange(100, vocab_size) for _ in range(in_len)],
                                   out_len))
    return workload
