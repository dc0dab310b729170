"""What the model runner hands back to the scheduler after a forward.

Mirrors ModelRunnerOutput in vllm/v1/outputs.py, without logprobs, pooling or speculative decoding.
"""

from dataclasses import dataclass


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # One list per request in req_ids: the tokens it sampled this step, empty for a request that is
    # still in the middle of a chunked prefill.
    sampled_token_ids: list[list[int]]


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
