"""Issue 22 item 4: streamed output is framed per step, not per token, and off the engine thread.

The engine thread hands each step's outputs over in one call (one RequestOutput per request, with every
token the step made; it never detokenizes). On the event loop a stream detokenizes and frames per
hand-over: one SSE frame per choice for all it read since it last sent, which is one engine step while
the stream keeps up and several steps merged when it fell behind (so it frames less often instead of
falling further behind). Checked on the output path with a fake engine (bursts merge, a stop string
inside a burst still cuts, usage counts what was sent) and end to end through HTTP with the official
`openai` client over the scripted engine, whose steps carry three tokens each.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from contract import NewRequest, RequestOutput, SamplingParams
from server.completions import stream_completion
from server.engine_client import EngineClient
from server.protocol import CompletionRequest
from server.tokenizer import TextTokenizer
from tests.serving import CharTokenizer, FakeEngine, free_port

REPO = Path(__file__).resolve().parent.parent


def out(text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", tuple(map(ord, text)), finished=finished, finish_reason="length" if finished else None,
                         num_prompt_tokens=1)


def stream(hand_overs: list[list[RequestOutput]], **body: object) -> tuple[list[dict], list[str]]:
    """A one-choice completions stream fed `hand_overs`: each inner list is several engine steps handed
    over before the stream reads again (one `on_outputs` per step, as the receiver thread makes them).
    Returns the JSON frames (before [DONE]) and the aborted request ids."""
    async def run() -> tuple[list[bytes], list[str]]:
        client, engine = EngineClient(), FakeEngine()
        client.connect(engine)
        client.bind_loop(asyncio.get_running_loop())
        request = CompletionRequest(prompt=[5], max_tokens=64, stream=True, return_token_ids=True,
                                    stream_options={"include_usage": True, "continuous_usage_stats": True}, **body)
        frames = stream_completion(request, "cmpl-r", client.call([NewRequest("r", (5,), SamplingParams())]),
                                   CharTokenizer(), "tiny")
        seen: list[bytes] = []
        pending = asyncio.ensure_future(anext(frames))
        await asyncio.sleep(0.02)  # the stream submitted its request and waits for outputs
        for steps in hand_overs:
            for step in steps:
                client.on_outputs([step])
            seen.append(await pending)
            pending = asyncio.ensure_future(anext(frames))
        seen.append(await pending)
        seen += [frame async for frame in frames]
        return seen, engine.aborted

    frames, aborted = asyncio.run(run())
    assert frames[-1] == b"data: [DONE]\n\n"
    return [orjson.loads(f.removeprefix(b"data: ")) for f in frames[:-1]], aborted


def test_a_stream_that_keeps_up_sends_one_frame_per_step_with_all_its_tokens():
    frames, _ = stream([[out("ab")], [out("c")], [out("de", finished=True)]])
    chunks = [f["choices"][0] for f in frames if f["choices"]]
    assert [c["text"] for c in chunks] == ["ab", "c", "de"]
    assert [c["token_ids"] for c in chunks] == [[97, 98], [99], [100, 101]]
    assert [f["usage"]["completion_tokens"] for f in frames if f["choices"]] == [2, 3, 5]
    assert chunks[-1]["finish_reason"] == "length" and frames[-1]["usage"]["completion_tokens"] == 5


def test_steps_that_arrive_together_go_out_as_one_frame():
    """Three steps handed over while the stream was busy: one frame with their five tokens, then one
    frame for the last two steps, the finished one's reason on it."""
    frames, _ = stream([[out("a")], [out("bc"), out("d"), out("ef")], [out("g"), out("h", finished=True)]])
    chunks = [f["choices"][0] for f in frames if f["choices"]]
    assert [c["text"] for c in chunks] == ["a", "bcdef", "gh"]
    assert [c["token_ids"] for c in chunks] == [[97], [98, 99, 100, 101, 102], [103, 104]]
    assert [c.get("finish_reason") for c in chunks] == [None, None, "length"]
    assert [f["usage"]["completion_tokens"] for f in frames if f["choices"]] == [1, 6, 8]


def test_a_stop_string_inside_merged_steps_cuts_there_and_drops_what_came_after():
    frames, aborted = stream([[out("x")], [out("yS"), out("T"), out("zz"), out("w", finished=True)]], stop=["ST"])
    chunks = [f["choices"][0] for f in frames if f["choices"]]
    assert "".join(c["text"] for c in chunks) == "xy"
    assert chunks[-1]["finish_reason"] == "stop" and chunks[-1]["token_ids"] == [121, 83, 84]  # y S T
    assert frames[-1]["usage"]["completion_tokens"] == 4  # x y S T: the steps after the stop are not counted
    assert aborted == ["r"]


def test_an_error_after_merged_steps_still_sends_their_text_first():
    failed = RequestOutput("r", finished=True, finish_reason="error", error="step failed")
    frames, _ = stream([[out("a")], [out("b"), out("c"), failed]])
    assert [f["choices"][0]["text"] for f in frames if f.get("choices")] == ["a", "bc"]
    assert frames[-1]["error"]["message"] == "step failed"


# --- end to end: the official client over HTTP, the scripted engine's three-token steps ---------------

TOKENS_PER_STEP = 3
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def scripted(checkpoints):
    """bench.scripted_engine on the tiny checkpoint's tokenizer: the real app, routes and SSE, over an
    engine thread that makes a step of three tokens per request every 20 ms."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.scripted_engine", "--model", str(checkpoints["v41"]), "--port", str(port),
         "--step-ms", "20", "--tokens-per-step", str(TOKENS_PER_STEP), "--served-model-name", "tiny"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                pytest.fail(f"bench.scripted_engine exited: {process.stderr.read().decode(errors='replace')}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("bench.scripted_engine did not become healthy")
            time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=30)


def completion_chunks(base: str) -> list:
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    return list(client.completions.create(model="tiny", prompt="Hello", max_tokens=MAX_TOKENS, stream=True,
                                          stream_options={"include_usage": True},
                                          extra_body={"return_token_ids": True}))


def test_openai_stream_chunks_carry_whole_steps(scripted, checkpoints):
    """Eight streams at once: every chunk carries whole steps (a multiple of three tokens, never one
    token per frame), at most one chunk per step, and the text is exactly the decode of the tokens."""
    tokenizer = TextTokenizer(checkpoints["v41"], bos_token_id=0)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        streams = list(pool.map(completion_chunks, [scripted] * 8))
    for chunks in streams:
        with_choices = [c for c in chunks if c.choices]
        ids = [c.choices[0].token_ids for c in with_choices]
        assert all(len(step) % TOKENS_PER_STEP == 0 and step for step in ids), ids
        assert len(with_choices) <= MAX_TOKENS // TOKENS_PER_STEP
        tokens = [t for step in ids for t in step]
        assert len(tokens) == MAX_TOKENS == chunks[-1].usage.completion_tokens
        assert "".join(c.choices[0].text for c in with_choices) == tokenizer.decode(tokens)
        assert with_choices[-1].choices[0].finish_reason == "length"


def test_openai_chat_stream_frames_per_step(scripted):
    client = openai.OpenAI(base_url=scripted + "/v1", api_key="none", max_retries=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=MAX_TOKENS, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    # a role chunk, then at most one chunk per step (the parser may hold text back, never split a step)
    assert len([c for c in chunks if c.choices]) <= 1 + MAX_TOKENS // TOKENS_PER_STEP
