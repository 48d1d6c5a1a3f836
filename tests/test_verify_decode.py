"""A verify step on the decode path (issue 27 item 4's model side): a DecodeBatch of `waves` rows per
sequence (its last token and its drafts, wave-major) gives the logits of the same tokens computed as a
chunk, and leaves the cache where a chunk leaves it, on V4's tiny model (window 16, CSA rate 4 with its
indexer, HCA rate 16): rounds cross ring wraps and close CSA and HCA groups at every wave, two sequences
at different positions share each wave, and a sequence with fewer drafts pads its missing waves with
rows in a scratch slot and page that no sequence reads. Shapes depend only on (sequences, waves, table
width), as a CUDA graph needs; the chunk and decode paths differ in the order of float sums, hence the
tolerance. The decode path hands out a DSpark proposer's taps as the chunk's forward does. V4.1 too."""

from __future__ import annotations

import torch

from models import DecodeBatch, ForwardBatch, ModelCache, ModelConfig
from models.random_model import build_random_model
from models.tiny import tiny_config_dict
from tests.conftest import random_tokens
from worker.cuda_graphs import DecodeGraphs, DecodeRow

DRAFTS = 3
WIDTH = 12  # block-table width of every row (pages of 16 tokens: 192 tokens)
SCRATCH = 2  # the scratch slot; its page is the last one
TOLERANCE = dict(rtol=1e-4, atol=1e-4)


def verify_rows(sequences: list[tuple[int, list[int], int]], cache: ModelCache, device: str,
                width: int = WIDTH) -> DecodeBatch:
    """sequences: (slot, forwarded tokens, first position); wave-major rows, short ones padded."""
    waves = DRAFTS + 1
    scratch_pages = [cache.num_pages - 1] * width
    rows = []
    for j in range(waves):
        for slot, tokens, position in sequences:
            if j < len(tokens):
                rows.append((slot, tokens[j], position + j, cache.default_pages(slot).tolist()[:width]))
            else:
                rows.append((SCRATCH, 0, j, scratch_pages))
    built = DecodeBatch.build(rows, width=width, device=device)
    return DecodeBatch(built.token_ids, built.positions, built.slots, built.block_tables, waves=waves)


def test_a_verify_batch_is_the_chunk_of_its_tokens():
    """On the CPU the poolers' torch reference appends every row before pooling any; the GPU test runs
    the same check through the Triton pooler, whose programs would race without the waves."""
    check_verify_batch("cpu", TOLERANCE)


def check_verify_batch(device: str, tolerance: dict) -> None:
    model = build_random_model(ModelConfig.from_dict(tiny_config_dict()), torch.float32, device, seed=0)
    chunked = ModelCache.allocate(model.config, 3, 192, draft_tokens=DRAFTS, device=device)
    waved = ModelCache.allocate(model.config, 3, 192, draft_tokens=DRAFTS, device=device)
    prompts = [random_tokens(37, seed=2), random_tokens(21, seed=3)]
    for cache in (chunked, waved):
        model(ForwardBatch.build([(slot, prompt, 0) for slot, prompt in enumerate(prompts)]), cache)
    positions = [len(p) for p in prompts]
    last = [5, 9]
    taps = (0, model.config.num_layers - 1)
    generator = torch.Generator().manual_seed(4)
    for round_ in range(20):
        drafts = [random_tokens(DRAFTS, seed=100 + round_), random_tokens(DRAFTS - round_ % 3, seed=200 + round_)]
        forwarded = [[last[s], *drafts[s]] for s in range(2)]
        rows_in = sum(map(len, forwarded))
        taps_out = {layer: torch.empty(rows_in, model.config.hidden_size, device=device) for layer in taps}
        want = model(ForwardBatch.build([(s, forwarded[s], positions[s]) for s in range(2)], logits="all"), chunked,
                     taps_out=taps_out)
        waves = DRAFTS + 1
        got_taps = {layer: torch.empty(2 * waves, model.config.hidden_size, device=device) for layer in taps}
        got = model.decode(verify_rows([(s, forwarded[s], positions[s]) for s in range(2)], waved, device), waved,
                           taps_out=got_taps)
        for s in range(2):
            rows = [j * 2 + s for j in range(len(forwarded[s]))]  # wave-major
            start = 0 if s == 0 else len(forwarded[0])
            torch.testing.assert_close(got[rows], want[start: start + len(forwarded[s])], **tolerance,
                                       msg=f"round {round_}, sequence {s}")
            for layer in taps:  # a DSpark proposer's taps: the mean stream leaving the layer
                torch.testing.assert_close(got_taps[layer][rows], taps_out[layer][start: start + len(forwarded[s])],
                                           **tolerance, msg=f"round {round_}, sequence {s}, tap {layer}")
        assert got.shape[0] == 2 * waves
        for s in range(2):  # accept some drafts; the next round starts after them
            accepted = int(torch.randint(0, len(drafts[s]) + 1, (), generator=generator))
            positions[s] += accepted + 1
            last[s] = int(random_tokens(1, seed=500 + 7 * round_ + s)[0])
    assert min(positions) > 21 + 2 * 16  # past two HCA windows
    for step in range(6):  # plain decode steps after: both caches hold the same state
        rows = [(s, last[s], positions[s], chunked.default_pages(s).tolist()[:WIDTH]) for s in range(2)]
        batch = DecodeBatch.build(rows, width=WIDTH, device=device)
        torch.testing.assert_close(model.decode(batch, waved), model.decode(batch, chunked), **tolerance,
                                   msg=f"decode step {step}")
        positions = [p + 1 for p in positions]
        last = [int(t) for t in random_tokens(2, seed=900 + step)]


def test_a_v41_verify_batch_is_the_chunk_of_its_tokens(checkpoints):
    """V4.1 (Engram on two layers, CSA2's shared kv / index sources with candidate blocks, quantization
    simulation off): a verify batch's rows, with their Engram rows hashed wave by wave, give the logits
    of the same tokens computed as a chunk, round after round of partly accepted drafts (each slot's
    Engram look-back rewound to the tokens that stand, as the runner does), and leave the caches where
    plain decode steps agree."""
    from models import load_model

    check_verify_batch_v41(load_model(checkpoints["v41"], simulate_quantization=False), "cpu", TOLERANCE)


def test_v41_verify_steps_through_the_graphs_inputs_are_the_chunk_of_their_tokens(checkpoints):
    """The same rounds through worker/cuda_graphs.py's DecodeGraphs uncaptured (the static inputs, the
    Engram fetch of every wave into the static rows, the body a graph captures, run eagerly), keeping a
    DSpark proposer's taps: each row's mean stream entering layers 1 and 3, as the chunk's forward
    hands them out."""
    from models import load_model

    check_verify_batch_v41(load_model(checkpoints["v41"], simulate_quantization=False), "cpu", TOLERANCE,
                           through_graph_inputs=True)


def check_verify_batch_v41(model, device: str, tolerance: dict, through_graph_inputs: bool = False) -> None:
    chunked = ModelCache.allocate(model.config, 3, 192, draft_tokens=DRAFTS, device=device)
    waved = ModelCache.allocate(model.config, 3, 192, draft_tokens=DRAFTS, device=device)
    width = chunked.default_pages(0).shape[0]  # the whole 192 tokens' table
    memory, waves = model.engram_memory, DRAFTS + 1
    taps = (1, 3)
    graphs = DecodeGraphs(model, waved, 2, width, scratch_slot=SCRATCH, scratch_page=waved.num_pages - 1,
                          waves=waves, keep_taps=taps if through_graph_inputs else ())
    prompts = [random_tokens(37, seed=2), random_tokens(21, seed=3)]
    for cache in (chunked, waved):
        model(ForwardBatch.build([(slot, prompt, 0) for slot, prompt in enumerate(prompts)]), cache)
    positions, last = [len(p) for p in prompts], [5, 9]
    generator = torch.Generator().manual_seed(4)
    for round_ in range(16):
        drafts = [random_tokens(DRAFTS, seed=100 + round_), random_tokens(DRAFTS - round_ % 3, seed=200 + round_)]
        forwarded = [[last[s], *drafts[s]] for s in range(2)]
        before = {id(cache): cache.engram_context[:2].tolist() for cache in (chunked, waved)}
        rows_in = sum(map(len, forwarded))
        taps_out = {layer: torch.empty(rows_in, model.config.hidden_size, device=device) for layer in taps}
        want = model(ForwardBatch.build([(s, forwarded[s], positions[s]) for s in range(2)], logits="all"), chunked,
                     taps_out=taps_out)
        if through_graph_inputs:
            pages = [tuple(waved.default_pages(s).tolist()) for s in range(2)]
            got = graphs.run_waves([[DecodeRow(s, forwarded[s][j], positions[s] + j, pages[s])
                                     if j < len(forwarded[s]) else None for s in range(2)] for j in range(waves)])
        else:
            batch = verify_rows([(s, forwarded[s], positions[s]) for s in range(2)], waved, device, width)
            rows = model.engram_rows(batch.slots, batch.token_ids, batch.positions, waved, waves=waves)
            got = model.decode(batch, waved, rows)
        for s in range(2):
            wave_rows = [j * 2 + s for j in range(len(forwarded[s]))]
            start = 0 if s == 0 else len(forwarded[0])
            torch.testing.assert_close(got[wave_rows], want[start: start + len(forwarded[s])], **tolerance,
                                       msg=f"round {round_}, sequence {s}")
            for i, layer in enumerate(taps if through_graph_inputs else ()):
                torch.testing.assert_close(graphs.taps[wave_rows, i], taps_out[layer][start: start + len(forwarded[s])],
                                           **tolerance, msg=f"round {round_}, sequence {s}, tap {layer}")
        for s in range(2):
            accepted = int(torch.randint(0, len(drafts[s]) + 1, (), generator=generator))
            for cache in (chunked, waved):
                memory.rewind(cache.engram_context, s, before[id(cache)][s], forwarded[s][: accepted + 1])
            positions[s] += accepted + 1
            last[s] = int(random_tokens(1, seed=500 + 7 * round_ + s)[0])
    assert torch.equal(chunked.engram_context[:2], waved.engram_context[:2])
    for step in range(6):  # plain decode steps after: both caches hold the same state
        rows = [(s, last[s], positions[s], chunked.default_pages(s).tolist()) for s in range(2)]
        batch = DecodeBatch.build(rows, width=width, device=device)
        logits = [model.decode(batch, cache, model.engram_rows([0, 1], last, positions, cache))
                  for cache in (waved, chunked)]
        torch.testing.assert_close(*logits, **tolerance, msg=f"decode step {step}")
        positions = [p + 1 for p in positions]
        last = [int(t) for t in random_tokens(2, seed=900 + step)]
