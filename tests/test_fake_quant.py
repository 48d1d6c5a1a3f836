"""The simulated V4.1 formats: exact power-of-two scales, E2M1 ties, block skipping, representability."""

from __future__ import annotations

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
