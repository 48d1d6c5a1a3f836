"""Per kernel family of a decode step: device time, bytes read and achieved bytes/s against the copy
bandwidth measured in the same run (`python -m bench.slice families`, issue 20 item 5).

A family is a set of modules of the slice: the attention projections (every linear under
`self_attn`, compressors' and indexers' included), the mHC sites' projections and mixes, the router,
the shared expert, the routed experts, and the head. One eager decode step (context 0, seeded random
tokens) runs with forward hooks that keep each family module's first inputs of that step; each family
is then replayed alone, every one of its modules in layer order on those inputs, as one CUDA graph
(no launch gaps: the figure is the kernels' own time), `repeats` times between CUDA events. A pass
reads every weight of the family once (routed experts: only the experts the step routed to), so
bytes / time is what its kernels achieve; a family far below the copy bandwidth is where a decode
step loses time to arithmetic or to too few busy SMs, not to memory. The remainder of the measured
step (attention over the cache, norms, RoPE, casts, sampling, ...) is reported as `rest`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.slice_roofline import timed_ms

FAMILIES = ("attention_projections", "hyper_connections", "router", "shared_expert", "routed_experts", "head")


def family_of(name: str, module: torch.nn.Module) -> str | None:
    """The family a module's forward belongs to (None: not timed on its own). Only leaves of a family
    are hooked: an attention projection is each linear under self_attn, not self_attn itself."""
    leaf = not any(True for _ in module.children())
    if name == "lm_head":
        return "head"
    if name.endswith(".mlp.experts"):
        return "routed_experts"
    if name.endswith(".mlp.shared_experts"):
        return "shared_expert"
    if name.endswith(".mlp.gate"):
        return "router"
    if name.endswith(("attn_hc", "ffn_hc", "hc_head")):
        return "hyper_connections"
    if ".self_attn." in name and leaf and any(True for _ in module.parameters(recurse=False)) and "norm" not in name:
        return "attention_projections"
    return None


@dataclass
class Captured:
    """A family's module calls of one step, with their inputs (kept alive for the replays)."""

    calls: list[tuple[torch.nn.Module, tuple, dict]] = field(default_factory=list)
    weight_bytes: int = 0

    def run(self) -> None:
        for module, args, kwargs in self.calls:
            module(*args, **kwargs)


def capture_families(model: torch.nn.Module, step: Callable[[], None]) -> dict[str, Captured]:
    """Runs `step` (one eager decode step) with hooks keeping each family module's first call."""
    families: dict[str, Captured] = {name: Captured() for name in FAMILIES}
    seen: set[int] = set()
    handles = []
    for name, module in model.named_modules():
        family = family_of(name, module)
        if family is None:
            continue

        def keep(module, args, kwargs, family=family):
            if id(module) not in seen:
                seen.add(id(module))
                families[family].calls.append((module, args, kwargs))

        handles.append(module.register_forward_pre_hook(keep, with_kwargs=True))
    try:
        with torch.no_grad():
            step()
    finally:
        for handle in handles:
            handle.remove()
    return families


def family_weight_bytes(model: torch.nn.Module, family: Captured, experts_touched: list[int]) -> int:
    """Bytes a pass of the family reads from its weights: each module's parameters and buffers once;
    routed experts only for the experts the step touched."""
    layers = {id(layer.mlp.experts): i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")}
    total = 0
    for module, _, _ in family.calls:
        tensors = list(module.parameters()) + list(module.buffers())
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if id(module) in layers:
            count = max(t.shape[0] for t in tensors)  # tensors are stacked per expert
            nbytes = nbytes * experts_touched[layers[id(module)]] // count
        total += nbytes
    return total


def time_family(family: Captured, device: str, repeats: int) -> float:
    """Median milliseconds of one pass: a CUDA graph of the pass on the GPU, plain calls on the CPU."""
    with torch.no_grad():
        if device != "cuda":
            return statistics.median(timed_ms(family.run, device, repeats))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                family.run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            family.run()
        return statistics.median(timed_ms(graph.replay, device, repeats))


def family_rows(model: torch.nn.Module, families: dict[str, Captured], experts_touched: list[int], step_ms: float,
                copy_bps: float, device: str, repeats: int) -> list[dict[str, Any]]:
    """One row per family (time, bytes, bytes/s, share of the copy bandwidth, share of the step) and
    the rest of the step."""
    rows, spent = [], 0.0
    for name in FAMILIES:
        family = families[name]
        if not family.calls:
            continue
        ms = time_family(family, device, repeats)
        nbytes = family_weight_bytes(model, family, experts_touched)
        spent += ms
        rows.append({"family": name, "modules": len(family.calls), "us_per_step": 1000 * ms, "weight_bytes": nbytes,
                     "bytes_per_s": nbytes / (ms / 1000), "ratio_to_copy": nbytes / (ms / 1000) / copy_bps,
                     "share_of_step": ms / step_ms})
    rows.append({"family": "rest", "us_per_step": 1000 * (step_ms - spent), "share_of_step": (step_ms - spent) / step_ms})
    return rows
