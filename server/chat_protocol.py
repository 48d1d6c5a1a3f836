"""OpenAI chat-completions models (with vLLM's extras). The chat fields themselves (messages, tools,
tool_choice, reasoning_effort, chat_template_kwargs...) stay loose here: server/chat validates them
with DeepSeek's rules and answers ChatRequestError (400)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool, StrictInt, model_validator

from server.protocol import MAX_LOGPROBS, PromptLogprobs, SamplingFields, Usage


class ChatCompletionRequest(SamplingFields):
    messages: list[Any]
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    add_special_tokens: StrictBool = False  # the chat format writes the BOS itself

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @property
    def sample_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry]


class ChatChoice(BaseModel):
    index: int
    message: dict[str, Any]  # ParsedMessage.to_openai() plus the `reasoning` alias
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, for the prompt every choice shares
    prompt_token_ids: list[int] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
