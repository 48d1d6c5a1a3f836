"""The summary a person starting the server reads once it listens: where, what, how big, whether a key
is needed (never the key), and the endpoints, taken from the app's own routes so the list cannot drift
from what is served."""

from __future__ import annotations

import re
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.routing import APIRoute

CONVERTER = re.compile(r"{(\w+):\w+}")  # {model_id:path} -> {model_id}


@dataclass(frozen=True)
class ServingSummary:
    names: tuple[str, ...]  # the reported name first
    model_dir: str
    model_type: str
    max_model_len: int
    max_num_seqs: int
    device: str
    dtype: str
    tensor_parallel_size: int
    api_key_required: bool

    def describe(self, url: str, routes: list[str]) -> str:
        also = f" (also accepted: {', '.join(self.names[1:])})" if len(self.names) > 1 else ""
        key = "required (Authorization: Bearer ...)" if self.api_key_required else "not required: the API is open"
        return "\n  ".join((
            f"ready at {url}",
            f"model {self.names[0]!r}{also}: {self.model_dir} ({self.model_type})",
            f"max_model_len {self.max_model_len}, max_num_seqs {self.max_num_seqs}",
            f"device {self.device}, dtype {self.dtype}, tensor parallel {self.tensor_parallel_size}",
            f"API key {key}",
            "endpoints " + ", ".join(routes),
        ))


def endpoints(app: FastAPI) -> list[str]:
    """'GET /v1/models', 'POST /v1/completions', ... for every API route of `app` (FastAPI's own
    documentation pages aside)."""
    found = []
    for route in app.routes:
        if isinstance(route, APIRoute):
            methods = "/".join(sorted(route.methods - {"HEAD", "OPTIONS"}))
            found.append(methods + " " + CONVERTER.sub(r"{\1}", route.path))
    return found

