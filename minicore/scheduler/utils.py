"""check_stop: whether a request's newest token finishes it (vllm/v1/core/sched/utils.py). Like
vLLM's, it leaves min_tokens to the sampler, which masks EOS and the stop ids until then. Left out:
pooling requests."""

from minicore.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The status it finishes with, if any: EOS, a stop token id (its stop_reason), the caps."""
    params = request.sampling_params
    last_token_id = request.output_token_ids[-1]
    if last_token_id == request.eos_token_id and not params.ignore_eos:
        return RequestStatus.FINISHED_STOPPED
    if last_token_id in params.stop_token_ids:
        request.stop_reason = last_token_id
        return RequestStatus.FINISHED_STOPPED
    if ((params.max_tokens is not None and request.num_output_tokens >= params.max_tokens)
            or request.num_tokens >= max_model_len):
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
