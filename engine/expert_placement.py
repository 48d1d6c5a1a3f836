"""Where each routed expert lives under expert offload (issue 28): resident on the GPU, or in pinned
host RAM and staged (copied, or read in place) when a step routes to it.

`offload.experts: host` keeps `gpu_experts_per_layer` experts of every MoE layer on the GPU (the
hottest by measured routing, once the runtime measures it) and the others in host RAM, plus a GPU
staging ring of `offload.staging_experts` expert-sized slots that host-resident experts are brought
into. The count comes from the config (a count per layer, or a GPU budget in GB), or, when neither is
given, from the plan: as many per layer as the GPU holds after every other byte of the plan and the
KV of every sequence at full length (what a rig without offload is planned for). Every byte of the
routed experts is placed once: GPU resident + host = all of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from contract.config import OffloadSection
from engine.plan_weights import WeightTensor

ROUTED = "routed experts"
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class ExpertPlacement:
    """Per rank: `gpu_per_layer` of `experts_per_layer` experts of each of `layers` MoE layers on the
    GPU, the rest in host RAM; `staging_slots` GPU slots for host-resident experts."""

    layers: int
    experts_per_layer: int
    expert_bytes: int  # one expert's gate_up and down, per rank, as held (packed when kept as stored)
    gpu_per_layer: int
    staging_slots: int

    @property
    def host_per_layer(self) -> int:
        return self.experts_per_layer - self.gpu_per_layer

    @property
    def gpu_bytes(self) -> int:
        return self.layers * self.gpu_per_layer * self.expert_bytes

    @property
    def staging_bytes(self) -> int:
        return self.staging_slots * self.expert_bytes if self.host_per_layer else 0

    @property
    def host_bytes(self) -> int:
        return self.layers * self.host_per_layer * self.expert_bytes


def routed_expert_shape(weights: list[WeightTensor], experts_per_layer: int, ranks: int) -> tuple[int, int]:
    """(MoE layers, bytes of one expert per rank) from the plan's routed-expert tensors."""
    routed = [t for t in weights if t.kind == ROUTED]
    layers = {int(m.group(1)) for t in routed if (m := _LAYER.search(t.name))}
    if not layers:
        return 0, 0
    total = sum(t.per_rank(ranks) for t in routed)
    return len(layers), total // (len(layers) * experts_per_layer)


def place_experts(offload: OffloadSection, layers: int, experts_per_layer: int, expert_bytes: int,
                  gpu_room: int) -> ExpertPlacement:
    """The placement `offload` asks for. `gpu_room`: GPU bytes per rank left for resident experts and
    the staging ring when every other byte of the plan is placed (used when the config gives no count);
    may be negative. Raises ValueError, naming the key, for a count the layers do not have."""
    staging = min(offload.staging_experts, layers * experts_per_layer)
    if offload.gpu_experts_per_layer is not None:
        per_layer = offload.gpu_experts_per_layer
        if per_layer > experts_per_layer:
            raise ValueError(f"offload.gpu_experts_per_layer {per_layer}: the model has {experts_per_layer} routed"
                             " experts a layer")
    elif offload.gpu_experts_gb is not None:
        per_layer = min(experts_per_layer, int(offload.gpu_experts_gb * 2**30) // max(1, layers * expert_bytes))
    else:
        room = gpu_room - staging * expert_bytes
        per_layer = max(0, min(experts_per_layer, room // max(1, layers * expert_bytes)))
    return ExpertPlacement(layers, experts_per_layer, expert_bytes, per_layer, staging)
