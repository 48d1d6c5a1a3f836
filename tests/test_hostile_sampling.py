"""Hostile sampling parameters (issue 21, item 1): a value that would make one row's probabilities NaN
is refused with a 400 naming it (vLLM's ranges), a tiny temperature runs at vLLM's floor, and a row
that still cannot be drawn fails its own request only: the other rows of the step get bitwise the
tokens they get without it, through the sampler, the runner and a real server with the openai client."""

from __future__ import annotations

import math
import threading

import httpx
import openai
import pytest
import torch

from contract import InvalidSamplingParams, SamplingParams, ScheduledChunk, StepPlan
from models import load_model
from tests.serving import running_server
from worker import ModelRunner
from worker.sampler import NOT_DRAWABLE, DrawRow, sample_rows

VOCAB = 64
GOOD = [
    DrawRow(SamplingParams(temperature=0.0), 0),
    DrawRow(SamplingParams(temperature=0.0, logit_bias=((3, 2.0),), logprobs=2), 1),
    DrawRow(SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=5), 2),
    DrawRow(SamplingParams(temperature=1.0, seed=9, repetition_penalty=1.3), 0, (1, 2, 3), (4,)),
]


def good_logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(3)) * 4


def with_bad_row(position: int, bad_logits: torch.Tensor, bad: DrawRow) -> tuple[torch.Tensor, list[DrawRow]]:
    logits = good_logits(len(GOOD))
    return torch.cat([logits[:position], bad_logits[None], logits[position:]]), [*GOOD[:position], bad, *GOOD[position:]]


NAN_ROW = torch.full((VOCAB,), 1.0).index_fill(0, torch.tensor([7]), math.nan)
INF_ROW = torch.zeros(VOCAB).index_fill(0, torch.tensor([9]), math.inf)
NO_TOKEN_ROW = torch.full((VOCAB,), -math.inf)
UNVALIDATED = {  # params that bypass validate (the engine refuses them; the sampler must still survive them)
    "temperature 1e-300": SamplingParams(temperature=1e-300),
    "repetition_penalty 1e-45": SamplingParams(temperature=0.0, repetition_penalty=1e-45),
    "repetition_penalty 0, seeded": SamplingParams(seed=1, repetition_penalty=0.0),
}


@pytest.mark.parametrize("bad_logits", [NAN_ROW, INF_ROW, NO_TOKEN_ROW], ids=["nan", "inf", "all -inf"])
@pytest.mark.parametrize("bad_params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=1),
                                        SamplingParams(seed=4), SamplingParams(top_p=0.5)],
                         ids=["plain", "greedy", "seeded", "unseeded"])
def test_a_non_finite_row_comes_back_none_and_the_others_are_bitwise_unchanged(bad_logits, bad_params):
    for position in (0, 2, len(GOOD)):
        logits, rows = with_bad_row(position, bad_logits, DrawRow(bad_params, 0))
        drawn = sample_rows(logits, rows)
        assert drawn[position] is None
        # the good rows are greedy or seeded, so their tokens are reproducible: compared with them alone
        assert drawn[:position] + drawn[position + 1:] == sample_rows(good_logits(len(GOOD)), GOOD)


def test_only_plain_rows_with_a_nan_row_take_the_one_argmax_path_and_fail_it_alone():
    plain = [DrawRow(SamplingParams(temperature=0.0), 0)] * 3
    logits = good_logits(3)
    logits[1] = NAN_ROW
    drawn = sample_rows(logits, plain)
    assert drawn[1] is None and drawn[0] is not None and drawn[2] is not None
    assert [drawn[0], drawn[2]] == sample_rows(logits[[0, 2]], plain[:2])


@pytest.mark.parametrize("name", list(UNVALIDATED))
def test_params_that_make_a_row_non_finite_fail_that_row_only(name):
    logits = good_logits(len(GOOD) + 1)
    logits[-1] = logits[-1].abs() + 1.0  # every seen token's logit positive: the penalty divides it
    rows = [*GOOD, DrawRow(UNVALIDATED[name], 0, prompt_token_ids=tuple(range(VOCAB)))]
    drawn = sample_rows(logits, rows)
    assert drawn[-1] is None
    assert drawn[:-1] == sample_rows(logits[:-1], GOOD)


@pytest.mark.parametrize("params, param", [
    (SamplingParams(temperature=1e-300), "temperature"),
    (SamplingParams(temperature=-0.5), "temperature"),
    (SamplingParams(temperature=math.inf), "temperature"),
    (SamplingParams(temperature=math.nan), "temperature"),
    (SamplingParams(top_p=0.0), "top_p"),
    (SamplingParams(top_p=1.5), "top_p"),
    (SamplingParams(top_k=-1), "top_k"),
    (SamplingParams(min_p=1.01), "min_p"),
    (SamplingParams(min_p=math.nan), "min_p"),
    (SamplingParams(presence_penalty=2.5), "presence_penalty"),
    (SamplingParams(frequency_penalty=-math.inf), "frequency_penalty"),
    (SamplingParams(repetition_penalty=1e-39), "repetition_penalty"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    (SamplingParams(repetition_penalty=1e300), "repetition_penalty"),
    (SamplingParams(logit_bias=((3, 1e30),)), "logit_bias"),
    (SamplingParams(logit_bias=((3, math.nan),)), "logit_bias"),
    (SamplingParams(logprobs=-1), "logprobs"),
    (SamplingParams(prompt_logprobs=VOCAB + 1), "prompt_logprobs"),
    (SamplingParams(max_tokens=0, min_tokens=0), "max_tokens"),
])
def test_the_engine_boundary_refuses_values_outside_vllms_ranges_naming_them(params, param):
    with pytest.raises(InvalidSamplingParams) as caught:
        params.validate(VOCAB)
    assert caught.value.param == param


def test_the_extremes_inside_the_ranges_are_accepted():
    for params in (SamplingParams(temperature=0.01, top_p=1e-300, min_p=1.0, top_k=1),
                   SamplingParams(repetition_penalty=1e-6, presence_penalty=-2.0, frequency_penalty=2.0),
                   SamplingParams(repetition_penalty=1e6, logit_bias=((0, -100.0), (1, 100.0)), logprobs=VOCAB)):
        params.validate(VOCAB)


# -- the runner: a step with one hostile chunk -------------------------------------------------------

PROMPT = (5, 9, 2, 7, 11, 3, 8)
STEP = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy-top": SamplingParams(temperature=0.0, logprobs=3),
    "seeded": SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=11, logprobs=2),
}


@pytest.fixture(scope="module")
def model(checkpoints):
    return load_model(checkpoints["v41"])


def runner(model) -> ModelRunner:
    return ModelRunner(model, num_slots=4, max_model_len=64, deterministic=True)


def chunk(run: ModelRunner, request_id: str, slot: int, params: SamplingParams) -> ScheduledChunk:
    return ScheduledChunk(request_id=request_id, slot=slot, pages=tuple(run.cache.default_pages(slot).tolist()),
                          token_ids=PROMPT, position=0, sample=True, logprob_targets=(), params=params,
                          num_generated=0, prompt_token_ids=PROMPT)


@pytest.mark.parametrize("name", list(UNVALIDATED))
def test_the_runner_fails_the_hostile_chunk_alone(model, name):
    hostile = runner(model)
    good = [chunk(hostile, rid, slot, params) for slot, (rid, params) in enumerate(STEP.items())]
    bad = chunk(hostile, "hostile", len(good), UNVALIDATED[name])
    results = hostile.execute(StepPlan((good[0], bad, *good[1:]))).chunks
    assert results[1].error == NOT_DRAWABLE and results[1].sampled is None
    assert (results[0], *results[2:]) == runner(model).execute(StepPlan(tuple(good))).chunks


# -- a real server ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(checkpoints):
    with running_server(checkpoints["v41"], "tiny", "--max-model-len", "512", "--deterministic") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


STREAM_PROMPTS = ["Hello world", "The quick brown fox", "Once upon a time"]
STREAM_TOKENS = 64


def streamed_tokens(client, prompt: str, started: threading.Event | None = None) -> list[int]:
    tokens: list[int] = []
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=STREAM_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True, "return_token_ids": True}):
        tokens += chunk.choices[0].token_ids
        if started is not None:
            started.set()
    return tokens


REFUSED = [  # (extra body fields, the param the 400 names)
    ({"repetition_penalty": 1e-39}, "repetition_penalty"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),
    ({"temperature": -1e-300}, "temperature"),
    ({"temperature": 1e300}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 1e300}, "presence_penalty"),
    ({"frequency_penalty": -1e300}, "frequency_penalty"),
    ({"logit_bias": {"5": 1e300}}, "logit_bias"),
    ({"top_k": 2**40}, "top_k"),
]
ACCEPTED = [  # the extremes inside the ranges: they run, and must not disturb anyone else
    {"temperature": 1e-300},
    {"temperature": 5e-324, "seed": 3},
    {"temperature": 0.01, "top_p": 1e-300},
    {"min_p": 1.0, "top_k": 1},
    {"temperature": 0.01, "repetition_penalty": 1e-6, "frequency_penalty": -2, "presence_penalty": -2},
    {"temperature": 0, "repetition_penalty": 1e6, "logit_bias": {"5": -100, "6": 100}},
]


def test_hostile_requests_are_refused_or_run_alone_while_streams_keep_their_greedy_tokens(server, client):
    solo = [streamed_tokens(client, prompt) for prompt in STREAM_PROMPTS]
    results: dict[int, list[int]] = {}
    started = [threading.Event() for _ in STREAM_PROMPTS]

    def stream(index: int) -> None:
        results[index] = streamed_tokens(client, STREAM_PROMPTS[index], started[index])

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(STREAM_PROMPTS))]
    for thread in threads:
        thread.start()
    assert all(event.wait(60) for event in started)
    for extra, param in REFUSED:
        for endpoint, body in (("/v1/completions", {"prompt": "x"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            response = httpx.post(server + endpoint, json={**body, "max_tokens": 4, **extra}, timeout=60)
            assert response.status_code == 400, (endpoint, extra, response.text)
            assert response.json()["error"]["param"].startswith(param), response.text
    for extra in ACCEPTED:
        response = client.completions.create(model="tiny", prompt="x", max_tokens=4,
                                             extra_body={"ignore_eos": True, **extra})
        assert response.usage.completion_tokens == 4 and response.choices[0].finish_reason == "length", extra
    for thread in threads:
        thread.join(120)
    assert [results[i] for i in range(len(STREAM_PROMPTS))] == solo
    assert httpx.get(server + "/health").status_code == 200


def test_a_tiny_temperature_runs_at_vllms_floor(client):
    """vLLM raises 0 < temperature < 0.01 to 0.01: a seeded draw at 1e-300 is the draw at 0.01."""
    def seeded(temperature: float) -> list[int]:
        return client.completions.create(
            model="tiny", prompt="Hello", max_tokens=8, temperature=temperature, seed=5,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        ).choices[0].token_ids
    assert seeded(1e-300) == seeded(0.001) == seeded(0.01)
