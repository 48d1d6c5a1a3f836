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
    """kernels/mma_layout.py's load-time layout: a permutation (its inverse gives the released codes
    back); lane (g, t)'s 16 bytes of a chunk are row g's scale group t, byte 2i holding columns
    32 t + 4i and + 2 (low, high nibble), byte 2i + 1 columns + 1 and + 3 (so the low nibbles of
    bytes 2i, 2i + 1 are b0 of mma.m16n8k16 for k-block i, the high ones b1); read in order, nibble by
    nibble, they give the columns in CODE_ORDER (how the Triton kernels pair them with activations)."""
    from kernels.mma_layout import CODE_ORDER, from_released, mma_layout, released_layout
    from kernels.quant import quantize_mxfp4

    codes = torch.randint(0, 256, (3, 16, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    tiled = mma_layout(codes)
    assert tiled.shape == (3, 2, 4, 8, 64)
    assert torch.equal(released_layout(tiled), codes)
    nibbles = torch.stack((codes & 15, codes >> 4), -1).reshape(3, 16, 512)
    for expert, tile, chunk, g, t, i in ((0, 0, 0, 0, 0, 0), (1, 1, 3, 7, 3, 7), (2, 0, 2, 5, 1, 2)):
        lane = tiled[expert, tile, chunk, g, 16 * t : 16 * t + 16]
        column = chunk * 128 + 32 * t + 4 * i
        row = nibbles[expert, tile * 8 + g]
        assert (int(lane[2 * i]) & 15, int(lane[2 * i]) >> 4) == (int(row[column]), int(row[column + 2]))
        assert (int(lane[2 * i + 1]) & 15, int(lane[2 * i + 1]) >> 4) == (int(row[column + 1]), int(row[column + 3]))
    in_order = torch.stack((tiled & 15, tiled >> 4), -1).reshape(3, 2, 4, 8, 128)  # [E, tile, chunk, g, position]
    for chunk in range(4):
        assert torch.equal(in_order[:, :, chunk].reshape(3, 16, 128), nibbles[:, :, chunk * 128 + CODE_ORDER])
    in_place = codes.clone()
    assert torch.equal(mma_layout(in_place, in_place=True), tiled)
    weights = torch.randn(2, 8, 128, generator=torch.Generator().manual_seed(2))
    assert from_released(*quantize_mxfp4(weights)).small_scales  # scales <= 2: the one-multiply decode
    assert not from_released(*quantize_mxfp4(weights * 2.0**12)).small_scales


