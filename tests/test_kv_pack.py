"""Packed KV (kernels/kv_pack.py): FP4 unpack(pack(x)) is bitwise the model's own simulated rounding; FP8
reads are within e4m3's error of what was written."""

from __future__ import annotations

import pytest
import torch

from kernels.fake_quant import fake_quant_fp4_e4m3, fake_quant_fp4_ue8m0
from kernels.kv_pack import fake_quant_fp8, pack_fp4_e4m3, pack_fp4_ue8m0, pack_fp8, unpack_fp4, unpack_fp8


def hard_inputs(dim: int, seed: int) -> torch.Tensor:
    """Rows of random scales, plus rows with exact E2M1 ties, zeros, negative zeros and tiny values."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(200, dim, generator=g) * torch.logspace(-12, 4, 200).unsqueeze(1)]
    grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -2.5, 0.0, -0.0, 6.0, 1e-30, -1e-30, 3.0])
    rows.append(grid.repeat(dim // 16).unsqueeze(0).repeat(4, 1) * torch.tensor([[1.0], [0.01], [1e3], [2.0**-20]]))
    rows.append(torch.zeros(1, dim))
    return torch.cat(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressed_kv_entries_round_trip_bitwise(dtype):
    x = hard_inputs(512, seed=1).to(dtype)
    packed = pack_fp4_e4m3(x)
    assert torch.equal(unpack_fp4(packed, dtype), fake_quant_fp4_e4m3(x))
    assert packed.nbytes() == x.shape[0] * (512 // 2 + 512 // 16)  # 288 bytes an entry instead of 1024 (bf16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_keys_round_trip_bitwise(dtype):
    x = hard_inputs(128, seed=2).to(dtype)
    packed = pack_fp4_ue8m0(x)
    assert torch.equal(unpack_fp4(packed, dtype), fake_quant_fp4_ue8m0(x))
    assert packed.nbytes() == x.shape[0] * (128 // 2 + 128 // 32)


def test_index_keys_can_be_packed_from_their_rounded_values():
    """With power-of-two scales, rounded index keys re-pack to the same values (the bytes may differ:
    a block whose largest code was 3 gets a scale half as large)."""
    rounded = fake_quant_fp4_ue8m0(hard_inputs(64, seed=3))
    assert torch.equal(unpack_fp4(pack_fp4_ue8m0(rounded)), rounded)


def test_a_dim_the_block_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="not a multiple of the 16-wide scale block"):
        pack_fp4_e4m3(torch.ones(3, 40))


def fp8_bound(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """What an fp8 read may differ from x by, per element: 2^-4 of the value (e4m3's 3 mantissa bits,
    round to nearest) or 2^-10 of its block's scale (amax / 448) in e4m3's subnormals."""
    blocks = x.float().reshape(*x.shape[:-1], -1, block)
    scale = blocks.abs().amax(-1, keepdim=True) / 448
    return torch.maximum(blocks.abs() * 2.0**-4, scale * 2.0**-10).reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_entries_round_trip_within_e4m3s_error_and_keep_the_rope_tail(dtype):
    """A V4-Flash entry (512 wide, the last 64 RoPE channels in bf16): 448 e4m3 bytes + 7 float32
    scales + 128 tail bytes = 604 bytes instead of 1,024 in bf16."""
    x = hard_inputs(512, seed=4).to(dtype)
    packed = pack_fp8(x, tail=64)
    assert packed.nbytes() == x.shape[0] * 604
    y = unpack_fp8(packed, dtype)
    assert y.dtype == dtype and y.shape == x.shape
    body, tail = x[:, :448].float(), x[:, 448:].float()
    slack = 2.0**-8 * body.abs() if dtype == torch.bfloat16 else 0  # the read's own rounding to bf16
    assert ((y[:, :448].float() - body).abs() <= fp8_bound(body) + slack).all()
    assert torch.equal(y[:, 448:], tail.to(torch.bfloat16).to(dtype))  # the RoPE channels: bf16 as stored
    relative = (y[:, :448].float() - body).abs() / body.abs()
    amax = body.reshape(-1, 7, 64).abs().amax(-1, keepdim=True).expand(-1, 7, 64).reshape(body.shape)
    normal = (body.abs() >= 2.0**-6 * amax / 448) & (amax > 1e-30)  # e4m3 normals, scales far from float32's floor
    assert relative[normal].max() <= 2.0**-4 and relative[normal].max() > 2.0**-6  # e4m3, not something finer
    assert torch.equal(unpack_fp8(pack_fp8(torch.zeros(2, 512), tail=64)), torch.zeros(2, 512))


def test_fp8_values_on_the_e4m3_grid_come_back_exactly():
    """Blocks whose amax is 448 times a power of two and whose values are e4m3 numbers at that scale."""
    g = torch.Generator().manual_seed(5)
    codes = (torch.randn(6, 128, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    codes[:, 0], codes[:, 64] = 448.0, -448.0
    x = codes * torch.tensor([2.0**-20, 2.0**-3, 1.0, 2.0**5, 2.0**-9, 4.0])[:, None]
    assert torch.equal(unpack_fp8(pack_fp8(x)), x)
    assert torch.equal(fake_quant_fp8(x), x)


def test_fp8_index_keys_and_widths_the_block_does_not_divide():
    """Index keys are e4m3 throughout (128 + 8 bytes); a body narrower than a block, or not a multiple of
    it, takes one scale for what its last block has (the tiny models: 24 and 16 channels)."""
    x = hard_inputs(128, seed=6)
    assert pack_fp8(x).nbytes() == x.shape[0] * (128 + 2 * 4)
    assert ((unpack_fp8(pack_fp8(x)) - x).abs() <= fp8_bound(x)).all()
    for dim, tail in ((32, 8), (16, 0), (100, 4)):
        y = torch.randn(9, dim, generator=torch.Generator().manual_seed(dim))
        packed = pack_fp8(y, tail=tail)
        body = dim - tail
        assert packed.codes.shape[-1] == body and packed.scales.shape[-1] == 4 * -(-body // 64)
        padded = torch.nn.functional.pad(y[:, :body], (0, -(-body // 64) * 64 - body))
        bound = fp8_bound(padded)[:, :body]
        assert ((unpack_fp8(packed)[:, :body] - y[:, :body]).abs() <= bound).all()
    with pytest.raises(ValueError, match="needs e4m3 channels"):
        pack_fp8(torch.ones(3, 8), tail=8)
