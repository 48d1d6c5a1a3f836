"""The responses kept for GET /v1/responses/{id} and `previous_response_id`: in this process's memory,
the last STORED_RESPONSES of them (the oldest is forgotten first), like vLLM's in-memory store; a
restart forgets them all, and a response asked with store=false is never kept.

Each keeps, beside the response, the conversation it ends as chat messages (instructions left out),
which the next turn's prompt starts with. A turn's conversation shares its message dicts with the
turn before it, so a long chain costs a tuple of references per response, not a copy of its history.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from server.request_errors import ClientError
from server.responses_protocol import ResponseObject

STORED_RESPONSES = 1024
Message = dict[str, Any]


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    conversation: tuple[Message, ...]  # never changed once kept: later turns share these dicts


class ResponseStore:
    """Used from the event loop only (the routes and the stream generators), so it needs no lock."""

    def __init__(self, capacity: int = STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()

    def keep(self, response: ResponseObject, conversation: tuple[Message, ...]) -> None:
        self._kept[response.id] = StoredResponse(response, conversation)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._kept.get(response_id)

    def conversation(self, previous_response_id: str | None) -> tuple[Message, ...]:
        """The conversation a new turn continues (empty without a previous response); ClientError
        (400) for an id this server does not hold."""
        if previous_response_id is None:
            return ()
        stored = self._kept.get(previous_response_id)
        if stored is None:
            raise ClientError(
                f"previous_response_id: no stored response {previous_response_id!r} (this server keeps the last "
                f"{self.capacity} responses in memory, and none asked with store=false)", "previous_response_id")
        return stored.conversation
