"""StructuredOutputManager: compiles each structured request's grammar off the busy loop, fills the
grammar bitmask of a step, and advances each request's matcher with what it sampled.

Mirrors vllm/v1/structured_output/__init__.py (StructuredOutputManager) with its xgrammar backend
(backend_xgrammar.py) and StructuredOutputRequest (request.py). EngineCore.add_request calls
grammar_init: the request waits in the queue as WAITING_FOR_FSM while a thread compiles its
grammar (xgrammar's GrammarCompiler; small constraints on a thread of their own) or finds it in
the cache (keyed by the constraint and bounded by VLLM_XGRAMMAR_CACHE_MB, as vLLM's, but
minicore's own: CompiledGrammarCache); the scheduler calls promote_compiled, grammar_bitmask and
accept_tokens (minicore/scheduler/structured_output.py). The runner's sampler masks the logits
with the bitmask (minicore/model/sampler.py). xgrammar and its tokenizer table load on the first
structured request.
With drafts a request gets a bitmask row per position it verifies (the matcher advanced through
its drafts, then rolled back); with async scheduling a step scheduled before the token in flight
is back has its bitmask filled when the update brings that token, while its forward runs (the
runner waits for it before it samples). With both, the drafts are the runner's, which it proposed
when it sampled that token and sends back with it (ModelRunnerOutput.draft_token_ids). Left out:
the guidance and outlines backends. With --reasoning-parser a grammar starts where the reasoning
ends (minicore/structured_output/reasoning.py).
"""

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from minicore.protocol import EngineCoreOutput
from minicore.request import FinishReason, Request, RequestStatus
from minicore.sampling_params import StructuredOutputsParams
from minicore.scheduler.interfaces import NO_STRUCTURED_OUTPUT
from minicore.scheduler.output import SchedulerOutput
from minicore.scheduler.structured_output import SkipsUncompiled
from minicore.structured_output.params import build_grammar
from minicore.structured_output.reasoning import (
    NO_REASONING,
    NoReasoning,
    ReasoningEnd,
    ReasoningGate,
    make_reasoning_gate,
)

logger = logging.getLogger(__name__)

# The compiled-grammar cache's bound, read as vLLM reads it (VLLM_XGRAMMAR_CACHE_MB, default 512).
CACHE_MB_ENV, DEFAULT_CACHE_MB = "VLLM_XGRAMMAR_CACHE_MB", 512
# A constraint this short compiles in milliseconds: it gets a thread of its own, so that it never
# waits behind a large one (a 20,000-string enum compiles for seconds).
SMALL_GRAMMAR_CHARS = 4096


@dataclass(slots=True, eq=False)
class StructuredOutputRequest:
    """A request's constraint, its compiled grammar (a future until compiled) and its matcher."""
    params: StructuredOutputsParams
    compiled: Future
    # Until it ends, the grammar leaves the output free (--reasoning-parser).
    reasoning: ReasoningEnd
    matcher: object = None
    # Async scheduling with drafts: what the runner proposed for the request's next step.
    proposals: list[int] = ()


class CompiledGrammarCache:
    """The compiled grammars of recent constraints, least recently used out first, their
    memory_size_bytes together at most limit_bytes. Not xgrammar's own cache: with it (0.2.8) the
    process grew about 10 times its limit before it plateaued, and compiles took twice as long
    (docs/BENCHMARKS.md); a compiled grammar's memory_size_bytes is within 25% of what it holds."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.size_bytes = 0
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()  # the two compile threads share it

    def get(self, key):
        with self._lock:
            if (compiled := self._entries.get(key)) is not None:
                self._entries.move_to_end(key)
            return compiled

    def put(self, key, compiled) -> None:
        with self._lock:
            if key in self._entries or compiled.memory_size_bytes > self.limit_bytes:
                return
            self._entries[key] = compiled
            self.size_bytes += compiled.memory_size_bytes
            while self.size_bytes > self.limit_bytes:
                self.size_bytes -= self._entries.popitem(last=False)[1].memory_size_bytes


class StructuredOutputManager(SkipsUncompiled):
    def __init__(self, tokenizer, vocab_size: int, disable_any_whitespace: bool = False,
                 cache_limit_bytes: int = DEFAULT_CACHE_MB << 20,
                 max_whitespace_cnt: int | None = None, runner_drafts: bool = False,
                 reasoning: NoReasoning | ReasoningGate = NO_REASONING):
        """runner_drafts: the runner proposes the drafts (async scheduling with drafts), so a
        step's scheduled drafts are placeholders for its proposals. reasoning: where each
        request's grammar starts (minicore/structured_output/reasoning.py)."""
        super().__init__()
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.disable_any_whitespace = disable_any_whitespace
        self.max_whitespace_cnt = max_whitespace_cnt
        self.compiler = None  # built by the first structured request
        self.cache = CompiledGrammarCache(cache_limit_bytes)
        # xgrammar compiles in C++ without the GIL, off the busy loop: small constraints on one
        # thread, large ones on another.
        self.executor_small = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile-small")
        self.executor_large = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._compiling: list[Request] = []
        # Every unfinished structured request: the per-step work walks these, not the batch.
        self._structured: list[Request] = []
        # Requests whose grammar did not compile, with the error, until the next update ends them.
        self._failed: list[tuple[Request, str]] = []
        # Steps scheduled before a structured request's token in flight was back, oldest first,
        # with the structured requests they scheduled: their bitmasks wait for those tokens.
        self._pending: list[tuple[SchedulerOutput, dict[str, Request]]] = []
        self._draft_ids = _proposed_drafts if runner_drafts else _scheduled_drafts
        self.reasoning = reasoning
        self.scheduler_side = self

    def grammar_init(self, request: Request) -> None:
        """Start compiling the request's grammar, if it has one; it waits as WAITING_FOR_FSM."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        if self.compiler is None:
            self.compiler = _make_compiler(self.tokenizer, self.vocab_size)
        key = params.key()
        executor = (self.executor_small if len(key[1]) <= SMALL_GRAMMAR_CHARS
                    else self.executor_large)
        request.structured_output_request = StructuredOutputRequest(
            params, executor.submit(self._compile, params, key),
            self.reasoning.for_request(request.prompt_token_ids))
        request.status = RequestStatus.WAITING_FOR_FSM
        self._compiling.append(request)
        self._structured.append(request)

    def _compile(self, params: StructuredOutputsParams, key):
        if (compiled := self.cache.get(key)) is not None:
            return compiled
        # A ValueError naming the field where it does not parse.
        grammar = build_grammar(params, self.disable_any_whitespace, self.max_whitespace_cnt)
        try:
            compiled = self.compiler.compile_grammar(grammar)
        except RuntimeError as e:
            raise ValueError(f"invalid structured_outputs.{params.kind}: {e}") from None
        self.cache.put(key, compiled)
        return compiled

    def promote_compiled(self) -> None:
        """WAITING_FOR_FSM -> WAITING for each request whose grammar is ready (on the scheduler's
        thread: an abort may have finished it meanwhile)."""
        if not self._compiling:
            return
        still = []
        for request in self._compiling:
            so_request = request.structured_output_request
            if request.is_finished():
                # Its client left while it compiled: a compile still queued is dropped, so that
                # grammars nobody waits for do not hold back the ones behind them.
                so_request.compiled.cancel()
            elif not so_request.compiled.done():
                still.append(request)
            else:
                self._start_matcher(request, so_request)
        self._compiling = still

    def _start_matcher(self, request: Request, so_request: StructuredOutputRequest) -> None:
        import xgrammar as xgr

        try:
            so_request.matcher = xgr.GrammarMatcher(so_request.compiled.result())
        except ValueError as e:  # the frontend's check passed, so rare: that request alone fails
            self._failed.append((request, str(e)))
            return
        request.status = RequestStatus.WAITING

    def grammar_bitmask(self, scheduler_output: SchedulerOutput,
                        requests: dict[str, Request]) -> None:
        """Bitmask rows for each scheduled request with a matcher (vLLM: get_grammar_bitmask): one
        per draft it verifies and one for its own token. A step scheduled while such a request's
        previous token is still in flight (async scheduling) has them filled when that token is
        back (accept_tokens), and the runner waits for them before it samples (vLLM:
        pending_structured_output_tokens)."""
        if not self._structured:
            return
        self._structured = [r for r in self._structured if not r.is_finished()]
        drafts = scheduler_output.scheduled_spec_decode_tokens
        scheduled = {r.request_id: r for r in self._structured
                     if r.request_id in scheduler_output.num_scheduled_tokens
                     and requests.get(r.request_id) is r}
        if not scheduled:
            return
        import xgrammar as xgr

        rows, first = {}, 0
        for req_id in scheduled:
            rows[req_id] = first
            first += 1 + len(drafts.get(req_id, ()))
        scheduler_output.structured_output_request_ids = rows
        scheduler_output.grammar_bitmask = xgr.allocate_token_bitmask(first, self.vocab_size)
        if _tokens_in_flight(scheduler_output, scheduled):
            # Past the placeholder this step samples: a token the matcher has not seen yet.
            scheduler_output.pending_structured_output_tokens = True
            scheduler_output.grammar_filled = threading.Event()
            self._pending.append((scheduler_output, scheduled))
        else:
            self._fill(scheduler_output, scheduled)

    def _fill(self, scheduler_output: SchedulerOutput, scheduled: dict[str, Request]) -> None:
        """Each row: the tokens the matcher allows after the request's tokens and its drafts
        before that position; the matcher is rolled back after. Rows past a draft the grammar
        refuses, or past the grammar's end, allow every token: the draft is rejected there (its
        row forbids it), so those positions are never sampled; so are the rows of placeholders
        the runner had no proposal for."""
        bitmask = scheduler_output.grammar_bitmask
        drafts = scheduler_output.scheduled_spec_decode_tokens
        for req_id, first in scheduler_output.structured_output_request_ids.items():
            request = scheduled[req_id]
            if request.is_finished():
                continue
            so_request = request.structured_output_request
            matcher = so_request.matcher
            advanced = 0
            # A grammar ends on its stop token; a request that goes on past it (ignore_eos, or a
            # stop token the request does not stop on) is free from then on, as in vLLM.
            draft_ids = self._draft_ids(drafts.get(req_id, ()), so_request)
            free = so_request.reasoning.num_free(draft_ids)  # rows still in the reasoning
            for row, token_id in enumerate([*draft_ids, None][free:], free):
                if matcher.is_terminated():
                    break
                matcher.fill_next_token_bitmask(bitmask, first + row)
                if token_id is None or not matcher.accept_token(token_id):
                    break
                advanced += 1
            if advanced:
                matcher.rollback(advanced)

    def _fill_pending(self) -> None:
        """Fill the steps whose requests' tokens in flight are all back (at most the one this
        step samples left), in order."""
        while self._pending:
            scheduler_output, scheduled = self._pending[0]
            if _tokens_in_flight(scheduler_output, scheduled):
                return
            self._pending.pop(0)
            self._fill(scheduler_output, scheduled)
            scheduler_output.grammar_filled.set()

    def accept_tokens(self, outputs: list[EngineCoreOutput], requests: dict[str, Request],
                      proposals: dict[str, list[int]]) -> Sequence[str]:
        """Advance each matcher by its request's new tokens, then fill the bitmasks that waited
        for them. proposals: the runner's drafts for each request's next step (runner_drafts)."""
        if not self._structured:
            self._fill_pending()
            return ()
        if proposals:
            for request in self._structured:
                if (drafts := proposals.get(request.request_id)) is not None:
                    request.structured_output_request.proposals = drafts
        for output in outputs:
            so_request = requests[output.request_id].structured_output_request
            if so_request is None or so_request.matcher.is_terminated():
                continue
            tokens = output.new_token_ids
            for token_id in tokens[so_request.reasoning.consume(tokens):]:
                if not so_request.matcher.accept_token(token_id):
                    logger.error("request %r: the grammar refused token %d", output.request_id,
                                 token_id)
                    break
        self._fill_pending()
        return self._end_failed(outputs) if self._failed else ()

    def _end_failed(self, outputs: list[EngineCoreOutput]) -> list[str]:
        failed, self._failed = self._failed, []
        failed = [(r, message) for r, message in failed if not r.is_finished()]
        for request, message in failed:
            logger.error("request %r: its grammar did not compile: %s", request.request_id,
                         message)
            outputs.append(EngineCoreOutput(request.request_id, [], FinishReason.ERROR,
                                            error_message=message))
        return [r.request_id for r, _ in failed]

    def shutdown(self) -> None:
        for executor in (self.executor_small, self.executor_large):
            executor.shutdown(wait=False, cancel_futures=True)
        # A forward waiting for its bitmask must not outlive the engine.
        for scheduler_output, _ in self._pending:
            scheduler_output.grammar_filled.set()
        self._pending.clear()


class RefusedStructuredOutput:
    """Where structured outputs cannot run (a runner without logits): a structured request is
    refused at add_request, with the reason; the scheduler gets the do-nothing side."""
    scheduler_side = NO_STRUCTURED_OUTPUT

    def __init__(self, reason: str):
        self.reason = reason

    def grammar_init(self, request: Request) -> None:
        if request.sampling_params.structured_outputs is not None:
            raise ValueError(f"structured outputs are not supported with {self.reason}")

    def shutdown(self) -> None:
        pass


def make_structured_output_manager(config, model_runner, has_logits: bool):
    """The engine's manager: a refusing one where structured outputs cannot run, else
    xgrammar's."""
    if reason := structured_outputs_unsupported(config, has_logits):
        return RefusedStructuredOutput(reason)
    so_config = config.structured_outputs_config
    runner_drafts = (config.speculative_config is not None
                     and config.scheduler_config.async_scheduling)
    tokenizer = model_runner.tokenizer
    return StructuredOutputManager(tokenizer, model_runner.vocab_size,
                                   so_config.disable_any_whitespace, cache_limit_mb() << 20,
                                   so_config.max_whitespace_cnt, runner_drafts,
                                   make_reasoning_gate(so_config, tokenizer))


def _tokens_in_flight(scheduler_output: SchedulerOutput, scheduled: dict[str, Request]) -> bool:
    """Whether a structured request of the step has tokens in flight besides the step's own (a
    placeholder for its token and one per draft it verifies): its bitmask must wait for them."""
    drafts = scheduler_output.scheduled_spec_decode_tokens
    return any(not r.is_finished()
               and r.num_output_placeholders > 1 + len(drafts.get(req_id, ()))
               for req_id, r in scheduled.items())


def _scheduled_drafts(scheduled: list[int], so_request: StructuredOutputRequest) -> list[int]:
    return scheduled


def _proposed_drafts(scheduled: list[int], so_request: StructuredOutputRequest) -> list[int]:
    """The drafts the runner runs in the placeholders' place (AsyncSpecDecodeSampler)."""
    return so_request.proposals[:len(scheduled)]


def cache_limit_mb() -> int:
    value = os.environ.get(CACHE_MB_ENV, str(DEFAULT_CACHE_MB))
    if not value.isdigit():
        raise ValueError(f"{CACHE_MB_ENV} must be a whole number of MiB (0 for no cache), got "
                         f"{value!r}")
    return int(value)


def structured_outputs_unsupported(config, has_logits: bool) -> str | None:
    """What in this config structured outputs cannot run with: the InputProcessor refuses such
    requests with it, and the engine again."""
    return None if has_logits else "a runner without logits"


def _make_compiler(tokenizer, vocab_size: int):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
