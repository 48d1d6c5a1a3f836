"""A request's output constraints, read from every field clients send them in.

- `response_format`: OpenAI's text / json_object / json_schema (what `client.chat.completions.parse`
  and LangChain's `with_structured_output` send), and vLLM's structural_tag.
- `structured_outputs`: vLLM's object (json, regex, choice, grammar, json_object, structural_tag,
  disable_any_whitespace). Holding only options (`{"disable_any_whitespace": true}`), it adjusts the
  constraint another field set, as vLLM merges a response_format into it.
- the legacy `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields (and
  `guided_whitespace_pattern`'s compact form).
- a chat's `tool_choice` "required" or named, and `strict` tools under "auto": the model's DSML call
  syntax with each tool's argument schema (server/chat reads the tools; the engine builds the grammar).
- `allowed_token_ids` and `bad_words` (vLLM's token-level bans).
At most one constraint per request: two are a 400 naming the second. What only a compiler can judge
(a schema it does not support, a regex that does not parse) is judged by the engine's compiler before
the request is made (EngineClient.check_grammar), so it is a 400 too. This module never imports
xgrammar: the front end stays torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from contract import SamplingParams, StructuredOutput
from server.request_errors import ClientError
from server.tokenizer import TextTokenizer

# the whitespace pattern vLLM documents for compact JSON; anything else is refused (xgrammar takes a
# whitespace count, not a pattern)
COMPACT_WHITESPACE = ("", "[ ]?", r"[\n\t ]{0,0}")
STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
STRUCTURED_OUTPUT_FLAGS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties",
                           "whitespace_pattern", "backend", "_backend", "_backend_was_auto")


@dataclass(frozen=True)
class Constraints:
    structured: StructuredOutput | None = None
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()

    def applied(self, params: SamplingParams) -> SamplingParams:
        return replace(params, structured=self.structured, allowed_token_ids=self.allowed_token_ids,
                       bad_words=self.bad_words)


def read_constraints(body: Any, tokenizer: TextTokenizer, *, reasoning: bool = False,
                     tool_call: StructuredOutput | None = None) -> Constraints:
    """The constraints of a completions or chat body. `reasoning`: the prompt leaves a `<think>`
    open (the constraint starts after `</think>`); `tool_call`: the chat's forced tool call, if any."""
    extra = body.model_extra or {}
    found = [c for c in (_response_format(body), _structured_outputs(extra), *_guided(extra), tool_call) if c is not None]
    if len(found) > 1:
        raise ClientError(f"{found[1].param}: a request takes one output constraint; {found[0].param} set one already",
                          found[1].param)
    structured = None
    if found:
        compact = _compact_options(extra) or not found[0].any_whitespace
        structured = replace(found[0], reasoning=reasoning, any_whitespace=not compact)
    return Constraints(structured, _allowed_token_ids(extra), _bad_words(extra, tokenizer))


def tool_call_constraint(tools: tuple[dict[str, Any], ...], tool_choice: str, tool_name: str | None,
                         parallel_tool_calls: bool) -> StructuredOutput | None:
    """The DSML call grammar for tool_choice "required" / a named tool, or for "auto" when some tool
    is `strict` (its calls must match its schema; the model may still answer in text)."""
    if tool_choice in ("required", "function"):
        choice: Any = "required" if tool_choice == "required" else {"type": "function", "function": {"name": tool_name}}
    elif tool_choice == "auto" and any(t["function"].get("strict") for t in tools):
        choice = "auto"
    else:
        return None
    spec = {"tools": list(tools), "tool_choice": choice, "parallel_tool_calls": parallel_tool_calls}
    return StructuredOutput("tool_call", json.dumps(spec), param="tool_choice")


def _response_format(body: Any) -> StructuredOutput | None:
    fmt = getattr(body, "response_format", None)
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise ClientError("response_format must be an object", "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", param="response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, Mapping):
            raise ClientError("response_format.json_schema must be an object with a schema", "response_format")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:  # OpenAI allows leaving it out: any JSON object then
            return StructuredOutput("json_object", param="response_format")
        return StructuredOutput("json_schema", _schema_text(schema, "response_format"), param="response_format")
    if kind == "structural_tag":
        return StructuredOutput("structural_tag", json.dumps(dict(fmt)), param="response_format")
    raise ClientError("response_format.type must be 'text', 'json_object', 'json_schema' or 'structural_tag'",
                      "response_format")


def _structured_outputs(extra: Mapping[str, Any]) -> StructuredOutput | None:
    raw = extra.get("structured_outputs")
    if raw is None:
        return None
    param = "structured_outputs"
    if not isinstance(raw, Mapping):
        raise ClientError("structured_outputs must be an object", param)
    unknown = sorted(set(raw) - set(STRUCTURED_OUTPUT_KEYS) - set(STRUCTURED_OUTPUT_FLAGS))
    if unknown:
        raise ClientError(f"structured_outputs.{unknown[0]} is not a structured-output field", param)
    chosen = [key for key in STRUCTURED_OUTPUT_KEYS if raw.get(key) not in (None, False)]
    if len(chosen) > 1:
        raise ClientError(f"structured_outputs takes one of {', '.join(STRUCTURED_OUTPUT_KEYS)}, got {', '.join(chosen)}",
                          param)
    return _constraint(chosen[0], raw[chosen[0]], param, compact=False) if chosen else None


def _compact_options(extra: Mapping[str, Any]) -> bool:
    """structured_outputs' whitespace options (for any constraint of the request)."""
    raw = extra.get("structured_outputs")
    if not isinstance(raw, Mapping):
        return False
    disabled = raw.get("disable_any_whitespace", False)
    if not isinstance(disabled, bool):
        raise ClientError("structured_outputs.disable_any_whitespace must be a boolean", "structured_outputs")
    return disabled or _compact(raw.get("whitespace_pattern"), "structured_outputs")


def _guided(extra: Mapping[str, Any]) -> list[StructuredOutput | None]:
    compact = _compact(extra.get("guided_whitespace_pattern"), "guided_whitespace_pattern")
    return [_constraint(key, extra[f"guided_{key}"], f"guided_{key}", compact)
            for key in ("json", "regex", "choice", "grammar") if extra.get(f"guided_{key}") is not None]


def _constraint(key: str, value: Any, param: str, compact: bool) -> StructuredOutput:
    if key == "json":
        return StructuredOutput("json_schema", _schema_text(value, param), param=param, any_whitespace=not compact)
    if key == "json_object":
        return StructuredOutput("json_object", param=param, any_whitespace=not compact)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ClientError(f"{param} must be a non-empty list of strings", param)
        return StructuredOutput("choice", json.dumps(value), param=param)
    if key == "structural_tag":
        text = value if isinstance(value, str) else json.dumps(value)
        return StructuredOutput("structural_tag", text, param=param)
    if not isinstance(value, str) or not value:
        raise ClientError(f"{param} must be a non-empty string", param)
    return StructuredOutput("regex" if key == "regex" else "grammar", value, param=param)


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema as JSON text: an object, a boolean, or JSON text of one."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ClientError(f"{param}: the schema is not valid JSON: {exc}", param) from exc
    if not isinstance(schema, (Mapping, bool)):
        raise ClientError(f"{param}: a JSON schema must be an object", param)
    return json.dumps(schema)


def _compact(pattern: Any, param: str) -> bool:
    if pattern is None:
        return False
    if pattern in COMPACT_WHITESPACE:
        return True
    raise ClientError(f"{param}: only a pattern allowing no whitespace is supported ({COMPACT_WHITESPACE[0]!r})", param)


def _allowed_token_ids(extra: Mapping[str, Any]) -> tuple[int, ...]:
    ids = extra.get("allowed_token_ids")
    if ids is None:
        return ()
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ClientError("allowed_token_ids must be a non-empty list of token ids", "allowed_token_ids")
    return tuple(dict.fromkeys(ids))


def _bad_words(extra: Mapping[str, Any], tokenizer: TextTokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's rule: each word as written and with a leading space (words usually follow a space),
    as token ids."""
    words = extra.get("bad_words")
    if words is None:
        return ()
    if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
        raise ClientError("bad_words must be a list of non-empty strings", "bad_words")
    sequences: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False, param="bad_words"))
            if ids:
                sequences[ids] = None
    return tuple(sequences)
