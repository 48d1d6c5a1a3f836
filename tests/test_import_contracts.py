"""The folder map's import rules (docs/structure.md): import-linter's contracts in pyproject.toml, and
what the HTTP front end and the engine's spawn target actually load in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT = {"contract", "engine", "server", "scheduler", "worker", "models", "kernels", "engram_store", "bench"}


def loaded_after(*modules: str) -> set[str]:
    """The modules a fresh interpreter holds after importing `modules` (nothing else imported first)."""
    code = "import importlib, json, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
    code += "print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return set(json.loads(result.stdout))


def test_import_linter_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--config", "pyproject.toml"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout and "Contracts: 6 kept, 0 broken" in result.stdout


def test_the_http_front_end_never_imports_torch():
    loaded = loaded_after("server.__main__", "server.launch", "server.app", "server.engine_process")
    assert "torch" not in loaded
    heavy = sorted(m for m in loaded if m.split(".")[0] in {"models", "worker", "kernels", "engram_store", "scheduler"})
    assert heavy == []
    assert "server.app" in loaded and "engine.process" in loaded  # the spawn target is named, not run


def test_the_engine_spawn_target_imports_only_the_stdlib_zmq_and_contract():
    loaded = loaded_after("engine.process") - loaded_after()  # less what the interpreter itself holds
    top = {m.split(".")[0] for m in loaded} - set(sys.stdlib_module_names)
    project = {m for m in top if m in PROJECT}
    assert project == {"contract", "engine"}
    assert {m for m in loaded if m.startswith("engine.")} == {"engine.process"}
    assert {m for m in top - project if not m.startswith("_")} <= {"zmq", "orjson", "cython_runtime"}, top - project


def test_no_module_imports_itself_through_others():
    """No import circle between any two modules of the project (lazy imports included), so every
    folder and module can be read and tested bottom-up."""
    import grimp

    graph = grimp.build_graph(*sorted(PROJECT - {"bench"}), exclude_type_checking_imports=True)
    imports = {m: graph.find_modules_directly_imported_by(m) & graph.modules for m in graph.modules}
    circles = strongly_connected(imports)
    assert circles == [], circles


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """The groups of two or more modules that import each other, directly or around (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = [stack.pop()]
            while group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return groups


def test_the_circle_finder_finds_circles():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []
