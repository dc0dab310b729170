"""/tokenize and /detokenize: a prompt (or chat messages) to token ids and back.

Mirrors vllm/entrypoints/openai/serving_tokenization.py, on OpenAIServing's tokenizer, model check
and chat rendering (chat_template, chat_template_kwargs, continue_final_message as chat
completions). add_special_tokens defaults as vLLM's: True for a prompt, False for messages.
/tokenize runs on the tokenizer thread (OpenAIServing.on_tokenizer_thread): a long prompt is
encoded off the event loop.
Left out: tools in the chat template, return_token_strs, the tokenizer info endpoint.
"""

from minicore.entrypoints.openai_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    OpenAIError,
    TokenizeRequest,
    TokenizeResponse,
)
from minicore.entrypoints.serving import OpenAIServing


def tokenize(serving: OpenAIServing, request: TokenizeRequest) -> TokenizeResponse:
    serving.check_model(request.model)
    if (request.prompt is None) == (request.messages is None):
        raise OpenAIError("give either a prompt or messages", 400, "prompt")
    add_special_tokens = request.add_special_tokens
    if request.messages is None:
        text, param = request.prompt, "prompt"
    else:
        text, param = serving.render_chat(request)[1], "messages"
    if add_special_tokens is None:  # vLLM's defaults: a prompt's BOS as completions; chat's none
        add_special_tokens = request.messages is None
    tokens = serving.encode(text, add_special_tokens, param)
    return TokenizeResponse(len(tokens), serving.max_model_len, tokens)


def detokenize(serving: OpenAIServing, request: DetokenizeRequest) -> DetokenizeResponse:
    serving.check_model(request.model)
    if any(not 0 <= t < serving.vocab_size for t in request.tokens):
        raise OpenAIError(f"token ids must be in [0, {serving.vocab_size})", 400, "tokens")
    return DetokenizeResponse(serving.tokenizer.decode(request.tokens))
