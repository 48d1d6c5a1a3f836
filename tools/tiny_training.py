"""Training the V4.1 modules themselves: a differentiable forward through the serving code.

`DeepseekV41.residual_streams` is the serving forward's layer loop outside inference mode. A training
step runs it over a fresh `ModelCache` (every sequence one chunk at position 0), so gradients flow
through the cache's writes and reads where the served model reads them, and the trained weights are
the served function. What training adds around it changes no forward value:
- `reference_kernels`: on CUDA the serving ops dispatch to Triton kernels, which have no backward;
  inside it every loaded kernels/ module's `triton` is None, so the plain torch references run (the CPU
  path, the one `make serve` serves the default model on).
- `use_straight_through`: V4.1's simulated fp8 / fp4 formats round in the forward, fp4 by a table
  look-up that has no gradient; each module's rounding stays in the forward and passes the gradient
  through unchanged (quantization-aware training with a straight-through estimator).
- `TrainableEngramTables`: the Engram row source as float parameters, gathered and rounded to the
  stored format (fp8 e4m3, power-of-two scale per 32 channels) in the forward, so the saved fp8 tables
  give the same rows when served.
- `IndexerDistillation`: a lightning indexer's top-k is a hard choice, so the language-model loss gives
  it no gradient. Each index source is trained as DeepSeek-V3.2 trains its indexer: the KL divergence
  from its layer's attention (over the window, every visible compressed entry and the sink, summed over
  heads, restricted to the entries and renormalised; "dense" although the layer attends only its top-k)
  to the softmax of the indexer's scores. Its inputs are detached, so this loss trains the indexers'
  own projections (q_b_proj, weights_proj, the key owners' k_proj and k_norm) and nothing else.
- `ExpertBalance`: MoE load balance without an auxiliary loss, as DeepSeek-V3: after each step every
  router's `e_score_correction_bias` (a buffer, saved with the weights) moves by a fixed rate towards the
  experts that got fewer tokens than the mean.
- the MTP layer (models/mtp_v41.py, what serving drafts with), trained on the token after next.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engram_store import EngramStep
from kernels.index_topk import head_weighted_scores
from models import ForwardBatch, ModelCache
from models.attention_v41 import SharedCompressedAttention
from models.cache import paged_read
from models.csa2 import SharedCompressor, SharedIndexer
from models.engram import EngramFusion, EngramMemory
from models.engram_setup import engram_hasher
from models.layers import apply_rope
from models.model_v41 import DeepseekV41
from models.mtp import allocate_mtp_cache
from models.mtp_v41 import MTPLayerV41
from models.moe import Router
from models.random_model import tensor_seed
from models.tiny import quantize_engram_rows

IGNORE = -100


# -- straight-through rounding and torch kernels -----------------------------------------------------

class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fn) -> torch.Tensor:
        out = fn(x)
        return out.clone() if out is x else out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def straight_through(fn):
    """`fn`'s values in the forward, the identity's gradient in the backward."""
    if getattr(fn, "straight_through", False):
        return fn

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return _StraightThrough.apply(x, fn)

    rounded.straight_through = True
    return rounded


def use_straight_through(model: nn.Module) -> None:
    """Every simulated rounding of V4.1 in `model` (window K=V, compressed entries, indexer q and k)
    straight-through; the forward's values do not change."""
    for module in model.modules():
        if isinstance(module, SharedCompressedAttention):
            module.quantize_kv = straight_through(module.quantize_kv)
        if isinstance(module, (SharedCompressor, SharedIndexer)):
            module.quantize = straight_through(module.quantize)


@contextmanager
def reference_kernels() -> Iterator[None]:
    """Within it the kernels/ modules loaded so far take their torch references on every device (each
    dispatches on its module-level `triton`, None on CPU-only installs)."""
    patched = [(m, m.triton) for name, m in list(sys.modules.items())
               if name.startswith("kernels.") and getattr(m, "triton", None) is not None]
    for module, _ in patched:
        module.triton = None
    try:
        yield
    finally:
        for module, triton in patched:
            module.triton = triton


# -- Engram tables as parameters ---------------------------------------------------------------------

def _fp8_rows(rows: torch.Tensor) -> torch.Tensor:
    """Rows rounded as the checkpoint stores them (quantize_engram_rows), back in float32."""
    flat = rows.reshape(-1, rows.shape[-1])
    values, scales = quantize_engram_rows(flat)
    return (values.float() * scales.repeat_interleave(32, dim=-1)).view(rows.shape)


_stored_rows = straight_through(_fp8_rows)


class TrainableEngramTables(nn.Module):
    """A RowSource (engram_store/rows.py) over float tables held as parameters, one [rows, head_dim] per
    Engram layer; rows come back rounded to the stored fp8 format (straight-through), which is what
    InMemoryEngramTable serves from the saved tables."""

    reads_ahead = False

    def __init__(self, tables: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.tables = nn.ParameterList(nn.Parameter(t) for t in tables)

    def start(self, row_ids: Mapping[int, torch.Tensor]) -> EngramStep:
        return EngramStep(dict(row_ids))

    def rows(self, step: EngramStep, layer_index: int) -> torch.Tensor:
        table = self.tables[layer_index]
        return _stored_rows(F.embedding(step.row_ids[layer_index].to(table.device), table))

    def stored(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each table as the checkpoint holds it: (fp8 values, float32 power-of-two scales per 32)."""
        return [quantize_engram_rows(t.detach().float().cpu()) for t in self.tables]

    def hint(self, request_ids, row_ids) -> None:
        """Nothing to read ahead."""

    def cancel(self, request_id: str) -> None:
        """No hints to drop."""

    def counters(self) -> None:
        return None

    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tables)

    def check_integrity(self) -> None:
        """Plain tensors: nothing to check."""

    def close(self) -> None:
        """Memory only: nothing to stop."""


def attach_trainable_engram(model: DeepseekV41, tokenizer, tables: TrainableEngramTables) -> None:
    """The model's Engram memory: the hasher of `tokenizer` over `tables`."""
    model.engram_memory = EngramMemory(engram_hasher(model.config.engram, tokenizer), tables)


# -- MoE balance -------------------------------------------------------------------------------------

class ExpertBalance:
    """Counts each routed MoE's tokens per expert while `recording`; `update` moves the biases."""

    def __init__(self, roots: Sequence[nn.Module]) -> None:
        self.routers = [m for root in roots for m in root.modules() if isinstance(m, Router) and not m.hashed]
        self.loads: list[torch.Tensor | None] = [None] * len(self.routers)
        self.active = False
        for index, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(index))

    def _hook(self, index: int):
        def record(router: Router, args, output) -> None:
            if self.active:
                counts = torch.bincount(output[1].flatten(), minlength=router.weight.shape[0]).float()
                self.loads[index] = counts if self.loads[index] is None else self.loads[index] + counts
        return record

    @contextmanager
    def recording(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False

    @torch.no_grad()
    def update(self, rate: float) -> float:
        """Moves every bias by `rate` towards underloaded experts; returns the worst max / mean load."""
        worst = torch.zeros(())
        for router, load in zip(self.routers, self.loads):
            if load is None:
                continue
            mean = load.mean()
            router.e_score_correction_bias += rate * torch.sign(mean - load)
            worst = torch.maximum(worst, (load.max() / mean.clamp_min(1)).cpu())
        self.loads = [None] * len(self.routers)
        return float(worst)


# -- the indexers' loss ------------------------------------------------------------------------------

class IndexerDistillation:
    """Captures, while `recording`, each index source's attention input and its key owner's latents
    (the compressor's `kv_norm` output, one call per chunk), then `loss` gives the indexers' KL term."""

    def __init__(self, model: DeepseekV41) -> None:
        self.attention = {i: layer.self_attn for i, layer in enumerate(model.model.layers)}
        self.sources = {i: a for i, a in self.attention.items() if a.indexer is not None}
        for layer, attn in self.sources.items():
            if attn.key_source != attn.kv_source or attn.key_source is None:
                raise ValueError(f"layer {layer}: the indexer loss needs the key owner to be the kv source")
        self.active = False
        self.inputs: dict[int, torch.Tensor] = {}
        self.latents: dict[int, list[torch.Tensor]] = {}
        for layer in self.sources:
            self.attention[layer].register_forward_pre_hook(self._input_hook(layer))
        for owner in {a.key_source for a in self.sources.values()}:
            self.attention[owner].compressor.kv_norm.register_forward_hook(self._latent_hook(owner))

    def _input_hook(self, layer: int):
        def capture(module, args) -> None:
            if self.active:
                self.inputs[layer] = args[0]
        return capture

    def _latent_hook(self, layer: int):
        def capture(module, args, output) -> None:
            if self.active:
                self.latents.setdefault(layer, []).append(output)
        return capture

    @contextmanager
    def recording(self) -> Iterator[None]:
        self.inputs, self.latents, self.active = {}, {}, True
        try:
            yield
        finally:
            self.active = False

    def loss(self, batch: ForwardBatch, cache: ModelCache, focus: Sequence[Sequence[int]], queries: int,
             generator: torch.Generator) -> torch.Tensor:
        """Mean KL over index sources and chunks (every chunk at position 0) of up to `queries` query rows
        per chunk drawn with `generator`, plus the chunk's `focus` rows (needle answers)."""
        terms = []
        for layer, attn in self.sources.items():
            owner = self.attention[attn.key_source]
            latents = self.latents[attn.key_source]
            assert len(latents) == len(batch.chunks), "a chunk too short to close a group"
            for index, chunk in enumerate(batch.chunks):
                assert chunk.position == 0, "the indexer loss runs on whole sequences"
                term = self._chunk_term(attn, owner, chunk, self.inputs[layer][chunk.rows].detach(),
                                        latents[index].detach(), cache, focus[index], queries, generator)
                if term is not None:
                    terms.append(term)
        return torch.stack(terms).mean() if terms else torch.zeros((), device=batch.token_ids.device)

    def _chunk_term(self, attn: SharedCompressedAttention, owner: SharedCompressedAttention, chunk, x: torch.Tensor,
                    latents: torch.Tensor, cache: ModelCache, focus: Sequence[int], queries: int,
                    generator: torch.Generator) -> torch.Tensor | None:
        rate, n = attn.visible_rate, chunk.length
        entries = n // rate
        if entries == 0:
            return None
        assert latents.shape[0] == entries
        rows = _query_rows(n, rate, focus, queries, generator).to(x.device)
        cos, sin = attn.rope(torch.arange(n, device=x.device))
        stored = cache.layers[attn.kv_source].shared.entries
        with torch.no_grad():
            target = attention_over_entries(attn, x, rows, cos, sin, paged_read(stored, chunk.pages, entries), rate)
        q_residual = attn.q_a_norm(attn.q_a_proj(x[rows])).detach()
        q, head_weights = attn.indexer.queries(x[rows], q_residual, cos[rows], sin[rows])
        key_cos, key_sin = owner.rope(torch.arange(entries, device=x.device) * rate)
        keys = owner.indexer.keys(latents, key_cos, key_sin, cache.layers[attn.key_source].shared.index_keys)
        scores = head_weighted_scores(q, head_weights, keys)
        hidden = torch.arange(entries, device=x.device)[None, :] >= ((rows + 1) // rate)[:, None]
        log_p = scores.masked_fill(hidden, float("-inf")).log_softmax(dim=-1)
        kl = torch.where(target > 0, target * (target.clamp_min(1e-30).log() - log_p), 0.0)
        return kl.sum(dim=-1).mean()


def _query_rows(n: int, rate: int, focus: Sequence[int], queries: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `queries` rows that see an entry ((row + 1) // rate >= 1), drawn without replacement, and the
    `focus` rows that do, sorted."""
    first = rate - 1
    drawn = torch.randperm(n - first, generator=generator)[:queries] + first
    wanted = torch.tensor([r for r in focus if r >= first], dtype=torch.long)
    return torch.unique(torch.cat([drawn, wanted]))


def attention_over_entries(attn: SharedCompressedAttention, x: torch.Tensor, rows: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, entries: torch.Tensor, rate: int) -> torch.Tensor:
    """[len(rows), entries]: the probability each query row of the chunk (x [n, D], position 0 first)
    would give each visible compressed entry if it attended all of them beside its window and its sink,
    summed over heads and renormalised over the entries."""
    n_heads, dim = attn.num_heads, attn.head_dim
    q_residual = attn.q_a_norm(attn.q_a_proj(x[rows]))
    q = apply_rope(attn.q_b_proj(q_residual).view(len(rows), n_heads, dim), cos[rows], sin[rows])
    kv = attn.quantize_kv(apply_rope(attn.kv_norm(attn.kv_proj(x)), cos, sin))
    key_positions = torch.arange(x.shape[0], device=x.device)[None, :]
    in_window = (key_positions <= rows[:, None]) & (key_positions > rows[:, None] - attn.window)
    scale = dim**-0.5
    window = (torch.einsum("qhd,kd->hqk", q.float(), kv.float()) * scale).masked_fill(~in_window, float("-inf"))
    visible = torch.arange(entries.shape[0], device=x.device)[None, :] < ((rows + 1) // rate)[:, None]
    picked = (torch.einsum("qhd,ed->hqe", q.float(), entries.float()) * scale).masked_fill(~visible, float("-inf"))
    sink = attn.sinks.float()[:, None, None].expand(-1, len(rows), 1)
    total = torch.logsumexp(torch.cat([window, picked, sink], dim=-1), dim=-1, keepdim=True)
    mass = (picked - total).exp().sum(dim=0)
    return mass / mass.sum(dim=-1, keepdim=True).clamp_min(1e-30)


# -- initialisation and the checkpoint's tensors -----------------------------------------------------

def init_parameters(modules: Mapping[str, nn.Module], n_layers: int, seed: int) -> None:
    """Every parameter of the named modules drawn from its own generator, seeded by (seed, full name), so
    the initial model does not depend on the device or the order of construction. Normal(0, 1/sqrt(fan
    in)) projections, outputs into the residual (o_b_proj, down projections, Engram's value rows) scaled
    by 1/sqrt(2 x layers), norms and mHC scales 1, mHC biases and sinks 0, the mHC projection 10x
    smaller (its logits start near the biases), embedding rows N(0, 1)."""
    residual = (2 * n_layers) ** -0.5
    for prefix, root in modules.items():
        fusions = {f"{name}.wkv.weight": m for name, m in root.named_modules() if isinstance(m, EngramFusion)}
        for name, param in root.named_parameters():
            generator = torch.Generator().manual_seed(tensor_seed(seed, f"{prefix}{name}"))
            if isinstance(root, TrainableEngramTables):
                value = torch.randn(param.shape, generator=generator)
            else:
                value = _initial(name, param.shape, generator, residual, fusions.get(name))
            param.data.copy_(value)


def _initial(name: str, shape: torch.Size, generator: torch.Generator, residual: float,
             fusion: EngramFusion | None) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    if "norm" in owner.rsplit(".", 1)[-1] or leaf in ("q_weight", "k_weight", "scale"):
        return torch.ones(shape)
    if leaf in ("base", "sinks"):
        return torch.zeros(shape)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=generator)
    std = shape[-1] ** -0.5
    if leaf == "fn":
        std *= 0.1
    elif name.endswith("lm_head.weight"):
        std *= 0.5
    elif leaf == "down_proj" or owner.endswith(("o_b_proj", "down_proj")):
        std *= residual
    value = torch.randn(shape, generator=generator) * std
    if fusion is not None:  # the value rows after the hc keys
        value[fusion.hc * fusion.hidden :] *= residual
    return value


def stored_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """What the checkpoint holds a float tensor in: matrices in `dtype`, vectors (norms, mHC biases and
    scales, sinks, router biases: few values, some of them routing ties) in float32. The loader holds
    the mHC and Engram fusion matrices in float32 whatever is stored."""
    return dtype if tensor.dim() >= 2 else torch.float32


def checkpoint_tensors(model: DeepseekV41, mtp: MTPLayerV41 | None, tables: TrainableEngramTables | None,
                       dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The safetensors contents under the loader's names: the model's parameters and buffers, the MTP
    head's as `mtp.0.*`, the Engram tables as fp8 values and scales."""
    named = _tensors(model, "")  # the loader's names: each shared module under its first name
    if mtp is not None:
        named.update(_tensors(mtp, "mtp.0."))
    out = {}
    for name, tensor in named.items():
        tensor = tensor.detach().cpu()
        out[name] = (tensor.to(stored_dtype(tensor, dtype)) if tensor.is_floating_point() else tensor).clone()
    if tables is not None:
        for layer, (values, scales) in zip(model.config.engram.layer_ids, tables.stored()):
            out[f"model.engram_tables.{layer}.weight"] = values.contiguous()
            out[f"model.engram_tables.{layer}.weight_scale_inv"] = scales.contiguous()
    return out


def _tensors(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + name: t for name, t in list(module.named_parameters()) + list(module.named_buffers())}


@torch.no_grad()
def round_to_stored(modules: Mapping[str, nn.Module], dtype: torch.dtype) -> None:
    """Parameters rounded to what the checkpoint stores, so what is evaluated is what is served."""
    for root in modules.values():
        if not isinstance(root, TrainableEngramTables):  # rounded to fp8 in every forward already
            for param in root.parameters():
                param.copy_(param.to(stored_dtype(param, dtype)).float())


# -- one step's losses -------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainingSequence:
    tokens: list[int]
    answer_rows: tuple[int, ...] = ()  # rows whose next token is a needle answer token


class TinyTrainer:
    """The model, its MTP head and Engram tables on one device, and a batch's losses through the
    serving forward (see the module docstring)."""

    def __init__(self, model: DeepseekV41, mtp: MTPLayerV41 | None, tables: TrainableEngramTables | None,
                 indexer_queries: int = 256) -> None:
        self.model, self.mtp, self.tables = model, mtp, tables
        self.device = model.lm_head.weight.device
        self.indexer_queries = indexer_queries
        use_straight_through(model)
        if mtp is not None:
            use_straight_through(mtp)
        self.distillation = IndexerDistillation(model)
        self.balance = ExpertBalance([model] + ([mtp] if mtp is not None else []))

    @contextmanager
    def wider_selection(self, factor: int) -> Iterator[None]:
        """Within it every index source picks `factor` times its top-k entries and the candidate source
        `factor` times its blocks: a warm-up in the spirit of DeepSeek-V3.2's dense stage, where the
        attention learns from more of the entries (and the indexers from its choices) before training
        goes on at the served sparsity."""
        sources = list(self.distillation.sources.values())
        saved = [(a.indexer.topk, a.top_blocks) for a in sources]
        for attn in sources:
            attn.indexer.topk, attn.top_blocks = attn.indexer.topk * factor, attn.top_blocks * factor
        try:
            yield
        finally:
            for attn, (topk, blocks) in zip(sources, saved):
                attn.indexer.topk, attn.top_blocks = topk, blocks

    def modules(self) -> dict[str, nn.Module]:
        """The trained modules by checkpoint prefix (the tables under `model.engram_tables.`)."""
        out: dict[str, nn.Module] = {"": self.model}
        if self.mtp is not None:
            out["mtp.0."] = self.mtp
        if self.tables is not None:
            out["engram."] = self.tables
        return out

    def losses(self, sequences: Sequence[TrainingSequence], generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Mean next-token cross-entropy (`lm`), over needle answers (`needle`, 0 without any), the MTP
        head's on the token after next (`mtp`), and the indexers' KL (`indexer`)."""
        config = self.model.config
        longest = max(len(s.tokens) for s in sequences)
        cache = ModelCache.allocate(config, len(sequences), longest, device=self.device)
        batch = _placed(ForwardBatch.build([(i, s.tokens, 0) for i, s in enumerate(sequences)]), cache, self.device)
        with self.distillation.recording(), self.balance.recording():
            streams, pre = self.model.residual_streams(batch, cache)
        logits = self.model.head(streams, pre).float()
        targets = _shifted(sequences, 1, self.device)
        out = {"lm": F.cross_entropy(logits, targets, ignore_index=IGNORE)}
        answers = [c.start + r for c, s in zip(batch.chunks, sequences) for r in s.answer_rows]
        out["needle"] = (F.cross_entropy(logits[answers], targets[answers]) if answers
                         else torch.zeros((), device=self.device))
        if self.mtp is not None:
            with self.balance.recording():
                mtp_logits = self._mtp_logits(sequences, batch, streams, pre, longest)
            out["mtp"] = F.cross_entropy(mtp_logits.float(), _shifted(sequences, 2, self.device, drop=1),
                                         ignore_index=IGNORE)
        focus = [s.answer_rows for s in sequences]
        out["indexer"] = self.distillation.loss(batch, cache, focus, self.indexer_queries, generator)
        return out

    def _mtp_logits(self, sequences: Sequence[TrainingSequence], batch: ForwardBatch, streams: torch.Tensor,
                    pre: torch.Tensor, longest: int) -> torch.Tensor:
        """The MTP head over every row but each sequence's last: row p with token p + 1."""
        cache = allocate_mtp_cache(self.model.config, len(sequences), longest, device=self.device)
        inputs = _placed(ForwardBatch.build([(i, s.tokens[1:], 0) for i, s in enumerate(sequences)], logits="all"),
                         cache, self.device)
        keep = torch.cat([torch.arange(c.start, c.start + c.length - 1) for c in batch.chunks]).to(self.device)
        logits, _, _ = self.mtp(streams[keep], inputs, cache, pre=pre[keep])
        return logits

    @torch.no_grad()
    def mtp_agreement(self, sequences: Sequence[TrainingSequence]) -> tuple[float, float, int]:
        """Teacher-forced, over every row with a token after next: (how often the MTP head's argmax is the
        target's argmax at the next row, how often it is the true token, rows counted)."""
        longest = max(len(s.tokens) for s in sequences)
        cache = ModelCache.allocate(self.model.config, len(sequences), longest, device=self.device)
        batch = _placed(ForwardBatch.build([(i, s.tokens, 0) for i, s in enumerate(sequences)]), cache, self.device)
        streams, pre = self.model.residual_streams(batch, cache)
        target = self.model.head(streams, pre).argmax(-1)
        drafts = self._mtp_logits(sequences, batch, streams, pre, longest).argmax(-1)
        truth = _shifted(sequences, 2, self.device, drop=1)
        # MTP row of main row p (p < n - 1) against the main argmax at p + 1, which predicts token p + 2 too
        next_rows = torch.cat([torch.arange(c.start + 1, c.start + c.length) for c in batch.chunks]).to(self.device)
        valid = truth != IGNORE
        agree = (drafts == target[next_rows])[valid].float().mean().item()
        correct = (drafts == truth)[valid].float().mean().item()
        return agree, correct, int(valid.sum())


def _placed(batch: ForwardBatch, cache: ModelCache, device: torch.device) -> ForwardBatch:
    return batch.with_pages(cache.default_pages).to(device)


def _shifted(sequences: Sequence[TrainingSequence], shift: int, device: torch.device, drop: int = 0) -> torch.Tensor:
    """Per sequence (its first `drop` tokens left out), each row's target `shift` tokens on, IGNORE past
    the end; concatenated in batch order."""
    out = []
    for s in sequences:
        tokens = s.tokens[drop:]
        ahead = tokens[shift - drop :] if shift > drop else tokens
        out += ahead + [IGNORE] * (len(tokens) - len(ahead))
    return torch.tensor(out, dtype=torch.long, device=device)


def parameter_groups(trainer: TinyTrainer, weight_decay: float, engram_lr_scale: float) -> list[dict]:
    """AdamW groups: matrices with weight decay; embeddings, norms, mHC biases and scales, sinks without;
    Engram tables without and at `engram_lr_scale` times the learning rate (rows are updated only when
    their n-grams occur)."""
    decay, plain, tables = [], [], []
    for root in trainer.modules().values():
        for name, param in root.named_parameters():
            if isinstance(root, TrainableEngramTables):
                tables.append(param)
            elif param.dim() >= 2 and not name.endswith("embed_tokens.weight"):
                decay.append(param)
            else:
                plain.append(param)
    groups = [{"params": decay, "weight_decay": weight_decay, "lr_scale": 1.0},
              {"params": plain, "weight_decay": 0.0, "lr_scale": 1.0}]
    if tables:
        groups.append({"params": tables, "weight_decay": 0.0, "lr_scale": engram_lr_scale})
    return groups


def lr_at(progress: float, peak: float, warmup: float, floor: float = 0.1) -> float:
    """Linear warm-up over the first `warmup` of training, then a cosine down to `floor` x peak."""
    if progress < warmup:
        return peak * max(progress, 1e-3) / warmup
    t = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))
