"""Engram against shared/golden/engram: compression, layout, multipliers, row ids, incremental hashing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from engram_store.hashing import EngramLayout, NgramHasher, build_compressed_token_map, hash_multipliers

GOLDEN = Path(__file__).resolve().parent.parent.parent / "shared" / "golden" / "engram"
pytestmark = pytest.mark.skipif(not GOLDEN.exists(), reason=f"golden data folder {GOLDEN} is absent")
CONFIGS = ["cfgA", "cfgB"]


def golden(name: str) -> dict:
    return json.loads((GOLDEN / f"engram_{name}.json").read_text())


def hasher_for(case: dict) -> NgramHasher:
    config = case["config"]
    lookup = build_compressed_token_map(Tokenizer.from_file(str(GOLDEN / "tokenizer.json")))
    layout = EngramLayout.build(config["engram_layer_ids"], config["engram_max_ngram_size"], config["engram_n_heads"], config["engram_vocab_size"])
    return NgramHasher(lookup, layout, config["engram_pad_id"])


@pytest.mark.parametrize("name", CONFIGS)
def test_compression_layout_and_multipliers(name):
    case = golden(name)
    config = case["config"]
    lookup = build_compressed_token_map(Tokenizer.from_file(str(GOLDEN / "tokenizer.json")))
    assert lookup == case["compressed_token_map"]["lookup"]
    assert max(lookup) + 1 == config["engram_compressed_vocab_size"]
    layout = hasher_for(case).layout
    assert [[list(order) for order in layer] for layer in layout.primes] == case["layout"]["primes"]
    assert [list(o) for o in layout.offsets] == case["layout"]["offsets"]
    assert list(layout.num_embeddings) == config["engram_num_embeddings"]
    for index, layer in enumerate(config["engram_layer_ids"]):
        values = hash_multipliers(layer, config["engram_max_ngram_size"], config["engram_compressed_vocab_size"])
        assert [str(v) for v in values] == case["multipliers"]["values_str"][index]


@pytest.mark.parametrize("name", CONFIGS)
def test_hash_ids_of_every_case(name):
    case = golden(name)
    hasher = hasher_for(case)
    for hash_case in case["hash_cases"]:
        for b, ids in enumerate(hash_case["input_ids"]):
            live = hash_case["token_mask"][b] if hash_case["token_mask"] is not None else None
            tokens, _ = hasher.ngram_tokens(ids, live, hasher.empty_context())
            assert tokens.tolist() == hash_case["ngram_tokens"][b], hash_case["name"]
            rows, _ = hasher.row_ids(ids, live, hasher.empty_context())
            assert rows.tolist() == hash_case["hash_ids"][b], hash_case["name"]


@pytest.mark.parametrize("name", CONFIGS)
def test_incremental_hashing_equals_full(name):
    case = golden(name)
    hasher = hasher_for(case)
    for inc in case["incremental_cases"]:
        for b, ids in enumerate(inc["input_ids"]):
            live = inc["token_mask"][b] if inc["token_mask"] is not None else None
            context = hasher.empty_context()
            pieces = []
            for chunk in inc["chunks"]:
                s, e = chunk["start"], chunk["end"]
                rows, context = hasher.row_ids(ids[s:e], None if live is None else live[s:e], context)
                assert rows.tolist() == chunk["hash_ids"][b], (inc["name"], s)
                assert context == chunk["engram_context_after"][b], (inc["name"], s)
                pieces.append(rows)
            assert np.concatenate(pieces).tolist() == inc["hash_ids_full"][b]


@pytest.mark.parametrize("name", CONFIGS)
def test_fusion_matches_golden(name):
    """Rows, wkv output, gate and output within the README's 2e-5 (gate absolute, out relative to max)."""
    import torch
    from safetensors import safe_open

    from engram_store import InMemoryEngramTable
    from models.engram import EngramFusion

    case = golden(name)
    config, fusion = case["config"], case["fusion"]
    weights = safe_open(str(GOLDEN / fusion["weights_file"]), framework="pt")
    tensors = safe_open(str(GOLDEN / fusion["tensors_file"]), framework="pt")
    layer_ids = config["engram_layer_ids"]
    table = InMemoryEngramTable(
        [weights.get_tensor(f"layers.{l}.engram.embed.weight") for l in layer_ids],
        [weights.get_tensor(f"layers.{l}.engram.embed.scale") for l in layer_ids],
    )
    hasher = hasher_for(case)
    for fusion_case in fusion["cases"]:
        ids = tensors.get_tensor(fusion_case["tensors"]["input_ids"])
        hidden = tensors.get_tensor(fusion_case["tensors"]["hidden_in"])
        mask_name = fusion_case["tensors"].get("token_mask")
        mask = tensors.get_tensor(mask_name).bool() if mask_name else torch.ones(ids.shape, dtype=torch.bool)
        for layer in fusion_case["layers"]:
            module = EngramFusion(config["hidden_size"], config["hc_mult"], config["n_hash_cols"], config["engram_head_dim"], config["rms_norm_eps"])
            l = layer["layer_id"]
            module.load_state_dict({
                "wkv.weight": weights.get_tensor(f"layers.{l}.engram.wkv.weight"),
                "q_weight": weights.get_tensor(f"layers.{l}.engram.q_weight"),
                "k_weight": weights.get_tensor(f"layers.{l}.engram.k_weight"),
            })
            expected = {k: tensors.get_tensor(v) for k, v in layer["tensors"].items()}
            for b in range(ids.shape[0]):
                row_ids, _ = hasher.row_ids(ids[b].tolist(), mask[b].tolist(), hasher.empty_context())
                row_ids = torch.from_numpy(row_ids[:, layer["layer_index"]])
                assert torch.equal(row_ids, expected["hash_ids"][b])
                rows = table.rows(table.start({layer["layer_index"]: row_ids}), layer["layer_index"])
                if "rows" in expected:
                    assert torch.equal(rows, expected["rows"][b])
                kv, dot, _ = module.gate_terms(hidden[b], rows)
                if "kv" in expected:
                    assert (kv - expected["kv"][b]).abs().max() <= 2e-5 * expected["kv"][b].abs().max()
                out = module(hidden[b], rows, mask[b])
                gate = EngramFusion.gate(dot, mask[b])
                assert (gate - expected["gate"][b]).abs().max() <= 2e-5
                assert (out - expected["out"][b]).abs().max() <= 2e-5 * expected["out"][b].abs().max()


def test_next_row_ids_of_many_sequences_equal_hashing_each():
    case = golden("cfgA")
    hasher = hasher_for(case)
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, len(hasher.lookup), size=n).tolist() for n in (1, 2, 5, 9)]
    contexts, expected = [], []
    for seq in sequences:
        _, context = hasher.row_ids(seq[:-1], None, hasher.empty_context()) if len(seq) > 1 else (None, hasher.empty_context())
        contexts.append(context)
        expected.append(hasher.row_ids(seq[-1:], None, context)[0][0])
    got = hasher.next_row_ids(np.array([s[-1] for s in sequences]), np.array(contexts))
    assert np.array_equal(got, np.stack(expected))
