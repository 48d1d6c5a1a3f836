"""server/chat against the golden DeepSeek-V4 / V4.1 chat data (vLLM 0.33.0 outputs).

render_cases: request body -> prompt, byte for byte (or a 400). encode_cases: encoder calls.
parse_cases: generated text -> message, whole and streamed under every golden chunking, every
2-way split and 1-character chunks. Tool-call ids are random in vLLM and left out of the data,
so they are checked for shape and uniqueness only.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from server.chat import (
    ChatFormat,
    ChatRequestError,
    Delta,
    dialect_for,
    encode_messages,
)

GOLDEN = Path(__file__).resolve().parent.parent.parent / "shared" / "golden" / "chat_encoding"
if not GOLDEN.is_dir():
    pytest.skip(f"golden data folder {GOLDEN} is absent", allow_module_level=True)

FAMILY = {"V4": "deepseek_v4", "V4.1": "deepseek_v41"}


def _cases(name: str) -> list[dict[str, Any]]:
    return json.loads((GOLDEN / name).read_text())["cases"]


def _ids(cases: list[dict[str, Any]]) -> list[str]:
    return [c["id"] for c in cases]


RENDER = _cases("render_cases.json")
ENCODE = _cases("encode_cases.json")
PARSE = _cases("parse_cases.json")


def _format(case: dict[str, Any]) -> ChatFormat:
    return ChatFormat.for_checkpoint(None, FAMILY[case["model_version"]])


@pytest.mark.parametrize("case", RENDER, ids=_ids(RENDER))
def test_render(case: dict[str, Any]) -> None:
    fmt = _format(case)
    if case["expected_error"] is not None:
        with pytest.raises(ChatRequestError):
            fmt.render(case["request"])
    else:
        assert fmt.render(case["request"]) == case["expected_prompt"]


@pytest.mark.parametrize("case", ENCODE, ids=_ids(ENCODE))
def test_encode(case: dict[str, Any]) -> None:
    dialect = dialect_for(FAMILY[case["model_version"]])
    assert dialect is not None

    def encode() -> str:
        kwargs = case["encode_kwargs"]
        return encode_messages(case["messages"], dialect, context=case["context"], **kwargs)

    if case["expected_error"] is not None:
        with pytest.raises(ChatRequestError):
            encode()
    else:
        assert encode() == case["expected_prompt"]


# ── parsing ───────────────────────────────────────────────────────────


def _body(case: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], **case["request"]}


def _prompt(case: dict[str, Any]) -> str:
    return "<｜begin▁of▁sentence｜><｜User｜>hi" + case["prompt_suffix"]


def _accumulate(deltas: list[Delta]) -> dict[str, Any]:
    """Fold OpenAI-shaped stream deltas the way a client does."""
    reasoning, content, calls = "", "", {}
    for delta in deltas:
        fragment = delta.to_openai()
        reasoning += fragment.get("reasoning_content") or ""
        content += fragment.get("content") or ""
        for call in fragment.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in call:
                assert entry["id"] is None and call["type"] == "function"
                entry["id"], entry["name"] = call["id"], call["function"]["name"]
            entry["arguments"] += call["function"]["arguments"]
    ordered = [calls[i] for i in sorted(calls)]
    assert all(c["id"] and c["id"].startswith("chatcmpl-tool-") for c in ordered)
    return {
        "reasoning": reasoning or None,
        "content": content or None,
        "tool_calls": [{"name": c["name"], "arguments": c["arguments"]} for c in ordered],
        "finish_reason": "tool_calls" if ordered else "stop",
    }


def _stream(case: dict[str, Any], chunks: list[str]) -> dict[str, Any]:
    parser = _format(case).parser(_body(case), _prompt(case))
    deltas: list[Delta] = []
    for chunk in chunks:
        deltas += parser.feed(chunk)
    deltas += parser.finish()
    return _accumulate(deltas)


def _chunks(text: str, name: str, chunking: dict[str, Any]) -> list[str]:
    if "boundaries" in chunking:
        cuts = chunking["boundaries"]
    elif name == "whole":
        cuts = []
    else:  # chars_N
        step = int(name.split("_")[1])
        cuts = list(range(step, len(text), step))
    edges = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(edges)]


def _streamed_expectation(case: dict[str, Any], name: str = "whole") -> dict[str, Any]:
    return case["streaming"]["chunkings"][name].get("result") or case["expected"]


@pytest.mark.parametrize("case", PARSE, ids=_ids(PARSE))
def test_parse_whole(case: dict[str, Any]) -> None:
    message = _format(case).parse(_body(case), _prompt(case), case["model_output"])
    got = {
        "reasoning": message.reasoning_content,
        "content": message.content,
        "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in message.tool_calls],
        "finish_reason": message.finish_reason("stop"),
    }
    assert got == case["expected"]
    ids = [c.id for c in message.tool_calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("chatcmpl-tool-") for i in ids)


@pytest.mark.parametrize("case", PARSE, ids=_ids(PARSE))
def test_parse_golden_chunkings(case: dict[str, Any]) -> None:
    text = case["model_output"]
    for name, chunking in case["streaming"]["chunkings"].items():
        got = _stream(case, _chunks(text, name, chunking))
        assert got == _streamed_expectation(case, name), name


@pytest.mark.parametrize("case", PARSE, ids=_ids(PARSE))
def test_parse_every_split(case: dict[str, Any]) -> None:
    text, expected = case["model_output"], _streamed_expectation(case)
    for cut in range(len(text) + 1):
        assert _stream(case, [text[:cut], text[cut:]]) == expected, cut
    assert _stream(case, list(text)) == expected


# ── request handling beyond the golden data ──────────────────────────


@pytest.mark.parametrize(
    "tool_choice, kept", [("required", ("required", None)),
                          ({"type": "function", "function": {"name": "get_time"}}, ("function", "get_time"))]
)
def test_a_constrained_tool_choice_is_kept_for_the_grammar(tool_choice: Any, kept: tuple) -> None:
    """required / named choices are read (server/structured_outputs.py constrains the output); the
    prompt renders as under "auto"."""
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "get_time"}}],
        "tool_choice": tool_choice,
    }
    fmt = ChatFormat.for_checkpoint(None, "deepseek_v4")
    request = fmt.read(body)
    assert (request.tool_choice, request.tool_name) == kept
    assert fmt.render(body) == fmt.render({**body, "tool_choice": "auto"})


def test_a_named_tool_choice_must_name_a_tool() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "get_time"}}],
            "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    with pytest.raises(ChatRequestError, match="not among the tools") as info:
        ChatFormat.for_checkpoint(None, "deepseek_v4").render(body)
    assert info.value.param == "tool_choice"


def test_checkpoint_template_takes_precedence(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m.role }}]"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
        "{% if tools %}{{ tools | tojson }}{% endif %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}{{ enable_thinking }}"
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "chat_template": template})
    )
    fmt = ChatFormat.for_checkpoint(tmp_path, "deepseek_v41_text")
    body = {"messages": [{"role": "user", "content": "hé"}], "reasoning_effort": "none"}
    assert fmt.render(body) == "<s>[user]hé[assistant]False"
    message = fmt.parse(body, "<s>[user]hé[assistant]", "<think>r</think>answer")
    assert (message.reasoning_content, message.content) == ("r", "answer")


def test_family_without_template_cannot_chat() -> None:
    fmt = ChatFormat.for_checkpoint(None, "llama")
    with pytest.raises(ChatRequestError):
        fmt.render({"messages": [{"role": "user", "content": "hi"}]})
