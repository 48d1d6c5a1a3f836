"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it) over the chat pipeline: the request
becomes a chat request (server/responses_input.py) that the chat path renders, runs and parses; its
parsed message becomes the output items: a reasoning item (the whole reasoning as its content, an
empty summary), a message item with one output_text part, then a function_call item per tool call.
server/responses_stream.py streams the same as Responses events.

The status is "incomplete" (reason max_output_tokens) when the generation stopped at its length
limit, else "completed"; the items themselves say "completed", as vLLM's do.
`usage.output_tokens_details.reasoning_tokens` counts the output tokens inside the <think> block
the prompt opened: those before the first </think>.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from server.chat import ChatFormat
from server.chat.grammar import reasoning_open
from server.chat.tokens import THINK_END
from server.chat_completions import ChatCall, build_chat_call, create_chat_completion
from server.engine_client import EngineCall
from server.protocol import Usage
from server.responses_input import (
    Message,
    chat_messages,
    chat_request,
    conversation,
    responses_params,
)
from server.responses_protocol import (
    FunctionCallOutput,
    IncompleteDetails,
    InputTokensDetails,
    MessageOutput,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningOutput,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
    new_id,
    parse_items,
)
from server.tokenizer import TextTokenizer


@dataclass(frozen=True)
class ResponsesCall:
    """One Responses request made ready: its chat call, and what its response echoes and keeps."""

    body: ResponsesRequest
    chat: ChatCall
    turn: tuple[Message, ...]  # the conversation through this input (no instructions), for the next turn
    model: str
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self, status: str, output: Iterable[OutputItem] = (), usage: ResponseUsage | None = None,
        error: ResponseError | None = None,
    ) -> ResponseObject:
        body = self.body
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=status, error=error,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            model=self.model, output=list(output), usage=usage, instructions=body.instructions,
            metadata=body.metadata, previous_response_id=body.previous_response_id,
            max_output_tokens=body.max_output_tokens, temperature=self.chat.body.temperature,
            top_p=self.chat.body.top_p, tools=body.tools, tool_choice=body.tool_choice,
            parallel_tool_calls=body.parallel_tool_calls, reasoning=body.reasoning, text=body.text or TextConfig(),
            user=body.user,
        )

    def finished(self, output: Iterable[OutputItem], finish_reason: str, usage: Usage, reasoning_tokens: int) -> ResponseObject:
        status = "incomplete" if finish_reason == "length" else "completed"
        return self.response(status, output, ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
            total_tokens=usage.total_tokens,
        ))

    def conversation_after(self, response: ResponseObject) -> tuple[Message, ...]:
        """The conversation a next turn continues: this one's, then the response's output read back
        as input items (an empty answer is an empty assistant turn)."""
        answer = chat_messages(parse_items([item.model_dump() for item in response.output])) if response.output else []
        return (*self.turn, *(answer or [{"role": "assistant", "content": ""}]))


def build_responses_call(
    body: ResponsesRequest, history: tuple[Message, ...], fmt: ChatFormat, tokenizer: TextTokenizer,
    max_model_len: int, base_id: str, model_name: str,
) -> ResponsesCall:
    """`history`: the stored conversation of previous_response_id. Raises ClientError (400) naming
    the Responses field for what the client must fix."""
    with responses_params():
        messages, turn = conversation(body, history)
        chat = build_chat_call(chat_request(body, messages), fmt, tokenizer, max_model_len, base_id)
    return ResponsesCall(body, chat, turn, model_name)


class ReasoningTokens:
    """Counts the output tokens inside the <think> block the prompt left open (none if it opened
    none): those before the first </think>."""

    def __init__(self, prompt: str, tokenizer: TextTokenizer) -> None:
        self.count, self._open, self._tokenizer = 0, reasoning_open(prompt), tokenizer

    def add(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            if not self._open:
                return
            if self._tokenizer.token_text(token) == THINK_END:
                self._open = False
            else:
                self.count += 1


def output_items(message: Mapping[str, Any]) -> list[OutputItem]:
    """A chat message (server/chat_completions.message_of) as Responses output items."""
    items: list[OutputItem] = []
    if message.get("reasoning_content"):
        items.append(ReasoningOutput(content=[ReasoningText(text=message["reasoning_content"])]))
    if message.get("content"):
        items.append(MessageOutput(content=[OutputText(text=message["content"])]))
    for call in message.get("tool_calls", ()):
        items.append(FunctionCallOutput(call_id=call["id"], name=call["function"]["name"],
                                        arguments=call["function"]["arguments"]))
    return items


async def create_response(
    call: ResponsesCall, engine_call: EngineCall, fmt: ChatFormat, tokenizer: TextTokenizer
) -> ResponseObject:
    completion = await create_chat_completion(call.chat, engine_call, fmt, tokenizer, call.model)
    [choice] = completion.choices
    reasoning = ReasoningTokens(call.chat.prompt, tokenizer)
    reasoning.add(choice.token_ids or ())
    assert choice.finish_reason is not None, "a finished generation has its finish reason"
    return call.finished(output_items(choice.message), choice.finish_reason, completion.usage, reasoning.count)
