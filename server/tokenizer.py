"""The checkpoint's tokenizer (tokenizer.json through `tokenizers`) with its BOS convention.

`encode` refuses, before tokenizing, a text that cannot fit the served context: no token is longer
than the vocabulary's longest token string (byte-level BPE writes a token's bytes as that many
characters, so a token covers at most that many characters of the text), hence a text of more than
max_tokens x that many characters has more than max_tokens tokens. The bound only refuses texts that
could never fit, and costs nothing; a tokenizer with a normalizer (which may drop characters) skips it.
A lone surrogate (which `str` admits but no UTF-8 text holds) is a client error, not a crash.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from server.request_errors import ClientError


class PromptTooLong(ClientError):
    """A text with more tokens than the served context holds, known without tokenizing it (HTTP 400)."""


class TextTokenizer:
    def __init__(self, model_dir: Path, bos_token_id: int | None, max_tokens: int | None = None) -> None:
        """`max_tokens`: the served context (max_model_len); texts that cannot fit are refused unread."""
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{model_dir}: no tokenizer.json beside the checkpoint")
        self.tokenizer = Tokenizer.from_file(str(path))
        settings_path = model_dir / "tokenizer_config.json"
        settings = json.loads(settings_path.read_text()) if settings_path.exists() else {}
        self.add_bos = bool(settings.get("add_bos_token", True)) and bos_token_id is not None
        self.bos_token_id = bos_token_id
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.max_tokens = max_tokens
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True, bounded: bool = True, param: str = "prompt") -> list[int]:
        """Token ids of `text`; `bounded` (the generation paths) refuses a text that cannot fit the served
        context without tokenizing it (PromptTooLong). `param` names the request field in errors."""
        if bounded and self.max_tokens is not None and self.tokenizer.normalizer is None:
            if len(text) > self.max_tokens * self.max_token_chars:
                raise PromptTooLong(
                    f"{param}: this model's maximum context length is {self.max_tokens} tokens; the text has "
                    f"{len(text)} characters, more than that many tokens can hold (a token here is at most "
                    f"{self.max_token_chars} characters)", param)
        check_utf8(text, param)
        # the batch call releases the GIL while it works (`encode` holds it: a large text would stall the
        # event loop even from a worker thread)
        ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token alone, as logprobs report it."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def check_utf8(text: str, param: str) -> None:
    """Raises ClientError for text no UTF-8 can encode (a lone surrogate such as "\\ud800", which JSON
    escapes admit): the tokenizer would fail on it with a server error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ClientError(f"{param}: the text holds {text[exc.start]!r} at character {exc.start}, which is not "
                          "valid Unicode (a lone surrogate)", param) from None
