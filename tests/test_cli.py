"""`python -m server` from vLLM's launch lines: the real server started as `vllm serve` users start it
and talked to with the official openai client, refusals (exit 2, naming the flag), --help, --version,
and the pieces behind them (flag spellings, format names, default chat kwargs, progress)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from contract import progress
from contract.config import FLAG_KEYS, ChatSection, ConfigFileError
from contract.progress import GiB, Progress
from models.loader import TensorSource
from server.app import VERSION
from server.chat.request import ChatRequest
from server.chat_options import check_format_names, template_source
from server.cli import build_parser, context_length, normalize, parse_args
from tests.serving import REPO, free_port

HI = [{"role": "user", "content": "Hello, how are you?"}]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)


@contextmanager
def launched(*args: str) -> Iterator[tuple[str, list[str]]]:
    """`python -m server ARGS --port P` once /health answers; yields its URL and its output so far."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "server", *args, "--port", str(port)], cwd=REPO,
                               env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()
    base, deadline = f"http://127.0.0.1:{port}", time.time() + 120
    try:
        while not any("ready at" in line for line in lines):  # the summary comes once it listens
            if process.poll() is not None or time.time() > deadline:
                pytest.fail(f"server did not start: {''.join(lines)}")
            time.sleep(0.3)
        assert httpx.get(base + "/health").status_code == 200
        yield base, lines
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def vllm_server(checkpoints):
    """The launch line of a vLLM user, on the tiny V4.1 checkpoint."""
    with launched(
        "serve", str(checkpoints["v41"]), "--served-model-name", "a", "b", "--enable-auto-tool-choice",
        "--tool-call-parser", "deepseek_v41", "--reasoning-parser", "deepseek_v41", "--tokenizer-mode", "deepseek_v41",
        "--default-chat-template-kwargs", '{"thinking": false}', "--uvicorn-log-level", "warning",
        "--disable-log-requests", "--trust-remote-code", "--max_model_len", "1k", "--enable-chunked-prefill",
        "--compilation-config", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}', "--attention_config.use_fp4_indexer_cache=True",
    ) as (base, lines):
        yield base, lines


@pytest.fixture(scope="module")
def client(vllm_server):
    return openai.OpenAI(base_url=vllm_server[0] + "/v1", api_key="unused", max_retries=0)


def test_every_served_name_is_listed_and_accepted_the_first_reported(client):
    assert [m.id for m in client.models.list().data] == ["a", "b"]
    response = client.chat.completions.create(model="b", messages=HI, max_tokens=4, temperature=0)
    assert response.model == "a" and response.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="c", messages=HI, max_tokens=1)


def test_default_chat_template_kwargs_turn_thinking_off_unless_the_request_asks(vllm_server, client):
    base, _ = vllm_server

    def prompt(**extra) -> list[int]:
        return httpx.post(base + "/tokenize", json={"messages": HI, **extra}).json()["tokens"]

    off, on = {"chat_template_kwargs": {"thinking": False}}, {"chat_template_kwargs": {"thinking": True}}
    assert prompt() == prompt(**off) != prompt(**on)  # the server default lies under the request's own keys
    message = client.chat.completions.create(model="a", messages=HI, max_tokens=8, temperature=0).choices[0].message
    assert getattr(message, "reasoning_content", None) is None and getattr(message, "reasoning", None) is None


def test_startup_summary_names_url_model_limits_key_and_routes(vllm_server):
    base, lines = vllm_server
    summary = "".join(lines)
    assert f"ready at {base}" in summary and "model 'a' (also accepted: b)" in summary
    assert "max_model_len 1000, max_num_seqs 8" in summary and "device cpu, dtype float32" in summary
    assert "API key not required" in summary
    for route in ("GET /v1/models", "POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
                  "POST /detokenize", "GET /metrics", "GET /health"):
        assert route in summary
    assert "no counterpart here: --compilation-config, --attention-config" in summary


def test_positional_model_without_serve_logs_requests_renders_the_chat_template_and_needs_a_key(checkpoints, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-secret-1\n")
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
    with launched(str(checkpoints["v41"]), "--enable-log-requests", "--api-key-file", str(keys),
                  "--chat-template", template, "--log-level", "info") as (base, lines):
        llm = openai.OpenAI(base_url=base + "/v1", api_key="sk-secret-1", max_retries=0)
        assert llm.completions.create(model="ds4-tiny", prompt="Hi", max_tokens=2).choices  # the YAML's name

        def tokens(**body) -> list[int]:
            return httpx.post(base + "/tokenize", json=body, headers={"Authorization": "Bearer sk-secret-1"}).json()["tokens"]

        assert tokens(messages=HI) == tokens(prompt="[user] Hello, how are you?")  # BOS from the template
        deadline = time.time() + 10
        while not any("prompt tokens" in line for line in lines) and time.time() < deadline:
            time.sleep(0.1)
    output = "".join(lines)
    assert "API key required" in output and "sk-secret-1" not in output
    assert "request cmpl-" in output and "prompt tokens, SamplingParams(" in output


@pytest.mark.parametrize("args, named", [
    # (mtp on a checkpoint without an MTP layer: tests/test_spec_engine.py; the default has one)
    (("--speculative-config", '{"method": "dspark", "num_speculative_tokens": 2}'), "--speculative-config"),
    (("--data-parallel-size", "4"), "--data-parallel-size"),
    (("--pipeline-parallel-size", "2"), "--pipeline-parallel-size"),
    (("--tool-call-parser", "hermes"), "--tool-call-parser"),
    (("--reasoning-parser", "qwen3"), "--reasoning-parser"),
    (("--default-chat-template-kwargs", "{thinking: false}"), "--default-chat-template-kwargs"),
    (("--default-chat-template-kwargs", "[1]"), "--default-chat-template-kwargs"),
    (("--chat-template", "no/such/template.jinja"), "--chat-template"),
    (("--kv-cache-dtype", "fp8_e5m2"), "--kv-cache-dtype"),
    (("--kv-transfer-config", '{"kv_connector": "NixlConnector"}'), "--kv-transfer-config"),
])
def test_refused_before_anything_starts_with_exit_2_naming_the_flag(args, named):
    result = run_cli("serve", *args)
    assert result.returncode == 2 and named in result.stderr, result.stderr


def test_vllms_fp8_kv_cache_names_are_one_config_value():
    from contract.config import load_config

    for name in ("fp8", "fp8_ds_mla", "fp8_e4m3"):
        args = parse_args(["serve", "m", "--kv-cache-dtype", name])
        config = load_config(None, [], {flag: getattr(args, flag) for flag in FLAG_KEYS})
        assert args.kv_cache_dtype == config.memory.kv_cache_dtype == "fp8"
    assert parse_args(["--kv-cache-dtype", "fp4"]).kv_cache_dtype == "fp4"


def test_the_v4_flash_recipe_launch_line_serves_with_an_fp8_cache(checkpoints):
    """vLLM's DeepSeek-V4-Flash recipe line (TP 1) on the tiny V4 checkpoint: fp8_ds_mla is the fp8
    cache (e4m3 entries, RoPE channels bf16), which the startup log says; a chat completion through the
    openai client answers, with the greedy tokens of the plain cache's server (the tiny model's first
    tokens; the logits differ slightly, tests/test_packed_kv.py measures how far)."""
    recipe = ("serve", str(checkpoints["mixed"]), "--enable-expert-parallel", "--trust-remote-code",
              "--tokenizer-mode", "deepseek_v4", "--tensor-parallel-size", "1", "--max-model-len", "1k", "--log-level", "info")
    replies = {}
    for kind in ("fp8_ds_mla", "auto"):
        with launched(*recipe, "--kv-cache-dtype", kind) as (base, lines):
            llm = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
            response = llm.chat.completions.create(model=llm.models.list().data[0].id, messages=HI, max_tokens=6,
                                                   temperature=0, logprobs=True)
            replies[kind] = [t.token for t in response.choices[0].logprobs.content]
            message = response.choices[0].message
            assert (message.content or getattr(message, "reasoning_content", None)) and len(replies[kind]) == 6
            if kind != "auto":
                assert any("kv_cache_dtype fp8: compressed KV entries and index keys as float8_e4m3fn" in line
                           for line in lines), "".join(lines)
    assert replies["fp8_ds_mla"][:3] == replies["auto"][:3]


def test_speculative_config_empty_or_null_asks_for_nothing():
    assert not parse_args(["--speculative-config", "null"]).speculative_config
    assert parse_args(["--speculative-config", "{}"]).speculative_config == {}


def test_max_model_len_past_the_position_limit_cannot_start(checkpoints):
    result = run_cli(str(checkpoints["v41"]), "--max-model-len", "8192")
    assert result.returncode == 2, result.stderr
    assert "cannot start" in result.stderr and "--max-model-len" in result.stderr and "4096" in result.stderr


def test_another_formats_parser_cannot_start_and_the_choices_are_listed(checkpoints):
    result = run_cli(str(checkpoints["v41"]), "--tool-call-parser", "deepseek_v4")
    assert result.returncode == 2 and "--tool-call-parser" in result.stderr and "deepseek_v41" in result.stderr


def test_help_lists_every_flag_its_default_and_the_subcommands():
    result = run_cli("--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    flags = ["--" + flag.replace("_", "-") for flag in FLAG_KEYS] + [
        "--config", "--set", "--api-key", "--log-level", "--uvicorn-log-level", "--disable-log-requests",
        "--enable-auto-tool-choice", "--trust-remote-code", "--version", "--disable-uvicorn-access-log"]
    assert [flag for flag in flags if flag not in text] == []
    for key in FLAG_KEYS.values():
        assert f"[{key}; default:" in text, key
    assert "{deepseek_v3,deepseek_v31,deepseek_v32,deepseek_v4,deepseek_v41}" in text
    assert "serve" in text and "plan" in text
    assert run_cli("plan", "--help").returncode == 0


def test_version_prints_the_apps_version():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"ds4serve {VERSION}"


def test_vllm_spellings_become_this_parsers():
    parser = build_parser()
    assert normalize(["--max_model_len", "8", "--set", "a_b=1", "--default-chat-template-kwargs.thinking", "false",
                      "--default_chat_template_kwargs.x.y=2"], parser) == [
        "--max-model-len", "8", "--set", "a_b=1", "--default-chat-template-kwargs", '{"thinking": false}',
        "--default-chat-template-kwargs", '{"x": {"y": 2}}']
    args = parse_args(["serve", "m", "--default-chat-template-kwargs", '{"thinking": true, "x": {"z": 1}}',
                       "--default-chat-template-kwargs.x.y", "2", "--served-model-name", "a", "b"])
    assert args.model == "m" and args.served_model_name == ["a", "b"]
    assert args.default_chat_template_kwargs == {"thinking": True, "x": {"z": 1, "y": 2}}
    assert [context_length(v) for v in ("4096", "32k", "32K", "1M", "auto")] == [4096, 32000, 32768, 2**20, "auto"]
    with pytest.raises(SystemExit):
        parse_args(["m", "--model", "other"])


def test_format_names_fit_the_models_own_format_only():
    check_format_names(ChatSection(tool_call_parser="deepseek_v4", reasoning_parser="deepseek_r1",
                                   tokenizer_mode="deepseek_v4"), "deepseek_v4")
    check_format_names(ChatSection(tool_call_parser="deepseek_v41", reasoning_parser="deepseek_v41"), "deepseek_v41_text")
    for chat, model_type in ((ChatSection(tool_call_parser="deepseek_v32"), "deepseek_v4"),
                             (ChatSection(reasoning_parser="deepseek_v4"), "deepseek_v41"),
                             (ChatSection(tokenizer_mode="deepseek_v41"), "deepseek_v4")):
        with pytest.raises(ConfigFileError, match="choose from"):
            check_format_names(chat, model_type)


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert template_source(str(path)) == "{{ messages[0].content }}"
    assert template_source("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    with pytest.raises(ConfigFileError, match="--chat-template"):
        template_source("missing.jinja")


def test_a_requests_own_kwargs_and_effort_win_over_the_server_defaults():
    def kwargs(defaults: dict, **body) -> dict:
        return dict(ChatRequest.from_body({"messages": HI, **body}, defaults).template_kwargs)

    assert kwargs({"thinking": False, "x": 1})["thinking"] is False
    assert kwargs({"thinking": False, "x": 1}, chat_template_kwargs={"thinking": True, "y": 2}).items() >= {
        "thinking": True, "x": 1, "y": 2}.items()
    # thinking and enable_thinking are one knob: the request's spelling replaces the default's
    assert "enable_thinking" not in kwargs({"enable_thinking": True}, chat_template_kwargs={"thinking": False})
    assert "thinking" not in kwargs({"thinking": True}, reasoning_effort="none")
    assert kwargs({"thinking": False}, reasoning_effort="high")["enable_thinking"] is True


def test_progress_is_a_log_line_where_a_bar_would_be_noise(caplog, capsys, monkeypatch):
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)  # a line at every update, not every 30 s
    with caplog.at_level(logging.INFO), Progress("loading x", 4 * GiB, logging.getLogger("ds4serve.test")) as shown:
        shown.update(GiB)
    assert "loading x: 1.0 of 4.0 GiB (25%)" in caplog.text and "left" in caplog.text
    assert capsys.readouterr().err == ""  # stderr is no terminal here: no bar drawn


def test_the_weight_bars_total_is_what_reading_every_tensor_reads(checkpoints):
    source = TensorSource(checkpoints["mixed"])
    total = source.stored_bytes()
    for name in source.names():
        source.get(name)
    assert source.bytes_read == total > 0
