"""The frontend's side of a request: token ids in, text and finish state out.

Mirrors RequestState in vllm/v1/engine/output_processor.py: it detokenizes incrementally, applies
stop strings (the engine only knows stop tokens, so a stop string finishes the request here and
the caller aborts it in the engine), and keeps the timestamps metrics need. Streaming holds back
the last len(longest stop string) - 1 characters until they cannot start a stop string any more.
Left out: logprobs, n > 1, pooling outputs.
"""

import time

from minicore.engine.detokenizer import IncrementalDetokenizer
from minicore.outputs import CompletionOutput, RequestOutput
from minicore.protocol import EngineCoreOutput
from minicore.sampling_params import SamplingParams


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer, arrival_time: float | None = None):
        self.request_id = request_id
        # The DP rank that runs it.
        self.engine_index = 0
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop)
        self.stop_buffer_length = max(map(len, params.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, output: EngineCoreOutput) -> bool:
        """Take one engine output; True if a stop string ended the request here (the caller must
        then abort it in the engine, which does not know it is done)."""
        now = time.monotonic()
        self.first_token_time = self.first_token_time or now
        self.last_token_time = now
        self.token_ids.extend(output.new_token_ids)
        self.num_cached_tokens = output.num_cached_tokens
        if output.finished:
            self.finish_reason, self.stop_reason = str(output.finish_reason), output.stop_reason
        stop = self.detokenizer.update(output.new_token_ids)
        if stop is None:
            return False
        stopped_here = not output.finished
        self.finish_reason, self.stop_reason = "stop", stop
        return stopped_here

    def streamable_text(self) -> str:
        """The text that can be sent: all of it once finished, else all but what could still turn
        out to be the start of a stop string."""
        text = self.detokenizer.output_text
        if self.finished or not self.stop_buffer_length:
            return text
        return text[:max(0, len(text) - self.stop_buffer_length)]

    def make_request_output(self) -> RequestOutput:
        completion = CompletionOutput(0, self.streamable_text(), list(self.token_ids),
                                      self.finish_reason, self.stop_reason)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion],
                             self.finished, self.num_cached_tokens)
