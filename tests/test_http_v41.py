"""The golden V4.1 checkpoint served over HTTP (`--model`): greedy token ids equal the reference's and
echoed prompt logprobs are the golden logits' (median deviation <= 1e-3, 95th percentile <= 1e-2);
also with its compressed KV packed to FP4 in the host tier behind a one-page (16-token) GPU ring."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from safetensors.torch import load_file

from tests.serving import running_server
from tests.test_v41_golden import GOLDEN, SEQUENCES

pytestmark = pytest.mark.skipif(not GOLDEN.exists(), reason=f"golden data folder {GOLDEN} is absent")


HOST_TIER = ("--kv-offload", "host_packed", "--kv-hot-tokens", "16", "--block-size", "16")


@pytest.fixture(scope="module", params=["plain", "host-tier"])
def client(request):
    extra = HOST_TIER if request.param == "host-tier" else ()
    with running_server(GOLDEN, "golden-v41", "--max-model-len", "256", *extra) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def golden():
    return json.loads((GOLDEN / "golden_inputs_and_generation.json").read_text()), load_file(GOLDEN / "golden_outputs.safetensors")


@pytest.mark.parametrize("name", SEQUENCES)
def test_served_greedy_tokens_and_prompt_logprobs(client, golden, name):
    inputs, outputs = golden
    sequence = inputs["sequences"][name]
    prompt = sequence["input_ids"]
    response = client.completions.create(
        model="golden-v41", prompt=prompt, max_tokens=len(sequence["greedy_new_tokens"]), temperature=0,
        echo=True, logprobs=1, extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = response.choices[0]
    assert choice.token_ids == sequence["greedy_new_tokens"]
    served = torch.tensor(choice.logprobs.token_logprobs[1 : len(prompt)])
    expected = outputs[f"{name}_logits"][:-1].log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None]).flatten()
    deviation = (served - expected).abs()
    assert deviation.median() <= 1e-3 and deviation.quantile(0.95) <= 1e-2, deviation
