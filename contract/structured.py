"""A request's output constraint, as it crosses from the HTTP front end to the engine's grammar compiler.

The front end turns `response_format`, vLLM's `structured_outputs` / `guided_*` fields and a forced
`tool_choice` into one `StructuredOutput`; the engine process compiles it with xgrammar
(engine/structured_outputs.py) into a structural tag, so every kind, and the reasoning before it, is
one grammar. Nothing here imports xgrammar: the front end stays torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StructuredKind = Literal["json_object", "json_schema", "regex", "choice", "grammar", "structural_tag", "tool_call"]
KINDS: tuple[str, ...] = StructuredKind.__args__  # type: ignore[attr-defined]


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match.

    kind / spec: json_object (spec unused), json_schema (the schema as JSON text), regex (the
    pattern), choice (a JSON list of the allowed strings), grammar (EBNF, xgrammar's dialect of
    GBNF), structural_tag (a structural tag as JSON text, xgrammar's or vLLM's legacy shape),
    tool_call (JSON text {"tools": [...OpenAI function tools], "tool_choice": "required" or
    {"type": "function", "function": {"name": ...}}, "parallel_tool_calls": bool}: one or more calls
    of the tools, or one of the named one, in the model's DSML call syntax).
    reasoning: the output opens with reasoning that ends with `</think>` (the prompt ended with
    `<think>`); the constraint applies after it, the reasoning itself is free text.
    param: the request field it came from, named in the 400 if it does not compile.
    """

    kind: StructuredKind
    spec: str = ""
    reasoning: bool = False
    param: str = "response_format"
    any_whitespace: bool = True  # JSON kinds: False allows no whitespace between tokens (compact JSON)

    @property
    def key(self) -> tuple[str, str, bool, bool]:
        """What the compiled grammar depends on (the compile cache's key)."""
        return (self.kind, self.spec, self.reasoning, self.any_whitespace)
