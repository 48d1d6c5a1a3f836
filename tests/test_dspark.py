"""DSpark drafting (issue 27: models/dspark.py, worker/dspark.py) on the tiny V4.1, on CPU: the draft
checkpoint loads (in this project's tensor names and in the release's); the draft forward is the math a
plain torch statement of DeepSpec's DSpark on V4.1's layers gives; the proposer's incremental drafts
(context rings kept across chunks, rejected rows never written) are the drafts computed afresh; greedy
decoding with DSpark drafts is plain greedy bitwise, through a runner and served through the openai
client (deterministic mode: mixed batches, preemption, prefix-cache hits, an abort, a seeded sampled
request); bad dspark configs are config errors naming the key."""

from __future__ import annotations

import concurrent.futures
import json
import math
import shutil
from pathlib import Path

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from contract import TokenLogprob
from contract.config import ConfigFileError, load_config
from models import ForwardBatch, ModelConfig, load_model
from models.dspark import BlockBatch, allocate_rings, attach_dspark, build_tiny_dspark
from models.tiny import build_tiny_checkpoint, tiny_config_dict
from tests.conftest import random_tokens
from tests.serving import dropped_stream, running_server, settled_metrics
from tests.test_proposers import decode as decode_with_drafts
from worker import ModelRunner
from worker.dspark import DSparkProposer

torch.set_num_threads(1)

K = 4
PROMPT = tuple(random_tokens(27, seed=6))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(the tiny V4.1 checkpoint, a random DSpark draft for it with a Markov rank of 128)."""
    root = tmp_path_factory.mktemp("dspark")
    target = build_tiny_checkpoint(root / "v41", seed=3)
    return target, build_tiny_dspark(root / "draft", target, seed=4, dspark_markov_rank=128)


def with_draft(dirs, draft=None):
    target, default = dirs
    model = load_model(target)
    attach_dspark(model, draft or default)
    return model


# -- loading ------------------------------------------------------------------------------------------
RELEASE_NAMES = [  # this project's module names -> the release's (the V4.1 reference's inference names)
    ("block.self_attn.", "attn."), ("q_a_proj.", "wq_a."), ("q_b_proj.", "wq_b."), ("kv_proj.", "wkv."),
    ("o_a_proj.", "wo_a."), ("o_b_proj.", "wo_b."), ("q_a_norm.", "q_norm."), ("attn.sinks", "attn.attn_sink"),
    ("block.mlp.", "ffn."), ("gate.e_score_correction_bias", "gate.bias"),
    ("shared_experts.gate_proj.", "shared_experts.w1."),
    ("shared_experts.up_proj.", "shared_experts.w3."), ("shared_experts.down_proj.", "shared_experts.w2."),
    ("block.input_layernorm.", "attn_norm."), ("block.post_attention_layernorm.", "ffn_norm."),
    ("block.attn_hc.", "hc_attn_"), ("block.ffn_hc.", "hc_ffn_"),
]


def release_spelling(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The draft's tensors as the release names them, routed experts one matrix each."""
    out = {}
    for name, tensor in weights.items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name.replace("block.mlp.", "ffn.").removesuffix("gate_up_proj")
            for expert, matrix in enumerate(tensor):
                gate, up = matrix.chunk(2)
                out[f"{prefix}{expert}.w1.weight"], out[f"{prefix}{expert}.w3.weight"] = gate, up
        elif name.endswith("experts.down_proj"):
            prefix = name.replace("block.mlp.", "ffn.").removesuffix("down_proj")
            for expert, matrix in enumerate(tensor):
                out[f"{prefix}{expert}.w2.weight"] = matrix
        else:
            for mine, theirs in RELEASE_NAMES:
                name = name.replace(mine, theirs)
            out[name] = tensor.contiguous()
    return out


def test_the_draft_checkpoint_loads_in_either_spelling(dirs, tmp_path):
    target, draft_dir = dirs
    draft = with_draft(dirs).dspark
    config = draft.config
    assert (config.stages, config.block_size, config.tap_layers, config.noise_token_id, config.markov_rank) == (
        3, 5, (3, 4, 5), 511, 128)
    layers = config.layers
    assert (layers.n_routed_experts, layers.num_experts_per_tok, layers.sliding_window) == (4, 3, 16)
    stored = load_file(draft_dir / "model.safetensors")
    held = dict(list(draft.named_parameters()) + list(draft.named_buffers()))
    assert set(held) == set(stored) and all(torch.equal(held[n], stored[n]) for n in stored)
    released = tmp_path / "released"
    released.mkdir()
    shutil.copy(draft_dir / "config.json", released / "config.json")
    renamed = release_spelling(stored)
    assert "mtp.0.attn.wq_a.weight" in renamed and "mtp.1.ffn.experts.3.w2.weight" in renamed
    assert "mtp.2.hc_ffn_fn" in renamed and "mtp.0.ffn.gate.bias_vl" in renamed
    save_file(renamed, str(released / "model.safetensors"))
    again = with_draft(dirs, released).dspark
    assert all(torch.equal(tensor, held[name]) for name, tensor in
               list(again.named_parameters()) + list(again.named_buffers()))


# -- the draft forward against a plain statement of its math --------------------------------------------
def rms(x, weight, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


def rope(x, positions, theta, dim, inverse=False):
    """Interleaved pairs of the last `dim` channels turned by position * theta^(-2i / dim)."""
    angles = positions[:, None].float() / theta ** (torch.arange(0, dim, 2).float() / dim)
    cos, sin = angles.cos(), angles.sin() * (-1 if inverse else 1)
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    even, odd = x[..., -dim::2], x[..., -dim + 1::2]
    turned = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
    return torch.cat([x[..., :-dim], turned], dim=-1)


def fp8(x):
    """float8_e4m3fn values with a power-of-two scale per 32 channels (V4.1's window KV)."""
    blocks = x.view(*x.shape[:-1], -1, 32)
    scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448)))
    return ((blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).view(x.shape)


def hc_site(streams, w, prefix, pre_in, c):
    """An mHC site: (its pre, post, comb, the streams collapsed by `pre_in`)."""
    n = c["hc_mult"]
    flat = streams.flatten(1)
    logits = (flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + c["rms_norm_eps"])) @ w[prefix + "fn"].T
    base, scale = w[prefix + "base"], w[prefix + "scale"]
    pre = torch.sigmoid(logits[:, :n] * scale[0] + base[:n]) + c["hc_eps"]
    post = 2 * torch.sigmoid(logits[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = torch.softmax(logits[:, 2 * n:].view(-1, n, n) * scale[2] + base[2 * n:].view(n, n), -1) + c["hc_eps"]
    comb = comb / (comb.sum(-2, keepdim=True) + c["hc_eps"])
    for _ in range(c["hc_sinkhorn_iters"] - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + c["hc_eps"])
        comb = comb / (comb.sum(-2, keepdim=True) + c["hc_eps"])
    return pre, post, comb, (pre_in[:, :, None] * streams).sum(1)


def merge(streams, post, comb, out):
    return post[:, :, None] * out[:, None, :] + torch.einsum("tjk,tjd->tkd", comb, streams)


def swiglu(x, gate, up, down, limit):
    return F.silu((x @ gate.T).clamp(max=limit)) * (x @ up.T).clamp(-limit, limit), down


def moe(x, w, p, c, d):
    """Routed (sqrtsoftplus, bias picks, weights renormalised and scaled, weight before the down
    projection) plus the shared expert, SwiGLU clamped at swiglu_limit."""
    scores = F.softplus(x @ w[p + "gate.weight"].T).sqrt()
    ids = (scores + w[p + "gate.e_score_correction_bias"]).topk(d["dspark_num_experts_per_tok"], dim=-1).indices
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * c["routed_scaling_factor"]
    out = torch.zeros_like(x)
    limit, inter = c["swiglu_limit"], c["moe_intermediate_size"]
    for t in range(x.shape[0]):
        for slot, e in enumerate(ids[t].tolist()):
            gate_up = w[p + "experts.gate_up_proj"][e]
            h, down = swiglu(x[t:t + 1], gate_up[:inter], gate_up[inter:], w[p + "experts.down_proj"][e], limit)
            out[t] += ((weights[t, slot] * h) @ down.T)[0]
    shared, down = swiglu(x, w[p + "shared_experts.gate_proj.weight"], w[p + "shared_experts.up_proj.weight"],
                          w[p + "shared_experts.down_proj.weight"], limit)
    return out + shared @ down.T


def attention(x, context, positions, w, p, c):
    """Block rows x [B, D] at `positions` over the context keys [M, hd] and their own, every row every key."""
    heads, hd, rd, eps = c["num_attention_heads"], c["head_dim"], c["qk_rope_head_dim"], c["rms_norm_eps"]
    q = (rms(x @ w[p + "q_a_proj.weight"].T, w[p + "q_a_norm.weight"], eps) @ w[p + "q_b_proj.weight"].T)
    q = rope(q.view(-1, heads, hd), positions, c["rope_theta"], rd)
    own = fp8(rope(rms(x @ w[p + "kv_proj.weight"].T, w[p + "kv_norm.weight"], eps), positions, c["rope_theta"], rd))
    keys = torch.cat([context, own])
    scores = torch.einsum("bhd,kd->hbk", q, keys) / math.sqrt(hd)
    sinks = w[p + "sinks"][:, None, None].expand(-1, x.shape[0], 1)
    probs = torch.softmax(torch.cat([scores, sinks], -1), -1)[..., :-1]
    out = rope(torch.einsum("hbk,kd->bhd", probs, keys), positions, c["rope_theta"], rd, inverse=True)
    groups = c["o_groups"]
    grouped = torch.einsum("bgi,gri->bgr", out.reshape(x.shape[0], groups, -1),
                           w[p + "o_a_proj.weight"].view(groups, c["o_lora_rank"], -1))
    return grouped.flatten(1) @ w[p + "o_b_proj.weight"].T


def reference_block(w, target_w, raw, taps, first_token):
    """One sequence's drafts, logits and confidence logits: context taps [L, taps, D] at 0 .. L - 1, the
    block after them starting with `first_token`, as DeepSpec's DSpark on V4.1's layers defines them."""
    c, eps = raw, raw["rms_norm_eps"]
    seen, main, positions, streams = block_inputs(w, target_w, raw, taps, first_token)
    pre = F.one_hot(torch.zeros(len(positions), dtype=torch.long), c["hc_mult"]).float()
    for stage in range(raw["num_nextn_predict_layers"]):
        p = f"mtp.{stage}.block."
        context = fp8(rope(rms(main @ w[p + "self_attn.kv_proj.weight"].T, w[p + "self_attn.kv_norm.weight"], eps),
                           seen, c["rope_theta"], c["qk_rope_head_dim"]))
        attn_pre, post, comb, collapsed = hc_site(streams, w, p + "attn_hc.", pre, c)
        normed = rms(collapsed, w[p + "input_layernorm.weight"], eps)
        out = attention(normed, context, positions, w, p + "self_attn.", c)
        streams = merge(streams, post, comb, out)
        pre, post, comb, collapsed = hc_site(streams, w, p + "ffn_hc.", attn_pre, c)
        streams = merge(streams, post, comb, moe(rms(collapsed, w[p + "post_attention_layernorm.weight"], eps), w,
                                                 p + "mlp.", c, raw))
    return markov_drafts(w, target_w, raw, (pre[:, :, None] * streams).sum(1),
                         f"mtp.{raw['num_nextn_predict_layers'] - 1}.", first_token)


def block_inputs(w, target_w, raw, taps, first_token):
    """Where both drafts' plain statements start: the context rows the window keeps (`seen`), their taps
    through main_proj and its norm (`main`), the block's positions, and its embedded streams
    [block, hc_mult, D] (`first_token`, then the noise token)."""
    length, block, window = taps.shape[0], raw["dspark_block_size"], raw["sliding_window"]
    seen = torch.arange(max(0, length - window), length)
    main = rms(taps[seen].flatten(1) @ w["mtp.0.main_proj.weight"].T, w["mtp.0.main_norm.weight"], raw["rms_norm_eps"])
    positions = torch.arange(length, length + block)
    ids = torch.tensor([first_token] + [raw["dspark_noise_token_id"]] * (block - 1))
    return seen, main, positions, target_w["model.embed_tokens.weight"][ids][:, None].expand(-1, raw["hc_mult"], -1)


def markov_drafts(w, target_w, raw, hidden, last, first_token):
    """Where both end: the last stage's (`last`, e.g. "mtp.2.") norm and the target's head on the block's
    collapsed `hidden` [block, D], the Markov head applied left to right from `first_token` (greedy), and
    the confidence head on [hidden, Markov embedding]; (drafts, logits, confidence logits)."""
    base = rms(hidden, w[last + "norm.weight"], raw["rms_norm_eps"]) @ target_w["lm_head.weight"].T
    previous, drafts, logits, embedded = first_token, [], [], []
    for j in range(hidden.shape[0]):
        embedded.append(w[last + "markov_head.embed.weight"][previous])
        logits.append(base[j] + w[last + "markov_head.head.weight"] @ embedded[-1])
        previous = int(logits[-1].argmax())
        drafts.append(previous)
    features = torch.cat([hidden, torch.stack(embedded)], dim=-1)
    return drafts, torch.stack(logits), (features @ w[last + "confidence_head.proj.weight"].T)[:, 0]


def check_draft_forward(dirs, reference) -> None:
    """Two sequences at once (21 context rows, more than the 16-row window, in slot 2; 7 in slot 0) on
    random taps: the same greedy drafts, logits and confidence logits as `reference(draft weights,
    target weights, draft config, taps, token)`, the plain statement, within 1e-4 of their largest
    magnitude (float32: only the order of sums differs)."""
    target, draft_dir = dirs
    draft = with_draft(dirs).dspark
    raw = json.loads((draft_dir / "config.json").read_text())
    w, target_w = load_file(draft_dir / "model.safetensors"), load_file(target / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    taps = [torch.randn(n, 3, raw["hidden_size"], generator=generator) for n in (21, 7)]
    rings = allocate_rings(draft.config, 3, torch.float32, "cpu")
    for slot, rows in ((2, taps[0]), (0, taps[1])):
        seen = torch.arange(max(0, len(rows) - 16), len(rows))
        draft.write_context(rows[seen], seen, torch.full_like(seen, slot), rings)
    got = draft.draft(BlockBatch.build([(2, 17, 20, 0), (0, 33, 6, 0)], 5, 511, "cpu"), rings)
    for n, (rows, token) in enumerate(((taps[0], 17), (taps[1], 33))):
        drafts, logits, confidence = reference(w, target_w, raw, rows, token)
        assert got.tokens[n].tolist() == drafts
        assert (got.logits[n] - logits).abs().max() <= 1e-4 * logits.abs().max()
        assert (got.confidence[n] - confidence).abs().max() <= 1e-4 * confidence.abs().max()


def test_the_draft_forward_is_dsparks_math(dirs):
    """V4.1's draft against the plain statement of DSpark's math (`reference_block`)."""
    check_draft_forward(dirs, reference_block)


# -- the proposer through a runner ----------------------------------------------------------------------
def decode(runner, length, on_step=None) -> tuple[list[TokenLogprob], list[int]]:
    """tests/test_proposers.py's greedy decoding with drafts, of this module's PROMPT."""
    return decode_with_drafts(runner, length, on_step, PROMPT)


def drafts_afresh(model, tokens: list[int]) -> tuple[int, ...]:
    """The K drafts after `tokens` (the last one just drawn) from scratch: the target over the others in
    one chunk for their taps, the last window of them as context, one block."""
    draft = model.dspark
    runner = ModelRunner(model, num_slots=1, max_model_len=128, deterministic=True)
    taps = torch.empty(len(tokens) - 1, 3, model.config.hidden_size)
    runner.model(ForwardBatch.build([(0, tokens[:-1], 0)]), runner.cache,
                 taps_out={layer: taps[:, i] for i, layer in enumerate(draft.config.tap_layers)})
    rings = allocate_rings(draft.config, 1, torch.float32, "cpu")
    seen = torch.arange(max(0, len(taps) - 16), len(taps))
    draft.write_context(taps[seen], seen, torch.zeros_like(seen), rings)
    block = draft.draft(BlockBatch.build([(0, tokens[-1], len(tokens) - 2, 0)], 5, 511, "cpu"), rings)
    return tuple(block.tokens[0, :K].tolist())


def successor_markov(weights: dict[str, torch.Tensor], sequences: list[list[int]], strength: float = 100.0) -> None:
    """Rigs the Markov head of a draft's `weights` so that after a token seen in `sequences` the draft
    follows it with the token that followed it there (a bigram table of rank up to the Markov rank):
    the drafts then often pass, which random weights almost never do."""
    last = max(int(name.split(".")[1]) for name in weights if name.startswith("mtp."))
    embed, head = f"mtp.{last}.markov_head.embed.weight", f"mtp.{last}.markov_head.head.weight"
    successors = {a: b for tokens in sequences for a, b in zip(tokens, tokens[1:])}
    rank = weights[embed].shape[1]
    weights[embed], weights[head] = torch.zeros_like(weights[embed]), torch.zeros_like(weights[head])
    for i, (a, b) in enumerate(list(successors.items())[:rank]):
        weights[embed][a, i] = 1.0
        weights[head][b, i] += strength


def rigged_copy(draft_dir: Path, out: Path, sequences: list[list[int]]) -> Path:
    """A copy of the draft at `out` with its Markov head following the bigrams of `sequences` (some drafts pass)."""
    shutil.copytree(draft_dir, out)
    weights = load_file(out / "model.safetensors")
    successor_markov(weights, sequences)
    save_file(weights, str(out / "model.safetensors"))
    return out


def test_greedy_with_dspark_drafts_is_plain_greedy_and_drafts_as_afresh(dirs, tmp_path):
    """Deterministic mode: plain greedy's tokens and bitwise logprobs with the proposer's drafts fed back
    (K = 4 of a block of 5); every step's drafts those of the draft run afresh over the whole sequence;
    with a Markov head rigged to the plain run's bigrams some steps accept drafts and some reject them."""
    plain = decode(ModelRunner(with_draft(dirs), num_slots=2, max_model_len=128, deterministic=True), 30)[0]
    target, draft_dir = dirs
    rigged = rigged_copy(draft_dir, tmp_path / "rigged", [[*PROMPT, *(t.token_id for t in plain)]])
    for directory in (draft_dir, rigged):
        model = with_draft(dirs, directory)
        proposer = DSparkProposer(model, num_slots=2, k=K)
        runner = ModelRunner(model, num_slots=2, max_model_len=128, deterministic=True, draft_tokens=K,
                             proposer=proposer)
        seen = []

        def check(out, drafts):
            seen.append(drafts == drafts_afresh(model, [*PROMPT, *(t.token_id for t in out)]))

        got, accepted = decode(runner, 30, check)
        assert got == plain  # tokens, logprobs and top-2 alternatives bitwise
        assert seen and all(seen)
        if directory == rigged:
            print(f"rigged: {sum(accepted)} drafts accepted over {len(accepted)} verify steps")
            assert 0 < sum(accepted) < K * len(accepted)


def test_the_confidence_head_cuts_the_block_where_deepspec_does(dirs):
    proposer = DSparkProposer(with_draft(dirs), num_slots=1, k=4, confidence_threshold=0.5)
    logits = torch.logit(torch.tensor([[0.9, 0.6, 0.4, 0.8], [0.3, 0.9, 0.9, 0.9], [0.7, 0.7, 0.7, 0.7]]))
    assert proposer.confident_lengths(logits).tolist() == [2, 0, 4]
    assert DSparkProposer(with_draft(dirs), num_slots=1, k=4).confident_lengths(logits).tolist() == [4, 4, 4]


# -- served: the openai client -------------------------------------------------------------------------
PROMPTS = ["Hello there", "def main(): return 1 + 2 + 3 + 1 + 2 + 3", "the cat sat on the mat, the cat sat"]
# 238 tokens: two 128-token pages each, the first a prefix-cache point, the third page needed 18 tokens on
LONG_PROMPTS = [f"{i}: " + " ".join(PROMPTS) * 5 + " " + " ".join(PROMPTS)[:40] for i in range(3)]


def served_workload(base: str) -> dict[str, object]:
    """What a served model answers, in a fixed order: PROMPTS greedily at once (a mixed batch), then under
    pressure 3 long greedy requests at once on too few KV pages (preemption), one of them twice more
    alone (prefix-cache hits), a seeded sampled request, and a greedy request beside a stream the client
    drops after 3 chunks (an abort). Greedy replies as (token ids, tokens, logprobs)."""
    llm = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)

    def greedy(prompt: str, max_tokens: int = 24) -> tuple[list[int], list[str], list[float]]:
        reply = llm.completions.create(model="spec", prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=1,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
        choice = reply.choices[0]
        return choice.model_extra["token_ids"], choice.logprobs.tokens, choice.logprobs.token_logprobs

    out: dict[str, object] = {}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        out["mixed"] = list(pool.map(greedy, PROMPTS))
        out["crowded"] = list(pool.map(greedy, LONG_PROMPTS, [30] * 3))
        out["again"] = [greedy(LONG_PROMPTS[0], 12), greedy(LONG_PROMPTS[0], 12)]  # the second hits the first's point
        sampled = llm.completions.create(model="spec", prompt=PROMPTS[1], max_tokens=20, temperature=0.8, seed=7,
                                         extra_body={"ignore_eos": True})
        out["seeded"] = sampled.choices[0].text
        beside = pool.submit(greedy, PROMPTS[0], 20)
        pool.submit(dropped_stream, llm, "spec", PROMPTS[2]).result()
        out["beside_abort"] = beside.result()
    return out


ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # the servers' torch: a busy machine's other core must not stall its steps
SERVED = ("--deterministic", "--max-model-len", "512", "--set", "memory.num_kv_pages=6", "--max-num-seqs", "3")


def served_without_drafts(target: Path, draft_dir: Path, out: Path) -> tuple[dict[str, object], str]:
    """`served_workload` on `target` served without drafts (it must preempt and hit its prefix cache), and
    the --speculative-config of a DSpark draft (K = 5, fixed) whose Markov head follows those replies'
    bigrams, copied to `out`."""
    with running_server(target, "spec", *SERVED, env=ONE_THREAD) as base:
        plain = served_workload(base)
        preempted, hits = settled_metrics(base, "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total")
        assert preempted > 0 and hits > 0
    rigged = rigged_copy(draft_dir, out, [ids for ids, _, _ in plain["mixed"] + plain["crowded"]])
    return plain, json.dumps({"method": "dspark", "num_speculative_tokens": 5, "model": str(rigged), "adaptive": False})


def test_served_greedy_with_dspark_drafts_is_greedy_without_them(dirs, tmp_path):
    """The tiny V4.1 served in deterministic mode (6 KV pages of 128 tokens, which the 3 long requests at
    once outgrow), through the openai client: with --speculative-config method dspark (K = 5, a draft
    whose Markov head follows the plain run's bigrams) every greedy reply has the same tokens and
    bitwise the same logprobs as without, the seeded sampled reply the same text; both servers preempted
    and hit their prefix cache; drafts were verified, some accepted, some not."""
    target, draft_dir = dirs
    plain, config = served_without_drafts(target, draft_dir, tmp_path / "rigged")
    with running_server(target, "spec", *SERVED, "--speculative-config", config, env=ONE_THREAD) as base:
        drafting = served_workload(base)
        drafts, accepted, preempted, hits = settled_metrics(
            base, "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
            "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total")
        print(f"dspark served: {drafts:.0f} drafts, {accepted:.0f} accepted, {preempted:.0f} preemptions, "
              f"{hits:.0f} prefix-hit tokens")
        assert drafts > accepted > 0 and preempted > 0 and hits > 0
        assert httpx.get(base + "/health").status_code == 200
    for key in plain:
        assert drafting[key] == plain[key], key


# -- configuration errors -------------------------------------------------------------------------------
def config_of(value: object, model: str | None = None):
    overrides = [f"runtime.speculative_config={json.dumps(value)}"] + ([f"model.path={model}"] if model else [])
    return load_config(None, overrides, {})


@pytest.mark.parametrize("value, named", [
    ({"method": "dspark", "num_speculative_tokens": 3}, "model"),
    ({"method": "mtp", "num_speculative_tokens": 2, "model": "somewhere"}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "confidence_threshold": 0.5}, "confidence_threshold"),
    ({"method": "dspark", "num_speculative_tokens": 3, "model": "d", "confidence_threshold": 2},
     "confidence_threshold"),
])
def test_a_bad_dspark_config_is_a_config_error_naming_the_key(value, named):
    with pytest.raises(ConfigFileError) as error:
        config_of(value)
    assert "speculative_config" in str(error.value) and named in str(error.value)


def test_the_engine_refuses_a_draft_that_is_not_a_dspark_checkpoint_of_its_model(dirs, tmp_path):
    from engine.layout import EngineConfigError, check_speculative

    target, draft_dir = dirs
    model_config = ModelConfig.from_file(target / "config.json")
    check_speculative(config_of({"method": "dspark", "num_speculative_tokens": 5, "model": str(draft_dir)}, target),
                      model_config)
    other = build_tiny_checkpoint(tmp_path / "wider", hidden_size=96)
    for model, k, named in ((target, 3, "dspark_block_size"), (tmp_path / "nowhere", 3, "cannot read"),
                            (draft_dir, 6, "num_speculative_tokens"),
                            (build_tiny_dspark(tmp_path / "other", other), 3, "hidden_size")):
        with pytest.raises(EngineConfigError) as error:
            check_speculative(config_of({"method": "dspark", "num_speculative_tokens": k, "model": str(model)}, target),
                              model_config)
        assert "--speculative-config" in str(error.value) and named in str(error.value), str(error.value)
    with pytest.raises(EngineConfigError, match="model_type differ"):  # V4.1's draft on a V4 target
        check_speculative(config_of({"method": "dspark", "num_speculative_tokens": 3, "model": str(draft_dir)}),
                          ModelConfig.from_dict(tiny_config_dict(hidden_size=64, num_attention_heads=4, head_dim=64)))


def test_serve_refuses_a_dspark_model_that_is_not_a_draft_naming_the_flag(dirs):
    """Exit 2 at start, before the model loads: the tiny V4.1's own directory holds no DSpark draft."""
    from tests.test_cli import run_cli

    target, _ = dirs
    config = json.dumps({"method": "dspark", "num_speculative_tokens": 3, "model": str(target)})
    result = run_cli("serve", str(target), "--speculative-config", config)
    assert result.returncode == 2, result.stderr
    assert "--speculative-config" in result.stderr and "dspark_block_size" in result.stderr, result.stderr
