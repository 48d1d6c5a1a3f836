"""The tensor-parallel worker pool: rank 0 in the engine process, ranks 1..N-1 in their own processes.

Every step rank 0 sends the StepPlan to the other ranks once (`PlanChannel`: one broadcast over a
CPU (gloo) group, the plan as orjson bytes, no pickling), then every rank runs the same forward; the
model's own collectives (models/parallel.py) keep them in lockstep, and rank 0's result is the step's.

Ranks are started with torch.multiprocessing's spawn context and join torch.distributed through the
standard environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK; `env://`), gloo on CPU,
NCCL on GPU (NCCL_NVLS_ENABLE=0: no NVLink multicast), plus a gloo group for the plans either way.
Under torchrun (`torchrun --nproc-per-node N -m server --tensor-parallel-size N ...`) the launcher has
set that environment and started every rank: rank 0 serves HTTP and its engine joins the others,
which run `external_rank_main` (no HTTP); a failed rank then ends the engine, and torchrun restarts.

Faults: a rank that exits is seen by a watchdog thread at once; one that hangs makes rank 0's next
collective fail after `parallel.timeout_s`. Either way the step in flight fails its requests with the
reason (EngineCore), the engine reports itself unhealthy (EngineStats.unhealthy, so /health answers
503), and `maintain()` on the engine thread restarts the pool: kills the ranks, starts new ones and
rebuilds rank 0's runner with the same page count, so the scheduler's arithmetic still holds (or,
with `parallel.on_rank_failure: exit`, raises, which ends the engine process non-zero). The prefix disk
tier's moves the old ranks had in flight are lost with them: the next step reports each one failed, so
the scheduler frees the host and disk records they pinned instead of waiting for them forever. `close()`
stops every rank, so no process outlives the engine.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from contract import DoneStep, EngramStats, ExpertOffloadStats, LaunchedStep, StepPlan, StepResult, TierDone
from contract.codec import decode_plan, encode_plan
from contract.launch_env import external_rank, launched_externally

if TYPE_CHECKING:
    from contract.config import ServeConfig
    from worker.runner import ModelRunner

log = logging.getLogger("ds4serve.tp")
# (plan_group=, num_pages=) -> (this rank's runner, its memory plan or None)
RunnerBuilder = Callable[..., tuple["ModelRunner", object]]

HEADER_BYTES = 8
FIRST_FRAME = 64 * 1024  # most plans fit one broadcast; a longer one sends the rest in a second


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or stopped answering; the message is meant for clients."""


class PlanChannel:
    """Rank 0 -> every rank: one StepPlan per step (None: stop), over a gloo group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.frame = torch.zeros(FIRST_FRAME, dtype=torch.uint8)

    def send(self, plan: StepPlan | None) -> None:
        payload = b"" if plan is None else encode_plan(plan)
        head = len(payload).to_bytes(HEADER_BYTES, "little", signed=True) if plan is not None else (-1).to_bytes(
            HEADER_BYTES, "little", signed=True)
        first = head + payload[: FIRST_FRAME - HEADER_BYTES]
        self.frame[: len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        dist.broadcast(self.frame, src=0, group=self.group)
        rest = payload[FIRST_FRAME - HEADER_BYTES :]
        if rest:
            dist.broadcast(torch.frombuffer(bytearray(rest), dtype=torch.uint8), src=0, group=self.group)

    def receive(self) -> StepPlan | None:
        dist.broadcast(self.frame, src=0, group=self.group)
        length = int.from_bytes(self.frame[:HEADER_BYTES].numpy().tobytes(), "little", signed=True)
        if length < 0:
            return None
        payload = self.frame[HEADER_BYTES : HEADER_BYTES + length].numpy().tobytes()
        if length > FIRST_FRAME - HEADER_BYTES:
            rest = torch.empty(length - (FIRST_FRAME - HEADER_BYTES), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)
            payload += rest.numpy().tobytes()
        return decode_plan(payload)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_group(rank: int, world: int, local_rank: int, master: tuple[str, int], device: str, timeout_s: float):
    """Initialises torch.distributed from the standard environment; returns the plans' gloo group."""
    os.environ.update({"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank)})
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")  # NVLink multicast off (device notes)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method="env://", timeout=timeout)
    return dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD


def leave_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group whose peers died may not close cleanly; it is dropped either way
            log.debug("destroying the process group failed", exc_info=True)


def external_rank_main(config: "ServeConfig", build: RunnerBuilder, device: str) -> int:
    """`python -m server` as rank >= 1 under torchrun: no HTTP, only the plans rank 0 sends."""
    rank, world, local_rank, master = external_rank()
    if world != config.parallel.tensor_parallel_size:
        raise ValueError(f"parallel.tensor_parallel_size is {config.parallel.tensor_parallel_size} but the launcher "
                         f"started {world} ranks (WORLD_SIZE)")
    rank_main(rank, world, master, config, build, device, None, local_rank)
    return 0


def rank_main(rank: int, world: int, master: tuple[str, int], config: "ServeConfig", build: RunnerBuilder,
              device: str, num_pages: int | None, local_rank: int | None = None) -> None:
    """Entry point of ranks 1..N-1: build the same runner as rank 0 (`build`, the engine factory's,
    picklable), then run the plans it sends."""
    from contract.logs import configure_logging

    configure_logging(logging.INFO, config.server.log_format)
    local_rank = rank if local_rank is None else local_rank
    group = join_group(rank, world, local_rank, master, device, config.parallel.timeout_s)
    runner, _ = build(plan_group=group, num_pages=num_pages)
    channel = PlanChannel(group)
    while (plan := channel.receive()) is not None:
        runner.execute(plan)
    runner.close()
    leave_group()


class WorkerPool:
    """The engine's executor. With one rank it is rank 0's runner behind one more call."""

    def __init__(self, config: "ServeConfig", build: RunnerBuilder, device: str) -> None:
        """`build(plan_group=..., num_pages=...)` makes this process's runner (engine/factory.py; it is
        sent to the rank processes too, so it must pickle); `device`: "cpu" or "cuda" (ranks take
        theirs by local rank)."""
        self.config, self.build, self.device = config, build, device
        self.world = config.parallel.tensor_parallel_size
        self.external = self.world > 1 and launched_externally()  # torchrun started the other ranks
        if self.external and external_rank()[:2] != (0, self.world):
            raise ValueError(f"the engine must be rank 0 of {self.world} (RANK / WORLD_SIZE: {external_rank()[:2]})")
        self.processes: list[mp.Process] = []
        self.channel: PlanChannel | None = None
        self.unhealthy: str | None = None  # why the pool cannot run steps now
        self._engram_stats: EngramStats | None = None  # rank 0's last reported counters
        self._offload_stats: ExpertOffloadStats | None = None
        self.restarts = 0
        self._dead: str | None = None  # set by the watchdog thread
        self._generation = 0  # a watchdog only reports deaths of its own generation of ranks
        self._watchdog: threading.Thread | None = None
        self._closing = threading.Event()
        self._lost: tuple[TierDone, ...] = ()  # disk tier moves a restart lost, reported with the next step
        self.runner, self.memory_plan = self._start(num_pages=None)

    @property
    def num_pages(self) -> int:
        return self.runner.cache.num_pages

    def _start(self, num_pages: int | None):
        if self.world == 1:
            return self.build(plan_group=None, num_pages=num_pages)
        local_rank = 0
        if self.external:
            _, _, local_rank, master = external_rank()
        else:
            master = ("127.0.0.1", free_port())
            context = mp.get_context("spawn")
            self.processes = [
                context.Process(target=rank_main, args=(rank, self.world, master, self.config, self.build, self.device, num_pages),
                                name=f"ds4serve-tp-rank{rank}", daemon=True)
                for rank in range(1, self.world)
            ]
            for process in self.processes:
                process.start()
        group = join_group(0, self.world, local_rank, master, self.device, self.config.parallel.timeout_s)
        runner, memory_plan = self.build(plan_group=group, num_pages=num_pages)
        self.channel = PlanChannel(group)
        self._dead = None
        self._generation += 1
        self._watchdog = threading.Thread(target=self._watch, args=(list(self.processes), self._generation),
                                          daemon=True, name="ds4serve-tp-watchdog")
        self._watchdog.start()
        log.info("tensor-parallel pool of %d ranks (pids %s)", self.world, [p.pid for p in self.processes])
        return runner, memory_plan

    def _watch(self, processes: list[mp.Process], generation: int) -> None:
        """Notices a rank that exits (sentinels), so an idle pool is restarted before a request fails."""
        from multiprocessing.connection import wait

        sentinels = {p.sentinel: p for p in processes}
        while not self._closing.is_set() and sentinels and generation == self._generation:
            for sentinel in wait(list(sentinels), timeout=0.5):
                process = sentinels.pop(sentinel)
                if not self._closing.is_set() and self._dead is None and generation == self._generation:
                    self._dead = f"tensor-parallel rank {process.name[-1]} (pid {process.pid}) exited with code {process.exitcode}"
                    self.unhealthy = self._dead
                    log.error(self._dead)
                return

    # -- ModelExecutor ---------------------------------------------------------------------------
    @property
    def pending_inputs(self) -> bool:
        """Each rank resolves a PENDING_TOKEN input from its own draws, which the plan's draw_seed keeps
        equal on every rank."""
        return self.runner.pending_inputs

    @property
    def proposes_drafts(self) -> bool:
        return self.runner.proposes_drafts

    def execute(self, plan: StepPlan) -> StepResult:
        return self.launch(plan).result()

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Sends the plan to the other ranks and queues rank 0's step. With several ranks rank 0's step
        runs to its end here (its collectives pace it with the others), so that a rank failure surfaces
        as this step's; each rank still resolves the next plan's pending inputs from its own draws."""
        if self._dead is not None:
            raise RankFailure(self._dead)
        if self.channel is None:
            return self.runner.launch(plan)
        try:
            self.channel.send(plan)
            result = self.runner.execute(plan)
        except RuntimeError as exc:  # a collective failed: a peer died or timed out
            self._dead = self._dead or f"tensor-parallel step failed: {exc}"
            self.unhealthy = self._dead
            raise RankFailure(self._dead) from exc
        return DoneStep(self._with_lost(result))

    def _with_lost(self, result: StepResult) -> StepResult:
        """The step's result with the moves the last restart lost reported failed (once)."""
        if not self._lost:
            return result
        lost, self._lost = self._lost, ()
        return replace(result, tier_done=lost + result.tier_done)

    def maintain(self) -> bool:
        """Called by the engine thread between steps: restarts the pool after a rank failure (True: the
        new ranks' caches and prefix-tier rows are empty)."""
        if self._dead is None:
            return False
        if self.config.parallel.on_rank_failure == "exit" or self.external:
            why = "the launcher owns the ranks" if self.external else "parallel.on_rank_failure is 'exit'"
            raise RankFailure(f"{self._dead}; {why}")
        reason = self._dead
        self.unhealthy = f"restarting the tensor-parallel pool after: {reason}"
        started = time.monotonic()
        num_pages = self.num_pages
        self._lost += tuple(TierDone(ticket, f"the prefix disk tier's move was lost with the tensor-parallel ranks:"
                                      f" {reason}") for ticket in self.runner.tickets.in_flight)
        self._stop_ranks(graceful=False)
        self.runner.close()
        self.runner = None  # the old cache and weights go before the new ones are built (stats read it: see engram_stats)
        self.runner, _ = self._start(num_pages=num_pages)
        self.restarts += 1
        self.unhealthy = None
        log.warning("tensor-parallel pool restarted in %.1f s after: %s", time.monotonic() - started, reason)
        return True

    def cancel(self, request_id: str) -> None:
        """An aborted request: rank 0 drops its pending Engram prefetches (none during a restart)."""
        runner = self.runner
        if runner is not None:
            runner.cancel(request_id)

    def engram_stats(self) -> EngramStats | None:
        """Rank 0's Engram counters; while a restart rebuilds the runner (the engine process's main
        thread asks for stats at any time), the last ones it reported."""
        runner = self.runner
        if runner is not None:
            self._engram_stats = runner.engram_stats()
        return self._engram_stats

    def offload_stats(self) -> ExpertOffloadStats | None:
        """Rank 0's expert offload counters (the last ones while a restart rebuilds the runner)."""
        runner = self.runner
        if runner is not None:
            self._offload_stats = runner.offload_stats()
        return self._offload_stats

    def health(self) -> str | None:
        return self.unhealthy

    def close(self) -> None:
        """Stops every rank (a stop plan, then kill after a grace period): no process outlives the pool."""
        self._closing.set()
        self._stop_ranks(graceful=self._dead is None)
        if self.runner is not None:
            self.runner.close()

    def _stop_ranks(self, graceful: bool) -> None:
        if self.channel is not None and graceful:
            try:
                self.channel.send(None)
            except RuntimeError:
                graceful = False
        for process in self.processes:
            process.join(5 if graceful else 0)
            if process.is_alive():
                process.kill()
                process.join(5)
        self.processes, self.channel = [], None
        leave_group()
