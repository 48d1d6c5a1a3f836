"""`--load-format dummy`: a directory holding only config.json serves seeded random weights at its dims
(through the real server and the official openai client), deterministic for a seed, split across
tensor-parallel ranks as a checkpoint would be, in bf16 or the release's formats, with V4.1's Engram
tables of the configured size (written once as table files for the disk tier); the memory plan needs
no safetensors; bad values and missing files are refused naming the key or the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
import torch

from contract.config import DEFAULT_MODEL_DIR, ConfigFileError, load_config
from contract.model_files import check_model_dir, tokenizer_dir
from engine.factory import check_tokenizer, weight_parts
from engine.layout import EngineConfigError
from engine.memory_plan import model_bytes
from engine.plan import build_plan, model_config_json
from engram_store.build import EngramConfigError
from engram_store.convert import read_header, table_file, verify_table
from engram_store.store import EngramOptions
from kernels.quant import quantize_mxfp4
from models import ForwardBatch, ModelCache, ModelConfig, TensorParallel
from models.dummy_weights import build_dummy_model
from models.layers import Fp8Linear
from models.moe import Experts
from models.parallel import shard_of
from models.random_model import random_tensor, seeded
from server.cli import parse_args
from tests.conftest import random_tokens
from tests.serving import server_process

TINY = DEFAULT_MODEL_DIR  # the embedded default: its config.json, and the tokenizer a dummy directory borrows
HOST = EngramOptions(residency="host")


@pytest.fixture
def config_only(tmp_path) -> Path:
    """A directory with the tiny V4.1's config.json and nothing else."""
    directory = tmp_path / "dims"
    directory.mkdir()
    shutil.copy(TINY / "config.json", directory / "config.json")
    return directory


def build(directory: Path, seed: int = 0, **kwargs):
    return build_dummy_model(directory, seed, tokenizer_dir=TINY, **{"engram": HOST, **kwargs})


def greedy(model, prompt: list[int], steps: int = 6) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        cache = ModelCache.allocate(model.config, 1, 128)
        tokens.append(int(model(ForwardBatch.build([(0, tokens, 0)]), cache)[-1].argmax()))
    return tokens[len(prompt):]


def tensors(model) -> dict[str, torch.Tensor]:
    return dict(list(model.named_parameters()) + list(model.named_buffers()))


def test_a_config_only_directory_serves_chat_through_the_openai_client(config_only):
    with server_process(config_only, "dims", "--load-format", "dummy", "--max-model-len", "512") as server:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
        response = client.chat.completions.create(model="dims", messages=[{"role": "user", "content": "Hello"}],
                                                  max_tokens=6, temperature=0)
        choice = response.choices[0]  # random weights think on: the text lands in reasoning_content
        assert choice.finish_reason == "length" and response.usage.completion_tokens == 6
        assert (choice.message.content or "") + (getattr(choice.message, "reasoning_content", None) or "")
    assert not any(config_only.glob("*.safetensors"))


def test_the_same_seed_draws_the_same_model_another_seed_another():
    prompt = random_tokens(12, seed=3)
    first, again, other = (build(TINY, seed) for seed in (0, 0, 1))
    assert all(torch.equal(a, b) for a, b in zip(tensors(first).values(), tensors(again).values()))
    assert greedy(first, prompt) == greedy(again, prompt)
    assert not torch.equal(tensors(first)["model.layers.0.self_attn.q_a_proj.weight"],
                           tensors(other)["model.layers.0.self_attn.q_a_proj.weight"])
    assert torch.equal(first.engram_memory.source.tiers["host"].layers[0].values.view(torch.uint8),
                       again.engram_memory.source.tiers["host"].layers[0].values.view(torch.uint8))


def test_tensor_parallel_ranks_hold_their_shards_of_the_one_model():
    whole = tensors(build(TINY, engram=None))
    for rank in range(2):
        model = build(TINY, engram=None, tp=TensorParallel(rank=rank, world_size=2))
        for name, held in tensors(model).items():
            shard, module = shard_of(model, name), model.get_submodule(name.rpartition(".")[0])
            expected = whole[name]
            if isinstance(module, Experts):
                expected = expected[module.first : module.first + module.held]
            elif shard is not None:
                expected = torch.cat([expected.narrow(shard.dim, a, b - a) for a, b in shard.ranges], shard.dim)
            assert torch.equal(held, expected), (rank, name)
    released = build(TINY, engram=None, released=True)
    for rank in range(2):  # the release's formats: each rank's experts and FP8 rows of the same quantized model
        model = build(TINY, engram=None, released=True, tp=TensorParallel(rank=rank, world_size=2))
        experts, q_b = model.model.layers[2].mlp.experts, model.model.layers[2].self_attn.q_b_proj
        whole_experts, whole_q_b = released.model.layers[2].mlp.experts, released.model.layers[2].self_attn.q_b_proj
        own = slice(experts.first, experts.first + experts.held)
        assert torch.equal(experts.down_proj_codes, whole_experts.down_proj_codes[own])
        rows = slice(rank * q_b.out_features, (rank + 1) * q_b.out_features)
        assert isinstance(q_b, Fp8Linear) and torch.equal(q_b.weight.view(torch.uint8),
                                                          whole_q_b.weight[rows].view(torch.uint8))


def test_the_released_format_holds_mxfp4_experts_and_fp8_linears_of_the_same_draw():
    model = build(TINY, released=True)
    layer = model.model.layers[1]
    for linear in (layer.self_attn.q_a_proj, layer.self_attn.kv_proj, layer.mlp.shared_experts.down_proj):
        assert isinstance(linear, Fp8Linear) and linear.weight.dtype == torch.float8_e4m3fn
    assert isinstance(model.model.layers[1].engram.wkv, Fp8Linear)  # V4.1 stores Engram's wkv FP8 too
    o_a = layer.self_attn.o_a_proj  # grouped, stored FP8 and held so (as the loader holds it)
    assert isinstance(o_a, Fp8Linear) and o_a.groups == model.config.o_groups and o_a.weight.dtype == torch.float8_e4m3fn
    experts = layer.mlp.experts
    assert experts.gate_up_proj_codes.dtype == torch.uint8 and "gate_up_proj" not in experts._parameters
    name = "model.layers.1.mlp.experts.gate_up_proj"
    dense = random_tensor(name, experts.weights("gate_up_proj").shape[1:], 0, seeded("cpu", 0, name, 3))
    codes, scales = quantize_mxfp4(dense)
    assert torch.equal(experts.gate_up_proj_codes[3], codes) and torch.equal(experts.gate_up_proj_scales[3], scales)
    assert len(greedy(model, random_tokens(8, seed=1), steps=2)) == 2


def test_the_plan_of_a_config_only_directory_counts_what_dummy_weights_hold(config_only):
    sets = [f"model.path={config_only}", "model.load_format=dummy", "model.quantization=checkpoint"]
    config = load_config(None, sets)
    plan = build_plan(config, Path("cpu-tiny.yaml"), model_config_json(config))
    model = build(config_only, released=True)
    experts = sum(t.numel() * t.element_size() for m in model.modules() if isinstance(m, Experts)
                  for t in m.buffers())
    assert sum(t.nbytes for t in plan.weights if t.kind == "routed experts") == experts  # MXFP4, as drawn
    dense = build_plan(load_config(None, sets[:2]), Path("cpu-tiny.yaml"), model_config_json(config))
    model = build(config_only)
    assert dense.weights_bytes == model_bytes(model) - model.engram_memory.source.resident_bytes()


def test_engram_disk_tables_are_drawn_once_and_read_the_host_tables_rows(config_only, tmp_path):
    disk = EngramOptions(residency="disk", path=tmp_path / "tables", host_cache_bytes=1 << 14, queue_depth=8)
    prompt = random_tokens(40, seed=5)
    expected = greedy(build(config_only), prompt, steps=3)
    assert greedy(build(config_only, engram=disk), prompt, steps=3) == expected
    files = sorted((tmp_path / "tables").glob("*.tbl"))
    assert len(files) == 2 and all(verify_table(path) == [] for path in files)
    ids = {path: read_header(path).table_id for path in files}
    build(config_only, engram=disk)  # written once: the second start opens the same files
    assert {path: read_header(path).table_id for path in files} == ids
    with pytest.raises(EngramConfigError, match=f"{table_file(tmp_path / 'tables', 1)}.*model.seed 1"):
        build(config_only, seed=1, engram=disk)  # another seed's tables are not these: refused at an explicit path


def test_a_missing_config_json_bad_load_format_and_missing_weights_are_refused(config_only, tmp_path):
    yaml = tmp_path / "rig.yaml"
    yaml.write_text("model:\n  load_format: pickle\n")
    with pytest.raises(ConfigFileError, match=f"{yaml}: model.load_format: Input should be 'auto' or 'dummy'"):
        load_config(yaml)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigFileError, match=rf"model.path \(MODEL / --model\) {empty}: no config.json"):
        check_model_dir(load_config(None, [f"model.path={empty}", "model.load_format=dummy"]))
    with pytest.raises(ConfigFileError, match="no weights .* add --load-format dummy"):
        check_model_dir(load_config(None, [f"model.path={config_only}"]))
    with pytest.raises(ConfigFileError, match=rf"model.tokenizer \(--tokenizer\) {empty}: no tokenizer.json"):
        check_model_dir(load_config(None, [f"model.path={config_only}", "model.load_format=dummy",
                                           f"model.tokenizer={empty}"]))


def test_the_borrowed_tokenizer_must_be_the_models_vocabulary(config_only):
    config = load_config(None, [f"model.path={config_only}", "model.load_format=dummy"])
    check_model_dir(config)
    assert tokenizer_dir(config) == DEFAULT_MODEL_DIR
    check_tokenizer(config, ModelConfig.from_file(config_only / "config.json"))
    dims = json.loads((config_only / "config.json").read_text())
    bigger = ModelConfig.from_dict({**dims, "vocab_size": 129280})
    with pytest.raises(EngineConfigError,
                       match=rf"\({dims['vocab_size']} tokens\) does not fit .* vocab_size 129280.*--tokenizer"):
        check_tokenizer(config, bigger)
    assert tokenizer_dir(load_config(None, [f"model.path={config_only}", f"model.tokenizer={TINY}"])) == TINY


def test_the_prefix_catalog_fingerprint_names_the_seed_and_format_and_the_flags_parse(config_only):
    parts = [weight_parts(load_config(None, [f"model.path={config_only}", "model.load_format=dummy", *extra]))
             for extra in ([], ["model.seed=1"], ["model.quantization=checkpoint"])]
    assert len({tuple(sorted(p.items())) for p in parts}) == 3 and "tokenizer.json" in parts[0]
    assert weight_parts(load_config(None, [])) == {}  # a checkpoint with its own tokenizer: the catalog as before
    args = parse_args(["serve", str(config_only), "--load-format", "safetensors", "--tokenizer", str(TINY)])
    assert (args.load_format, args.tokenizer) == ("auto", str(TINY))
    assert parse_args(["--load-format", "dummy"]).load_format == "dummy"
