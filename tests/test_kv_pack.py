"""Packed FP4 KV (kernels/kv_pack.py): unpack(pack(x)) is bitwise the model's own simulated rounding."""

from __future__ import annotations

import pytest
import torch

from kernels.fake_quant import fake_quant_fp4_e4m3, fake_quant_fp4_ue8m0
from kernels.kv_pack import pack_fp4_e4m3, pack_fp4_ue8m0, unpack_fp4


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
