"""The simulated V4.1 formats: exact power-of-two scales, E2M1 ties, block skipping, representability."""

from __future__ import annotations

import pytest
import torch

from kernels.fake_quant import (
    fake_quant_fp4_e4m3,
    fake_quant_fp4_ue8m0,
    fake_quant_fp8_ue8m0,
    pow2_ceil,
    round_e2m1,
)


def test_pow2_ceil_is_exact_at_and_around_powers_of_two():
    powers = torch.exp2(torch.arange(-126, 127, dtype=torch.float32))
    assert torch.equal(pow2_ceil(powers), powers)
    above = torch.nextafter(powers, torch.full_like(powers, float("inf")))
    assert torch.equal(pow2_ceil(above[:-1]), powers[1:])
    y = torch.rand(10_000) * 1e3 + 1e-3
    expected = torch.exp2(torch.ceil(torch.log2(y.double()))).float()
    assert torch.equal(pow2_ceil(y), expected)


def test_e2m1_rounds_half_to_even_and_keeps_sign():
    q = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, -0.75, -0.2, -0.0, 6.0, 5.1])
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, -1.0, 0.0, 0.0, 6.0, 6.0])
    out = round_e2m1(q)
    assert torch.equal(out, expected) and not torch.signbit(out[10])


def test_outputs_lie_on_their_grids():
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 128)
    fp8 = fake_quant_fp8_ue8m0(x).view(64, 4, 32)
    scale = pow2_ceil(x.view(64, 4, 32).abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448)
    assert torch.equal((fp8 / scale).to(torch.float8_e4m3fn).float(), fp8 / scale)
    fp4 = fake_quant_fp4_ue8m0(x).view(64, 4, 32)
    scale4 = pow2_ceil(x.view(64, 4, 32).abs().amax(-1, keepdim=True) / 6)
    assert torch.equal(round_e2m1(fp4 / scale4), fp4 / scale4)
    e4m3 = fake_quant_fp4_e4m3(x).view(64, 8, 16)
    amax = x.view(64, 8, 16).abs().amax(-1, keepdim=True).clamp_min(6 * 2.0**-9)
    scale16 = (amax / 6).to(torch.float8_e4m3fn).float()
    assert torch.equal(round_e2m1(e4m3 / scale16), e4m3 / scale16)
    # within one grid step (2 at the top), or clamped at 6 where the e4m3 scale rounded down
    assert (e4m3 - x.view(64, 8, 16)).abs().le(2 * scale16).all()


def test_quantizers_skip_dims_their_block_does_not_divide():
    x = torch.randn(3, 48)
    assert fake_quant_fp8_ue8m0(x) is x and fake_quant_fp4_ue8m0(x) is x
    assert not torch.equal(fake_quant_fp4_e4m3(x), x)  # 48 is a multiple of 16


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def quantizer_inputs(dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    """Blocks over ~40 binades (a scale a block, powers of two and not), the grids' exact ties (a block whose
    amax makes its scale 1: E2M1's .25 / .75 / 1.25 / 1.75 / 2.5 / 3.5 / 5 and e4m3's midpoints, normal and
    subnormal), zeros, negative zeros and all-zero blocks (the amax floors)."""
    generator = torch.Generator(device).manual_seed(seed)
    x = torch.randn(96, 64, generator=generator, device=device)
    x *= torch.exp2(torch.randint(-20, 21, (96, 1), generator=generator, device=device).float())
    x[:48] *= torch.rand(48, 1, generator=generator, device=device) + 0.5
    x[0, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, -0.0, 0.0, 1.0, -6.0, 3.0])
    x[1, :32] = 448.0 * torch.tensor([1.0] + [-1.0] * 31)  # fp8: scale 1
    x[1, 1:8] = torch.tensor([-1.0625, -2.125, 9.5, 208.0, 2.0**-7 * 1.0625, 2.0**-8 * 3, 2.0**-10])  # e4m3 ties / subnormals
    x[2] = 0.0
    x[3, :32] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizer_kernel_is_bitwise_the_torch_ops(dtype):
    """The fused kernel (Triton's interpreter here; compiled in tests/test_gpu.py) against the torch ops,
    bit for bit, signs of zeros included, for the three formats."""
    from kernels.fake_quant import FP4_E4M3, FP4_UE8M0, FP8_UE8M0, fake_quant_triton

    for seed in range(3):
        x = quantizer_inputs(dtype, seed)
        for fmt, block, reference in ((FP8_UE8M0, 32, fake_quant_fp8_ue8m0), (FP4_UE8M0, 32, fake_quant_fp4_ue8m0),
                                      (FP4_E4M3, 16, fake_quant_fp4_e4m3)):
            got, want = fake_quant_triton(x, block, fmt), reference(x, block)
            assert got.dtype == dtype and got.shape == x.shape
            assert torch.equal(_bits(got), _bits(want)), (fmt, seed, (got != want).sum())
