"""DSpark drafting on a DeepSeek-V4 target (issue 27: V4-Flash-0731's draft, models/dspark.py), on the tiny
V4 and CPU: the draft loads in this project's names and in the release's (`hc_head_fn`, `markov_w1`, ...),
and the published V4-Flash-0731 layout maps one to one onto its parameters; V4's taps are the mean stream
leaving each tap layer; the draft forward is the math a plain torch statement of the V4-Flash-0731 draft
gives (V4 layers, own hc_head); greedy decoding with its drafts is plain greedy bitwise through a runner and
served through the openai client; the static plan counts the draft as the engine holds it; a draft that
is not one of the target is a config error naming the key. Helpers come from tests/test_dspark.py."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import ForwardBatch, ModelConfig, load_model
from models.cache import ModelCache
from models.config import ConfigError
from models.dspark import (
    DSparkConfig,
    attach_dspark,
    build_tiny_dspark,
    draft_names,
    held_draft,
)
from models.tiny import build_tiny_checkpoint
from tests.serving import running_server, settled_metrics
from tests.test_dspark import (
    K,
    ONE_THREAD,
    PROMPT,
    SERVED,
    block_inputs,
    check_draft_forward,
    config_of,
    decode,
    drafts_afresh,
    hc_site,
    markov_drafts,
    merge,
    moe,
    release_spelling,
    rigged_copy,
    rms,
    rope,
    served_without_drafts,
    served_workload,
)
from tests.test_dspark_memory import dspark_rig, tensors
from worker import ModelRunner
from worker.dspark import DSparkProposer

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(the tiny V4 checkpoint, a random V4-Flash-0731-shaped DSpark draft for it, Markov rank 128)."""
    root = tmp_path_factory.mktemp("dspark_v4")
    target = build_tiny_checkpoint(root / "v4", seed=3, family="v4")
    return target, build_tiny_dspark(root / "draft", target, seed=4, dspark_markov_rank=128)


def with_draft(dirs, draft=None, keep_quantized=False):
    target, default = dirs
    model = load_model(target, keep_quantized=keep_quantized)
    attach_dspark(model, draft or default, keep_quantized=keep_quantized)
    return model


# -- loading ------------------------------------------------------------------------------------------
V4_HEADS = [("hc_head.hc_fn", "hc_head_fn"), ("hc_head.hc_base", "hc_head_base"), ("hc_head.hc_scale", "hc_head_scale"),
            ("markov_head.embed.", "markov_head.markov_w1."), ("markov_head.head.", "markov_head.markov_w2.")]


def v4_release_spelling(weights):
    """The draft's tensors as V4-Flash-0731 names them: the layers' as V4.1's release does, the heads'
    hc_head_fn / hc_head_base / hc_head_scale and markov_head.markov_w1 / markov_w2."""
    out = {}
    for name, tensor in release_spelling(weights).items():
        for mine, theirs in V4_HEADS:
            name = name.replace(mine, theirs)
        out[name] = tensor
    return out


def test_the_v4_draft_loads_in_either_spelling(dirs, tmp_path):
    """As V4-Flash-0731's config.json: num_nextn_predict_layers 1, the three stages counted by the layer
    kinds listed after the target's; the target's experts (no dspark_n_routed_experts); V4 stages."""
    target, draft_dir = dirs
    raw = json.loads((draft_dir / "config.json").read_text())
    assert raw["num_nextn_predict_layers"] == 1 and len(raw["layer_types"]) == 4 + 3
    draft = with_draft(dirs).dspark
    config = draft.config
    assert (config.stages, config.block_size, config.tap_layers, config.noise_token_id, config.markov_rank) == (
        3, 5, (1, 2, 3), 511, 128)
    layers = config.layers
    assert (layers.model_type, layers.n_routed_experts, layers.num_experts_per_tok, layers.sliding_window) == (
        "deepseek_v4", 8, 2, 16)
    assert layers.mlp_layer_types == ("moe",) * 3 and layers.mtp_layer_types == ()
    stored = load_file(draft_dir / "model.safetensors")
    held = tensors(draft)
    assert "mtp.2.hc_head.hc_fn" in held and "mtp.1.hc_head.hc_fn" not in held
    assert not any("tid2eid" in name or "_vl" in name for name in held)
    assert set(held) == set(stored) and all(torch.equal(held[n], stored[n]) for n in stored)
    released = tmp_path / "released"
    released.mkdir()
    shutil.copy(draft_dir / "config.json", released / "config.json")
    renamed = v4_release_spelling(stored)
    assert {"mtp.2.hc_head_fn", "mtp.2.markov_head.markov_w1.weight", "mtp.0.attn.wq_a.weight",
            "mtp.1.ffn.experts.3.w2.weight", "mtp.0.ffn.gate.bias"} <= set(renamed)
    save_file(renamed, str(released / "model.safetensors"))
    again = tensors(with_draft(dirs, released).dspark)
    assert set(again) == set(held) and all(torch.equal(tensor, held[name]) for name, tensor in again.items())


def flash_0731_config() -> dict:
    """DeepSeek-V4-Flash-0731's config.json as the public sources give it: the shipped V4-Flash config
    with the DSpark keys (block 5, noise 128799, taps 40-42, Markov rank 256) and 46 compress ratios."""
    raw = json.loads((REPO / "configs/models/DeepSeek-V4-Flash/config.json").read_text())
    raw.update(dspark_block_size=5, dspark_noise_token_id=128799, dspark_target_layer_ids=[40, 41, 42],
               dspark_markov_rank=256, compress_ratios=raw["compress_ratios"] + [0, 0])
    return raw


def released_0731_names(raw: dict) -> set[str]:
    """The `mtp.*` tensors (scales aside) of the released V4-Flash-0731 draft, as public readers of the
    checkpoint list them: three V4 stages, the taps' main_proj / main_norm on stage 0, the heads and
    hc_head on stage 2."""
    stage = ["attn.attn_sink", "attn.q_norm.weight", "attn.kv_norm.weight", "attn_norm.weight", "ffn_norm.weight",
             "ffn.gate.weight", "ffn.gate.bias"]
    stage += [f"attn.{p}.weight" for p in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")]
    stage += [f"ffn.shared_experts.{p}.weight" for p in ("w1", "w2", "w3")]
    stage += [f"hc_{site}_{leaf}" for site in ("attn", "ffn") for leaf in ("fn", "base", "scale")]
    stage += [f"ffn.experts.{e}.{p}.weight" for e in range(raw["n_routed_experts"]) for p in ("w1", "w2", "w3")]
    names = {f"mtp.{i}.{rest}" for i in range(3) for rest in stage}
    return names | {"mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.2.norm.weight",
                    "mtp.2.confidence_head.proj.weight", "mtp.2.markov_head.markov_w1.weight",
                    "mtp.2.markov_head.markov_w2.weight", "mtp.2.hc_head_fn", "mtp.2.hc_head_base",
                    "mtp.2.hc_head_scale"}


def test_the_published_0731_layout_is_the_draft_one_to_one():
    """Three stages from num_nextn_predict_layers 1 and 46 ratios for 43 layers; the target's 256 experts,
    top-6; every released tensor names one of the draft's parameters (the per-expert matrices stacked)
    and every parameter is named, with the released shapes where a public reader states them."""
    raw = flash_0731_config()
    config = DSparkConfig.from_dict(raw, ModelConfig.from_dict(json.loads(
        (REPO / "configs/models/DeepSeek-V4-Flash/config.json").read_text())))
    assert (config.stages, config.tap_layers, config.block_size, config.markov_rank) == (3, (40, 41, 42), 5, 256)
    assert (config.layers.n_routed_experts, config.layers.num_experts_per_tok) == (256, 6)
    held = {name: tuple(t.shape) for name, t in tensors(held_draft(config)).items()}
    released = released_0731_names(raw)
    index = draft_names(released)
    named = set(index.direct) | {f"{experts}.{leaf}" for experts in index.experts
                                 for leaf in ("gate_up_proj", "down_proj")}
    assert named == set(held)
    assert all(len(parts.by_expert) == 256 and all(len(p) == 3 for p in parts.by_expert.values())
               for parts in index.experts.values())
    assert len(released) + 3 * (5 + 3) + 1 + 3 * 256 * 3 == 4705  # with the FP8 and MXFP4 scales
    assert held["mtp.0.main_proj.weight"] == (4096, 12288) and held["mtp.2.hc_head.hc_fn"] == (4, 16384)
    assert held["mtp.2.markov_head.embed.weight"] == held["mtp.2.markov_head.head.weight"] == (129280, 256)
    assert held["mtp.2.confidence_head.proj.weight"] == (1, 4352)


# -- the taps -----------------------------------------------------------------------------------------
def test_v4_taps_are_the_mean_stream_leaving_each_tap_layer(dirs):
    """V4-Flash-0731 taps a layer's output (V4.1 its input): each tap equals the mean over the streams the
    model's first i + 1 layers leave (the same forward stopped after layer i, its streams_out)."""
    target, _ = dirs
    model = load_model(target)
    tokens = PROMPT[:19]
    taps = {layer: torch.empty(len(tokens), 64) for layer in (1, 2, 3)}
    cache = ModelCache.allocate(model.config, 1, 64)
    model(ForwardBatch.build([(0, list(tokens), 0)]), cache, taps_out=taps)
    layers = model.model.layers
    for layer, tap in taps.items():
        model.model.layers = layers[: layer + 1]
        streams = torch.empty(len(tokens), 4, 64)
        model(ForwardBatch.build([(0, list(tokens), 0)]), ModelCache.allocate(model.config, 1, 64), streams_out=streams)
        assert torch.equal(tap, streams.mean(dim=1)), layer
        if layer > 1:
            assert not torch.allclose(tap, taps[layer - 1])
    model.model.layers = layers


# -- the draft forward against a plain statement of its math --------------------------------------------
def v4_site(streams, w, prefix, c):
    """A V4 mHC site: (post, comb, the streams collapsed by this site's own pre)."""
    pre, post, comb, _ = hc_site(streams, w, prefix, torch.zeros(streams.shape[:2]), c)
    return post, comb, (pre[:, :, None] * streams).sum(1)


def v4_attention(x, context, positions, w, p, c):
    """V4 attention of block rows x [B, D] at `positions` over the context keys [M, hd] and their own:
    each query head RMS-normalized (no weight), keys not rounded, every row every key, the sinks."""
    heads, hd, eps, theta = c["num_attention_heads"], c["head_dim"], c["rms_norm_eps"], c["rope_theta"]
    rd = int(hd * c["partial_rotary_factor"])
    q = (rms(x @ w[p + "q_a_proj.weight"].T, w[p + "q_a_norm.weight"], eps) @ w[p + "q_b_proj.weight"].T)
    q = q.view(-1, heads, hd)
    q = rope(q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps), positions, theta, rd)
    own = rope(rms(x @ w[p + "kv_proj.weight"].T, w[p + "kv_norm.weight"], eps), positions, theta, rd)
    keys = torch.cat([context, own])
    scores = torch.einsum("bhd,kd->hbk", q, keys) / math.sqrt(hd)
    sinks = w[p + "sinks"][:, None, None].expand(-1, x.shape[0], 1)
    probs = torch.softmax(torch.cat([scores, sinks], -1), -1)[..., :-1]
    out = rope(torch.einsum("hbk,kd->bhd", probs, keys), positions, theta, rd, inverse=True)
    groups = c["o_groups"]
    grouped = torch.einsum("bgi,gri->bgr", out.reshape(x.shape[0], groups, -1),
                           w[p + "o_a_proj.weight"].view(groups, c["o_lora_rank"], -1))
    return grouped.flatten(1) @ w[p + "o_b_proj.weight"].T


def v4_reference_block(w, target_w, raw, taps, first_token):
    """One sequence's drafts, logits and confidence logits, as the V4-Flash-0731 draft computes them: taps
    [L, 3, D] at 0 .. L - 1 as the context, the block after them starting with `first_token`, three V4
    layers, then the last stage's hc_head, norm and the target's head, the Markov head left to right."""
    c, eps, rd = raw, raw["rms_norm_eps"], int(raw["head_dim"] * raw["partial_rotary_factor"])
    seen, main, positions, streams = block_inputs(w, target_w, raw, taps, first_token)
    routing = {"dspark_num_experts_per_tok": c["num_experts_per_tok"]}
    for stage in range(3):
        p = f"mtp.{stage}.block."
        context = rope(rms(main @ w[p + "self_attn.kv_proj.weight"].T, w[p + "self_attn.kv_norm.weight"], eps),
                       seen, c["rope_theta"], rd)
        post, comb, collapsed = v4_site(streams, w, p + "attn_hc.", c)
        out = v4_attention(rms(collapsed, w[p + "input_layernorm.weight"], eps), context, positions, w,
                           p + "self_attn.", c)
        streams = merge(streams, post, comb, out)
        post, comb, collapsed = v4_site(streams, w, p + "ffn_hc.", c)
        streams = merge(streams, post, comb, moe(rms(collapsed, w[p + "post_attention_layernorm.weight"], eps), w,
                                                 p + "mlp.", c, routing))
    flat = streams.flatten(1)
    mixes = (flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)) @ w["mtp.2.hc_head.hc_fn"].T
    pre = torch.sigmoid(mixes * w["mtp.2.hc_head.hc_scale"] + w["mtp.2.hc_head.hc_base"]) + c["hc_eps"]
    return markov_drafts(w, target_w, raw, (pre[:, :, None] * streams).sum(1), "mtp.2.", first_token)


def test_the_v4_draft_forward_is_the_0731_drafts_math(dirs):
    """V4-Flash-0731's draft against the plain statement of its math (`v4_reference_block`)."""
    check_draft_forward(dirs, v4_reference_block)


# -- greedy decoding through a runner and served ----------------------------------------------------------
def test_greedy_with_v4_dspark_drafts_is_plain_greedy(dirs, tmp_path):
    """Deterministic mode, K = 4 of a block of 5: plain greedy's tokens and bitwise logprobs with the
    proposer's drafts fed back; every step's drafts those of the draft run afresh over the whole sequence;
    with the Markov head rigged to the plain run's bigrams some drafts are accepted and some rejected."""
    plain = decode(ModelRunner(with_draft(dirs), num_slots=2, max_model_len=128, deterministic=True), 30)[0]
    _, draft_dir = dirs
    rigged = rigged_copy(draft_dir, tmp_path / "rigged", [[*PROMPT, *(t.token_id for t in plain)]])
    for directory in (draft_dir, rigged):
        model = with_draft(dirs, directory)
        runner = ModelRunner(model, num_slots=2, max_model_len=128, deterministic=True, draft_tokens=K,
                             proposer=DSparkProposer(model, num_slots=2, k=K))
        seen = []

        def check(out, drafts):
            seen.append(drafts == drafts_afresh(model, [*PROMPT, *(t.token_id for t in out)]))

        got, accepted = decode(runner, 30, check)
        assert got == plain
        assert seen and all(seen)
        if directory == rigged:
            print(f"rigged V4 draft: {sum(accepted)} drafts accepted over {len(accepted)} verify steps")
            assert 0 < sum(accepted) < K * len(accepted)


def test_served_greedy_with_v4_dspark_drafts_is_greedy_without_them(dirs, tmp_path):
    """The tiny V4 served in deterministic mode through the openai client (tests/test_dspark.py's
    workload: a mixed batch, preemption on 6 KV pages, prefix-cache hits, a seeded sampled request, an
    abort): with --speculative-config dspark (K = 5, the Markov head rigged to the plain run's bigrams)
    every greedy reply has the same tokens and bitwise logprobs, the sampled one the same text; drafts
    were verified, some accepted, some not."""
    target, draft_dir = dirs
    plain, config = served_without_drafts(target, draft_dir, tmp_path / "rigged")
    with running_server(target, "spec", *SERVED, "--speculative-config", config, env=ONE_THREAD) as base:
        drafting = served_workload(base)
        drafts, accepted = settled_metrics(base, "vllm:spec_decode_num_draft_tokens_total",
                                           "vllm:spec_decode_num_accepted_tokens_total")
        print(f"V4 dspark served: {drafts:.0f} drafts, {accepted:.0f} accepted")
        assert drafts > accepted > 0
    for key in plain:
        assert drafting[key] == plain[key], key


# -- the plan and the engine's checks -------------------------------------------------------------------
@pytest.mark.parametrize("quantization, block", [("none", None), ("checkpoint", 32)])
def test_the_plan_counts_the_v4_draft_as_the_engine_holds_it(dirs, tmp_path, quantization, block):
    """From config.json alone, the V4 draft's tensors (its hc_head included) are the bytes load_dspark
    holds, dense or, in the release's formats, as stored; the rings the proposer's."""
    from engine.plan import build_plan

    target, draft_dir = dirs
    if block:
        draft_dir = build_tiny_dspark(tmp_path / "fp8", target, seed=4, fp8=block)
    config, path, config_json = dspark_rig(target, draft_dir, quantization)
    plan = build_plan(config, path, config_json)
    model = with_draft((target, draft_dir), keep_quantized=quantization == "checkpoint")
    held = {f"dspark.{name}": t.numel() * t.element_size() for name, t in tensors(model.dspark).items()}
    assert {t.name: t.nbytes for t in plan.weights if t.kind == "DSpark draft layers"} == held
    assert "dspark.mtp.2.hc_head.hc_fn" in held
    proposer = DSparkProposer(model, config.scheduler.max_num_seqs, k=K)
    assert plan.draft_state_bytes == proposer.device_bytes() > 0


def test_the_engine_takes_a_v4_draft_and_refuses_one_that_is_not_its_targets(dirs, tmp_path):
    from engine.layout import EngineConfigError, check_speculative

    target, draft_dir = dirs
    model_config = ModelConfig.from_file(target / "config.json")
    check_speculative(config_of({"method": "dspark", "num_speculative_tokens": 5, "model": str(draft_dir)}, target),
                      model_config)
    v41 = build_tiny_checkpoint(tmp_path / "v41", seed=1, head_dim=32, qk_rope_head_dim=8)
    wider = build_tiny_checkpoint(tmp_path / "wider", family="v4", hidden_size=96)
    for model, k, named in ((target, 3, "dspark_block_size"), (draft_dir, 6, "num_speculative_tokens"),
                            (build_tiny_dspark(tmp_path / "of_v41", v41), 3, "model_type"),
                            (build_tiny_dspark(tmp_path / "of_wider", wider), 3, "hidden_size")):
        with pytest.raises(EngineConfigError) as error:
            check_speculative(config_of({"method": "dspark", "num_speculative_tokens": k, "model": str(model)}, target),
                              model_config)
        assert "--speculative-config" in str(error.value) and named in str(error.value), str(error.value)
    # method mtp on a checkpoint whose mtp.* layers are V4-Flash-0731's DSpark draft: refused at start
    with pytest.raises(EngineConfigError, match="method mtp.*DSpark draft"):
        check_speculative(config_of({"method": "mtp", "num_speculative_tokens": 2}, draft_dir),
                          ModelConfig.from_file(draft_dir / "config.json"))
    listed = json.loads((draft_dir / "config.json").read_text())
    listed["layer_types"][-1] = "compressed_sparse_attention"
    with pytest.raises(ConfigError, match="layer_types of the DSpark stages"):
        DSparkConfig.from_dict(listed, model_config)
