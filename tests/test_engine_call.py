"""The front end's engine calls: one queue per HTTP call, each request validated once, a chat body
read once whatever n is (server/engine_client.py, server/chat_completions.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from contract import EngineLimits, NewRequest, RequestOutput, RequestRejected, SamplingParams, validate_request
from server.chat import ChatFormat
from server.chat.request import ChatRequest
from server.chat_completions import build_chat_call, stream_chat_completion
from server.chat_protocol import ChatCompletionRequest
from server.engine_client import EngineClient
from server.tokenizer import TextTokenizer

LIMITS = EngineLimits(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, vocab_size=100, eos_token_ids=(1,))


class CountingEngine:
    """An engine handle that checks requests against real limits and counts what it is asked."""

    def __init__(self) -> None:
        self.validated: list[str] = []
        self.submitted: list[str] = []
        self.aborted: list[str] = []

    def validate(self, request: NewRequest) -> None:
        self.validated.append(request.request_id)
        validate_request(LIMITS, request)

    def submit(self, request: NewRequest) -> None:
        self.submitted.append(request.request_id)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def connected() -> tuple[EngineClient, CountingEngine]:
    client, engine = EngineClient(), CountingEngine()
    client.connect(engine)
    client.bind_loop(asyncio.get_running_loop())
    return client, engine


def requests(n: int) -> list[NewRequest]:
    return [NewRequest(f"r{i}", (5, 6), SamplingParams(max_tokens=4)) for i in range(n)]


def test_a_call_validates_each_request_once_and_refuses_before_sending():
    async def run():
        client, engine = connected()
        call = client.call(requests(3))
        assert engine.validated == ["r0", "r1", "r2"] and engine.submitted == []
        call.start()
        call.start()  # idempotent
        assert engine.validated == ["r0", "r1", "r2"] and engine.submitted == ["r0", "r1", "r2"]
        with pytest.raises(RequestRejected, match="outside the vocabulary"):
            client.call([NewRequest("bad", (5, 1000), SamplingParams())])
        assert "bad" not in engine.submitted
        call.close()

    asyncio.run(run())


def test_one_queue_carries_every_choice_of_a_call_in_step_order():
    async def run():
        client, engine = connected()
        call = client.call(requests(3))
        call.start()
        # two engine steps, each one frame with outputs for several requests of the call
        client.on_outputs([RequestOutput("r0", (7,)), RequestOutput("r2", (9,)), RequestOutput("r1", (8,), finished=True,
                                                                                              finish_reason="length")])
        client.on_outputs([RequestOutput("r2", (10,), finished=True, finish_reason="stop"),
                           RequestOutput("r0", (11,), finished=True, finish_reason="length")])
        seen = [(index, output.new_token_ids) async for index, output in call]
        return seen, engine.aborted

    seen, aborted = asyncio.run(run())
    assert seen == [(0, (7,)), (2, (9,)), (1, (8,)), (2, (10,)), (0, (11,))]
    assert aborted == []  # every request finished by itself


def test_leaving_a_call_early_aborts_what_still_runs_and_stop_ends_one_choice():
    async def run():
        client, engine = connected()
        call = client.call(requests(3))
        call.start()
        client.on_outputs([RequestOutput("r0", (7,)), RequestOutput("r1", (8,), finished=True, finish_reason="length")])
        outputs = aiter(call)
        assert (await anext(outputs))[0] == 0
        call.stop(0)  # a stop string in choice 0
        assert engine.aborted == ["r0"]
        assert (await anext(outputs))[0] == 1
        await outputs.aclose()  # the caller leaves: r2 still runs
        client.on_outputs([RequestOutput("r2", (9,))])  # arrives after the call ended: dropped
        return engine.aborted, call.queue.qsize()

    aborted, queued = asyncio.run(run())
    assert aborted == ["r0", "r2"] and queued == 0


def test_a_chat_body_is_read_once_whatever_n(checkpoints, monkeypatch):
    directory = checkpoints["v41"]
    config = json.loads((directory / "config.json").read_text())
    tokenizer = TextTokenizer(directory, config.get("bos_token_id", 0))
    fmt = ChatFormat.for_checkpoint(directory, config["model_type"])
    reads = []
    original = ChatRequest.from_body
    monkeypatch.setattr(ChatRequest, "from_body",
                        staticmethod(lambda body, *defaults: reads.append(1) or original(body, *defaults)))
    body = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=2,
                                 stream=True, seed=11)
    call = build_chat_call(body, fmt, tokenizer, 256, "x")
    assert [r.params.seed for r in call.requests] == [11, 12, 13]  # one params object, a seed per choice
    assert len({r.params.max_tokens for r in call.requests}) == 1

    async def run():
        client, engine = connected()
        engine_limits = EngineLimits(4, 64, 256, tokenizer.vocab_size, (1,))
        engine.validate = lambda request: validate_request(engine_limits, request)  # the real vocabulary
        frames = stream_chat_completion(call, client.call(call.requests), fmt, tokenizer, "tiny")
        first = asyncio.ensure_future(anext(frames))
        await asyncio.sleep(0.05)
        client.on_outputs([RequestOutput(r.request_id, (5,), finished=True, finish_reason="length") for r in call.requests])
        return [await first] + [frame async for frame in frames]

    frames = asyncio.run(run())
    assert frames[-1] == b"data: [DONE]\n\n" and len(frames) > 3
    assert len(reads) == 1  # rendering and the three choices' output parsers share one reading
