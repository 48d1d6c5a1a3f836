"""The DSpark proposer's fixed-shape draft steps (worker/dspark_graphs.py, what CUDA graphs capture) against
its eager path (worker/dspark.py, itself checked against a plain statement of DeepSpec's DSpark in
tests/test_dspark.py), on CPU: tests/test_mtp_draft_steps.py's script of steps (every count of standing
rows, prompt chunks beside decode chunks, chunks drafting nothing next, a padded bucket) fed to both with
random taps: the same drafts (and confidence cuts), and every request slot's context rings the same; V4.1's
draft and V4-Flash-0731's on V4."""

from __future__ import annotations

import pytest
import torch

from models import load_model
from models.dspark import attach_dspark, build_tiny_dspark
from models.tiny import build_tiny_checkpoint
from tests.test_mtp_draft_steps import SLOTS, check_greedy_with_static_steps, steps_script
from tests.test_proposers import K
from worker.dspark import DSparkProposer


@pytest.fixture(scope="module", params=["v41", "v4"])
def model(request, tmp_path_factory):
    """The tiny V4.1 with a random DSpark draft attached, and the tiny V4 with a V4-Flash-0731-shaped one
    (its taps the streams leaving the tap layers)."""
    root = tmp_path_factory.mktemp("dspark-steps")
    target = build_tiny_checkpoint(root / request.param, seed=3, family=request.param)
    model = load_model(target)
    attach_dspark(model, build_tiny_dspark(root / "draft", target, seed=4, dspark_markov_rank=128))
    return model


@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_static_draft_steps_propose_the_eager_paths_drafts(model, threshold):
    eager = DSparkProposer(model, num_slots=SLOTS, k=K, confidence_threshold=threshold)
    static = DSparkProposer(model, num_slots=SLOTS, k=K, confidence_threshold=threshold)
    steps = static.use_static_steps()
    script, _ = steps_script(seed=1, config=model.config, taps=len(eager.tap_layers))
    proposed = 0
    for step, chunks in enumerate(script):
        want, got = eager.propose(chunks), static.propose(chunks)
        assert got == want, f"step {step}"
        proposed += len(got)
    assert len(steps.runs) >= 10 and 3 in steps.runs  # most steps static, one bucket padded
    assert threshold or proposed >= 20
    torch.testing.assert_close(static.rings[:, :SLOTS], eager.rings[:, :SLOTS], rtol=1e-4, atol=1e-5)


def test_greedy_with_static_dspark_steps_is_plain_greedy(model):
    """Through a runner (deterministic): plain greedy's tokens and logprobs, the same drafts as eagerly."""
    check_greedy_with_static_steps(model, lambda: DSparkProposer(model, num_slots=2, k=K), 16)
