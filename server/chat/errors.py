"""The one error type of the chat layer: a client mistake that the HTTP layer answers with 400."""

from __future__ import annotations


class ChatRequestError(ValueError):
    """A chat request that no renderer or parser can serve as sent.

    `param` names the offending request field (OpenAI error shape), or is None when the
    problem is not tied to one field.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
