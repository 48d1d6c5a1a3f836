"""The chat section's vLLM-facing options: --chat-template resolved, and vLLM's format names checked.

Here the chat format is not chosen by name: server/chat/ takes the model's own from its type
(config.json model_type), tool calls are always parsed (tool_choice "auto", vLLM's
--enable-auto-tool-choice) and reasoning always split off. vLLM launch lines name the format anyway
(--tool-call-parser, --reasoning-parser, --tokenizer-mode); those names are accepted when they describe
the served model's format and refused otherwise, so a line written for another model fails at start
instead of serving a format it did not ask for.
"""

from __future__ import annotations

from pathlib import Path

from contract.config import ChatSection, ConfigFileError
from server.chat import dialect_for

# vLLM's tool parsers for the DeepSeek family, and the markup each reads
TOOL_PARSERS = {
    "deepseek_v3": "V3 / R1's <｜tool▁calls▁begin｜> blocks",
    "deepseek_v31": "V3.1's <｜tool▁calls▁begin｜> blocks",
    "deepseek_v32": "V3.2's <｜DSML｜function_calls> blocks",
    "deepseek_v4": "V4's <｜DSML｜tool_calls> blocks",
    "deepseek_v41": "V4.1's <｜DSML｜ calls> blocks",
}
# vLLM's reasoning parsers for the family: all read <think>...</think>, as V4 and V4.1 write it
REASONING_PARSERS = ("deepseek_r1", "deepseek_v3", "deepseek_v4", "deepseek_v41")
# the Hugging Face tokenizer (auto, hf), or vLLM's DeepSeek chat encoders
TOKENIZER_MODES = ("auto", "hf", "deepseek_v4", "deepseek_v41")
TEMPLATE_MARKS = ("{{", "{%", "{#")


def template_source(value: str | None) -> str | None:
    """chat.template as vLLM's --chat-template takes it: a file's text, or the value itself when it is a
    Jinja template; anything else names a file that is not there (ConfigFileError)."""
    if value is None:
        return None
    if Path(value).is_file():
        return Path(value).read_text()
    if any(mark in value for mark in TEMPLATE_MARKS):
        return value
    raise ConfigFileError(f"chat.template (--chat-template) {value!r}: no such file, and not a Jinja template")


def check_format_names(chat: ChatSection, model_type: str) -> None:
    """Raises ConfigFileError, listing the names that fit, when a vLLM name does not describe the chat
    format of a model of `model_type`."""
    dialect = dialect_for(model_type)
    family = dialect.name if dialect is not None else None  # deepseek_v4 or deepseek_v41, as vLLM names them
    fits = {
        "tool_call_parser": (family,) if family else (),
        "reasoning_parser": ("deepseek_r1", "deepseek_v3", family) if family else (),
        "tokenizer_mode": ("auto", "hf", family) if family else ("auto", "hf"),
    }
    known = {"tool_call_parser": tuple(TOOL_PARSERS), "reasoning_parser": REASONING_PARSERS,
             "tokenizer_mode": TOKENIZER_MODES}
    for key, allowed in fits.items():
        name = getattr(chat, key)
        if name is None or name in allowed:
            continue
        flag = "--" + key.replace("_", "-")
        what = (f"reads {TOOL_PARSERS[name]}" if key == "tool_call_parser" and name in TOOL_PARSERS
                else "is another model's" if name in known[key] else "is not a name this server knows")
        choices = ", ".join(a for a in allowed if a) or "none (this model has no built-in chat format)"
        raise ConfigFileError(f"chat.{key} ({flag}) {name!r} {what}; this {model_type} model's format is"
                              f" {family or 'not built in'}: choose from {choices}")
