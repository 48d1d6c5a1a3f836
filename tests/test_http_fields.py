"""vLLM's request fields through real HTTP (the official openai client, vLLM's fields in extra_body,
against `python -m server` on the tiny V4.1 checkpoint): a field the server accepts does what it
says, and a vLLM field it does not implement is a 400 naming it (issue 23, item 4).

Implemented here: truncate_prompt_tokens, prompt_logprobs, include_stop_str_in_output,
skip_special_tokens (completions), add_special_tokens, return_tokens_as_token_ids, best_of = n, and
echo's text_offset, which indexes the returned text (the BOS it leaves out has no text there).
"""

from __future__ import annotations

from itertools import pairwise

import openai
import pytest

from models.config import ModelConfig
from server.logprobs import TextOffsets
from server.tokenizer import TextTokenizer
from tests.conftest import random_tokens
from tests.serving import running_server

PROMPT = "Hello world"
HI = [{"role": "user", "content": "Hello, how are you?"}]
NO_THINK = {"chat_template_kwargs": {"thinking": False}, "ignore_eos": True}
MAX_MODEL_LEN = 512
VOCAB = 512  # the tiny checkpoint's


@pytest.fixture(scope="module")
def server(checkpoints):
    with running_server(checkpoints["v41"], "tiny", "--max-model-len", str(MAX_MODEL_LEN)) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(checkpoints):
    return TextTokenizer(checkpoints["v41"], ModelConfig.from_file(checkpoints["v41"] / "config.json").bos_token_id)


def complete(client, prompt: str | list[int] = PROMPT, max_tokens: int = 8, stream: bool = False, **fields):
    """A greedy completion; `fields` go in the body (vLLM's through extra_body, as its clients send them)."""
    openai_fields = {k: fields.pop(k) for k in ("echo", "logprobs", "stop", "n", "suffix") if k in fields}
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=stream,
                                      **openai_fields, extra_body={"ignore_eos": True, **fields})


def chat(client, max_tokens: int = 8, stream: bool = False, **fields):
    openai_fields = {k: fields.pop(k) for k in ("logprobs", "top_logprobs", "stop") if k in fields}
    return client.chat.completions.create(model="tiny", messages=HI, max_tokens=max_tokens, temperature=0, stream=stream,
                                          **openai_fields, extra_body={**NO_THINK, **fields})


def pieces(text: str, offsets: list[int]) -> list[str]:
    """The text each token's offset range covers."""
    bounds = [*offsets, len(text)]
    assert bounds == sorted(bounds), offsets
    return [text[a:b] for a, b in pairwise(bounds)]


# --- vLLM fields refused ---------------------------------------------------------------------------

REFUSED_BOTH = [
    ("use_beam_search", True), ("length_penalty", 0.5), ("early_stopping", True), ("logits_processors", ["a.B"]),
    ("guided_decoding_backend", "xgrammar"), ("priority", 1), ("kv_transfer_params", {"do_remote_decode": True}),
    ("vllm_xargs", {"key": 1}), ("mm_processor_kwargs", {"size": 1}), ("request_id", "mine"),
    ("max_repetition_pattern_size", 4), ("min_repetition_pattern_size", 2), ("repetition_min_count", 3), ("best_of", 2),
]
REFUSED_COMPLETIONS = [("suffix", "the end"), ("prompt_embeds", "AAAA")]
REFUSED_CHAT = [
    ("echo", True), ("chat_template", "{{ messages }}"), ("skip_special_tokens", False),
    ("add_generation_prompt", False), ("continue_final_message", True), ("documents", [{"title": "t", "text": "x"}]),
]


def assert_refused(refused: pytest.ExceptionInfo, field: str) -> None:
    error = refused.value
    assert error.status_code == 400 and error.param == field, error.body
    assert error.body["type"] == "invalid_request_error" and error.body["message"].startswith(f"{field}: ")


@pytest.mark.parametrize("field, value", REFUSED_BOTH + REFUSED_COMPLETIONS)
def test_completions_refuse_a_vllm_field_they_do_not_implement(client, field, value):
    for stream in (False, True):  # refused before a stream's 200
        with pytest.raises(openai.BadRequestError) as refused:
            complete(client, stream=stream, **{field: value})
        assert_refused(refused, field)


@pytest.mark.parametrize("field, value", REFUSED_BOTH + REFUSED_CHAT)
def test_chat_refuses_a_vllm_field_it_does_not_implement(client, field, value):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, **{field: value})
    assert_refused(refused, field)


def test_refused_fields_at_their_defaults_and_vendor_extras_are_accepted(client):
    defaults = {"use_beam_search": False, "length_penalty": 1.0, "early_stopping": False, "priority": 0,
                "logits_processors": None, "vllm_xargs": {}, "repetition_min_count": 0, "best_of": 1}
    extras = {"vendor_extra": {"anything": 1}, "spaces_between_special_tokens": False}
    assert complete(client, suffix=None, **defaults, **extras).choices[0].text
    chat_defaults = {"echo": False, "add_generation_prompt": True, "continue_final_message": False,
                     "skip_special_tokens": True, "documents": None}
    assert chat(client, **defaults, **chat_defaults, **extras).choices[0].message.content
    assert len(complete(client, n=2, best_of=2).choices) == 2


def test_prompt_logprobs_with_stream_are_a_400(client):
    with pytest.raises(openai.BadRequestError) as refused:
        complete(client, stream=True, prompt_logprobs=1)
    assert refused.value.param == "prompt_logprobs"


# --- truncate_prompt_tokens ------------------------------------------------------------------------

def test_truncate_prompt_tokens_keeps_the_last_k(client):
    prompt = random_tokens(40, seed=5, high=VOCAB)
    cut = complete(client, prompt, truncate_prompt_tokens=10, return_token_ids=True)
    assert cut.usage.prompt_tokens == 10 and cut.choices[0].model_extra["prompt_token_ids"] == prompt[-10:]
    assert complete(client, prompt, truncate_prompt_tokens=-1).usage.prompt_tokens == 40  # it fits already
    long = random_tokens(600, seed=6, high=VOCAB)
    fitted = complete(client, long, max_tokens=12, truncate_prompt_tokens=-1, return_token_ids=True)
    assert fitted.usage.prompt_tokens == MAX_MODEL_LEN - 12
    assert fitted.choices[0].model_extra["prompt_token_ids"] == long[-(MAX_MODEL_LEN - 12):]
    text = "Hello world " * 1000  # more characters than 512 tokens can hold: refused untokenized without truncation
    with pytest.raises(openai.BadRequestError) as too_long:
        complete(client, text)
    assert too_long.value.param == "prompt"
    assert complete(client, text, truncate_prompt_tokens=20).usage.prompt_tokens == 20
    assert chat(client, truncate_prompt_tokens=5).usage.prompt_tokens == 5


@pytest.mark.parametrize("keep", [0, MAX_MODEL_LEN - 11, -2])
def test_a_truncation_that_cannot_run_is_a_400(client, keep):
    with pytest.raises(openai.BadRequestError) as refused:
        complete(client, max_tokens=12, truncate_prompt_tokens=keep)
    assert refused.value.param == "truncate_prompt_tokens"


# --- prompt_logprobs -------------------------------------------------------------------------------

def test_prompt_logprobs_give_each_prompt_token_its_logprob_and_top_alternatives(client):
    prompt = random_tokens(12, seed=7, high=VOCAB)
    response = complete(client, prompt, max_tokens=2, echo=True, logprobs=3, prompt_logprobs=2,
                        return_tokens_as_token_ids=True)  # the echo's alternatives by id: texts may repeat
    entries, echoed = response.choices[0].model_extra["prompt_logprobs"], response.choices[0].logprobs
    assert len(entries) == len(prompt) == response.usage.prompt_tokens and entries[0] is None
    for i, (token, entry) in enumerate(zip(prompt[1:], entries[1:]), start=1):
        assert next(iter(entry)) == str(token), "the prompt token comes first"
        assert entry[str(token)]["logprob"] == echoed.token_logprobs[i]
        ranked = sorted(((e["rank"], t, e["logprob"]) for t, e in entry.items() if e["rank"] is not None))
        assert [rank for rank, _, _ in ranked][:2] == [1, 2] and 2 <= len(entry) <= 3
        assert {f"token_id:{t}": lp for _, t, lp in ranked}.items() <= echoed.top_logprobs[i].items()
        assert all(isinstance(e["decoded_token"], str) for e in entry.values())
    assert len(echoed.top_logprobs[1]) == 3, "echo keeps its own count of alternatives"
    plain = complete(client, max_tokens=2, prompt_logprobs=0)
    assert len(plain.choices[0].model_extra["prompt_logprobs"]) == plain.usage.prompt_tokens
    assert all(len(e) == 1 for e in plain.choices[0].model_extra["prompt_logprobs"][1:])
    assert plain.choices[0].logprobs is None


def test_chat_prompt_logprobs_cover_the_rendered_prompt(client):
    response = chat(client, max_tokens=2, prompt_logprobs=1, return_token_ids=True)
    entries, prompt = response.model_extra["prompt_logprobs"], response.model_extra["prompt_token_ids"]
    assert len(entries) == len(prompt) == response.usage.prompt_tokens and entries[0] is None
    assert all(next(iter(entry)) == str(token) and len(entry) <= 2 for token, entry in zip(prompt[1:], entries[1:]))


# --- echo, text_offset, skip_special_tokens, add_special_tokens --------------------------------------

def test_echo_text_offsets_index_the_returned_text(client, tokenizer):
    response = complete(client, max_tokens=12, echo=True, logprobs=1)
    choice, prompt_len = response.choices[0], response.usage.prompt_tokens
    text, logprobs = choice.text, choice.logprobs
    assert text.startswith(PROMPT) and logprobs.tokens[0] == tokenizer.token_text(tokenizer.bos_token_id)
    covered = pieces(text, logprobs.text_offset)
    assert covered[0] == "", "the BOS is not in the text"
    assert covered[1:prompt_len] == logprobs.tokens[1:prompt_len] and "".join(covered) == text
    assert all(piece == token for piece, token in zip(covered, logprobs.tokens) if "\ufffd" not in token and piece)
    kept = complete(client, max_tokens=12, echo=True, logprobs=1, skip_special_tokens=False).choices[0]
    assert kept.text == logprobs.tokens[0] + text  # the BOS's text is kept, and offsets count it
    assert pieces(kept.text, kept.logprobs.text_offset)[:prompt_len] == kept.logprobs.tokens[:prompt_len]


def test_output_text_offsets_start_at_zero(client):
    choice = complete(client, max_tokens=12, logprobs=0).choices[0]
    assert choice.logprobs.text_offset[0] == 0 and "".join(pieces(choice.text, choice.logprobs.text_offset)) == choice.text


def test_text_offsets_of_characters_split_across_byte_tokens(tokenizer):
    """The real tokenizer splits these characters into byte tokens: each token begins after the
    characters the tokens before it complete."""
    for text in ("é€😀 naïve 中文", "日本語、😀😀 x"):
        ids = tokenizer.encode(text)
        expected = [len(tokenizer.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
        assert TextOffsets(tokenizer).push(ids) == expected, text


def test_streamed_echo_and_logprobs_are_the_whole_responses(client):
    whole = complete(client, max_tokens=10, echo=True, logprobs=2).choices[0]
    chunks = [c.choices[0] for c in complete(client, max_tokens=10, echo=True, logprobs=2, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text and chunks[0].text.startswith(PROMPT)
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks for x in getattr(c.logprobs, name)] == getattr(whole.logprobs, name), name


def test_add_special_tokens(client):
    plain = complete(client, max_tokens=2, echo=True, logprobs=0)
    bare = complete(client, max_tokens=2, echo=True, logprobs=0, add_special_tokens=False)
    prompt_len = plain.usage.prompt_tokens
    assert bare.usage.prompt_tokens == prompt_len - 1
    assert bare.choices[0].logprobs.tokens[: prompt_len - 1] == plain.choices[0].logprobs.tokens[1:prompt_len]
    assert chat(client, add_special_tokens=True).usage.prompt_tokens == chat(client).usage.prompt_tokens + 1


# --- include_stop_str_in_output, return_tokens_as_token_ids ----------------------------------------

def a_stop_string(text: str) -> str:
    """Three ASCII letters from the middle of a greedy text (the tiny model's text is mostly byte noise)."""
    for start in range(4, len(text) - 3):
        if text[start : start + 3].isalpha() and text[start : start + 3].isascii():
            return text[start : start + 3]
    pytest.skip("the greedy text has no three ASCII letters in a row")


def test_include_stop_str_in_output_keeps_the_stop_string(client):
    greedy = complete(client, max_tokens=40).choices[0].text
    stop = a_stop_string(greedy)
    end = greedy.index(stop)
    assert complete(client, max_tokens=40, stop=[stop]).choices[0].text == greedy[:end]
    kept = complete(client, max_tokens=40, stop=[stop], include_stop_str_in_output=True).choices[0]
    assert kept.text == greedy[: end + len(stop)] and kept.finish_reason == "stop"
    streamed = complete(client, max_tokens=40, stop=[stop], include_stop_str_in_output=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == kept.text
    content = chat(client, max_tokens=40).choices[0].message.content
    chat_stop = a_stop_string(content)
    chat_end = content.index(chat_stop) + len(chat_stop)
    assert chat(client, max_tokens=40, stop=[chat_stop], include_stop_str_in_output=True).choices[0].message.content \
        == content[:chat_end]


def test_return_tokens_as_token_ids(client):
    choice = complete(client, logprobs=2, return_tokens_as_token_ids=True, return_token_ids=True).choices[0]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.model_extra["token_ids"]]
    assert all(key.startswith("token_id:") for top in choice.logprobs.top_logprobs for key in top)
    chosen = chat(client, logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True, return_token_ids=True).choices[0]
    assert [e.token for e in chosen.logprobs.content] == [f"token_id:{t}" for t in chosen.model_extra["token_ids"]]
    assert chosen.logprobs.content[0].bytes == list(chosen.logprobs.content[0].token.encode())
