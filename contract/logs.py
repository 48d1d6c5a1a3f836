"""Logging for the HTTP and engine processes: plain text or one JSON object per line, request ids, no
secrets.

One root handler on stderr carries every logger, uvicorn's included (it is started with
`log_config=None`, so its error and access loggers propagate here instead of getting handlers of their
own). The request id that server/http_edge.py assigns (or takes from `x-request-id`) is kept in a
context variable for the request's task, so every line logged while handling it, uvicorn's access line
included, carries `request_id`. Secrets: the API keys are never logged by the code, and as a second
line of defence the formatter replaces each known key, and any `Bearer <token>`, with `***` in the
final text (message, arguments and traceback alike). Standard library only: the engine process uses it
too (engine/process.py).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Iterable
from contextvars import ContextVar

REQUEST_ID: ContextVar[str | None] = ContextVar("ds4serve_request_id", default=None)
FORMATS = ("text", "json")
BEARER = re.compile(r"(?i)(bearer\s+)[^\s\"',]+")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class RequestIdFilter(logging.Filter):
    """Stamps each record with the request id of the task that logs it (None outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        return True


class Redactor:
    """Replaces secrets in finished log text, as they are and as a URL carries them (each character
    literal or percent-encoded, in either hex case, "+" for a space): a key a client puts in a query
    string reaches the access log encoded."""

    def __init__(self, secrets: Iterable[str]) -> None:
        # longest first, so a key that contains another is replaced whole
        ordered = sorted({s for s in secrets if s}, key=len, reverse=True)
        self.patterns = [re.compile("".join(_char_as_written(c) for c in secret)) for secret in ordered]

    def __call__(self, text: str) -> str:
        for pattern in self.patterns:
            text = pattern.sub("***", text)
        return BEARER.sub(r"\1***", text)


def _char_as_written(char: str) -> str:
    """A regex for one character of a secret: itself, or its UTF-8 bytes percent-encoded (any hex case)."""
    encoded = "".join(f"%{_hex_digit(b >> 4)}{_hex_digit(b & 15)}" for b in char.encode("utf-8"))
    options = [re.escape(char), encoded] + (["\\+"] if char == " " else [])
    return "(?:" + "|".join(options) + ")"


def _hex_digit(value: int) -> str:
    digit = f"{value:X}"
    return f"[{digit}{digit.lower()}]" if digit.isalpha() else digit


class TextFormatter(logging.Formatter):
    def __init__(self, redact: Redactor) -> None:
        super().__init__(TEXT_FORMAT)
        self.redact = redact

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        request_id = getattr(record, "request_id", None)
        return self.redact(f"{text} [request {request_id}]" if request_id else text)


class JsonFormatter(logging.Formatter):
    """{"ts", "level", "logger", "process", "msg", "request_id"?, "exc"?} on one line."""

    def __init__(self, redact: Redactor) -> None:
        super().__init__()
        self.redact = redact

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "process": record.processName,
            "msg": self.redact(record.getMessage()),
        }
        if getattr(record, "request_id", None):
            entry["request_id"] = record.request_id
        if record.exc_info:
            entry["exc"] = self.redact(self.formatException(record.exc_info))
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: int | str, log_format: str = "text", secrets: Iterable[str] = ()) -> None:
    """Replaces the root logger's handlers with one stderr handler in `log_format` ("text" or "json")."""
    if log_format not in FORMATS:
        raise ValueError(f"server.log_format {log_format!r} is not one of {FORMATS}")
    redact = Redactor(secrets)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(redact) if log_format == "json" else TextFormatter(redact))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
