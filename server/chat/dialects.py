"""What differs between the DeepSeek-V4 and V4.1 chat formats, as data.

Everything version-specific lives in one frozen `Dialect`; the encoder, the request layer and
the output parser read it instead of branching on a version name.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.chat.effort import EffortPolicy, V4Effort, V41Effort
from server.chat.tokens import DSML


@dataclass(frozen=True)
class Dialect:
    name: str
    calls_tag: str  # DSML block name: "tool_calls" (V4) or " calls" (V4.1)
    calls_open_aliases: tuple[str, ...]  # misspellings of the block opener the parser accepts
    invoke_tag: str
    parameter_tag: str
    reasoning_key: str  # the encoder-format message field that carries history reasoning
    system_token: bool  # V4.1 opens system turns with <｜System｜>
    # V4.1 counts a non-leading system turn as a user turn, and a user turn made only of tool
    # results as none; V4 counts user and developer turns as they are.
    v41_turns: bool
    # The V4 encoder is handed vLLM's parsed conversation (reasoning kept on assistant turns
    # only, message tools on developer turns only, a tool turn's text parts joined with "\n");
    # the V4.1 encoder gets the request messages (every list of text parts joined with "\n\n").
    conversation_view: bool
    strict_history_arguments: bool  # V4 rejects history tool-call arguments that are no JSON object
    forbidden_text: str | None  # V4.1 rejects its image placeholder typed as text
    effort: EffortPolicy

    def close(self, name: str) -> str:
        return f"</{DSML}{name}>"

    @property
    def calls_open(self) -> str:
        return f"<{DSML}{self.calls_tag}>"

    @property
    def calls_close(self) -> str:
        return self.close(self.calls_tag)

    @property
    def invoke_open(self) -> str:
        """The invoke tag up to the opening quote of its name attribute."""
        return f'<{DSML}{self.invoke_tag} name="'

    @property
    def invoke_close(self) -> str:
        return self.close(self.invoke_tag)

    @property
    def parameter_open(self) -> str:
        return f"<{DSML}{self.parameter_tag}"

    @property
    def parameter_close(self) -> str:
        return self.close(self.parameter_tag)


V4 = Dialect(
    name="deepseek_v4",
    calls_tag="tool_calls",
    calls_open_aliases=(f"<{DSML}toolcalls>", f"<{DSML}tool>"),
    invoke_tag="invoke",
    parameter_tag="parameter",
    reasoning_key="reasoning",
    system_token=False,
    v41_turns=False,
    conversation_view=True,
    strict_history_arguments=True,
    forbidden_text=None,
    effort=V4Effort(),
)

V41 = Dialect(
    name="deepseek_v41",
    calls_tag=" calls",
    calls_open_aliases=(),
    invoke_tag=" invoke",
    parameter_tag=" parameter",
    reasoning_key="reasoning_content",
    system_token=True,
    v41_turns=True,
    conversation_view=False,
    strict_history_arguments=False,
    forbidden_text="<｜deepseek_image｜>",
    effort=V41Effort(),
)

# config.json model_type -> dialect
DIALECTS = {"deepseek_v4": V4, "deepseek_v41": V41, "deepseek_v41_text": V41}


def dialect_for(model_type: str) -> Dialect | None:
    return DIALECTS.get(model_type)
