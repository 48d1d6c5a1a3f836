"""models.layers.rope_step: within one model call the layers of a rope kind share its cos / sin
(computed once per positions tensor), with bitwise the logits of computing them layer by layer."""

from __future__ import annotations

import contextlib

import pytest
import torch

from models import DecodeBatch, ForwardBatch, ModelCache, ModelConfig
from models.config import RopeSpec
from models.layers import RotaryTable, rope_step
from models.model_v41 import DeepseekV41
from models.random_model import build_random_model
from models.tiny import tiny_config_dict
from tests.conftest import random_tokens


def test_tables_of_one_spec_share_inside_a_step_and_never_outside():
    spec = RopeSpec(theta=10000.0, dim=16)
    first, second, other = RotaryTable(spec), RotaryTable(spec), RotaryTable(RopeSpec(theta=500.0, dim=16))
    positions, later = torch.tensor([0, 5, 9]), torch.tensor([1, 6, 10])
    want = first._compute(positions, 1)
    with rope_step():
        cos, sin = first(positions)
        assert second(positions)[0] is cos and second(positions)[1] is sin  # one computation for the spec
        assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])
        assert other(positions)[0] is not cos and not torch.equal(other(positions)[0], cos)  # another spec
        assert not torch.equal(first(later)[0], cos)  # other positions: their own tables
        with rope_step():  # a nested call starts empty
            assert first(positions)[0] is not cos
    assert first(positions)[0] is not first(positions)[0]  # outside a step: computed every call


def test_a_step_does_not_reuse_a_freed_positions_tensors_id():
    """The entry keeps its positions tensor alive, so a later tensor cannot take its id and its tables."""
    table = RotaryTable(RopeSpec(theta=10000.0, dim=8))
    with rope_step():
        seen = [table(torch.tensor([step]))[0] for step in range(50)]  # each temporary freed after its call
    assert all(torch.equal(cos, table._compute(torch.tensor([step]), 1)[0]) for step, cos in enumerate(seen))


def test_a_rate_rounds_positions_down_and_keys_its_own_table():
    """A compressed entry's table: its positions rounded down to the rate, shared by the layers of that
    rate, apart from the plain positions' table."""
    table = RotaryTable(RopeSpec(theta=160000.0, dim=8))
    positions = torch.tensor([0, 3, 4, 130, 131])
    with rope_step():
        plain, rounded = table(positions), table(positions, 4)
        assert table(positions, 4)[0] is rounded[0] and plain[0] is not rounded[0]
        assert table(positions, 128)[0] is not rounded[0]
    want = table._compute(torch.tensor([0, 0, 4, 128, 128]), 1)
    assert torch.equal(rounded[0], want[0]) and torch.equal(rounded[1], want[1])


def counted_steps(model, monkeypatch, share: bool) -> tuple[list[torch.Tensor], int]:
    """Logits of a prefill and 6 decode steps (4 sequences), and the cos / sin computations they ran."""
    calls = []
    compute = RotaryTable._compute
    monkeypatch.setattr(RotaryTable, "_compute", lambda self, positions, rate: calls.append(1) or compute(self, positions, rate))
    if not share:
        for module in ("models.model", "models.model_v41"):
            monkeypatch.setattr(f"{module}.rope_step", contextlib.nullcontext)
    pages = {slot: [4 * slot + i for i in range(4)] for slot in range(4)}
    cache = ModelCache.allocate(model.config, 4, 64, num_pages=16, block_tokens=16)
    prompts = [random_tokens(n, seed=slot) for slot, n in enumerate([3, 9, 20, 33])]
    out = [model(ForwardBatch.build([(s, p, 0, pages[s]) for s, p in enumerate(prompts)]), cache)]
    positions = [len(p) for p in prompts]
    for step in range(6):
        tokens = random_tokens(4, seed=50 + step)
        rows = [(s, tokens[s], positions[s], pages[s]) for s in range(4)]
        extra = (model.engram_rows(list(range(4)), tokens, positions, cache),) if isinstance(model, DeepseekV41) else ()
        out.append(model.decode(DecodeBatch.build(rows, width=4), cache, *extra))
        positions = [p + 1 for p in positions]
    monkeypatch.undo()
    return out, len(calls)


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_shared_tables_give_bitwise_the_logits_of_per_layer_ones(family, checkpoints, monkeypatch):
    """V4 (random tiny) and V4.1 (the tiny checkpoint): the same logits bit for bit, fewer
    computations (the tiny V4 has both rope kinds over its layers)."""
    if family == "v4":
        model = build_random_model(ModelConfig.from_dict(tiny_config_dict()), torch.float32, "cpu", 0)
    else:
        from models import load_model

        model = load_model(checkpoints["v41"], simulate_quantization=False)
    shared, shared_calls = counted_steps(model, monkeypatch, share=True)
    alone, alone_calls = counted_steps(model, monkeypatch, share=False)
    assert all(torch.equal(a, b) for a, b in zip(shared, alone))
    assert 0 < shared_calls < alone_calls, (shared_calls, alone_calls)
