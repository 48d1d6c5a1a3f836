"""kernels/moe_mxfp4_fp8.py: MXFP4 experts with FP8 activations (prefill, opt-in) against their torch
reference, which is checked in turn against exact arithmetic (the e4m3 table, the weights' exactness
within 8 binades) and against the bf16 experts (the same function up to the activations' rounding). On
CPU the kernels run in Triton's interpreter with the table upcast; tests/test_gpu.py runs them
compiled, with the PTX upcast too."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.moe import experts_reference
from kernels.moe_mxfp4 import Tile
from kernels.moe_mxfp4_fp8 import (
    FP8_BLOCKS,
    LUT_SHIFTS,
    STEP,
    SortedPairs,
    e4m3_lut,
    experts_fp8_reference,
    experts_sorted_fp8,
    fp8_down,
    fp8_down_reference,
    fp8_hidden,
    fp8_hidden_reference,
    fp8_weight_reference,
)
from kernels.quant import E2M1_VALUES, MXFP4Experts, quantize_mxfp4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_BLOCKS = {"gate_up": (16, 32, STEP, 4), "down": (16, 32, STEP, 4)}


def spread_scales(w: MXFP4Experts, generator: torch.Generator, low: int) -> MXFP4Experts:
    """A copy where one scale group in four lies a random 0..`low` binades below its K step's largest
    exponent: released checkpoints' groups of a step lie close together, these exercise the e4m3
    rounding below 8 binades too (`low` <= 8: every group stays within 8 of its step's top)."""
    exponents = w.scales.int()
    held, rows, groups = exponents.shape
    top = exponents.view(held, rows, groups * 32 // STEP, STEP // 32).amax(-1).repeat_interleave(STEP // 32, dim=-1)
    lowered = torch.randint(0, low + 1, exponents.shape, generator=generator, device=exponents.device)
    picked = torch.rand(exponents.shape, generator=generator, device=exponents.device) < 0.25
    scales = torch.where(picked, (top - lowered).clamp(min=1), exponents)
    return MXFP4Experts(w.codes, scales.to(torch.uint8))


def random_experts(generator: torch.Generator, dim: int, inter: int, low: int, device: str = DEVICE
                   ) -> tuple[MXFP4Experts, MXFP4Experts]:
    gate_up = MXFP4Experts(*quantize_mxfp4(torch.randn(4, 2 * inter, dim, generator=generator, device=device) / dim**0.5))
    down = MXFP4Experts(*quantize_mxfp4(torch.randn(4, dim, inter, generator=generator, device=device) / inter**0.5))
    return spread_scales(gate_up, generator, low), spread_scales(down, generator, low)


def check_experts_fp8(tokens: int, seed: int, device: str = DEVICE, dim: int = 256, inter: int = 128,
                      blocks: dict | None = SMALL_BLOCKS, upcasts: tuple[str, ...] = ("lut",),
                      mma_layout: bool = False, low: int = 12) -> None:
    """The sorted FP8 kernels against their references; this rank holds experts [2, 6) of 8 and the
    tokens choose among [1, 5) (expert 1 is another rank's). Each stage on its own: gate_up's hidden rows
    within bf16's rounding of the reference's, down on those very rows within the sums' rounding (exact
    products; Hopper's FP8 MMA keeps ~13 mantissa bits within a K step, float32 across steps) (one hidden value rounded the other way in bf16 can move its whole 1 x 128 group's e4m3 scale, so
    the whole is compared stage by stage), and the whole their composition."""
    from kernels.mma_layout import from_released, in_code_order
    from kernels.moe_pairs import sum_pairs_reference

    generator = torch.Generator(device).manual_seed(seed)
    x = torch.randn(tokens, dim, generator=generator, device=device).bfloat16()
    experts = torch.randint(1, 5, (tokens, 3), generator=generator, device=device)
    weights = torch.rand(tokens, 3, generator=generator, device=device)
    gate_up, down = random_experts(generator, dim, inter, low, device)
    held = (from_released(gate_up.codes, gate_up.scales), from_released(down.codes, down.scales)) if mma_layout \
        else (gate_up, down)
    tiles = Tile(*blocks["gate_up"]), Tile(*blocks["down"])
    pairs = SortedPairs.build(experts, weights, 2, 4, tiles[0].block_m)
    mine = pairs.expert_of >= 0
    for before_down in (False, True):
        want_hidden = fp8_hidden_reference(x, pairs.expert_of, pairs.weight, 3, gate_up, 1.5, before_down)
        for upcast in upcasts:
            hidden = fp8_hidden(x, pairs, held[0], 1.5, before_down, tiles[0], upcast)
            natural = in_code_order(hidden) if mma_layout else hidden  # CODE_ORDER is its own inverse
            torch.testing.assert_close(natural[mine], want_hidden[mine], rtol=1e-2, atol=1e-2)
            out = fp8_down(hidden, pairs, held[1], tiles[1], upcast)
            want_out = fp8_down_reference(natural, pairs.expert_of, down)
            torch.testing.assert_close(out[:, mine], want_out[:, mine], rtol=1e-3,
                                       atol=1e-3 * float(want_out.abs().max()))
            whole = experts_sorted_fp8(x, weights, experts, *held, 2, 1.5, before_down, blocks=blocks, upcast=upcast)
            composed = sum_pairs_reference(out, pairs.expert_of, pairs.weight, 3, before_down)
            assert torch.allclose(whole, composed, rtol=1e-6, atol=1e-6)


def test_the_e4m3_table_is_exact_to_8_binades_and_rounds_to_nearest_even_below():
    table = e4m3_lut().view(torch.float8_e4m3fn).float()
    shifts = torch.arange(LUT_SHIFTS, dtype=torch.float32)[:, None]
    exact = E2M1_VALUES[None, :] * torch.exp2(-shifts)
    assert torch.equal(table[:9], exact[:9])  # e4m3's subnormals reach 2 ** -9: 0.5 x 2 ** -8
    assert table[9, 1] == 0 and table[9, 3] == 2.0**-8  # 0.5 x 2 ** -9 ties to 0; 1.5 x 2 ** -9 to 2 ** -8
    assert not table[LUT_SHIFTS - 1].abs().any()  # from 13 binades down every code is 0
    assert torch.equal(table[:, 8:], -table[:, :8])  # the sign bit is the code's


def test_fp8_weights_are_the_checkpoints_where_a_steps_scales_lie_within_8_binades():
    generator = torch.Generator().manual_seed(0)
    close, _ = random_experts(generator, 256, 128, low=8, device="cpu")
    assert torch.equal(fp8_weight_reference(close, 1), close.expert(1, torch.float32))
    far, _ = random_experts(generator, 256, 128, low=14, device="cpu")
    exact, rounded = far.expert(1, torch.float32), fp8_weight_reference(far, 1)
    assert not torch.equal(rounded, exact)
    # what rounds lies more than 8 binades under its step's largest scale, so it is tiny beside the step's values
    step_top = exact.abs().view(exact.shape[0], -1, STEP).amax(-1).repeat_interleave(STEP, dim=1)
    assert bool(((rounded - exact).abs() <= step_top * 2.0**-9).all())


def test_fp8_experts_reference_is_the_bf16_function_up_to_the_activations_rounding():
    """The opt-in changes the rounding, not the function: within a few percent of the exact experts."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, 256, generator=generator).bfloat16()
    experts = torch.randint(0, 4, (16, 3), generator=generator)
    weights = torch.rand(16, 3, generator=generator)
    gate_up, down = random_experts(generator, 256, 128, low=2, device="cpu")
    got = experts_fp8_reference(x, weights, experts, gate_up, down, 0, 7.0, False)
    want = experts_reference(x.float(), weights, experts, gate_up, down, 0, 7.0, False)
    assert float((got - want).norm() / want.norm()) < 0.05


def test_fp8_experts_kernels_equal_their_reference():
    check_experts_fp8(tokens=24, seed=2)


def test_fp8_experts_kernels_read_the_mma_layout():
    check_experts_fp8(tokens=24, seed=3, mma_layout=True)


def test_fp8_experts_dispatched_tile_runs_in_the_interpreter_too():
    """FP8_BLOCKS carries a register cap (Triton's maxnreg), which the interpreter takes and ignores."""
    check_experts_fp8(tokens=8, seed=7, blocks=FP8_BLOCKS)


def test_fp8_experts_refuse_widths_the_steps_do_not_divide():
    gate_up = MXFP4Experts(*quantize_mxfp4(torch.randn(4, 256, 192)))
    down = MXFP4Experts(*quantize_mxfp4(torch.randn(4, 192, 128)))
    x, experts, weights = torch.randn(2, 192).bfloat16(), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3)
    with pytest.raises(ValueError, match="multiples of 128"):
        experts_sorted_fp8(x, weights, experts, gate_up, down, 0, 7.0, False)
