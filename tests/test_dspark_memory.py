"""A DSpark draft's bytes (issue 27), on the tiny V4.1 and CPU: a draft checkpoint in the release's formats
(FP8 linears with 32 x 32 or 128 x 128 block scales, MXFP4 routed experts) is held as stored with
`model.quantization: checkpoint` and drafts what the same checkpoint dequantized up front drafts; and
`python -m server plan` counts the draft's weights and the proposer's context rings, from config.json
alone, as exactly the bytes a loaded engine allocates for them; a draft it cannot plan is a config error
naming the key, a rig it no longer fits is refused naming the draft's key."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.factory import build_engine_core
from engine.memory_plan import model_bytes
from engine.plan import build_plan
from kernels.quant import dequantize_fp8_blocks, dequantize_mxfp4
from models import load_model
from models.dspark import BlockBatch, allocate_rings, attach_dspark, build_tiny_dspark
from models.layers import Fp8Linear
from models.tiny import build_tiny_checkpoint, tiny_config_dict
from tests.conftest import random_tokens
from tests.test_deploy_plan import plan_main, rig
from tests.test_dspark import release_spelling
from tests.test_proposers import decode
from worker import ModelRunner
from worker.dspark import DSparkProposer

torch.set_num_threads(1)

K = 4
PROMPT = tuple(random_tokens(27, seed=6))
DRAFT = "DSpark draft layers"  # the plan's kind for them


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The tiny V4.1 checkpoint and a random DSpark draft for it: dense, and in the release's formats
    with 32 x 32 and 128 x 128 FP8 blocks (the same draws, quantized)."""
    root = tmp_path_factory.mktemp("dspark_memory")
    target = build_tiny_checkpoint(root / "v41", seed=3)
    drafts = {None: build_tiny_dspark(root / "dense", target, seed=4)}
    for block in (32, 128):
        drafts[block] = build_tiny_dspark(root / f"fp8_{block}", target, seed=4, fp8=block)
    return target, drafts


def dequantized_up_front(draft_dir, out):
    """The draft checkpoint with every FP8 / MXFP4 tensor dequantized to float32 (its scales dropped) and
    no quantization_config: the dense checkpoint a draft held as stored must draft as."""
    stored, raw = load_file(draft_dir / "model.safetensors"), json.loads((draft_dir / "config.json").read_text())
    block = raw.pop("quantization_config")["weight_block_size"][0]
    dense = {}
    for name, tensor in stored.items():
        if name.endswith(("_scale_inv", "_scale")):
            continue
        if f"{name}_scale_inv" in stored:
            dense[name] = dequantize_fp8_blocks(tensor, stored[f"{name}_scale_inv"], block)
        elif f"{name}_scale" in stored:
            dense[name] = dequantize_mxfp4(tensor, stored[f"{name}_scale"])
        else:
            dense[name] = tensor
    out.mkdir()
    save_file({name: tensor.contiguous() for name, tensor in dense.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(raw))
    return out


def release_spelled(stored):
    """A quantized draft's tensors as the release names and stores them: FP8 weights with `.scale` blocks,
    per-expert w1 / w3 / w2 MXFP4 codes with `.scale` exponents (tests/test_dspark.py's renaming)."""
    values = {name: t for name, t in stored.items() if not name.endswith(("_scale", "_scale_inv"))}
    scales = {name: stored.get(f"{name}_scale_inv", stored.get(f"{name}_scale")) for name in values}
    out = release_spelling(values)
    for name, scale in release_spelling({n: s for n, s in scales.items() if s is not None}).items():
        out[name.removesuffix(".weight") + ".scale"] = scale
    return out


def tensors(module) -> dict[str, torch.Tensor]:
    return dict(list(module.named_parameters()) + list(module.named_buffers()))


def bits(tensor):
    """A tensor torch.equal can compare (it has no float8 kernel on the CPU)."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


def loaded(target, draft_dir, keep_quantized=False):
    model = load_model(target, keep_quantized=keep_quantized)
    attach_dspark(model, draft_dir, keep_quantized=keep_quantized)
    return model


# -- held as stored ------------------------------------------------------------------------------------
FP8_LINEARS = ("mtp.0.main_proj", "mtp.1.block.self_attn.q_a_proj", "mtp.1.block.self_attn.q_b_proj",
               "mtp.2.block.self_attn.kv_proj", "mtp.0.block.self_attn.o_a_proj", "mtp.0.block.self_attn.o_b_proj",
               "mtp.2.block.mlp.shared_experts.down_proj")


@pytest.mark.parametrize("block", [32, 128])
def test_a_released_format_draft_is_held_as_stored(dirs, tmp_path, block):
    """keep_quantized: the linears stored FP8 are Fp8Linear holding the stored e4m3 values and float32
    scales (o_a_proj, grouped, too), the routed experts the stored MXFP4 codes and exponents; the heads
    dense, as the target holds them. The same tensors in the release's spelling (`.scale` companions,
    per-expert matrices) are held alike. Without it every tensor is dequantized to the model's dtype."""
    target, drafts = dirs
    stored = load_file(drafts[block] / "model.safetensors")
    kept = loaded(target, drafts[block], keep_quantized=True).dspark
    for name in FP8_LINEARS:
        linear = kept.get_submodule(name)
        assert isinstance(linear, Fp8Linear) and linear.block == block, name
        assert linear.weight.dtype == torch.float8_e4m3fn and linear.weight_scale.dtype == torch.float32
        assert torch.equal(bits(linear.weight), bits(stored[f"{name}.weight"]))
        assert torch.equal(linear.weight_scale, stored[f"{name}.weight_scale_inv"])
    experts = kept.mtp[1].block.mlp.experts
    assert "gate_up_proj" not in dict(experts.named_parameters())
    assert torch.equal(experts.gate_up_proj_codes, stored["mtp.1.block.mlp.experts.gate_up_proj"])
    assert torch.equal(experts.down_proj_scales, stored["mtp.1.block.mlp.experts.down_proj_scale"])
    assert kept.mtp[0].block.self_attn.o_a_proj.groups > 1
    assert type(kept.mtp[2].markov_head.head) is torch.nn.Linear
    assert type(kept.mtp[2].confidence_head.proj) is torch.nn.Linear
    released = tmp_path / "released"
    released.mkdir()
    (released / "config.json").write_text((drafts[block] / "config.json").read_text())
    save_file(release_spelled(stored), str(released / "model.safetensors"))
    held, again = tensors(kept), tensors(loaded(target, released, keep_quantized=True).dspark)
    assert {n: (t.dtype, t.shape) for n, t in again.items()} == {n: (t.dtype, t.shape) for n, t in held.items()}
    assert all(torch.equal(bits(t), bits(held[n])) for n, t in again.items())
    dense = loaded(target, drafts[block]).dspark
    assert not any(isinstance(m, Fp8Linear) for m in dense.modules())
    assert all(t.dtype == torch.float32 for t in tensors(dense).values() if t.is_floating_point())


@pytest.mark.parametrize("block", [32, 128])
def test_drafts_held_as_stored_are_the_dequantized_checkpoints(dirs, tmp_path, block):
    """The same blocks from the draft held as stored (Fp8Linear's and MXFP4 experts' torch references) and
    from the checkpoint dequantized up front: two sequences on random taps (one past the 16-row window),
    the same greedy drafts, confidence and logits within 1e-5 of the logits' largest magnitude (both run
    the same float32 products of the same dequantized values; only the GEMMs' summation order may differ,
    as CPU kernels choose paths by operand alignment). Then greedy decoding with each through a runner:
    every step proposes the same drafts, and the output is plain greedy's."""
    target, drafts = dirs
    kept = loaded(target, drafts[block], keep_quantized=True)
    up_front = loaded(target, dequantized_up_front(drafts[block], tmp_path / "dense"))
    generator = torch.Generator().manual_seed(1)
    taps = [torch.randn(n, 3, 64, generator=generator) for n in (21, 7)]
    batch = BlockBatch.build([(2, 17, 20, 0), (0, 33, 6, 0)], 5, 511, "cpu")
    blocks = []
    for model in (kept, up_front):
        rings = allocate_rings(model.dspark.config, 3, torch.float32, "cpu")
        for slot, rows in ((2, taps[0]), (0, taps[1])):
            seen = torch.arange(max(0, len(rows) - 16), len(rows))
            model.dspark.write_context(rows[seen], seen, torch.full_like(seen, slot), rings)
        blocks.append(model.dspark.draft(batch, rings))
    assert torch.equal(blocks[0].tokens, blocks[1].tokens)
    scale = blocks[1].logits.abs().max()
    assert (blocks[0].logits - blocks[1].logits).abs().max() <= 1e-5 * scale
    assert (blocks[0].confidence - blocks[1].confidence).abs().max() <= 1e-5 * blocks[1].confidence.abs().max()

    plain = decode(ModelRunner(up_front, num_slots=2, max_model_len=128, deterministic=True), 20, prompt=PROMPT)[0]
    proposed = []
    for model in (kept, up_front):
        steps = []
        runner = ModelRunner(model, num_slots=2, max_model_len=128, deterministic=True, draft_tokens=K,
                             proposer=DSparkProposer(model, num_slots=2, k=K))
        got, _ = decode(runner, 20, lambda out, drafts: steps.append(drafts), PROMPT)
        assert got == plain
        proposed.append(steps)
    assert proposed[0] == proposed[1] and any(proposed[0])


# -- the memory plan -----------------------------------------------------------------------------------
def dspark_rig(target, draft_dir, quantization, k=K):
    return rig("cpu-tiny", f"model.path={target}", f"model.quantization={quantization}",
               "runtime.speculative_config=" + json.dumps({"method": "dspark", "num_speculative_tokens": k,
                                                           "model": str(draft_dir)}))


@pytest.mark.parametrize("quantization, block", [("none", None), ("none", 32), ("checkpoint", 32), ("checkpoint", 128)])
def test_the_plan_counts_the_draft_and_its_rings_as_the_engine_allocates(dirs, quantization, block):
    """From config.json alone: the draft's weights, tensor by tensor, are the bytes load_dspark allocates
    (dequantized to float32, or held as stored); the whole weight figure the loaded model's (Engram tables
    apart); the slot state the target cache's (with its rings' spare rows for K drafts) plus the
    proposer's rings, which is what the engine's own profiled plan counts at start. Exact: the plan
    builds the same modules on the meta device. The engine started on the rig holds the same bytes."""
    target, drafts = dirs
    config, path, config_json = dspark_rig(target, drafts[block], quantization)
    plan = build_plan(config, path, config_json)
    keep = quantization == "checkpoint"
    model = loaded(target, drafts[block], keep_quantized=keep)
    held = {f"dspark.{name}": tensor.numel() * tensor.element_size() for name, tensor in tensors(model.dspark).items()}
    assert {t.name: t.nbytes for t in plan.weights if t.kind == DRAFT} == held
    assert any(isinstance(m, Fp8Linear) for m in model.dspark.modules()) == (keep and block is not None)
    assert plan.weights_bytes == model_bytes(model) - model.engram_memory.source.resident_bytes()

    sched = config.scheduler
    proposer = DSparkProposer(model, sched.max_num_seqs, k=K)
    runner = ModelRunner(model, sched.max_num_seqs, plan.max_model_len, num_pages=1, block_tokens=sched.block_tokens,
                         snapshot_slots=sched.snapshot_slots, draft_tokens=K)
    assert plan.draft_state_bytes == proposer.device_bytes() == proposer.rings.numel() * 4
    assert plan.kv.slot_state_bytes == runner.cache.slot_bytes() + proposer.device_bytes()
    if block == 32:  # the engine itself (its profiled plan), once a format: it holds the draft so too
        _, spec = build_engine_core(config, lambda output: None)
        assert spec.memory.slot_state_bytes == plan.kv.slot_state_bytes
        assert spec.memory.weights_bytes == model_bytes(model)


def test_the_plan_prints_the_draft(dirs, capsys):
    target, drafts = dirs
    sets = ["--set", f"model.path={target}", "--set", "model.quantization=checkpoint", "--set",
            "runtime.speculative_config=" + json.dumps({"method": "dspark", "num_speculative_tokens": 3,
                                                        "model": str(drafts[32])})]
    status, out, err = plan_main(capsys, *sets)
    assert status == 0, err
    assert f"  {DRAFT}" in out and "the DSpark rings 108.00 KiB of it (3 stages x 8 + 1 slots x 16 rows x 64 x 4 B" in out


def test_the_release_plans_its_draft_from_the_published_config(capsys):
    """V4.1-Flash on four RTX PRO 6000s drafting with the DSpark layers inside its own checkpoint (not on
    this machine: the published config.json stands in): the draft's weights as stored and its rings fit;
    on two GPUs the rig is refused, naming the draft's key among what would close the gap."""
    model = json.dumps({"method": "dspark", "num_speculative_tokens": 5, "model": "/models/DeepSeek-V4.1-Flash"})
    status, out, err = plan_main(capsys, "--config", "configs/rtxpro6000x4.yaml", "--set",
                                 f"runtime.speculative_config={model}")
    assert status == 0, err
    assert f"  {DRAFT}" in out and "the DSpark rings 6.38 MiB of it (3 stages x 16 + 1 slots x 128 rows x 512 x 2 B" in out
    status, _, err = plan_main(capsys, "--config", "configs/rtxpro6000x4.yaml", "--set",
                               "parallel.tensor_parallel_size=2", "--set", f"runtime.speculative_config={model}")
    assert status == 1 and "does not fit" in err and "no draft layers (runtime.speculative_config" in err, err


def test_a_draft_the_plan_cannot_hold_is_a_config_error_naming_the_key(dirs, tmp_path, capsys):
    target, drafts = dirs
    v4_json = tmp_path / "v4" / "config.json"
    v4_json.parent.mkdir()
    v4_json.write_text(json.dumps(tiny_config_dict()))
    for model, k, extra, named in (
        (drafts[None], 6, (), "runtime.speculative_config.num_speculative_tokens"),  # a block of 5
        (target, 3, (), "dspark_block_size"),  # the target alone holds no draft
        (tmp_path / "nowhere", 3, (), "cannot read the draft config"),
        (drafts[None], 3, ("--model-config", str(v4_json)), "model_type differ"),  # V4.1's draft, a V4 target
    ):
        value = json.dumps({"method": "dspark", "num_speculative_tokens": k, "model": str(model)})
        status, _, err = plan_main(capsys, "--set", f"model.path={target}", "--set",
                                   f"runtime.speculative_config={value}", *extra)
        assert status == 2 and "--speculative-config" in err and named in err, err
