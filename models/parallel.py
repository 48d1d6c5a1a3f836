"""Tensor parallelism for the model: which rank this is, what it holds, and the collectives it needs.

A `TensorParallel` names one rank of an already initialised torch.distributed process group (gloo on
CPU, NCCL on GPU); the model never initialises or destroys the group (the worker pool does). `SINGLE`
is world size 1: every collective hands its input back untouched and torch.distributed is never
called, so an unsharded model runs exactly as it did before tensor parallelism existed.

A `Shard` says which part of a checkpoint tensor a rank holds, so the loader reads only that part.
Sizes split evenly or not at all: a size that does not divide by the world size is refused with a
ConfigError naming it (padding would silently change the model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from models.config import ConfigError


@dataclass(frozen=True)
class Shard:
    """This rank's part of a checkpoint tensor: the [start, end) `ranges` along `dim` of the full
    tensor (`full` long on that dim), concatenated in order."""

    dim: int
    full: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return sum(end - start for start, end in self.ranges)

    @property
    def start(self) -> int:
        """Where the first range begins (for a one-range shard of items: this rank's first item)."""
        return self.ranges[0][0]

    @property
    def whole(self) -> bool:
        return self.ranges == ((0, self.full),)


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in a tensor-parallel group. Loading needs only rank and world size (no group);
    the forward's collectives run over `group`."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None  # None: the default group

    @classmethod
    def from_default_group(cls) -> TensorParallel:
        """This process in torch.distributed's default group, which the caller has initialised."""
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), group=dist.group.WORLD)

    def shard(self, name: str, count: int, unit: int = 1, dim: int = 0, blocks: int = 1) -> Shard:
        """This rank's share of `count` items (heads, experts, vocabulary rows...), each `unit` wide
        along `dim`; with `blocks` > 1 the dim holds that many such runs back to back (e.g. Engram's
        per-stream keys and value) and the rank takes its share of each. `name` is the config key
        the error names when `count` does not divide."""
        if count % self.world_size:
            raise ConfigError(
                f"{name} = {count} does not divide by the tensor parallel size {self.world_size}; "
                "choose a tensor_parallel_size that divides it"
            )
        share = count // self.world_size * unit
        block = count * unit
        ranges = tuple((b * block + self.rank * share, b * block + (self.rank + 1) * share) for b in range(blocks))
        return Shard(dim=dim, full=block * blocks, ranges=ranges)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks, in place; returns it."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order (the same tensor on every rank)."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = TensorParallel()


def mark_shards(module: nn.Module, **shards: Shard) -> nn.Module:
    """Records which part of the checkpoint each named parameter of `module` holds (read by the loader;
    whole shards are left out, so world size 1 loads exactly as before)."""
    module.tp_shards = {leaf: shard for leaf, shard in shards.items() if not shard.whole}
    return module


def shard_of(model: nn.Module, full_name: str) -> Shard | None:
    """The shard `mark_shards` recorded for a parameter, None for a whole (replicated) one."""
    owner, _, leaf = full_name.rpartition(".")
    return getattr(model.get_submodule(owner), "tp_shards", {}).get(leaf)
