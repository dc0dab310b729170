"""Incremental detokenizer: turns each request's new token ids into new text, finds stop strings.

Mirrors vllm/v1/engine/detokenizer.py (the "slow" incremental path of
vllm/transformers_utils/detokenizer_utils.py): it decodes a short window of tokens twice, with and
without the newest ones, and emits the difference, so a multi-byte character split over tokens is
emitted only once complete. Works with any transformers tokenizer. skip_special_tokens is passed to
decode; spaces_between_special_tokens only reaches a slow (Python) tokenizer, as in vLLM, whose
fast detokenizer ignores it too. With include_stop_str_in_output a stop string stays in the text
(vLLM's check_stop_strings), and so does the stop token that ended a request (otherwise its text
is left out, as vLLM's update(stop_terminated)). Left out: the fast DecodeStream path.
"""

# Prompt tokens kept as decoding context, so the first output token's leading space renders.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] | None = None, *,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        # A fast tokenizer's Rust backend decodes faster than transformers' wrapper around it,
        # which adds nothing when it does not clean up spaces (vLLM's fast detokenizer does too).
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
            backend = tokenizer
        self._backend_decode = backend.decode
        self._decode_kwargs = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens and backend is tokenizer:
            self._decode_kwargs["spaces_between_special_tokens"] = False
        self.include_stop_str_in_output = include_stop_str_in_output
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""
        self.stop = stop or []

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend_decode(token_ids, **self._decode_kwargs)

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append tokens to the text; return the stop string that ended it, if one did (the text
        is then cut just before it and later tokens are ignored). stop_terminated: the last token
        is the EOS or stop id that ended the request, whose text is left out unless
        include_stop_str_in_output (vLLM's rule)."""
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            text = self._decode(self.token_ids[self.prefix_offset:])
            if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
                continue  # an incomplete character: wait for the bytes that finish it
            new_text = text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            start = len(self.output_text)
            self.output_text += new_text
            if (stop := self._find_stop(start)) is not None:
                return stop
        return None

    def _find_stop(self, new_text_start: int) -> str | None:
        """The stop string that matches earliest, where a match must end in the new text; the
        text is cut before it, or after it with include_stop_str_in_output."""
        matches = [(index, stop) for stop in self.stop
                   if (index := self.output_text.find(
                       stop, max(0, new_text_start - len(stop) + 1))) >= 0]
        if not matches:
            return None
        index, stop = min(matches)
        if self.include_stop_str_in_output:
            index += len(stop)
        self.output_text = self.output_text[:index]
        return stop
