"""vLLM request fields this server does not implement: each is refused with a 400 naming it.

Every field of vLLM's CompletionRequest and ChatCompletionRequest (its current ones and those older
clients still send) is either implemented (declared in server/protocol.py or server/chat_protocol.py,
or read by server/chat) or listed here with the value that asks for nothing: sent with any other
value it is the client's 400, never a 200 that quietly ignored it. Fields vLLM does not have
(vendor extras) stay tolerated. A new refusal is one line in a table.

The structured-output fields (response_format, structured_outputs, guided_*, structural_tag,
allowed_token_ids, bad_words, tools, tool_choice) are not here: they are implemented elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from server.request_errors import ClientError


@dataclass(frozen=True)
class Refusal:
    reason: str  # why the field cannot be honoured here (the client reads it)
    default: Any = None  # the value that asks for nothing: sending it (or null) is accepted


_BEAM_SEARCH = "beam search is not built in this server"

# vLLM fields both endpoints share
GENERATION: Mapping[str, Refusal] = {
    "use_beam_search": Refusal(_BEAM_SEARCH, False),
    "length_penalty": Refusal(f"length_penalty only applies to beam search; {_BEAM_SEARCH}", 1.0),
    "early_stopping": Refusal(f"early_stopping only applies to beam search; {_BEAM_SEARCH}", False),
    "logits_processors": Refusal("this server loads no custom logits processors"),
    "guided_decoding_backend": Refusal("this server has one structured-output backend; it cannot be chosen per request"),
    "priority": Refusal("this server schedules requests first come, first served (no priority scheduling)", 0),
    "kv_transfer_params": Refusal("disaggregated serving (KV transfer) is not built in this server"),
    "vllm_xargs": Refusal("this server has no extensions that read vllm_xargs"),
    "mm_processor_kwargs": Refusal("this model takes text only: there is no multimodal processor"),
    "request_id": Refusal("send the request id as the x-request-id header: it names the response and its engine requests"),
    "max_repetition_pattern_size": Refusal("stopping on repeated token patterns is not built in this server", 0),
    "min_repetition_pattern_size": Refusal("stopping on repeated token patterns is not built in this server", 0),
    "repetition_min_count": Refusal("stopping on repeated token patterns is not built in this server", 0),
}

COMPLETIONS: Mapping[str, Refusal] = {
    **GENERATION,
    "suffix": Refusal("this model has no fill-in-the-middle format: suffix is not supported"),
    "prompt_embeds": Refusal("prompts are text or token ids here; prompt embeddings are not accepted"),
}

CHAT: Mapping[str, Refusal] = {
    **GENERATION,
    "echo": Refusal("echoing the last message into the reply is not supported on chat completions", False),
    "chat_template": Refusal("the chat format is the checkpoint's; a template cannot be sent with a request"),
    "skip_special_tokens": Refusal(
        "chat replies are parsed from their special tokens (<think>, tool-call markup), which never reach the "
        "message; skip_special_tokens=false is only supported on /v1/completions", True),
}

# what the built-in DeepSeek encoder does not read (a checkpoint's own Jinja template gets them all)
BUILT_IN_CHAT: Mapping[str, Refusal] = {
    "add_generation_prompt": Refusal(
        "the built-in DeepSeek chat format always ends the prompt with the assistant's turn", True),
    "continue_final_message": Refusal(
        "the built-in DeepSeek chat format cannot continue the final message (no prefill)", False),
    "documents": Refusal("the built-in DeepSeek chat format has no place for documents"),
}


def asks_something(value: Any, default: Any) -> bool:
    """A value other than the default or null (an empty list or object asks for nothing either)."""
    return value is not None and value != default and value not in ({}, [])


def refuse_unsupported(body: BaseModel, refusals: Mapping[str, Refusal]) -> None:
    """Raises ClientError (400, param = the field) for the first field of `refusals` that `body` sets
    to a value asking for something; undeclared fields are read from the body's extras."""
    sent = body.model_fields_set
    for field, refusal in refusals.items():
        if field in sent and asks_something(getattr(body, field), refusal.default):
            raise ClientError(f"{field}: {refusal.reason}", field)
