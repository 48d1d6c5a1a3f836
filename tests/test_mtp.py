"""The V4 MTP layer (models/mtp.py): config, names, loading (released spelling and formats), its forward
against a plain statement of DeepSeek's MTPBlock, chunk vs decode steps, and chained drafts."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from kernels import dequantize_fp8_blocks, quantize_fp8_blocks, quantize_mxfp4
from models import CheckpointError, ConfigError, DecodeBatch, ForwardBatch, ModelCache, ModelConfig, load_model
from models.config import CSA, SLIDING
from models.mtp import allocate_mtp_cache, greedy_drafts
from models.released_format import stored_fp8
from models.tiny import random_weights, tiny_config_dict
from models.weight_names import module_name

MTP_CONFIG = tiny_config_dict(num_nextn_predict_layers=1, num_hidden_layers=2, layer_types=[SLIDING, CSA],
                              mlp_layer_types=["hash_moe", "moe"])
CONFIG = ModelConfig.from_dict(MTP_CONFIG)

# This model's names of the MTP layer's tensors -> the release's (DeepSeek's V4 safetensors, `mtp.0.*`:
# its MTPBlock's e_proj / h_proj / enorm / hnorm / norm / hc_head_*, and the Block's attn / ffn / norms /
# hc_attn_* / hc_ffn_*, named as a layer's are).
RELEASE_NAMES = {
    "block.self_attn.q_a_proj.": "attn.wq_a.", "block.self_attn.q_b_proj.": "attn.wq_b.",
    "block.self_attn.kv_proj.": "attn.wkv.", "block.self_attn.o_a_proj.": "attn.wo_a.",
    "block.self_attn.o_b_proj.": "attn.wo_b.", "block.self_attn.q_a_norm.": "attn.q_norm.",
    "block.self_attn.kv_norm.": "attn.kv_norm.", "block.self_attn.sinks": "attn.attn_sink",
    "block.input_layernorm.": "attn_norm.", "block.post_attention_layernorm.": "ffn_norm.",
    "block.attn_hc.": "hc_attn_", "block.ffn_hc.": "hc_ffn_", "hc_head.hc_": "hc_head_",
    "block.mlp.gate.e_score_correction_bias": "ffn.gate.bias", "block.mlp.gate.": "ffn.gate.",
    "block.mlp.shared_experts.gate_proj.": "ffn.shared_experts.w1.",
    "block.mlp.shared_experts.down_proj.": "ffn.shared_experts.w2.",
    "block.mlp.shared_experts.up_proj.": "ffn.shared_experts.w3.",
}


def release_name(name: str) -> str:
    rest = name.removeprefix("mtp.0.")
    for ours, theirs in RELEASE_NAMES.items():
        if rest.startswith(ours):
            return "mtp.0." + theirs + rest[len(ours):]
    return name


def released_tensors(weights: dict[str, torch.Tensor], quantized: bool = False) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors in the release's spelling (per-expert w1 / w2 / w3); with `quantized`, as the
    release stores them: FP8 projections with `.scale` blocks, MXFP4 experts with `.scale` exponents."""
    out = {}
    for name, tensor in weights.items():
        if not name.startswith("mtp."):
            out[name] = tensor
        elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            for expert, matrix in enumerate(tensor):
                parts = zip(("w1", "w3"), matrix.chunk(2)) if name.endswith("gate_up_proj") else [("w2", matrix)]
                for part, values in parts:
                    stem = f"mtp.0.ffn.experts.{expert}.{part}"
                    out[stem + ".weight"], scale = quantize_mxfp4(values) if quantized else (values, None)
                    if quantized:
                        out[stem + ".scale"] = scale
        elif quantized and stored_fp8(name):
            stem = release_name(name).removesuffix(".weight")
            out[stem + ".weight"], out[stem + ".scale"] = quantize_fp8_blocks(tensor)
        else:
            out[release_name(name)] = tensor
    return out


def write_checkpoint(directory, tensors: dict[str, torch.Tensor], config: dict = MTP_CONFIG):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return random_weights(CONFIG, seed=3)


@pytest.fixture(scope="module")
def released(tmp_path_factory, weights):
    return write_checkpoint(tmp_path_factory.mktemp("mtp") / "released", released_tensors(weights))


@pytest.fixture(scope="module")
def model(released):
    return load_model(released, mtp=True)


def test_config_reads_the_mtp_layers():
    assert (CONFIG.num_nextn_predict_layers, CONFIG.mtp_layer_types, CONFIG.mtp_compress_rates) == (1, (SLIDING,), (0,))
    legacy = tiny_config_dict(num_hidden_layers=3, layer_types=None, mlp_layer_types=None, compress_rates=None,
                              compress_ratios=[0, 4, 128, 4], num_nextn_predict_layers=1)
    legacy = ModelConfig.from_dict(legacy)  # the release lists the MTP layer's ratio last
    assert legacy.layer_types[2] != CSA and legacy.mtp_layer_types == (CSA,) and legacy.mtp_compress_rates == (4,)
    assert ModelConfig.from_dict(tiny_config_dict()).num_nextn_predict_layers == 0
    layers = CONFIG.mtp_layers_config()
    assert (layers.num_layers, layers.layer_types, layers.mlp_layer_types) == (1, (SLIDING,), ("moe",))
    with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
        ModelConfig.from_dict(tiny_config_dict(num_nextn_predict_layers=-1))


def test_release_names_map_to_the_layers_parameters(model):
    for name, _ in model.mtp.named_parameters(prefix="mtp"):
        if "experts." not in name:
            assert module_name(release_name(name)) == name, release_name(name)
    assert module_name("mtp.0.attn.wq_a.scale") == "mtp.0.block.self_attn.q_a_proj.scale"


def test_loads_with_and_without_the_mtp_layer(tmp_path, released, model, weights):
    assert load_model(released).mtp is None  # its tensors ignored, as before
    for name, tensor in model.mtp.named_parameters(prefix="mtp"):
        assert torch.equal(tensor, weights[name].to(tensor.dtype)), name
    assert model.mtp[0].shared[0] is model.model.embed_tokens and model.mtp[0].shared[1] is model.lm_head
    assert torch.equal(load_model(write_checkpoint(tmp_path / "ours", weights), mtp=True).mtp[0].e_proj.weight,
                       weights["mtp.0.e_proj.weight"])  # this model's own names load too

    without = {k: v for k, v in released_tensors(weights).items() if not k.startswith("mtp.0.hnorm")}
    with pytest.raises(CheckpointError, match=r"missing tensor 'mtp\.0\.hnorm\.weight'"):
        load_model(write_checkpoint(tmp_path / "missing", without), mtp=True)
    surprise = {**released_tensors(weights), "mtp.0.attn.surprise": torch.zeros(2)}
    with pytest.raises(CheckpointError, match=r"'mtp\.0\.attn\.surprise'"):
        load_model(write_checkpoint(tmp_path / "surprise", surprise), mtp=True)
    plain = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    config = {**MTP_CONFIG, "num_nextn_predict_layers": 0}
    with pytest.raises(CheckpointError, match="no MTP layers"):
        load_model(write_checkpoint(tmp_path / "none", plain, config), mtp=True)


def test_released_formats_load(tmp_path, weights, model):
    """FP8 e_proj / h_proj / attention / shared expert with `.scale` blocks and MXFP4 experts, as the
    release stores `mtp.0.*`: dequantized at load, or kept as stored (`model.quantization: checkpoint`)
    with the same logits."""
    from models.layers import Fp8Linear

    directory = write_checkpoint(tmp_path / "fp8", released_tensors(weights, quantized=True))
    dense, kept = load_model(directory, mtp=True), load_model(directory, mtp=True, keep_quantized=True)
    expected = dequantize_fp8_blocks(*quantize_fp8_blocks(weights["mtp.0.h_proj.weight"]))
    assert torch.equal(dense.mtp[0].h_proj.weight, expected)
    assert isinstance(kept.mtp[0].e_proj, Fp8Linear) and isinstance(kept.mtp[0].block.self_attn.q_b_proj, Fp8Linear)
    assert "gate_up_proj_codes" in dict(kept.mtp[0].block.mlp.experts.named_buffers())
    streams, batch = random_rows(CONFIG, 10, seed=1), ForwardBatch.build([(0, list(range(7, 17)), 0)], logits="all")
    dense_logits, *_ = dense.mtp[0](streams, batch, allocate_mtp_cache(CONFIG, 1, 32))
    kept_logits, *_ = kept.mtp[0](streams, batch, allocate_mtp_cache(CONFIG, 1, 32))
    torch.testing.assert_close(kept_logits, dense_logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(dense_logits, model.mtp[0](streams, batch, allocate_mtp_cache(CONFIG, 1, 32))[0])


# A plain statement of the MTP layer, from DeepSeek's V4 inference code (inference/model.py: MTPBlock.forward,
# Block.hc_pre / hc_post, Attention on a compress ratio 0 layer: window only, base rope_theta without YaRN,
# Gate / MoE / Expert, ParallelHead.hc_head), for one sequence's rows at positions 0 .. T - 1 in float32.
# hc_split_sinkhorn is stated as kernels/hyper.py's reference (checked against transformers elsewhere).


def rms(x, weight=None, eps=CONFIG.rms_norm_eps):
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight


def rotate(x, positions, inverse=False):
    """Interleaved (GPT-J) pairs of the last rope_head_dim channels, base theta (sliding layer)."""
    dim = CONFIG.rope_head_dim
    angles = positions[:, None].float() / CONFIG.main_rope.theta ** (torch.arange(0, dim, 2) / dim)
    angles = -angles if inverse else angles
    angles = angles[:, None] if x.dim() == 3 else angles
    even, odd = x[..., -dim:][..., 0::2], x[..., -dim:][..., 1::2]
    pairs = torch.stack([even * angles.cos() - odd * angles.sin(), odd * angles.cos() + even * angles.sin()], -1)
    return torch.cat([x[..., :-dim], pairs.flatten(-2)], -1)


def hc_pre(w, site, streams):
    n, c = CONFIG.hc_mult, CONFIG
    mixes = rms(streams.flatten(1)) @ w[site + "fn"].T
    (pre, post, comb), (pre_b, post_b, comb_b) = mixes.split([n, n, n * n], -1), w[site + "base"].split([n, n, n * n])
    scale = w[site + "scale"]
    pre = torch.sigmoid(pre * scale[0] + pre_b) + c.hc_eps
    post = 2 * torch.sigmoid(post * scale[1] + post_b)
    comb = torch.softmax(comb.view(-1, n, n) * scale[2] + comb_b.view(n, n), -1) + c.hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + c.hc_eps)
    for _ in range(c.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + c.hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + c.hc_eps)
    return (pre[..., None] * streams).sum(1), post, comb


def hc_post(out, streams, post, comb):
    return post[..., None] * out[:, None] + torch.einsum("tjk,tjd->tkd", comb, streams)


def attention(w, p, x, positions):
    c, t = CONFIG, x.shape[0]
    q_residual = rms(x @ w[p + "q_a_proj.weight"].T, w[p + "q_a_norm.weight"])
    q = rotate(rms((q_residual @ w[p + "q_b_proj.weight"].T).view(t, c.num_heads, c.head_dim)), positions)
    kv = rotate(rms(x @ w[p + "kv_proj.weight"].T, w[p + "kv_norm.weight"]), positions)
    scores = torch.einsum("thd,sd->hts", q, kv) / math.sqrt(c.head_dim)
    key, query = positions[None, :], positions[:, None]
    scores = scores.masked_fill(~((key <= query) & (key > query - c.sliding_window)), float("-inf"))
    sinks = w[p + "sinks"][:, None, None].expand(-1, t, 1)
    probs = torch.softmax(torch.cat([scores, sinks], -1), -1)[..., :-1]
    out = rotate(torch.einsum("hts,sd->thd", probs, kv), positions, inverse=True).reshape(t, c.o_groups, -1)
    grouped = torch.einsum("tgi,gri->tgr", out, w[p + "o_a_proj.weight"].view(c.o_groups, c.o_lora_rank, -1))
    return grouped.flatten(1) @ w[p + "o_b_proj.weight"].T


def swiglu(x, gate, up, down):
    limit = CONFIG.swiglu_limit
    return (F.silu((x @ gate.T).clamp(max=limit)) * (x @ up.T).clamp(-limit, limit)) @ down.T


def moe(w, p, x):
    c = CONFIG
    scores = F.softplus(x @ w[p + "gate.weight"].T).sqrt()
    ids = (scores + w[p + "gate.e_score_correction_bias"]).topk(c.num_experts_per_tok).indices
    weight = scores.gather(1, ids)
    weight = weight / weight.sum(-1, keepdim=True) * c.routed_scaling_factor
    out = swiglu(x, *(w[p + f"shared_experts.{m}_proj.weight"] for m in ("gate", "up", "down")))
    for t in range(x.shape[0]):
        for k, e in enumerate(ids[t].tolist()):
            gate, up = w[p + "experts.gate_up_proj"][e].chunk(2)
            out[t] += weight[t, k] * swiglu(x[t], gate, up, w[p + "experts.down_proj"][e])
    return out


def reference_mtp(w, streams, next_ids, positions):
    """(logits [T, vocab], output streams [T, hc_mult, D]) of rows at positions 0 .. T - 1."""
    m, b = "mtp.0.", "mtp.0.block."
    tokens = rms(w["model.embed_tokens.weight"][next_ids], w[m + "enorm.weight"]) @ w[m + "e_proj.weight"].T
    x = rms(streams, w[m + "hnorm.weight"]) @ w[m + "h_proj.weight"].T + tokens[:, None]
    collapsed, post, comb = hc_pre(w, b + "attn_hc.", x)
    attended = attention(w, b + "self_attn.", rms(collapsed, w[b + "input_layernorm.weight"]), positions)
    x = hc_post(attended, x, post, comb)
    collapsed, post, comb = hc_pre(w, b + "ffn_hc.", x)
    x = hc_post(moe(w, b + "mlp.", rms(collapsed, w[b + "post_attention_layernorm.weight"])), x, post, comb)
    pre = torch.sigmoid(rms(x.flatten(1)) @ w[m + "hc_head.hc_fn"].T * w[m + "hc_head.hc_scale"]
                        + w[m + "hc_head.hc_base"]) + CONFIG.hc_eps
    hidden = rms((pre[..., None] * x).sum(1), w[m + "norm.weight"])
    return hidden @ w["lm_head.weight"].T, x


def random_rows(config, n, seed):
    return torch.randn((n, config.hc_mult, config.hidden_size), generator=torch.Generator().manual_seed(seed))


def target_rows(model, tokens):
    """The target's pre-head streams of a prompt (the MTP layer's input), by its forward."""
    streams = torch.empty(len(tokens), CONFIG.hc_mult, CONFIG.hidden_size)
    cache = ModelCache.allocate(CONFIG, 1, 64)
    model(ForwardBatch.build([(0, tokens, 0)]), cache, streams_out=streams)
    return streams


def test_forward_is_deepseeks_mtp_block(model, weights):
    """24 rows (past the 16-token window) fed the target's streams of a prompt and the token after each."""
    tokens = torch.randint(7, 512, (25,), generator=torch.Generator().manual_seed(0)).tolist()
    streams, positions = target_rows(model, tokens[:-1]), torch.arange(24)
    logits, out, _ = model.mtp[0](streams, ForwardBatch.build([(0, tokens[1:], 0)], logits="all"),
                               allocate_mtp_cache(CONFIG, 1, 64))
    expected_logits, expected_out = reference_mtp(weights, streams, torch.tensor(tokens[1:]), positions)
    torch.testing.assert_close(out, expected_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)


def test_decode_steps_give_the_chunks_numbers(model):
    """The same 20 rows as one chunk, and as a chunk of 6 then 14 decode steps (ring rows wrap)."""
    streams, tokens = random_rows(CONFIG, 20, seed=2), list(range(30, 50))
    layer, whole = model.mtp[0], allocate_mtp_cache(CONFIG, 2, 64)
    logits, out, _ = layer(streams, ForwardBatch.build([(1, tokens, 0)], logits="all"), whole)
    stepped = allocate_mtp_cache(CONFIG, 2, 64, draft_tokens=3)
    first, first_out, _ = layer(streams[:6], ForwardBatch.build([(1, tokens[:6], 0)], logits="all"), stepped)
    rows, outs = [first], [first_out]
    with torch.inference_mode():
        for p in range(6, 20):
            step = DecodeBatch.build([(1, tokens[p], p, stepped.default_pages(1).tolist())])
            row_logits, row_out = layer.decode(streams[p:p + 1], step, stepped)
            rows.append(row_logits)
            outs.append(row_out)
    torch.testing.assert_close(torch.cat(rows), logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(outs), out, rtol=1e-4, atol=1e-4)


def test_chained_drafts_follow_the_layers_own_streams(model, weights):
    """Two sequences catch up (12 and 20 rows in one batch), then draft K = 3 more each: every chained row
    reads the row before's output streams and argmax token, one position on, as the statement does."""
    k, lengths = 3, (12, 20)
    streams = [random_rows(CONFIG, n, seed=10 + n) for n in lengths]
    tokens = [list(range(100 + n, 100 + 2 * n)) for n in lengths]
    layer, cache = model.mtp[0], allocate_mtp_cache(CONFIG, 2, 64, draft_tokens=k)
    batch = ForwardBatch.build([(slot, tokens[slot], 0) for slot in range(2)])
    logits, out, _ = layer(torch.cat(streams), batch, cache)
    firsts = logits.argmax(-1)
    rows = [(slot, firsts[slot].item(), n, cache.default_pages(slot).tolist()) for slot, n in enumerate(lengths)]
    with torch.inference_mode():
        drafts, draft_logits = greedy_drafts(layer, out[batch.logits_rows], DecodeBatch.build(rows), cache, k)
    for slot, n in enumerate(lengths):
        rows_in, ids = streams[slot], tokens[slot]
        expected_logits, expected_out = reference_mtp(weights, rows_in, torch.tensor(ids), torch.arange(n))
        chain = [expected_logits[-1].argmax().item()]
        for step in range(k):
            rows_in, ids = torch.cat([rows_in, expected_out[-1:]]), ids + [chain[-1]]
            expected_logits, expected_out = reference_mtp(weights, rows_in, torch.tensor(ids),
                                                          torch.arange(n + step + 1))
            torch.testing.assert_close(draft_logits[slot, step], expected_logits[-1], rtol=1e-4, atol=1e-4)
            chain.append(expected_logits[-1].argmax().item())
        assert [firsts[slot].item()] + drafts[slot].tolist() == chain


def test_dummy_weights_draw_the_mtp_layer_in_the_released_formats(tmp_path):
    from models.dummy_weights import build_dummy_model
    from models.layers import Fp8Linear

    (tmp_path / "config.json").write_text(json.dumps(MTP_CONFIG))
    model = build_dummy_model(tmp_path, released=True, mtp=True)
    assert isinstance(model.mtp[0].h_proj, Fp8Linear) and isinstance(model.mtp[0].block.self_attn.kv_proj, Fp8Linear)
    batch = ForwardBatch.build([(0, list(range(7, 15)), 0)], logits="all")
    logits, *_ = model.mtp[0](random_rows(CONFIG, 8, seed=4), batch, allocate_mtp_cache(CONFIG, 1, 16))
    assert logits.shape == (8, CONFIG.vocab_size) and logits.isfinite().all()


def test_target_hands_out_its_pre_head_streams(model):
    """forward's and decode's streams_out: the rows' streams after the last layer, the same either way."""
    tokens = list(range(40, 60))
    whole = target_rows(model, tokens)
    cache, last = ModelCache.allocate(CONFIG, 1, 64), torch.empty(1, CONFIG.hc_mult, CONFIG.hidden_size)
    model(ForwardBatch.build([(0, tokens[:-1], 0)]), cache)
    model.decode(DecodeBatch.build([(0, tokens[-1], len(tokens) - 1, cache.default_pages(0).tolist())]), cache,
                 streams_out=last)
    torch.testing.assert_close(last, whole[-1:], rtol=1e-4, atol=1e-4)
