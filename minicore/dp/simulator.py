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

The model emits made-up tokens: one when a prompt completes, and per decode step the accepted
drafts and one more. With K speculative tokens each rank's scheduler runs vLLM's draft path
(minicore/scheduler/spec_decode.py): after each update a made-up drafter gives every decoding
request K drafts through update_draft_token_ids, as the engine's NgramProposer does
(minicore/spec_decode/ngram_proposer.py), schedule() verifies them within the token budget, and
update_from_output takes the rejected ones back. How many are accepted is drawn from one random
stream a request (K draws a verifying step, so every variant sees the same counts): with a scalar
rate P each draft independently (1 + Binomial(K, P) tokens a step), with K per-position rates the
prefix rejection sampling keeps (draft i accepted at rate i once drafts 0..i-1 were). Clients
send requests all at once, at a Poisson rate, and at most max_concurrency at a time, as `vllm
bench serve` does; a request goes to the rank with the lowest 4 * waiting + running, as
DPCoordinator routes (minicore/dp/coordinator.py), here from the exact counts. Everything it
reports is simulated; given a SimTrace (minicore/dp/sim_trace.py, `simulate --trace-steps`), it
also writes each step as the engine's step-trace records, on the simulated clock. Left out:
scheduling and IO overheads, the collectives' own cost, stop strings, aborts, priorities, drafts
that depend on the content (ngram finds none or a short one).
"""

import random
from dataclasses import dataclass, field

from minicore.config import CacheConfig, SchedulerConfig
from minicore.dp.sim_trace import NO_TRACE, NoSimTrace
from minicore.dp.wave import is_sync_step, runs_dummy_batch
from minicore.engine.components import make_scheduler
from minicore.protocol import SpecDecodingStats
from minicore.request import Request
from minicore.sampling_params import SamplingParams
from minicore.scheduler.interfaces import DraftTokenIds
from minicore.scheduler.output import ModelRunnerOutput, SchedulerOutput
from minicore.scheduler.scheduler import Scheduler
from minicore.spec_decode.config import SpeculativeConfig
from minicore.spec_decode.drafter import decoding_requests
from minicore.spec_decode.metrics import sum_spec_stats


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
    # A scalar: each draft accepted independently; a tuple of K: per-position, as a prefix.
    acceptance_rate: float | tuple[float, ...] = 0.0
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self):
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0, got "
                             f"{self.num_speculative_tokens}")
        self.acceptance_rate = check_acceptance_rate(self.acceptance_rate,
                                                     self.num_speculative_tokens)
        if not self.request_rate > 0:
            raise ValueError("request_rate must be > 0 (inf: all at once), got "
                             f"{self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")


class _Rank:
    """One DP rank: its scheduler, and the requests sent to it that its loop has not taken in."""

    def __init__(self, index: int, config: SimConfig):
        self.index = index
        # The scheduler reads only num_speculative_tokens; the drafts are made up here.
        spec = (SpeculativeConfig(method="ngram", num_speculative_tokens=k)
                if (k := config.num_speculative_tokens) else None)
        self.scheduler = make_scheduler(config.scheduler_config, config.cache_config, spec,
                                        dp_size=config.data_parallel_size)
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

    def __init__(self, config: SimConfig, workload: list[SimRequest],
                 trace: NoSimTrace = NO_TRACE):
        self.config = config
        # --trace-steps (minicore/dp/sim_trace.py), bound once: off, each step calls two hooks
        # that do nothing.
        self.trace = trace
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

    def spec_decoding_stats(self) -> SpecDecodingStats | None:
        """The ranks' acceptance counters summed (vLLM's vllm:spec_decode_* over all ranks)."""
        if not self.config.num_speculative_tokens:
            return None
        return sum_spec_stats(rank.scheduler.spec_decode.stats for rank in self.ranks)

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
        start = self.now
        outputs = [rank.scheduler.schedule() for rank in self.ranks]
        self.trace.scheduled(self, outputs, gated)
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
            any(num_prefill > 0 for _, num_prefill in costs)))
        self.step_counter += 1
        if is_sync_step(self.step_counter) and not self._any_unfinished():
            self.engines_running = False
            self.step_counter = 0
        self.trace.stepped(self, start, outputs, costs)

    def _step_cost(self, scheduler: Scheduler, so: SchedulerOutput) -> tuple[float, int]:
        """The rank's step time, and how many prompt (or recomputed) tokens it computed. With
        nothing scheduled it runs a dummy step, the time of one decode."""
        executed = so.total_num_scheduled_tokens > 0
        if runs_dummy_batch(executed, scheduler.has_unfinished_requests(),
                            self.engines_running):
            return self.config.cost.step_seconds(1, 0, 0), 0
        num_decodes = num_prefill = num_context = 0
        for req_id, n in so.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            if _is_decode(request, n, len(so.scheduled_spec_decode_tokens.get(req_id, ()))):
                num_decodes += 1
            else:
                num_prefill += n
            num_context += request.num_computed_tokens
        return self.config.cost.step_seconds(num_decodes, num_prefill, num_context), num_prefill

    def _update(self, scheduler: Scheduler, so: SchedulerOutput) -> None:
        """The made-up model output for so, the scheduler's update and the client's view, then
        the next step's drafts."""
        req_ids = list(so.num_scheduled_tokens)
        sampled = [self._sample(scheduler.requests[req_id],
                                so.scheduled_spec_decode_tokens.get(req_id, []))
                   for req_id in req_ids]
        output = ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)
        for out in scheduler.update_from_output(so, output):
            sim_request = self.by_id[out.request_id]
            sim_request.chunk_times.append(self.now)
            sim_request.chunk_sizes.append(len(out.new_token_ids))
            if out.finish_reason is not None:
                self.in_flight -= 1
        if self.config.num_speculative_tokens:
            self._propose(scheduler, so)

    def _sample(self, request: Request, drafts: list[int]) -> list[int]:
        """Nothing for a prompt chunk, one token when a prompt completes, the accepted drafts and
        one more when drafts were verified."""
        if request.num_computed_tokens < request.num_tokens:
            return []
        num_accepted = 0
        if drafts:
            rng = self.accept_rng[int(request.request_id)]
            # K draws however many drafts the budget let through, so that a cut in one variant
            # does not shift the request's later draws.
            draws = [rng.random() for _ in range(self.config.num_speculative_tokens)]
            num_accepted = accepted_drafts(draws[:len(drafts)], self.config.acceptance_rate)
        return drafts[:num_accepted] + [_token_at(request.num_tokens + num_accepted)]

    def _propose(self, scheduler: Scheduler, so: SchedulerOutput) -> None:
        """K drafts for each of the step's requests that NgramProposer would draft for, through
        the scheduler's update_draft_token_ids: the tokens the made-up model will emit, so that
        an accepted draft is the very token it would have sampled."""
        requests = decoding_requests(scheduler.requests, so)
        k = self.config.num_speculative_tokens
        scheduler.update_draft_token_ids(DraftTokenIds(
            [r.request_id for r in requests],
            [[_token_at(r.num_tokens + i) for i in range(k)] for r in requests]))


def _is_decode(request: Request, num_scheduled: int, num_drafts: int) -> bool:
    """Scheduled (the step's num_computed_tokens already counted) for its newest token and its
    drafts, with output before: a decode. Anything else computes prompt (or, after a preemption,
    recomputed) tokens."""
    return (num_scheduled == 1 + num_drafts and request.num_output_tokens > 0
            and request.num_computed_tokens == request.num_tokens + num_drafts)


def _token_at(position: int) -> int:
    """The made-up model's token at a position: away from the special ids, never EOS."""
    return position % 30000 + 100


def accepted_drafts(draws: list[float], rate: float | tuple[float, ...]) -> int:
    """How many of the drafts (one uniform draw each) are accepted. A scalar rate accepts each
    independently and counts them: Binomial(len(draws), rate), the accepted run being the first
    that many drafts. Per-position rates accept the prefix rejection sampling keeps: draft i at
    rate[i] once drafts 0..i-1 were, none after the first rejection."""
    if not isinstance(rate, tuple):
        return sum(u < rate for u in draws)
    num_accepted = 0
    while num_accepted < len(draws) and draws[num_accepted] < rate[num_accepted]:
        num_accepted += 1
    return num_accepted


def check_acceptance_rate(rate, num_speculative_tokens: int) -> float | tuple[float, ...]:
    """The rate as the simulator uses it (a float, or a tuple of one per draft position);
    ValueError for a rate outside [0, 1] or per-position rates not one per draft."""
    per_position = isinstance(rate, (list, tuple))
    rates = tuple(rate) if per_position else (rate,)
    if per_position and len(rates) != num_speculative_tokens:
        raise ValueError(f"acceptance_rate: {len(rates)} per-position rates given for "
                         f"{num_speculative_tokens} speculative tokens; give one per draft "
                         "position, or one rate for all")
    for value in rates:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"acceptance_rate must be in [0, 1], got {value}")
    return rates if per_position else float(rate)


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
