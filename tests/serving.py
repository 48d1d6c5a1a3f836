"""Starts the real server (`python -m server`) in a subprocess for API tests and stops it after."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_server(model_dir: Path, served_name: str, *extra_args: str) -> Iterator[str]:
    """Yields the base URL once /health answers 200; fails the test with the server's output if it exits."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "--model", str(model_dir), "--port", str(port),
         "--served-model-name", served_name, "--log-level", "warning", *extra_args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    try:
        while time.time() < deadline:
            if process.poll() is not None:
                pytest.fail(f"server exited: {process.stdout.read()}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            pytest.fail("server did not become healthy")
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
