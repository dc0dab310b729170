"""Scheduler: which requests run this step, with how many tokens, in which KV blocks.

Mirrors vllm/v1/core/sched/scheduler.py. There is no prefill or decode phase: each request has
num_computed_tokens and num_tokens, and every step hands out a token budget so that the first
catches up with the second; chunked prefill, prefix caching and preemption by recompute all follow.
Checked step by step against vLLM 0.32.0's scheduler with benchmarks/vllm_differential.py
(docs/FIDELITY.md). Two deliberate deviations: a priority-policy victim preempted after being
scheduled in the same step leaves no never-computed block in the prefix cache (vLLM 0.32 leaves
their hashes registered), and finish_requests frees in the order given (vLLM: set order).
Features outside the core bind once, at construction, as components whose seams and do-nothing
defaults are interfaces.py's (the KV connector, drafts, async scheduling's placeholders,
logprobs, structured outputs; the composition root, minicore/engine/components.py, picks the
real ones), beside the scheduling policy (policies/) and BalanceScheduler's gate (balance.py).
The engine's
pause (vLLM's PauseState.PAUSED_ALL) is a gate engine/control.py binds over has_requests and
has_unfinished_requests. Left out: encoders, LoRA.
"""

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minicore.protocol import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, SchedulerStats
from minicore.request import Request, RequestStatus
from minicore.scheduler.interfaces import (
    NO_LOGPROBS,
    NO_PLACEHOLDERS,
    NO_REMOTE_KV,
    NO_SPEC_DECODE,
    NO_STRUCTURED_OUTPUT,
    DraftTokenIds,
    NoLogprobs,
    NoPlaceholders,
    NoSpecDecode,
)
from minicore.scheduler.kv_cache_manager import KVCacheBlocks, KVCacheManager
from minicore.scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from minicore.scheduler.policies import get_policy
from minicore.scheduler.utils import check_stop

if TYPE_CHECKING:
    from minicore.config import CacheConfig, SchedulerConfig
    from minicore.kv_transfer.base import KVConnectorBase_V1

RUNNING = RequestStatus.RUNNING
# The statuses of the requests in the waiting queue (a parked one, WAITING_FOR_REMOTE_KVS, is not).
IN_WAITING_QUEUE = (RequestStatus.WAITING, RequestStatus.WAITING_FOR_FSM, RequestStatus.PREEMPTED)
# Shared by every request that needs no new block this step (most decode steps): one allocation
# less per request per step.
NO_NEW_BLOCKS: tuple[int, ...] = ()


@dataclass(slots=True)
class _StepState:
    """What one schedule() call has scheduled so far, filled in place (not the token budget:
    the running loop keeps it in a local, since an attribute costs a lookup per request)."""
    # long_prefill_token_threshold, or 0 when one request alone has nobody to starve.
    long_prefill_threshold: int
    # time.monotonic() at the step's start: the SCHEDULED and PREEMPTED events' time, as vLLM.
    timestamp: float
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    preempted_reqs: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, scheduler_config: "SchedulerConfig", cache_config: "CacheConfig",
                 connector: "KVConnectorBase_V1 | None" = None,
                 structured_output_manager=NO_STRUCTURED_OUTPUT, *,
                 spec_decode: NoSpecDecode = NO_SPEC_DECODE,
                 placeholders: NoPlaceholders = NO_PLACEHOLDERS,
                 logprobs: NoLogprobs = NO_LOGPROBS):
        """The components (a KV connector's scheduler side, the structured output manager's,
        drafts', async scheduling's placeholders, logprobs) are chosen by the composition root
        (minicore/engine/components.py); each defaults to doing nothing."""
        if cache_config.num_blocks is None:
            raise ValueError("cache_config.num_blocks must be set before building a Scheduler")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.policy = get_policy(scheduler_config.policy)()
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
            self.max_model_len, spec_decode.num_lookahead_tokens, spec_decode.use_eagle)
        self.requests: dict[str, Request] = {}
        self.waiting = self.policy.create_request_queue()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # since the last schedule(): the runner is told
        self.num_preemptions = 0
        self.connector = connector  # a KV connector's scheduler side or None (vLLM's)
        self.remote_kv = (NO_REMOTE_KV if connector is None else
                          connector.make_remote_kv(self.kv_cache_manager, scheduler_config))
        self.spec_decode = spec_decode
        self.placeholders = placeholders
        self.logprobs = logprobs
        self.structured_output_manager = structured_output_manager

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens > self.max_model_len:
            raise ValueError(f"request {request.request_id!r}: the prompt has {request.num_tokens} "
                             f"tokens, more than max_model_len ({self.max_model_len})")
        self.waiting.add_request(request)
        self.requests[request.request_id] = request
        request.events.append(EngineCoreEvent.new_event(EngineCoreEventType.QUEUED))

    def finish_requests(self, request_ids, finished_status: RequestStatus) -> None:
        """Finish requests from outside (abort) or that a component ends; unknown or finished ids
        are ignored (a finished one is known while a KV connector holds its blocks)."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status!r} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        requests = self.requests
        self._finish([(requests[i], finished_status, None) for i in dict.fromkeys(request_ids)
                      if i in requests and not requests[i].is_finished()])

    def _finish(self, finished: list[tuple[Request, RequestStatus, EngineCoreOutput | None]]
                ) -> None:
        """Finish the requests, each with its status and its last output if it has one (the KV
        connector's kv_transfer_params go there), and free their blocks unless the connector
        holds them."""
        running = {request for request, _, _ in finished if request.status == RUNNING}
        if running:
            self.running = [r for r in self.running if r not in running]
        for request, status, output in finished:
            if request.status in IN_WAITING_QUEUE:
                self.waiting.remove_request(request)
            request.status = status
            self.finished_req_ids.add(request.request_id)
            delay_free = self.remote_kv.request_finished(request, output)
            if not delay_free:
                self._free_blocks(request)

    def _free_blocks(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    def has_requests(self) -> bool:
        """Whether the engine must keep stepping: unfinished requests, finished ones whose blocks
        a KV connector holds or that the runner has not been told of, or connector state not yet
        sent to its worker side (vLLM: has_requests). The engine's pause binds it to no work."""
        return bool(self.requests or self.finished_req_ids) or self.remote_kv.has_pending_requests()

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting) or self.remote_kv.num_waiting_for_remote_kvs() > 0

    def get_num_unfinished_requests(self) -> int:
        return sum(self.get_request_counts())

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting); requests parked for remote KV count as waiting, as in vLLM."""
        return len(self.running), len(self.waiting) + self.remote_kv.num_waiting_for_remote_kvs()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """False while some block is in use. reset_running_requests preempts the running requests
        first: recomputed when next scheduled; the runner forgets them as it does finished ones."""
        if reset_running_requests:
            for request in reversed(self.running):  # prepended one by one: their order is kept
                self._preempt_request(request, time.monotonic())
                self.finished_req_ids.add(request.request_id)
            self.running = []
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        stats = self.kv_cache_manager.prefix_cache_stats
        num_running, num_waiting = self.get_request_counts()
        return SchedulerStats(num_running, num_waiting, self.kv_cache_manager.usage,
                              stats.queries, stats.hits, self.num_preemptions,
                              self.remote_kv.num_waiting_for_remote_kvs(), self.spec_decode.stats)

    # ---- one step ------------------------------------------------------------------------------

    def _admission_gated(self) -> bool:
        return False  # BalanceScheduler's gate: admit no waiting request this step

    def _preempt_request(self, request: Request, timestamp: float) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.events.append(EngineCoreEvent(EngineCoreEventType.PREEMPTED, timestamp))
        self.waiting.prepend_request(request)

    def schedule(self) -> SchedulerOutput:
        # A scheduled request's tokens count as computed at once, so that a long prompt's next
        # chunk can be scheduled before this step's output is back. The output records the counts
        # from before this step.
        for request in self.remote_kv.promote_received():  # their KV is in
            self.waiting.prepend_request(request)
        self.structured_output_manager.promote_compiled()
        threshold = self.scheduler_config.long_prefill_token_threshold
        step = _StepState(threshold if len(self.running) + len(self.waiting) > 1 else 0,
                          time.monotonic())
        token_budget = self._schedule_running(step, self.max_num_scheduled_tokens)
        # A preemption means the KV cache is full: admitting now would only preempt again.
        if not step.preempted_reqs and not self._admission_gated():
            token_budget = self._schedule_waiting(step, token_budget)
        output = SchedulerOutput(
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=step.cached_reqs,
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_scheduled_tokens - token_budget,
            preempted_req_ids={r.request_id for r in step.preempted_reqs},
            finished_req_ids=self.finished_req_ids,
            scheduled_spec_decode_tokens=self.spec_decode.take_scheduled_drafts(
                step.cached_reqs.req_ids, self.requests),
        )
        self.finished_req_ids = set()
        self.placeholders.after_schedule(output, self.requests, len(self.running))
        self.structured_output_manager.grammar_bitmask(output, self.requests)
        output.kv_connector_metadata = self.remote_kv.build_connector_meta(output)
        return output

    def _schedule_running(self, step: _StepState, token_budget: int) -> int:
        """RUNNING requests first, in order; returns the budget left. running is changed only in
        place (by preemption), so req_index walks it while it shrinks."""
        threshold = step.long_prefill_threshold
        running, allocate_slots = self.running, self.kv_cache_manager.allocate_slots
        num_scheduled_tokens = step.num_scheduled_tokens
        add_req_id = step.cached_reqs.req_ids.append
        add_new_block_ids = step.cached_reqs.new_block_ids.append
        add_num_computed = step.cached_reqs.num_computed_tokens.append
        req_index = 0
        while req_index < len(running) and token_budget > 0:
            request = running[req_index]
            if self.placeholders.ends_in_flight(request, self.max_model_len):
                req_index += 1
                continue
            num_new_tokens = (request.num_tokens_with_spec + request.num_output_placeholders
                              - request.num_computed_tokens)
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            if num_new_tokens > token_budget:
                num_new_tokens = token_budget
            if num_new_tokens == 0:
                req_index += 1
                continue
            if (new_blocks := allocate_slots(request, num_new_tokens)) is None:
                new_blocks, token_budget, req_index = self._preempt_until_fits(
                    step, request, num_new_tokens, token_budget, req_index)
                if new_blocks is None:
                    break
            num_scheduled_tokens[request.request_id] = num_new_tokens
            add_req_id(request.request_id)
            add_new_block_ids(new_blocks.get_block_ids() if new_blocks.blocks else NO_NEW_BLOCKS)
            add_num_computed(request.num_computed_tokens)
            request.num_computed_tokens += num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1
        return token_budget

    def _preempt_until_fits(self, step: _StepState, request: Request, num_new_tokens: int,
                            token_budget: int, req_index: int
                            ) -> tuple[KVCacheBlocks | None, int, int]:
        """allocate_slots(request) has just failed: preempt the policy's victims one at a time,
        retrying after each, until it fits. Returns the new blocks (None once request itself was
        the victim: the running pass then stops) with the updated token_budget and req_index.
        A victim scheduled earlier in this step (the priority policy's may be anywhere in running)
        is unscheduled: its tokens go back to the budget, it leaves num_scheduled_tokens and
        cached_reqs, the blocks it was to fill lose their hashes (their KV will never be computed),
        and req_index moves back one (running shifted)."""
        kv = self.kv_cache_manager
        while True:
            victim = self.policy.pick_victim(self.running)
            if victim.request_id in step.num_scheduled_tokens:
                num_victim_tokens = step.num_scheduled_tokens.pop(victim.request_id)
                token_budget += num_victim_tokens
                kv.uncache_blocks_after(victim, victim.num_computed_tokens - num_victim_tokens)
                step.cached_reqs.remove(victim.request_id)
                req_index -= 1
            self._preempt_request(victim, step.timestamp)
            step.preempted_reqs.append(victim)
            if victim is request:
                return None, token_budget, req_index
            if (new_blocks := kv.allocate_slots(request, num_new_tokens)) is not None:
                return new_blocks, token_budget, req_index

    def _schedule_waiting(self, step: _StepState, token_budget: int) -> int:
        """Admit WAITING requests in the policy's order while budget and max_num_seqs allow;
        returns the budget left. One whose grammar still compiles is passed over and keeps its
        place (vLLM's skipped_waiting_requests)."""
        waiting, running, max_running = self.waiting, self.running, self.max_num_running_reqs
        while (waiting and token_budget > 0 and len(running) < max_running
               and self.structured_output_manager.skip_uncompiled(waiting)):
            if (num_new := self._try_admit(waiting.peek_request(), step, token_budget)) is None:
                break
            token_budget -= num_new
        self.structured_output_manager.restore_skipped(waiting)
        return token_budget

    def _try_admit(self, request: Request, step: _StepState, token_budget: int) -> int | None:
        """Admit the request at the head of the waiting queue with as many tokens as the budget,
        the long-prefill threshold and the KV cache allow (mini-sglang's PrefillAdder.try_add_one).
        Returns the number of tokens scheduled (0: parked while its KV comes from another
        instance), or None, having changed nothing, to stop admission for this step (without
        chunked prefill a prompt over the budget stops it, as does one the KV cache cannot hold)."""
        kv = self.kv_cache_manager
        # Only a request whose KV a connector loaded comes back with computed tokens: its blocks are
        # allocated and its prefix-cache query counted already.
        if resumed := request.num_computed_tokens > 0:
            computed_blocks, num_computed = (), request.num_computed_tokens
        else:
            computed_blocks, num_computed = kv.get_computed_blocks(request)
            num_external = self.remote_kv.get_num_new_matched_tokens(request, num_computed)
            if num_external > 0:  # it waits for that KV, outside the queue
                if not self.remote_kv.park(request, computed_blocks, num_computed, num_external):
                    return None
                self.waiting.pop_request()
                return 0
        num_new_tokens = request.num_tokens - num_computed
        if 0 < step.long_prefill_threshold < num_new_tokens:
            num_new_tokens = step.long_prefill_threshold
        if not self.scheduler_config.enable_chunked_prefill and num_new_tokens > token_budget:
            return None
        num_new_tokens = min(num_new_tokens, token_budget)
        # The tokens computed beyond the request's own count: the prefix hit (a request resumed
        # from remote KV has them counted already).
        if kv.allocate_slots(request, num_new_tokens, num_computed - request.num_computed_tokens,
                             computed_blocks,
                             self.scheduler_config.scheduler_reserve_full_isl) is None:
            return None
        self.waiting.pop_request()
        if not resumed:
            kv.record_prefix_cache_query(request.num_tokens, num_computed)
        self.remote_kv.update_state_after_alloc(request)
        self.running.append(request)
        request.status = RUNNING
        request.events.append(EngineCoreEvent(EngineCoreEventType.SCHEDULED, step.timestamp))
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed
        request.num_computed_tokens = num_computed
        step.new_reqs.append(NewRequestData.from_request(request,
                                                         kv.get_block_ids(request.request_id)))
        request.num_computed_tokens += num_new_tokens
        step.num_scheduled_tokens[request.request_id] = num_new_tokens
        return num_new_tokens

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """The drafter's proposals for each request's next step (spec_decode.py)."""
        self.spec_decode.update_draft_token_ids(draft_token_ids, self.requests, self.max_model_len)

    # ---- after the forward ---------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, finish stopped requests; the new tokens of the live requests."""
        sampled_token_ids = model_runner_output.sampled_token_ids
        requests = self.placeholders.requests_to_update(scheduler_output, model_runner_output,
                                                        self.requests)
        self.spec_decode.take_back_rejected(scheduler_output, model_runner_output, requests)
        outputs: list[EngineCoreOutput] = []
        finished: list[tuple[Request, RequestStatus, EngineCoreOutput]] = []
        for req_id, index in model_runner_output.req_id_to_index.items():
            new_token_ids = sampled_token_ids[index]
            # Mid-prefill requests sample nothing (the logprobs component may give them an output).
            if not new_token_ids or (request := requests.get(req_id)) is None:
                continue
            status = None
            for n, token_id in enumerate(new_token_ids):
                request.append_output_token_id(token_id)
                if (status := check_stop(request, self.max_model_len)) is not None:
                    new_token_ids = new_token_ids[:n + 1]
                    break
            output = EngineCoreOutput(
                req_id, new_token_ids,
                RequestStatus.get_finished_reason(status) if status else None,
                request.stop_reason, request.num_cached_tokens,
                events=request.take_events() if request.events else None)
            outputs.append(output)
            if status:
                finished.append((request, status, output))
        self.logprobs.add(outputs, requests, scheduler_output, model_runner_output)
        # Requests a component ends with an error, their outputs already in outputs.
        ended = self.structured_output_manager.accept_tokens(
            outputs, requests, model_runner_output.draft_token_ids)
        if finished:
            self._finish(finished)
        failed_loads, freed = self.remote_kv.update_from_kv_xfer_finished(
            model_runner_output.kv_connector_output, self.requests, outputs)
        for request in freed:  # finished, their blocks held until a transfer ended
            self._free_blocks(request)
        self.finish_requests([*ended, *failed_loads], RequestStatus.FINISHED_ABORTED)
        return outputs
