"""vLLM's --enable-log-requests (server.log_requests): one INFO line per engine request, as its call is
accepted. It names the request, its prompt's length and its sampling parameters, never the prompt's
text: logs travel further than the requests they describe. Logged in the HTTP handler's task, so each
line carries the HTTP request id too (contract/logs.py)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from contract import NewRequest
from server.engine_client import EngineCall, EngineClient

log = logging.getLogger("ds4serve.requests")


class RequestLoggingClient(EngineClient):
    """An EngineClient that logs each request of every call it accepts (refused ones are the 4xx's)."""

    def call(self, requests: Sequence[NewRequest], *args: Any, **kwargs: Any) -> EngineCall:
        call = super().call(requests, *args, **kwargs)
        for request in call.requests:
            log.info("request %s: %d prompt tokens, %s", request.request_id, len(request.prompt_token_ids),
                     request.params)
        return call
