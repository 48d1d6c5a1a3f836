"""The engine loop: schedule -> execute -> update, on its own thread (of the engine process, when served).

Requests and aborts arrive through a thread-safe inbox; each step's outputs leave together through one
callback call (one frame per step on the wire). A failing step ends the requests it carried with an
error reason and the loop goes on (the server stays up). The executor is injected behind the
contract's ModelExecutor protocol, so this module never imports torch.

Requests with an output constraint (`params.structured`) are matched by the engine's
StructuredOutputs (engine/structured_outputs.py; injected, like the executor): before each step
every drawing constrained chunk gets its grammar's token bitmask, after it the matchers take the
tokens the scheduler kept. A grammar that cannot be used fails its request alone.

Overlapped scheduling (`overlap`, the config's `scheduler.async_scheduling`; docs/overlap.md): each
step launches the next plan before it lands the one in flight, so the host's planning, output and
inbox work runs while the device computes. The scheduler gives the new plan's decodes the draws of the
step in flight as PENDING_TOKEN inputs when the executor resolves them (`pending_inputs`); outputs,
stop checks and grammar matching follow one step late. A step that fails to launch or to land lands
everything before anything else is planned (a failed step's draws cannot feed another), and the
executor is repaired only while no step is in flight. Without `overlap` a step lands at once.

With the prefix cache's disk tier, the loop hands the scheduler's committed disk entries to the
catalog's writer (engine/prefix_catalog.py) when its disk_version moved: at most once a second, and a
last time as the loop ends. The writer encodes and writes them on a thread of its own, so a step never
waits on the disk; the loop's share is taking the entries list. Before that last time, a loop that
stops cleanly flushes the GPU's state points to the disk tier (`Scheduler.flush`), for up to `flush_s`:
otherwise a point reaches the disk only when the GPU evicts it, and a restart would lose every
conversation still on the GPU. A loop that died does not flush: its executor may be gone.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from contract import (
    ChunkResult,
    EngineStats,
    LaunchedStep,
    ModelExecutor,
    NewRequest,
    RequestOutput,
    StepPlan,
    StepResult,
    StepTokens,
    StructuredOutput,
)
from scheduler import Scheduler

if TYPE_CHECKING:  # xgrammar (and torch) load in the engine process only, with the factory
    from engine.prefix_catalog import CatalogWriter
    from engine.structured_outputs import StructuredOutputs

log = logging.getLogger("ds4serve.engine")

OutputSink = Callable[[Sequence[RequestOutput]], None]  # called once per step with its outputs (never empty)
# how long a stopping loop may spend putting the prefix cache's GPU points on disk: with the close and
# the catalog's last write, within the 10 s the front end waits for the engine process to exit
FLUSH_S = 8.0


@dataclass(frozen=True)
class InFlight:
    """A launched step: its plan, its handle, and the requests whose grammar failed as it was planned."""

    plan: StepPlan
    step: LaunchedStep | None  # None: the launch itself raised `error`
    grammar_errors: dict[str, str]
    error: Exception | None = None
    launched_at: float = field(default_factory=time.perf_counter)


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: ModelExecutor, on_outputs: OutputSink,
                 structured: StructuredOutputs | None = None, catalog: CatalogWriter | None = None,
                 flush_s: float = FLUSH_S, overlap: bool = False) -> None:
        self.scheduler, self.executor, self._sink = scheduler, executor, on_outputs
        # an executor that takes no pending inputs (V4.1's Engram read from disk) would only plan empty steps
        # between its decodes: it runs serially (measured on the H200: 32 streams 4.5k tok/s overlapped, 6.7k
        # serial); a speculative one overlaps the steps that draft nothing (`_lands_at_once`)
        self.overlap = overlap and executor.pending_inputs
        scheduler.pending_inputs = self.overlap
        self._in_flight: InFlight | None = None  # the step launched and not landed yet (overlap only)
        self._landed_at = 0.0  # when the last step landed
        self.structured = structured  # None: constrained requests are refused
        self.catalog = catalog  # None: no prefix disk tier
        self.flush_s = flush_s
        self._stop_by = float("inf")  # set by stop(): no flush plan starts after stop() stopped waiting
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.steps = 0
        self.step_tokens = StepTokens()  # swapped whole, so stats() reads it from another thread
        self.failure: str | None = None  # why the loop thread ended, if it failed

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ds4serve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ends the loop after its step in progress (waiting up to `timeout` seconds for it) and its flush to
        the prefix disk tier (`flush_s` more); requests still running are left as they are. Then the catalog
        is written a last time. The executor stays open (its owner closes it)."""
        self._stop_by = time.monotonic() + timeout + self.flush_s
        self._stopping.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout + self.flush_s)
        if self.catalog is not None:  # the loop offered its last entries as it ended: write them
            self.catalog.close()
        if self.structured is not None:
            self.structured.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(
            running=s.running, waiting=s.waiting, preemptions=s.preemptions, pages_total=s.blocks.total,
            pages_held=s.blocks.held, pages_cached=s.blocks.cached, steps=self.steps, last_step_tokens=s.last_step_tokens,
            prefix_cache_queries=s.prefix_queried_tokens, prefix_cache_hits=s.prefix_hit_tokens,
            prefix_gpu_points=s.prefix_points, prefix_host_points=s.host_points, prefix_disk_points=s.disk_points,
            prefix_host_hits=s.host_hit_tokens, prefix_disk_hits=s.disk_hit_tokens, prefix_fetch_failures=s.fetch_failures,
            step_tokens=self.step_tokens, spec=s.spec, engram=self.executor.engram_stats(),
            offload=self.executor.offload_stats(), unhealthy=self.executor.health(),
        )

    def submit(self, request: NewRequest) -> None:
        """Validate first (raises RequestRejected for the caller), then queue for the loop."""
        self.scheduler.validate(request)
        self._inbox.put(("add", request))

    def check_grammar(self, structured: StructuredOutput, reply: Callable[[str | None], None]) -> None:
        """Compiles a constraint off the loop (kept for the request that follows); reply(None) when it
        compiled, reply(why not) otherwise, from a compile thread."""
        if self.structured is None:
            reply("structured outputs are unavailable in this engine")
        else:
            self.structured.check(structured, reply)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if self._in_flight is None:  # never under a running step
                    self._maintain()
                self._drain_inbox(block=not self.scheduler.has_work and self._in_flight is None)
                if self.scheduler.has_work or self._in_flight is not None:
                    self.step()
                self._persist()  # idle too: a change the rate limit held back is written within a second
            self._land_in_flight()
            self._flush()
        except Exception as exc:  # the loop cannot go on (e.g. a rank failed and the config says exit)
            log.exception("the engine loop stopped")
            self.failure = f"{type(exc).__name__}: {exc}"
            outputs = self.scheduler.fail_all(f"the engine stopped: {self.failure}")
            self._release_grammars(outputs)
            self._emit(outputs)
        finally:
            self._persist(final=True)

    def _flush(self) -> None:
        """Runs the scheduler's flush plans (tier moves, no chunks) until it has none left or the deadline
        passes; a failing plan ends the flush (the points committed so far are kept). The catalog follows
        as usual meanwhile, so a process killed mid-flush still leaves the points written a second ago."""
        deadline = min(time.monotonic() + self.flush_s, self._stop_by)
        while (plan := self.scheduler.flush()) is not None:
            if time.monotonic() >= deadline:
                log.warning("prefix disk tier: %d state points not on disk when the %.1f s flush ended: a restart"
                            " recomputes them", self.scheduler.unflushed(), self.flush_s)
                return
            try:
                result = self.executor.execute(plan)
            except Exception:  # the engine is stopping anyway: what is committed is kept, the rest recomputes
                log.exception("prefix disk tier: the flush failed; the points on disk so far are kept")
                return
            self.scheduler.update(plan, result)
            self._persist()

    def _persist(self, final: bool = False) -> None:
        """Offers the disk tier's committed entries to the catalog writer when they changed (the writer
        rate-limits, unless `final`). On the loop thread: the scheduler is the loop's alone."""
        if self.catalog is not None:
            self.catalog.offer(self.scheduler.disk_version, self.scheduler.disk_entries, final=final)

    def _maintain(self) -> None:
        """Lets the executor repair itself between steps (restart a failed tensor-parallel pool). A repair
        that rebuilt the model state (a watchdog can restart an idle pool, before any step fails) fails
        what ran on the old state and drops every prefix point, whose snapshots and rows are gone: a
        later hit would otherwise restore zeros."""
        if self.executor.maintain():
            outputs = self.scheduler.fail_all("the tensor-parallel ranks restarted: their cache state was lost")
            self._release_grammars(outputs)
            self._emit(outputs)

    def _emit(self, outputs: Sequence[RequestOutput]) -> None:
        if outputs:
            self._sink(outputs)

    def _drain_inbox(self, block: bool) -> None:
        try:
            kind, payload = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if kind == "add":
                self._add(payload)  # type: ignore[arg-type]
            elif kind == "abort":
                output = self.scheduler.abort(payload)  # type: ignore[arg-type]
                if output is not None:
                    self._emit([output])
                    self.executor.cancel(payload)  # drop the request's pending prefetches
                    self._release_grammars([output])
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, request: NewRequest) -> None:
        structured = request.params.structured
        if structured is not None:
            if self.structured is None:  # the front end checked its grammar with this engine: a safety net
                self._emit([RequestOutput(request.request_id, finished=True, finish_reason="error",
                                          error="structured outputs are unavailable in this engine",
                                          num_prompt_tokens=len(request.prompt_token_ids))])
                return
            self.structured.add(request.request_id, structured)
        self.scheduler.add(request)

    def step(self) -> None:
        """Plans and launches the next step, then lands the one in flight before it (overlap), or lands
        the new one at once. After a failure everything lands and the executor is repaired first."""
        launched = self._launch() if self.scheduler.has_work else None
        previous, self._in_flight = self._in_flight, launched
        ok = self._land(previous) if previous is not None else True
        if launched is not None and (not self.overlap or not ok or launched.step is None
                                     or self._lands_at_once(launched.plan)):
            self._in_flight = None
            ok = self._land(launched) and ok
        if not ok:
            self._maintain()  # e.g. a pool whose rank died restarts before the next step
        if not self.scheduler.has_work and self._in_flight is None:
            self.scheduler.check_integrity()

    def _launch(self) -> InFlight | None:
        plan = self.scheduler.schedule()
        if not plan.has_work:
            return None
        if plan.num_tokens:  # a step of state copies only runs no tokens
            self.step_tokens = self.step_tokens.observe(plan.num_tokens)
        plan, grammar_errors = self._constrain(plan)
        try:
            return InFlight(plan, self.executor.launch(plan), grammar_errors)
        except Exception as exc:  # a failing step fails its requests, not the engine (as it lands)
            return InFlight(plan, None, grammar_errors, exc)

    def _lands_at_once(self, plan: StepPlan) -> bool:
        """A speculative executor's step that verifies drafts or drafts next: the next step's chunks take
        what it proposes, so it lands before the next is planned (the others overlap)."""
        return self.executor.proposes_drafts and any(chunk.draft_token_ids or (chunk.sample and chunk.draft_next)
                                                     for chunk in plan.chunks)

    def _land(self, launched: InFlight) -> bool:
        """Applies a launched step's results (or its failure) and sends its outputs; False if it failed.
        The step's cost, what the draft policy weighs, is the time from when the device could start it
        (its launch, or the step before it landing, whichever was later: steps run in launch order) to
        its landing: a serial step's launch-to-land time, an overlapped one's share of the stream."""
        try:
            if launched.step is None:
                assert launched.error is not None
                raise launched.error
            result = launched.step.result()
        except Exception as exc:
            log.exception("step failed")
            outputs, ok = self.scheduler.fail_all(f"engine step failed: {type(exc).__name__}: {exc}"), False
        else:
            landed = time.perf_counter()
            self.scheduler.observe_step(launched.plan.num_tokens, landed - max(launched.launched_at, self._landed_at))
            self._landed_at = landed
            outputs, ok = self.scheduler.update(launched.plan, _failing(result, launched.grammar_errors)), True
        self.steps += 1
        self._match(outputs)
        self._emit(outputs)
        return ok

    def _land_in_flight(self) -> None:
        """The step still out lands (as the loop stops, before the flush runs steps of its own)."""
        launched, self._in_flight = self._in_flight, None
        if launched is not None:
            self._land(launched)

    def _constrain(self, plan: StepPlan) -> tuple[StepPlan, dict[str, str]]:
        """Each drawing constrained chunk with its grammar's bitmask; the requests whose grammar
        cannot be used, with why (their chunks run unconstrained and their results become errors)."""
        if self.structured is None or not self.structured.any_constrained:
            return plan, {}
        chunks, errors = list(plan.chunks), {}
        for i, chunk in enumerate(chunks):
            if chunk.sample and self.structured.constrained(chunk.request_id):
                # a bitmask constrains the first draw only: the scheduler gives a constrained request no drafts
                # (scheduler/request.py takes_drafts); stripped here too, so a scheduler slip can only cost
                # speed, never let an unconstrained draft through or stop the loop
                try:
                    chunks[i] = dataclasses.replace(chunk, token_bitmask=self.structured.bitmask(chunk.request_id),
                                                    draft_token_ids=())
                except Exception as exc:  # GrammarError, or a compile that failed otherwise
                    errors[chunk.request_id] = f"structured output: {exc}"
        return dataclasses.replace(plan, chunks=tuple(chunks)), errors

    def _match(self, outputs: Sequence[RequestOutput]) -> None:
        """The constrained requests' matchers take the tokens the scheduler kept; finished requests
        let go of theirs."""
        if self.structured is None:
            return
        for output in outputs:
            if output.new_token_ids:
                refused = self.structured.accept(output.request_id, output.new_token_ids)
                if refused is not None:  # the bitmask allowed it: a bug, not the client's
                    log.error("request %s: %s", output.request_id, refused)
        self._release_grammars(outputs)

    def _release_grammars(self, outputs: Sequence[RequestOutput]) -> None:
        if self.structured is not None:
            for output in outputs:
                if output.finished:
                    self.structured.release(output.request_id)


def _failing(result: StepResult, errors: dict[str, str]) -> StepResult:
    """`result` with the chunks of `errors`' requests failed."""
    if not errors:
        return result
    chunks = tuple(ChunkResult(c.request_id, sampled=None, error=errors[c.request_id]) if c.request_id in errors else c
                   for c in result.chunks)
    return dataclasses.replace(result, chunks=chunks)
