"""Kernel references: tie-breaking top-k and the block-scaled number formats."""

import torch

from kernels import dequantize_fp8_blocks, dequantize_mxfp4, quantize_fp8_blocks, quantize_mxfp4, stable_topk


def test_topk_ties_go_to_the_lowest_index():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    values, indices = stable_topk(scores, 2)
    assert indices.tolist() == [[1, 2], [0, 1]]
    assert values.tolist() == [[3.0, 3.0], [0.0, 0.0]]


def test_mxfp4_round_trips_representable_values():
    codes = torch.randint(0, 16, (4, 64), generator=torch.Generator().manual_seed(0))
    exponents = torch.randint(120, 134, (4, 2), dtype=torch.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    values = dequantize_mxfp4(packed, exponents)
    repacked, new_exponents = quantize_mxfp4(values)
    assert torch.equal(dequantize_mxfp4(repacked, new_exponents), values)
    # low nibble first: code 2 (1.0) then code 7 (6.0) in one byte
    assert dequantize_mxfp4(torch.tensor([[0x72] * 16], dtype=torch.uint8), torch.tensor([[127]], dtype=torch.uint8))[0, :2].tolist() == [1.0, 6.0]


def test_fp8_blocks_scale_each_block_independently():
    weight = torch.randn(200, 300) * torch.linspace(0.01, 100, 300)
    values, scale = quantize_fp8_blocks(weight)
    assert scale.shape == (2, 3)
    restored = dequantize_fp8_blocks(values, scale)
    assert ((restored - weight).abs() <= weight.abs() * 0.07 + scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300] * 2**-6).all()


def test_mma_layout_gives_each_lane_its_tensor_core_operand_nibbles():
    """kernels/mma_layout.py's load-time layout: a permutation (its inverse gives the released
    codes back), and lane (g, t)'s byte b of group grp holds the group's codes LOW[t][b] (low nibble)
    and LOW[t][b] + 8 (high) of row g: k = 2t, 2t + 1 | 2t + 8, 2t + 9 of each 16-column k-block,
    the B operand of mma.m16n8k16."""
    from kernels.mma_layout import LOW, mma_layout, released_layout

    codes = torch.randint(0, 256, (3, 16, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    tiled = mma_layout(codes)
    assert tiled.shape == (3, 2, 4, 8, 64)
    assert torch.equal(released_layout(tiled), codes)
    nibbles = torch.stack((codes & 15, codes >> 4), -1).reshape(3, 16, 512)
    for expert, tile, chunk, g, t, group, b in ((0, 0, 0, 0, 0, 0, 0), (1, 1, 3, 7, 3, 3, 3), (2, 0, 2, 5, 1, 2, 2)):
        byte = int(tiled[expert, tile, chunk, g, t * 16 + group * 4 + b])
        column = chunk * 128 + group * 32 + int(LOW[t][b])
        assert int(LOW[t][b]) in (2 * t, 2 * t + 1, 16 + 2 * t, 17 + 2 * t)
        assert byte & 15 == int(nibbles[expert, tile * 8 + g, column])
        assert byte >> 4 == int(nibbles[expert, tile * 8 + g, column + 8])
