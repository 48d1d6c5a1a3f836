"""The checkpoint's tokenizer (tokenizer.json through `tokenizers`) with its BOS convention."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer


class TextTokenizer:
    def __init__(self, model_dir: Path, bos_token_id: int | None) -> None:
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{model_dir}: no tokenizer.json beside the checkpoint")
        self.tokenizer = Tokenizer.from_file(str(path))
        settings_path = model_dir / "tokenizer_config.json"
        settings = json.loads(settings_path.read_text()) if settings_path.exists() else {}
        self.add_bos = bool(settings.get("add_bos_token", True)) and bos_token_id is not None
        self.bos_token_id = bos_token_id
        self.vocab_size = self.tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token alone, as logprobs report it."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
