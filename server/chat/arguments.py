"""DSML tool-call parameters to a JSON arguments string, the way vLLM 0.33.0 emits it.

`string="true"` values are kept raw; any other value (also with the `string` attribute
missing) is decoded as JSON, falling back to the raw text. The request's tool schema then
coerces types (a string "3" for an integer property becomes 3). While streaming, only a
prefix that later text cannot change is sent: see `stable_prefix`.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from server.chat.dialects import Dialect

_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")
_ALIASES = {
    "str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
    "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer",
    "uint32": "integer", "uint64": "integer", "long": "integer", "short": "integer",
    "unsigned": "integer", "float": "number", "float32": "number", "float64": "number",
    "double": "number", "bool": "boolean", "dict": "object", "arr": "array", "list": "array",
    "sequence": "array",
}  # fmt: skip


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class ArgumentConverter:
    """Turns the raw text between `<invoke name="...">` and `</invoke>` into JSON arguments."""

    def __init__(self, dialect: Dialect, tools: list[dict[str, Any]]) -> None:
        head = (
            re.escape(dialect.parameter_open)
            + r'\s+name="([^"]+)"(?:\s+string="([^"]*)")?\s*>'
        )
        close = re.escape(dialect.parameter_close)
        next_param = re.escape(dialect.parameter_open) + r'\s+name='
        self._complete = re.compile(head + rf"(.*?)(?:{close}|(?={next_param}))", re.DOTALL)
        self._partial = re.compile(head + r"(.*)$", re.DOTALL)
        self._properties: dict[str, dict[str, Any]] = {}
        for tool in tools:
            function = tool["function"]
            params = function.get("parameters") or {}
            props = params.get("properties", {}) if isinstance(params, dict) else {}
            self._properties.setdefault(function["name"], props if isinstance(props, dict) else {})
        self._has_tools = bool(tools)

    def convert(self, raw: str, partial: bool, name: str) -> str:
        """Arguments so far as JSON (`partial`: with the still-open parameter when usable).

        `name` picks the schema that decides whether {"arguments": ...} is a wrapper to remove.
        """
        text = _dumps(self._params(raw, partial))
        properties = self._properties.get(name, {})
        return _unwrap(text, properties) if self._has_tools and properties else text

    def coerce(self, args_json: str, name: str) -> str:
        """Values re-typed by the named tool's schema (unchanged text when nothing changes)."""
        properties = self._properties.get(name, {})
        return _coerce_types(args_json, properties) if self._has_tools and properties else args_json

    def string_keys(self, name: str) -> set[str] | None:
        """Keys whose value is always a string, so an open value may stream (None: no schema)."""
        properties = self._properties.get(name, {})
        if not properties:
            return None
        return {k for k, schema in properties.items() if set(schema_types(schema)) == {"string"}}

    def _params(self, raw: str, partial: bool) -> dict[str, Any]:
        params: dict[str, Any] = {}
        end = 0
        for m in self._complete.finditer(raw):
            params[m.group(1)] = m.group(3) if m.group(2) == "true" else _json_or_raw(m.group(3))
            end = m.end()
        if partial and (m := self._partial.search(raw, end)):
            if m.group(2) == "true":
                params[m.group(1)] = m.group(3)
            else:
                try:
                    params[m.group(1)] = json.loads(m.group(3))
                except ValueError:
                    pass
        return params


def _json_or_raw(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


def _unwrap(args_json: str, properties: dict[str, Any]) -> str:
    """{"arguments": {...}} or {"input": {...}} around the real arguments is taken off."""
    args = json.loads(args_json)
    allowed = set(properties)
    for wrapper in ("arguments", "input"):
        if set(args) != {wrapper} or wrapper in allowed:
            continue
        inner = args[wrapper]
        if isinstance(inner, str):
            try:
                inner = json.loads(inner)
            except ValueError:
                return args_json
        if isinstance(inner, dict) and set(inner) <= allowed:
            return _dumps(inner)
    return args_json


def _coerce_types(args_json: str, properties: dict[str, Any]) -> str:
    args = json.loads(args_json)
    if not isinstance(args, dict):
        return args_json
    return _dumps(args) if _coerce_dict(args, properties) else args_json


def _coerce_dict(args: dict[str, Any], properties: dict[str, Any]) -> bool:
    changed = False
    for key, value in args.items():
        schema = properties.get(key)
        if isinstance(schema, dict):
            coerced, value_changed = _coerce_value(value, schema)
            if value_changed:
                args[key] = coerced
                changed = True
    return changed


def _coerce_value(value: Any, schema: dict[str, Any]) -> tuple[Any, bool]:
    if isinstance(value, str):
        coerced = coerce_text(value, schema_types(schema))
        return coerced, coerced is not value
    if isinstance(value, dict):
        nested = schema.get("properties")
        return value, isinstance(nested, dict) and _coerce_dict(value, nested)
    if isinstance(value, list):
        items = schema.get("items")
        changed = False
        if isinstance(items, dict):
            for i, item in enumerate(value):
                coerced, item_changed = _coerce_value(item, items)
                if item_changed:
                    value[i], changed = coerced, True
        return value, changed
    coerced = coerce_text(_dumps(value), schema_types(schema))
    return coerced, type(coerced) is not type(value) or coerced != value


def schema_types(schema: Any) -> list[str]:
    """JSON types a schema allows (from type, enum values and anyOf/oneOf/allOf); default string."""
    if not isinstance(schema, dict):
        return ["string"]
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(t for t in declared if isinstance(t, str))
    if isinstance(schema.get("enum"), list):
        types.update(_json_type(v) for v in schema["enum"])
    for choice in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(choice), list):
            for option in schema[choice]:
                types.update(schema_types(option))
    return list(types) if types else ["string"]


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    for kind, name in ((int, "integer"), (float, "number"), (str, "string"), (list, "array")):
        if isinstance(value, kind):
            return name
    return "object"


def _finite(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
        return True
    except (ValueError, TypeError):
        return False


def coerce_text(value: str, types: list[str]) -> Any:
    """The first reading of `value` that fits an allowed type, in null..string priority."""
    allowed = {_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for kind in _PRIORITY:
        if kind not in allowed:
            continue
        if kind == "null" and value.lower() == "null":
            return None
        if kind == "string":
            return value
        if kind == "integer":
            try:
                return int(value)
            except ValueError:
                continue
        if kind == "number":
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                return number if number != int(number) else int(number)
        if kind == "boolean" and value.lower().strip() in ("true", "1", "false", "0"):
            return value.lower().strip() in ("true", "1")
        if kind in ("object", "array"):
            parsed = _json_or_missing(value)
            if parsed is not _MISSING and _finite(parsed):
                return parsed
    parsed = _json_or_missing(value)
    return parsed if parsed is not _MISSING and _finite(parsed) else value


_MISSING = object()


def _json_or_missing(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return _MISSING


def stable_prefix(args_json: str, string_keys: set[str] | None) -> str:
    """The part of `args_json` that more text cannot change.

    Everything up to the last top-level value is stable. That value is withheld (a number or
    object may still grow or be re-typed), except an open string of a string-only key, whose
    text streams up to, not including, its closing quote.
    """
    last_colon, last_key, pending_key = -1, None, None
    in_string = escape = False
    string_start, depth = -1, 0
    for i, c in enumerate(args_json):
        if escape:
            escape = False
        elif in_string:
            if c == "\\":
                escape = True
            elif c == '"':
                in_string = False
                if depth == 1:
                    pending_key = args_json[string_start + 1 : i]
        elif c == '"':
            in_string, string_start = True, i
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
        elif c == ":" and depth == 1:
            last_colon, last_key, pending_key = i, pending_key, None
    if last_colon < 0:
        return ""
    end = last_colon + 1
    while end < len(args_json) and args_json[end] in " \t\n\r":
        end += 1
    if end >= len(args_json) or args_json[end] != '"':
        return args_json[:end]
    if string_keys is not None and last_key not in string_keys:
        return args_json[:end]
    escape = False
    for i in range(end + 1, len(args_json)):
        if escape:
            escape = False
        elif args_json[i] == "\\":
            escape = True
        elif args_json[i] == '"':
            return args_json[:i]
    return args_json
