"""lm-eval against the real server, as its users run it: `python -m lm_eval --model local-chat-completions`
reads only each answer's `content`, so on a server started with `--default-chat-template-kwargs
'{"thinking": false}'` every answer must be a non-empty string (issue 23). The task is a local one of
three questions (tests/lm_eval_task/); the tiny random model answers gibberish, so only non-emptiness is
checked. A control task turns thinking back on per request (lm-eval passes unknown generation kwargs
through as request fields): the answer then starts in reasoning, `content` is null, and lm-eval is left
with empty strings, which is what the flag is there to prevent.

Needs lm-eval (the `test` extra's `lm_eval[api]`); skipped without it. Runs offline."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serving import REPO, running_server

pytest.importorskip("lm_eval")

TASK_DIR = REPO / "tests" / "lm_eval_task"
TASK, CONTROL = "ds4_tiny_qa", "ds4_tiny_qa_thinking"
SERVED = "tiny"


def lm_eval_command(base: str, tasks: str, out: Path) -> list[str]:
    model_args = ",".join([
        f"base_url={base}/v1/chat/completions", f"model={SERVED}", "num_concurrent=1", "max_retries=1",
        "tokenized_requests=False",
    ])
    return [sys.executable, "-m", "lm_eval", "--model", "local-chat-completions", "--model_args", model_args,
            "--apply_chat_template", "--tasks", tasks, "--include_path", str(TASK_DIR.relative_to(REPO)),
            "--limit", "3", "--log_samples", "--output_path", str(out)]


def logged_samples(out: Path, task: str) -> list[dict]:
    """lm-eval's --log_samples file for `task` (OUT/<model>/samples_<task>_<timestamp>.jsonl)."""
    pattern = re.compile(rf"samples_{re.escape(task)}_\d.*\.jsonl")
    files = [path for path in out.rglob("samples_*.jsonl") if pattern.fullmatch(path.name)]
    assert len(files) == 1, f"{task}: expected one samples file under {out}, found {files}"
    return [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]


def responses(sample: dict) -> list:
    """The answers lm-eval recorded for one document: its raw `resps` and its `filtered_resps`."""
    return [*(answer for per_request in sample["resps"] for answer in per_request), *sample["filtered_resps"]]


def test_local_chat_completions_gets_non_empty_answers_with_thinking_off_by_default(checkpoints, tmp_path):
    out = tmp_path / "lm_eval_out"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "TOKENIZERS_PARALLELISM": "false"}
    with running_server(checkpoints["v41"], SERVED, "--max-model-len", "1024",
                        "--default-chat-template-kwargs", '{"thinking": false}') as base:
        run = subprocess.run(lm_eval_command(base, f"{TASK},{CONTROL}", out), cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=180, check=False)
    log = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, f"lm-eval exited {run.returncode}:\n{log}"
    assert "API request failed" not in log and "Could not parse generations" not in log, log

    samples = logged_samples(out, TASK)
    assert sorted(s["doc_id"] for s in samples) == [0, 1, 2]
    for sample in samples:
        answers = responses(sample)
        assert answers and all(isinstance(a, str) and a for a in answers), (
            f"doc {sample['doc_id']}: lm-eval got an empty answer with thinking off: {answers!r}\n{log}")

    # The control: thinking on for the request, so the tiny model's 16 tokens all go to reasoning and
    # lm-eval, reading only `content`, fills in an empty string.
    control = logged_samples(out, CONTROL)
    assert len(control) == 3
    assert "" in [a for sample in control for a in responses(sample)], [responses(s) for s in control]
