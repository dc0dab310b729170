"""/tokenize and /detokenize: a prompt (or chat messages) to token ids and back.

Mirrors vllm/entrypoints/openai/serving_tokenization.py, on OpenAIServing's tokenizer, model check
and chat template. Left out: tools in the chat template, return_token_strs, the tokenizer info
endpoint.
"""

from minicore.entrypoints.openai_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    OpenAIError,
    TokenizeRequest,
    TokenizeResponse,
    check_text_param,
)
from minicore.entrypoints.serving import OpenAIServing


def tokenize(serving: OpenAIServing, request: TokenizeRequest) -> TokenizeResponse:
    serving.check_model(request.model)
    if (request.prompt is None) == (request.messages is None):
        raise OpenAIError("give either a prompt or messages", 400, "prompt")
    text = (request.prompt if request.messages is None
            else serving.apply_chat_template(request.messages, request.add_generation_prompt))
    check_text_param("prompt" if request.messages is None else "messages", text)
    tokens = serving.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
    return TokenizeResponse(len(tokens), serving.max_model_len, tokens)


def detokenize(serving: OpenAIServing, request: DetokenizeRequest) -> DetokenizeResponse:
    serving.check_model(request.model)
    if any(not 0 <= t < serving.vocab_size for t in request.tokens):
        raise OpenAIError(f"token ids must be in [0, {serving.vocab_size})", 400, "tokens")
    return DetokenizeResponse(serving.tokenizer.decode(request.tokens))
