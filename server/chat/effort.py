"""Reasoning effort: how request knobs pick thinking mode and effort, and what an effort prints.

The two versions differ in kind, not degree: V4 prints one of two long prose prefixes (or
nothing), V4.1 prints a numeric budget. Each is an `EffortPolicy`; the encoder only asks for
the text to place after BOS.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from server.chat.errors import ChatRequestError

Effort = str | int | None

_V4_PROMPTS = {
    "low": "",
    "high": (
        "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
        "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
        "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
        "edge cases, and adversarial scenarios.\n"
        "Explicitly write out your entire deliberation process, documenting every intermediate "
        "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
        "is left unchecked.\n\n"
    ),
    "max": (
        "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
        "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
        "exhaustively decompose the problem into its most fundamental components, trace every "
        "causal chain to its root, and resolve the underlying cause rather than any surface "
        "symptom.\n"
        "Do not stop reasoning until you have independently verified the solution from multiple "
        "angles and are certain that no assumption remains unchecked and no error remains "
        "undiscovered.\n\n"
    ),
}

# vLLM 0.33.0's release table; older trees carry the pre-release 25/50/75/100.
_V41_BUDGETS = {"low": 50, "high": 75, "xhigh": 75, "max": 100}
_V41_TEMPLATE = (
    "Reasoning Effort: {budget} (range 1-100, the higher the value, the more thorough the "
    "reasoning)\n\n"
)
_V41_INVALID = (
    "DeepSeek V4.1 reasoning_effort must be low, high, xhigh, max, or an integer within "
    "[1, 100] in chat_template_kwargs"
)


class EffortPolicy(Protocol):
    def resolve(self, kwargs: Mapping[str, Any]) -> tuple[bool, Effort]:
        """(thinking on?, encoder effort) from the effective chat-template kwargs."""

    def prompt(self, effort: Effort) -> str:
        """The text placed after BOS in thinking mode; raises ChatRequestError if invalid."""


def _thinking_knob(kwargs: Mapping[str, Any]) -> bool:
    """thinking / enable_thinking, either one truthy; on when neither key is present."""
    if "thinking" not in kwargs and "enable_thinking" not in kwargs:
        return True
    return bool(kwargs.get("thinking")) or bool(kwargs.get("enable_thinking"))


class V4Effort:
    def resolve(self, kwargs: Mapping[str, Any]) -> tuple[bool, Effort]:
        thinking = _thinking_knob(kwargs)
        effort = kwargs.get("reasoning_effort")
        if not isinstance(effort, str):
            return thinking, ("high" if thinking else None)
        if effort == "none":
            return False, None
        if effort in ("low", "minimal", "medium"):
            return thinking, "low"
        return thinking, ("max" if effort == "max" else "high")

    def prompt(self, effort: Effort) -> str:
        key = effort if effort is not None else "low"
        if not isinstance(key, str) or key not in _V4_PROMPTS:
            raise ChatRequestError(
                f"invalid reasoning effort {effort!r} for DeepSeek V4: expected low, high or max",
                "reasoning_effort",
            )
        return _V4_PROMPTS[key]


class V41Effort:
    def resolve(self, kwargs: Mapping[str, Any]) -> tuple[bool, Effort]:
        thinking = _thinking_knob(kwargs)
        effort = kwargs.get("reasoning_effort")
        if effort == "none":
            thinking, effort = False, None
        effort = "high" if effort is None else effort
        self._budget(effort)
        return thinking, effort

    def prompt(self, effort: Effort) -> str:
        return _V41_TEMPLATE.format(budget=self._budget("high" if effort is None else effort))

    @staticmethod
    def _budget(effort: Effort) -> int:
        if type(effort) is int and 1 <= effort <= 100:
            return effort
        if isinstance(effort, str) and effort in _V41_BUDGETS:
            return _V41_BUDGETS[effort]
        raise ChatRequestError(_V41_INVALID, "reasoning_effort")
