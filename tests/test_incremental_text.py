"""Streaming detokenization never splits a UTF-8 character across chunks."""

from server.completions import IncrementalText
from server.tokenizer import TextTokenizer


def test_deltas_hold_back_partial_characters(checkpoints):
    tokenizer = TextTokenizer(checkpoints["mixed"], bos_token_id=0)
    text = "naïve café — 東京 😀 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.token_text(t) for t in ids), "the test needs byte-piece tokens"
    stream = IncrementalText(tokenizer)
    deltas = [stream.push((t,), final=i == len(ids) - 1) for i, t in enumerate(ids)]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
