"""OpenAI Responses API models (POST /v1/responses), in pydantic: the request this server takes, and
the response object with its output items.

The request refuses what it does not know (`extra="forbid"`): a client asking for a background run,
a built-in tool or an `include` learns from a 400 naming the field that it is not served, instead of
getting an answer that quietly ignored it. Input items, though, ignore keys they do not use: clients
send an earlier response's output items back as input, and those carry output-only fields (id,
status, annotations, logprobs...).

Sampling values keep only their types here: their ranges are the chat path's (SamplingFields in
server/protocol.py), checked once the request has become a chat request (server/responses_input.py).
Besides OpenAI's fields the request takes vLLM's sampling extras for the Responses API (top_k, seed,
stop, ignore_eos, repetition_penalty, logit_bias, cache_salt) and the chat path's presence and
frequency penalties.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
)

ItemStatus = Literal["in_progress", "completed", "incomplete"]


def new_id(prefix: str) -> str:
    """OpenAI's id shapes: resp_..., msg_..., rs_..., fc_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


# --- input items -------------------------------------------------------------------------------------

class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Item):
    """A text content part: `input_text` in what the client wrote, `output_text` in an assistant
    message sent back; other parts (images, files, refusals) are refused."""

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Item):
    type: Literal["message"] = "message"  # EasyInputMessage leaves it out
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(_Item):
    """A call the model made earlier, sent back so its output can follow it."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningTextPart(_Item):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[ReasoningTextPart] = []
    content: list[ReasoningTextPart] | None = None
    encrypted_content: str | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _plain_reasoning_only(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("encrypted reasoning is not supported; send the reasoning item's content")
        return value

    @property
    def text(self) -> str:
        """The reasoning as text: its content, else its summary (as vLLM reads a reasoning item)."""
        return "".join(part.text for part in (self.content or self.summary))


def _item_type(value: Any) -> str | None:
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)


InputItem = Annotated[
    Union[
        Annotated[MessageItem, Tag("message")],
        Annotated[FunctionCallItem, Tag("function_call")],
        Annotated[FunctionCallOutputItem, Tag("function_call_output")],
        Annotated[ReasoningItem, Tag("reasoning")],
    ],
    Discriminator(_item_type, custom_error_type="input_item_type", custom_error_message=(
        "an input item must be a message, function_call, function_call_output or reasoning item")),
]
_INPUT_ITEM: TypeAdapter[Any] = TypeAdapter(InputItem)


def parse_items(raw: list[Any]) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]:
    """Each raw item as its model; a ValueError says which item failed and where, so the 400 names
    `input` with a readable message (pydantic's own would name the unions' internals)."""
    items = []
    for index, item in enumerate(raw):
        try:
            items.append(_INPUT_ITEM.validate_python(item))
        except ValidationError as exc:
            # the deepest error is the one inside the union member that fit (a list of parts, not a string)
            error = max(exc.errors(), key=lambda e: len(e["loc"]))
            where = ".".join(str(part) for part in error["loc"][1:] if _is_field(part))  # loc[0]: the item's tag
            reason = error["msg"].removeprefix("Value error, ")
            raise ValueError(f"item {index}{' ' + where if where else ''}: {reason}") from None
    return items


def _is_field(part: str | int) -> bool:
    """A location part that names a field or a list position, not a union member (`str`, `list[TextPart]`)."""
    return isinstance(part, int) or (part.isidentifier() and part != "str")


# --- tools, tool choice, text format, reasoning ---------------------------------------------------------

class FunctionTool(BaseModel):
    """A Responses function tool: flat, where a chat tool nests the same fields under `function`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class TextFormatText(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]


class TextFormatJsonObject(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_object"]


class TextFormatJsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: StrictBool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")] = (
        TextFormatText(type="text"))


class ReasoningConfig(BaseModel):
    """`effort` is checked by the chat path (its reasoning_effort); `summary` is accepted, but a
    reasoning item always carries the whole reasoning as its content and an empty summary, as vLLM's do."""

    model_config = ConfigDict(extra="forbid")

    effort: str | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


# --- the request -----------------------------------------------------------------------------------------

MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] = []
    tool_choice: Literal["auto", "none", "required"] | NamedFunction = "auto"
    parallel_tool_calls: StrictBool = True
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: str | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    user: str | None = None
    background: StrictBool | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (drop the oldest turns to fit) is not served
    # vLLM's sampling extras, and the chat path's penalties
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    ignore_eos: StrictBool | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    cache_salt: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_items(cls, raw: Any) -> Any:
        if isinstance(raw, str):
            return raw
        if not isinstance(raw, list) or not raw:
            raise ValueError("must be a string or a non-empty list of input items")
        return parse_items(raw)

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, raw: Any) -> Any:
        for index, tool in enumerate(raw if isinstance(raw, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tool {index}: only function tools are served, not {kind!r} (no built-in tools)")
        return raw

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _served_tool_choice(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and raw.get("type") != "function":
            raise ValueError("must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}")
        return raw

    @field_validator("background")
    @classmethod
    def _no_background(cls, background: bool | None) -> bool | None:
        if background:
            raise ValueError("background responses are not supported; leave background false")
        return background


# --- the response ----------------------------------------------------------------------------------------

class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []


class MessageOutput(BaseModel):
    id: str = Field(default_factory=lambda: new_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "completed"
    content: list[OutputText] = []


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(BaseModel):
    id: str = Field(default_factory=lambda: new_id("rs"))
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus = "completed"
    summary: list[Any] = []  # always empty: the whole reasoning is the content
    content: list[ReasoningText] = []


class FunctionCallOutput(BaseModel):
    id: str = Field(default_factory=lambda: new_id("fc"))
    type: Literal["function_call"] = "function_call"
    status: ItemStatus = "completed"
    call_id: str
    name: str
    arguments: str  # a JSON object as text


OutputItem = MessageOutput | ReasoningOutput | FunctionCallOutput


class InputTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: Literal["server_error"] = "server_error"
    message: str


class ResponseObject(BaseModel):
    """The `response` object; the request's own settings are echoed as OpenAI does."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = []
    usage: ResponseUsage | None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float
    top_p: float
    tools: list[FunctionTool]
    tool_choice: Literal["auto", "none", "required"] | NamedFunction
    parallel_tool_calls: bool
    reasoning: ReasoningConfig | None = None
    text: TextConfig
    truncation: Literal["disabled"] = "disabled"
    background: Literal[False] = False
    user: str | None = None

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)
