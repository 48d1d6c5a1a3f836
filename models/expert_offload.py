"""Expert offload's cache (issue 28): a MoE layer's routed experts split between the compute device and
host RAM, the hot ones resident, the others brought in per step.

`OffloadedExperts` takes a layer's `Experts` (this rank's run of them) and keeps `resident` of them on
the device in a stack of `resident + staging` expert slots; the rest move to host RAM (pinned when the
device is a GPU). A step's pairs routed to a host-resident expert get it copied into one of the
`staging` slots (a staged expert stays there until its slot is needed, so an expert routed to again
next step is a staging hit, not a copy), then the step runs the same expert kernels over the device
stack with each pair's expert id mapped to its slot. Each pair's output depends only on its token, its
expert's weights and its routing weight, and every path adds a token's pairs in top-k slot order
(kernels/moe.py), so the layer's output is bitwise the resident one's whenever the step's host experts
fit the staging slots (decode steps; longer chunks run in waves, `OffloadedExperts`).

Which experts are resident follows measured routing: every step counts each expert's pairs, and every
`rebalance_every` steps the host experts counted more than the coldest resident ones swap places with
them (both copies exact), after which the counts halve (an exponential window over rebalances).

`stats` accumulates what the tiers served, for the bench's bound (bytes from the device's memory and
bytes over PCIe a step). This path reads the step's expert ids on the host (one sync a layer), so it
runs eagerly; the decode path that reads a cold expert in place over PCIe without it is the GPU's next
step (issue 28 item 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from contract import ExpertOffloadStats
from kernels.moe import ExpertWeights, MXFP4Experts, plus_residual
from models.layers import TakesFp8Prefill
from models.moe import Experts, MoE, run_experts


@dataclass
class OffloadStats:
    """Counts since the cache was built (or `reset`): pairs routed to this rank's experts and where
    their expert was, host experts copied in (and their bytes), staging hits, swaps by rebalancing."""

    pairs: int = 0
    resident_pairs: int = 0
    staged_pairs: int = 0
    copies: int = 0
    copied_bytes: int = 0
    staging_hits: int = 0
    swaps: int = 0
    waves: int = 0  # runs of the expert kernels (a step with more host experts than staging slots runs several)


def _stack_like(weights: ExpertWeights, slots: int, device: torch.device | str, pin: bool) -> ExpertWeights:
    """An empty stack of `slots` experts shaped as `weights`' (pinned host memory with `pin`)."""
    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty((slots, *t.shape[1:]), dtype=t.dtype, device=device, pin_memory=pin)

    if isinstance(weights, MXFP4Experts):
        return MXFP4Experts(empty(weights.codes), empty(weights.scales))
    return empty(weights)


_PARTS = {True: ("codes", "scales"), False: ("dense",)}  # a stack's tensors, packed MXFP4 or not


def _tensors(weights: ExpertWeights) -> tuple[torch.Tensor, ...]:
    return (weights.codes, weights.scales) if isinstance(weights, MXFP4Experts) else (weights,)


def _copy_expert(target: ExpertWeights, slot: int, source: ExpertWeights, index: int) -> None:
    for into, out_of in zip(_tensors(target), _tensors(source)):
        into[slot].copy_(out_of[index], non_blocking=True)


def expert_bytes(weights: ExpertWeights) -> int:
    """Bytes of one expert of a stack (codes and scales when packed)."""
    return sum(t[0].numel() * t.element_size() for t in _tensors(weights))


class OffloadedExperts(nn.Module, TakesFp8Prefill):
    """`Experts`' contract (forward) over experts split between the device and host RAM (module
    docstring). `resident`: how many stay on the device (the first ones by `order`, default by id);
    `staging`: device slots for host experts. A step routed to more host experts than that (a long
    prompt chunk) runs in waves of `staging`, each over the resident experts (the first wave) or
    its share of the host ones, and adds the waves' sums: exact per pair, but the waves' sum rounds
    apart from the resident layer's, which adds each token's pairs in one pass."""

    LEAVES = ("gate_up_proj", "down_proj")

    def __init__(self, experts: Experts, resident: int, staging: int, rebalance_every: int = 64,
                 order: list[int] | None = None) -> None:
        super().__init__()
        held = experts.held
        if not 0 <= resident <= held:
            raise ValueError(f"{resident} resident experts: the layer holds {held}")
        if staging < 1 and resident < held:
            raise ValueError("host-resident experts need at least one staging slot")
        self.first, self.held, self.limit = experts.first, held, experts.limit
        self.weight_before_down = experts.weight_before_down
        self.resident, self.staging, self.rebalance_every = resident, staging, rebalance_every
        order = list(range(held)) if order is None else order
        if sorted(order) != list(range(held)):
            raise ValueError("order must list each of the layer's experts once")
        source = {leaf: experts.weights(leaf) for leaf in self.LEAVES}
        device = _tensors(source["gate_up_proj"])[0].device
        pin = device.type == "cuda"
        for leaf, weights in source.items():  # buffers: the memory plan counts them, `to` moves them
            for part, tensor in zip(_PARTS[isinstance(weights, MXFP4Experts)], _tensors(
                    _stack_like(weights, resident + staging, device, False))):
                self.register_buffer(f"{leaf}_{part}", tensor)
        self.packed = isinstance(source["gate_up_proj"], MXFP4Experts)
        # host RAM is no buffer: a module's `to` must not bring it back to the device
        self.host_stack = {leaf: _stack_like(w, held - resident, "cpu", pin) for leaf, w in source.items()}
        # where each expert is: its device slot (resident ones) or -1, and its host index or -1
        self.slot_of = [-1] * held
        self.host_index = [-1] * held
        for rank, expert in enumerate(order):
            for leaf, weights in source.items():
                if rank < resident:
                    _copy_expert(self.device_stack[leaf], rank, weights, expert)
                else:
                    _copy_expert(self.host_stack[leaf], rank - resident, weights, expert)
            if rank < resident:
                self.slot_of[expert] = rank
            else:
                self.host_index[expert] = rank - resident
        self.staged: list[int] = [-1] * staging  # the host expert each staging slot holds (-1: none)
        self.last_use = [0] * staging  # the step each staging slot was last routed to (least recent goes)
        self.counts = torch.zeros(held, dtype=torch.float64)
        self.steps = 0
        self.stats = OffloadStats()
        self.bytes_per_expert = sum(expert_bytes(w) for w in source.values())
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the source's storage may go once this returns

    def weights(self, leaf: str) -> ExpertWeights:
        """The device stack of `leaf`: resident slots, then staging slots."""
        if self.packed:
            return MXFP4Experts(self._buffers[f"{leaf}_codes"], self._buffers[f"{leaf}_scales"])
        return self._buffers[f"{leaf}_dense"]

    @property
    def device_stack(self) -> dict[str, ExpertWeights]:
        return {leaf: self.weights(leaf) for leaf in self.LEAVES}

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.steps and self.steps % self.rebalance_every == 0:  # between steps: no slot moves under a step
            self.rebalance()
        self.steps += 1
        local = experts - self.first
        mine = (local >= 0) & (local < self.held)
        ids = local[mine].tolist()  # the one host read of a step's routing (see the module docstring)
        self._count(ids)
        hosted = sorted({e for e in ids if self.host_index[e] >= 0})
        waves = [hosted[i: i + self.staging] for i in range(0, len(hosted), self.staging)] or [[]]
        self.stats.waves += len(waves)
        outside = self.resident + self.staging  # a slot past the stack: the pair is left out
        total = None
        for n, wave in enumerate(waves):
            self._stage(wave)
            slots = [slot if (slot < self.resident and n == 0) or e in wave else outside
                     for e, slot in enumerate(self.slot_of)]
            table = torch.tensor(slots, dtype=experts.dtype, device=experts.device)
            mapped = torch.where(mine, table[local.clamp(0, self.held - 1)], outside)
            part = run_experts(x, weights, mapped, self.device_stack["gate_up_proj"], self.device_stack["down_proj"],
                               0, self.limit, self.weight_before_down, residual if len(waves) == 1 else None,
                               fp8_prefill=self.fp8_prefill)
            total = part if total is None else total + part
        return total if len(waves) == 1 else plus_residual(total, residual)

    def _count(self, ids: list[int]) -> None:
        """Adds a step's pairs (this rank's local expert ids) to the routing counts and the stats."""
        if ids:
            self.counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=self.held).double()
        resident = sum(1 for e in ids if self.host_index[e] < 0)
        self.stats.pairs += len(ids)
        self.stats.resident_pairs += resident
        self.stats.staged_pairs += len(ids) - resident

    def _stage(self, wave: list[int]) -> None:
        """Brings the host experts of `wave` (at most `staging`) into staging slots: one already there
        is a hit; a miss takes the least recently used slot holding none of the wave."""
        for expert in wave:  # hits first, so a miss never evicts an expert of this wave
            slot = self.slot_of[expert]
            if slot >= self.resident:
                self.stats.staging_hits += 1
                self.last_use[slot - self.resident] = self.steps
        wanted = set(wave)
        for expert in wave:
            if self.slot_of[expert] >= self.resident:
                continue
            ring = min((r for r in range(self.staging) if self.staged[r] not in wanted), key=lambda r: self.last_use[r])
            evicted = self.staged[ring]
            if evicted >= 0:
                self.slot_of[evicted] = -1
            for leaf in self.LEAVES:
                _copy_expert(self.device_stack[leaf], self.resident + ring, self.host_stack[leaf],
                             self.host_index[expert])
            self.staged[ring], self.last_use[ring] = expert, self.steps
            self.slot_of[expert] = self.resident + ring
            self.stats.copies += 1
            self.stats.copied_bytes += self.bytes_per_expert

    def rebalance(self) -> int:
        """Swaps host experts counted more than the coldest resident ones into their slots (the
        resident expert goes to the host expert's place in host RAM); halves the counts. Returns the
        swaps made."""
        resident = sorted((e for e in range(self.held) if 0 <= self.slot_of[e] < self.resident),
                          key=lambda e: (self.counts[e].item(), e))
        hosted = sorted((e for e in range(self.held) if self.host_index[e] >= 0),
                        key=lambda e: (-self.counts[e].item(), e))
        swaps = 0
        for cold, hot in zip(resident, hosted):
            if self.counts[hot] <= self.counts[cold]:
                break
            self._swap(cold, hot)
            swaps += 1
        self.counts *= 0.5
        self.stats.swaps += swaps
        return swaps

    def _swap(self, cold: int, hot: int) -> None:
        """`hot` (host) takes `cold`'s resident slot; `cold` takes `hot`'s index in host RAM."""
        slot, index = self.slot_of[cold], self.host_index[hot]
        staged = self.slot_of[hot]
        for leaf in self.LEAVES:
            hold = [t[index].clone() for t in _tensors(self.host_stack[leaf])]
            for host, device in zip(_tensors(self.host_stack[leaf]), _tensors(self.device_stack[leaf])):
                host[index].copy_(device[slot])
            for device, value in zip(_tensors(self.device_stack[leaf]), hold):
                device[slot].copy_(value, non_blocking=True)
        if staged >= self.resident:  # its staged copy is now a stale duplicate: free the slot
            self.staged[staged - self.resident] = -1
        self.slot_of[hot], self.host_index[hot] = slot, -1
        self.slot_of[cold], self.host_index[cold] = -1, index

    def tiers_hold_every_expert(self) -> bool:
        """The accounting invariant: each expert is resident or in host RAM (exactly one), resident
        slots and host indices are each used once, and staging slots hold host experts only."""
        resident = [self.slot_of[e] for e in range(self.held) if 0 <= self.slot_of[e] < self.resident]
        hosted = [self.host_index[e] for e in range(self.held) if self.host_index[e] >= 0]
        each_once = all((0 <= self.slot_of[e] < self.resident) != (self.host_index[e] >= 0) for e in range(self.held))
        staged_ok = all(e < 0 or (self.host_index[e] >= 0 and self.slot_of[e] == self.resident + r)
                        for r, e in enumerate(self.staged))
        return (each_once and sorted(resident) == list(range(self.resident))
                and sorted(hosted) == list(range(self.held - self.resident)) and staged_ok)

    def expert_weights(self, expert: int) -> dict[str, tuple[torch.Tensor, ...]]:
        """One expert's tensors, from whichever tier holds it (for tests and checks)."""
        slot, index = self.slot_of[expert], self.host_index[expert]
        if 0 <= slot < self.resident:
            return {leaf: tuple(t[slot] for t in _tensors(self.device_stack[leaf])) for leaf in self.LEAVES}
        return {leaf: tuple(t[index] for t in _tensors(self.host_stack[leaf])) for leaf in self.LEAVES}


def offload_totals(model: nn.Module) -> ExpertOffloadStats | None:
    """The counters of every offloaded layer of `model`, summed (None: no layer is offloaded)."""
    caches = [m.stats for m in model.modules() if isinstance(m, OffloadedExperts)]
    if not caches:
        return None
    return ExpertOffloadStats(
        pairs_resident=sum(c.resident_pairs for c in caches), pairs_staged=sum(c.staged_pairs for c in caches),
        copies=sum(c.copies for c in caches), bytes_copied=sum(c.copied_bytes for c in caches),
        staging_hits=sum(c.staging_hits for c in caches), swaps=sum(c.swaps for c in caches),
    )


class LayerOffload:
    """`experts_loaded` for the loaders (models/loader.py): each of the backbone's MoE layers, as its
    experts arrive, gets an OffloadedExperts keeping `resident` on the device, so the device never
    holds more than one layer's experts beyond the resident ones (the MTP layer's stay as they are:
    the plan counts them apart). Counts the layers it offloaded."""

    def __init__(self, resident: int, staging: int, rebalance_every: int = 64) -> None:
        self.resident, self.staging, self.rebalance_every = resident, staging, rebalance_every
        self.layers = 0

    def __call__(self, model: nn.Module, moe_name: str) -> None:
        moe = model.get_submodule(moe_name)
        if not moe_name.startswith("model.layers.") or not isinstance(moe, MoE) or not isinstance(moe.experts, Experts):
            return
        moe.experts = OffloadedExperts(moe.experts, self.resident, self.staging, self.rebalance_every)
        self.layers += 1


def offload_experts(model: nn.Module, resident_per_layer: int, staging: int, rebalance_every: int = 64) -> int:
    """A loaded model's backbone MoE layers offloaded as LayerOffload does it while loading; returns
    how many layers it replaced."""
    offload = LayerOffload(resident_per_layer, staging, rebalance_every)
    for name, module in list(model.named_modules()):
        if isinstance(module, MoE):
            offload(model, name)
    return offload.layers
