"""The scheduler's side of logprobs, with a fake runner: prompt logprobs arrive chunk by chunk
(a request mid-prefill gets an output carrying only them, as vLLM), every prompt position once
even across a preemption, sampled-token logprobs ride on their token's output, and a request
asking for prompt logprobs reads no prefix cache (vLLM's skip_reading_prefix_cache)."""

from minicore.protocol import LogprobsLists
from minicore.request import Request
from minicore.sampling_params import SamplingParams
from minicore.scheduler.logprobs import take_new_prompt_logprobs
from minicore.scheduler.output import ModelRunnerOutput
from minicore.testing import default_tokens, make_request, make_scheduler, outputs_by_id


def _lists(positions) -> LogprobsLists:
    """Position p's row: token id p, logprob -p, rank 1 (what is where is easy to read back)."""
    return LogprobsLists([[p] for p in positions], [[-float(p)] for p in positions],
                         [1] * len(positions))


def _runner_step(s):
    """schedule() plus what ModelRunner returns: prompt logprobs for the positions each request
    computed this step (position j scores prompt token j + 1), a token and its logprobs for those
    that sample."""
    out = s.schedule()
    req_ids = list(out.num_scheduled_tokens)
    sampled, logprobs, prompt_logprobs = [], {}, {}
    for rid in req_ids:
        req = s.requests[rid]
        start = req.num_computed_tokens - out.num_scheduled_tokens[rid]
        end = min(req.num_computed_tokens, req.num_prompt_tokens - 1)
        if req.sampling_params.prompt_logprobs is not None and start < end:
            prompt_logprobs[rid] = _lists(range(start, end))
        sampled.append(default_tokens(req) if req.num_computed_tokens >= req.num_tokens else [])
        if sampled[-1] and req.sampling_params.logprobs is not None:
            logprobs[rid] = LogprobsLists([sampled[-1]], [[-0.5]], [1])
    runner_output = ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled,
                                      logprobs=logprobs or None,
                                      prompt_logprobs=prompt_logprobs or None)
    return out, s.update_from_output(out, runner_output)


def test_prompt_logprobs_arrive_chunk_by_chunk_then_with_the_first_token():
    s = make_scheduler(max_num_batched_tokens=4)
    s.add_request(make_request("a", 10, max_tokens=2, prompt_logprobs=1, logprobs=0))
    seen, tokens = [], []
    for _ in range(4):
        _, outputs = _runner_step(s)
        (output,) = outputs
        seen += [row[0] for row in output.new_prompt_logprobs.logprob_token_ids] \
            if output.new_prompt_logprobs else []
        tokens += output.new_token_ids
        if output.new_token_ids:
            assert output.new_logprobs.logprob_token_ids == [output.new_token_ids]
        else:
            assert output.new_logprobs is None
    assert seen == list(range(9)) and len(tokens) == 2


def test_a_request_without_logprobs_mid_prefill_gets_no_output():
    s = make_scheduler(max_num_batched_tokens=8)
    s.add_request(make_request("asks", 10, max_tokens=1, prompt_logprobs=0))
    s.add_request(make_request("quiet", 10, max_tokens=1))
    for _ in range(2):  # asks: 8 then 2 prompt tokens; quiet: 6 of its 10 in the second step
        out, outputs = _runner_step(s)
        assert list(outputs_by_id(outputs)) == ["asks"]
    assert out.num_scheduled_tokens == {"asks": 2, "quiet": 6}


def test_prompt_positions_are_sent_once_across_a_recompute():
    request = Request("r", list(range(20)), SamplingParams(prompt_logprobs=0))
    assert take_new_prompt_logprobs(request, _lists(range(0, 4)), 0) is not None
    assert take_new_prompt_logprobs(request, _lists(range(4, 8)), 4) is not None
    # Preempted and recomputed from the start: what was sent is not sent again.
    assert take_new_prompt_logprobs(request, _lists(range(0, 6)), 0) is None
    rest = take_new_prompt_logprobs(request, _lists(range(6, 10)), 6)
    assert rest.logprob_token_ids == [[8], [9]] and rest.sampled_token_ranks == [1, 1]


def test_prompt_logprobs_requests_read_no_prefix_cache():
    s = make_scheduler()
    prompt = list(range(500, 516))
    s.add_request(make_request("warm", prompt, max_tokens=1))
    _runner_step(s)
    asks = make_request("asks", prompt, max_tokens=1, prompt_logprobs=0)
    plain = make_request("plain", prompt, max_tokens=1)
    s.add_request(asks)
    s.add_request(plain)
    outputs = outputs_by_id(_runner_step(s)[1])
    assert asks.num_cached_tokens == 0 and plain.num_cached_tokens > 0
    assert len(outputs["asks"].new_prompt_logprobs.logprob_token_ids) == len(prompt) - 1
