"""Whether an outside launcher (torchrun) started the tensor-parallel ranks, read from the standard
environment. Standard library only: the HTTP front end asks before it imports anything heavy."""

from __future__ import annotations

import os


def launched_externally() -> bool:
    """torchrun (or another launcher) started every rank and set the standard environment: the pool
    then joins those ranks instead of spawning its own (and cannot restart them: the launcher does)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1


def external_rank() -> tuple[int, int, int, tuple[str, int]]:
    """(rank, world size, local rank, (master address, port)) from the launcher's environment."""
    env = os.environ
    rank = int(env["RANK"])
    return rank, int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", rank)), (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
