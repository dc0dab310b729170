"""The runner's logprobs component (minicore/model/logprobs.py) on hand-made logits: it knows which
requests asked (new ones noted, finished and preempted ones forgotten), gives a chunk's prompt
logprobs for exactly the positions that chunk predicts and lets a request go once its prompt is
done, and gives the sampled rows' logprobs only to the requests that asked."""

import torch

from minicore.model.logprobs import LogprobsOutput
from minicore.model.runner_base import CachedRequestState
from minicore.model.sampler import gather_logprobs
from minicore.sampling_params import SamplingParams
from minicore.scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

V = 10


def scheduler_output(new=(), finished=(), preempted=()) -> SchedulerOutput:
    return SchedulerOutput([NewRequestData(req_id, list(prompt), len(prompt), params, [1], 0)
                            for req_id, prompt, params in new], CachedRequestData(), {}, 0,
                           set(preempted), set(finished))


def runner_output(req_ids: list[str]) -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, [[] for _ in req_ids])


def test_prompt_logprobs_chunk_by_chunk_then_the_request_leaves():
    # The logits are the hidden states themselves: every number below is a log_softmax of them.
    component = LogprobsOutput(V, lambda hidden: hidden.float())
    prompt = [3, 1, 4, 1, 5]
    component.update_states(scheduler_output([("p", prompt, SamplingParams(prompt_logprobs=2)),
                                              ("q", [7, 7], SamplingParams())]))
    assert component.num_prompt_logprobs == {"p": 2} and component.num_logprobs == {}
    states = [CachedRequestState([7, 7], [1], 0, SamplingParams(), 2),
              CachedRequestState(prompt, [1], 0, SamplingParams(prompt_logprobs=2), 5)]
    torch.manual_seed(0)
    # Step 1: q's whole prompt (rows 0-1), p's first 3 tokens (rows 2-4), predicting 1, 4, 1.
    hidden = torch.randn(5, V)
    out = runner_output(["q", "p"])
    component.add_prompt(hidden, [0, 2, 5], states, [0, 0], [2, 3], out)
    expected = gather_logprobs(hidden[2:5].log_softmax(-1), 2, torch.tensor([1, 4, 1]))
    assert list(out.prompt_logprobs) == ["p"]
    assert out.prompt_logprobs["p"] == expected.tolists(range(3), 2)
    # Step 2: p's last 2 tokens; only position 3 predicts a prompt token (5). Its prompt is done.
    hidden = torch.randn(2, V)
    out = runner_output(["p"])
    component.add_prompt(hidden, [0, 2], states[1:], [3], [2], out)
    expected = gather_logprobs(hidden[:1].log_softmax(-1), 2, torch.tensor([5]))
    assert out.prompt_logprobs == {"p": expected.tolists([0], 2)}
    assert component.num_prompt_logprobs == {}
    out = runner_output(["p"])
    component.add_prompt(torch.randn(1, V), [0, 1], states[1:], [5], [1], out)
    assert out.prompt_logprobs is None


def test_sampled_logprobs_go_to_the_requests_that_asked():
    component = LogprobsOutput(V, lambda hidden: hidden)
    component.update_states(scheduler_output([("a", [1], SamplingParams(logprobs=1)),
                                              ("b", [2], SamplingParams()),
                                              ("c", [3], SamplingParams(logprobs=-1))]))
    assert component.num_logprobs == {"a": 1, "c": V}
    logprobs = torch.randn(2, V).log_softmax(-1)
    tensors = gather_logprobs(logprobs, V, torch.tensor([4, 6]))
    out = runner_output(["b", "a", "c"])
    component.add_sampled(tensors, [1, 2], out)  # rows 1 (a) and 2 (c) sampled
    assert out.logprobs == {"a": tensors.tolists([0], 1), "c": tensors.tolists([1], V)}
    out = runner_output(["b"])
    component.add_sampled(None, [0], out)  # no sampled row asked: the sampler gave none
    assert out.logprobs is None
    component.update_states(scheduler_output(finished=["a"], preempted=["c"]))
    assert component.num_logprobs == {}
