"""POST /tokenize and /detokenize, in vLLM's shapes.

`/tokenize` takes a text `prompt` (BOS added unless `add_special_tokens` is false) or chat `messages`,
which the chat renderer turns into the template's text first (no BOS added by default then: the
template writes it). Without a renderer, `messages` is a 400. `/detokenize` decodes as vLLM does,
special tokens included, so tokenize -> detokenize gives back the text the model sees.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from server.request_errors import ClientError
from server.tokenizer import TextTokenizer

# The request body (messages, add_generation_prompt, tools...) -> the prompt text; raises ValueError
# for messages it cannot render (a 400).
ChatRenderer = Callable[[dict[str, Any]], str]


def _text(body: TokenizeRequest, render_chat: ChatRenderer | None) -> str:
    if body.prompt is not None:
        return body.prompt
    if render_chat is None:
        raise ClientError("chat is unavailable on this server (no chat template renderer); send a prompt", "messages")
    try:
        return render_chat(body.model_dump(exclude_none=True))
    except ValueError as exc:
        raise ClientError(str(exc), "messages") from None


def tokenize(
    body: TokenizeRequest, tokenizer: TextTokenizer, max_model_len: int, render_chat: ChatRenderer | None
) -> TokenizeResponse:
    add_special_tokens = body.add_special_tokens if body.add_special_tokens is not None else body.messages is None
    # not bounded by the context: /tokenize counts any text the body limit admits (as vLLM's does)
    ids = tokenizer.encode(_text(body, render_chat), add_special_tokens=add_special_tokens, bounded=False)
    return TokenizeResponse(
        count=len(ids),
        max_model_len=max_model_len,
        tokens=ids,
        token_strs=[tokenizer.token_text(t) for t in ids] if body.return_token_strs else None,
    )


def detokenize(body: DetokenizeRequest, tokenizer: TextTokenizer) -> DetokenizeResponse:
    bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise ClientError(f"token id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})", "tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))
