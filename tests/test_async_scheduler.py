"""Async scheduling on the scheduler's side, in small exact numbers: output placeholders for the
tokens of a step in flight, the max_tokens skip, tokens sampled past a stop dropped, aborts and
preemptions with a step in flight, and a request id reused while its old request's step is in
flight. Steps overlap as EngineCore's batch queue overlaps them: step N+1 is scheduled before
step N's output is back (minicore.testing's schedule_step / finish_step)."""

from minicore.request import RequestStatus
from minicore.scheduler.output import ModelRunnerOutput
from minicore.spec_decode.config import SpeculativeConfig
from minicore.testing import (
    FAKE_TOKEN_BASE,
    finish_step,
    make_request,
    make_scheduler,
    num_free,
    run_until_finished,
    schedule_step,
)

T = FAKE_TOKEN_BASE


def async_scheduler(**kwargs):
    return make_scheduler(async_scheduling=True, **kwargs)


def run_overlapped(s, tokens=None, max_steps=200) -> dict[str, list[int]]:
    """Step as a batch queue of two does until nothing is left: schedule N+1, then finish N.
    Returns each request's output tokens, asserting that every step's output goes to requests
    that were scheduled in it."""
    outputs: dict[str, list[int]] = {}
    in_flight = None
    for _ in range(max_steps):
        if not s.has_requests() and in_flight is None:
            return outputs
        scheduled = schedule_step(s, tokens) if s.has_requests() else None
        if in_flight is not None:
            st = finish_step(s, in_flight)
            assert set(st.tokens) <= set(st.scheduled)
            for req_id, new in st.tokens.items():
                outputs.setdefault(req_id, []).extend(new)
        in_flight = scheduled
    raise AssertionError("requests still unfinished")


def test_a_step_in_flight_holds_one_placeholder_and_the_next_step_schedules_its_position():
    s = async_scheduler()
    s.add_request(make_request("a", 6, max_tokens=3))
    a = s.requests["a"]
    first = schedule_step(s)
    assert first[0].num_scheduled_tokens == {"a": 6}
    assert (a.num_computed_tokens, a.num_tokens, a.num_output_placeholders) == (6, 6, 1)
    second = schedule_step(s)  # before the first step's token is known
    assert second[0].num_scheduled_tokens == {"a": 1}
    assert (a.num_computed_tokens, a.num_tokens, a.num_output_placeholders) == (7, 6, 2)
    assert finish_step(s, first).tokens == {"a": [T]}
    assert (a.num_computed_tokens, a.num_tokens, a.num_output_placeholders) == (7, 7, 1)
    third = schedule_step(s)
    assert third[0].num_scheduled_tokens == {"a": 1}
    assert finish_step(s, second).tokens == {"a": [T + 1]}
    # Tokens 3 of 3 are in flight: the max_tokens skip schedules nothing more for a.
    assert schedule_step(s)[0].num_scheduled_tokens == {}
    st = finish_step(s, third)
    assert st.tokens == {"a": [T + 2]} and st.finished == ["a"]
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.num_output_placeholders == 0
    assert num_free(s) == 63


def test_a_prefill_in_chunks_gets_its_placeholder_with_its_last_chunk():
    s = async_scheduler(max_num_batched_tokens=8)
    s.add_request(make_request("a", 12, max_tokens=2))
    a = s.requests["a"]
    first = schedule_step(s)
    assert first[0].num_scheduled_tokens == {"a": 8} and a.num_output_placeholders == 0
    second = schedule_step(s)
    assert second[0].num_scheduled_tokens == {"a": 4} and a.num_output_placeholders == 1
    assert finish_step(s, first).tokens == {}  # mid-prefill: nothing sampled
    assert finish_step(s, second).tokens == {"a": [T]}


def test_overlapped_steps_give_the_tokens_and_blocks_that_one_step_at_a_time_gives():
    def requests():
        return [make_request(f"r{i}", 5 + 3 * i, max_tokens=4 + i, first_token=1000 * (i + 1))
                for i in range(5)]

    sync = make_scheduler(max_num_seqs=3, max_num_batched_tokens=16)
    for request in requests():
        sync.add_request(request)
    expected: dict[str, list[int]] = {}
    for st in run_until_finished(sync):
        for req_id, new in st.tokens.items():
            expected.setdefault(req_id, []).extend(new)
    s = async_scheduler(max_num_seqs=3, max_num_batched_tokens=16)
    for request in requests():
        s.add_request(request)
    assert run_overlapped(s) == expected
    assert {k: len(v) for k, v in expected.items()} == {f"r{i}": 4 + i for i in range(5)}
    assert num_free(s) == 63 and not s.requests


def test_a_token_sampled_past_an_eos_in_flight_is_dropped():
    s = async_scheduler()
    s.add_request(make_request("a", 4, max_tokens=10, eos_token_id=7))
    first = schedule_step(s, {"a": [7]})  # its first output is EOS
    second = schedule_step(s)
    assert second[0].num_scheduled_tokens == {"a": 1}  # scheduled before the EOS is known
    st = finish_step(s, first)
    assert st.tokens == {"a": [7]} and st.finished == ["a"]
    assert num_free(s) == 63
    assert finish_step(s, second).outputs == []  # the token after EOS never leaves
    # The runner learns of the finish with the next step.
    assert schedule_step(s)[0].finished_req_ids == {"a"}


def test_an_abort_with_a_step_in_flight_gives_no_output_and_frees_its_blocks():
    s = async_scheduler()
    s.add_request(make_request("a", 6, max_tokens=10))
    s.add_request(make_request("b", 6, max_tokens=10))
    first = schedule_step(s)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert num_free(s) == 63 - 2
    assert finish_step(s, first).tokens == {"b": [T]}
    second = schedule_step(s)
    assert second[0].num_scheduled_tokens == {"b": 1}
    assert second[0].finished_req_ids == {"a"}


def test_a_request_id_reused_after_an_abort_never_gets_the_old_requests_token():
    s = async_scheduler()
    s.add_request(make_request("a", 6, max_tokens=10))
    first = schedule_step(s)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    s.add_request(make_request("a", 3, max_tokens=2))
    second = schedule_step(s)  # admits the new a
    assert second[0].num_scheduled_tokens == {"a": 3}
    new_a = s.requests["a"]
    assert finish_step(s, first).outputs == []  # the old a's token
    assert (new_a.num_tokens, new_a.num_output_placeholders) == (3, 1)
    assert finish_step(s, second).tokens == {"a": [T]}
    assert new_a.output_token_ids == [T]


def test_a_request_preempted_with_a_step_in_flight_keeps_that_steps_token_and_resumes():
    # 6 usable blocks of 4 tokens: a and b fill them as they grow, and b (the last) is preempted.
    s = async_scheduler(num_blocks=7, max_num_seqs=2)
    s.add_request(make_request("a", 8, max_tokens=8))
    s.add_request(make_request("b", 8, max_tokens=8))
    b = s.requests["b"]
    in_flight = schedule_step(s)
    preempted_at = None
    outputs: dict[str, list[int]] = {}
    for n in range(40):
        scheduled = schedule_step(s)
        if scheduled[0].preempted_req_ids and preempted_at is None:
            preempted_at = n
            assert scheduled[0].preempted_req_ids == {"b"}
            assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 1
            num_tokens = b.num_tokens
        st = finish_step(s, in_flight)
        if preempted_at == n:
            # The step in flight ran b: its token arrives and is kept for b's recompute.
            assert b.num_tokens == num_tokens + 1 and b.num_output_placeholders == 0
        for req_id, new in st.tokens.items():
            outputs.setdefault(req_id, []).extend(new)
        in_flight = scheduled
        if not s.requests:
            break
    assert preempted_at is not None
    assert outputs == {r: [T + i for i in range(8)] for r in "ab"}
    assert num_free(s) == 6


def test_the_skip_stops_at_max_model_len_without_max_tokens():
    s = async_scheduler(max_model_len=8)
    s.add_request(make_request("a", 6, max_tokens=None))
    assert run_overlapped(s) == {"a": [T, T + 1]}
    assert num_free(s) == 63


# ---- drafts: proposed by the runner, placeholders here -------------------------------------------

NGRAM3 = SpeculativeConfig(method="ngram", num_speculative_tokens=3)


def runner_output(out, sampled: dict[str, list[int]], num_drafts: dict[str, int]):
    """What a runner that drafts itself returns: per request its tokens, and how many drafts it
    ran in the placeholders' place."""
    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)},
                             [sampled.get(r, []) for r in req_ids], num_draft_tokens=num_drafts)


def test_with_drafts_a_request_that_samples_gets_placeholders_and_counts_them_accepted():
    s = async_scheduler(speculative_config=NGRAM3)
    s.add_request(make_request("a", 6, max_tokens=20))
    a = s.requests["a"]
    first = s.schedule()
    assert a.spec_token_ids == [-1, -1, -1]
    assert (a.num_computed_tokens, a.num_output_placeholders) == (6, 1)
    second = s.schedule()  # before the first step's token is known: its drafts are unknown too
    assert second.num_scheduled_tokens == {"a": 4}
    assert second.scheduled_spec_decode_tokens == {"a": [-1, -1, -1]}
    assert (a.num_computed_tokens, a.num_output_placeholders) == (10, 5)
    s.update_from_output(first, runner_output(first, {"a": [T]}, {}))
    assert (a.num_computed_tokens, a.num_tokens, a.num_output_placeholders) == (10, 7, 4)
    third = s.schedule()
    assert third.num_scheduled_tokens == {"a": 4}
    # The runner found two drafts for the second step, and the model took the first.
    s.update_from_output(second, runner_output(second, {"a": [T + 1, T + 2]}, {"a": 2}))
    # Three placeholders scheduled, one accepted: two positions to compute again.
    assert (a.num_computed_tokens, a.num_tokens, a.num_output_placeholders) == (12, 9, 4)
    stats = s.spec_decode.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 2, 1)
    # A step whose runner found no draft counts as no draft.
    s.update_from_output(third, runner_output(third, {"a": [T + 3]}, {}))
    assert (stats.num_drafts, a.num_computed_tokens, a.num_output_placeholders) == (1, 9, 0)
    assert a.num_computed_tokens == a.num_tokens - 1


def test_placeholder_drafts_stop_short_of_max_model_len_and_at_disable_by_batch_size():
    s = async_scheduler(speculative_config=NGRAM3, max_model_len=10)
    s.add_request(make_request("a", 6, max_tokens=None))
    s.schedule()
    # The newest token goes to position 6 next step: drafts may take 7 and 8, not 9.
    assert s.requests["a"].spec_token_ids == [-1, -1]
    s = async_scheduler(speculative_config=SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, disable_by_batch_size=2))
    for name in "ab":
        s.add_request(make_request(name, 6))
    s.schedule()
    assert all(r.spec_token_ids == [] for r in s.requests.values())


def test_with_drafts_overlapped_steps_finish_every_request_and_free_every_block():
    s = async_scheduler(speculative_config=NGRAM3, num_blocks=13, max_num_seqs=3)
    for name, n in zip("abc", (3, 9, 17)):
        s.add_request(make_request(name, 8, max_tokens=n))
    # The fake runner rejects every placeholder draft: one token a step, as without drafts.
    outputs = run_overlapped(s)
    assert {r: len(tokens) for r, tokens in outputs.items()} == {"a": 3, "b": 9, "c": 17}
    assert num_free(s) == 12 and s.num_preemptions > 0
