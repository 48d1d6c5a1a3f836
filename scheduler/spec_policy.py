"""How many drafts a decode step verifies: adaptive K, and plain decoding when drafting would not pay.

A verify step of B sequences with k drafts each forwards B x (k + 1) rows and yields, per sequence, the
accepted drafts plus one drawn token. Whether that beats a plain step (B rows, B tokens) depends on
two things this module measures online instead of assuming:
- acceptance: of the verify chunks that reached draft position j (every draft before it accepted),
  the share that accepted it too (`acceptance`); the expected tokens a sequence gains with k drafts is
  1 + a_0 + a_0 a_1 + ... (the product over the positions before each);
- step cost: seconds a step takes as a function of the rows it forwards, fit as fixed + per_row x rows
  by exponentially weighted least squares over the engine's steps (`StepCost`). Small batches are
  launch-bound (per_row ~ 0: extra rows are nearly free), large ones compute-bound (each row costs).
Each step takes the k (0 .. the drafts proposed) with the most expected tokens per second for its
decode batch. Until both are measured (the first steps) it verifies every draft proposed, as vLLM's
fixed num_speculative_tokens does. While k is 0 every PROBE_EVERY-th step is still a probe: each of its
sequences verifies one draft in the step after it, so acceptance keeps being measured and drafting comes
back when the batch shrinks or drafts improve.
Users reported DSpark costing throughput at saturation on vLLM; this is the guard against that.

The drafts a chunk verifies are proposed as the step before it lands, so whether they will be wanted is
decided a step ahead, once per step as its sampling chunks are launched (`drafting_next`): while drafting
does not pay and no probe is due, the proposer skips its drafting work after the step (it only keeps its
state: worker/proposers.py), which is what lets plain decoding recover the proposer's own cost. Probes
come as whole steps, not as one sampling chunk in PROBE_EVERY: the proposer's drafting work (chained draft
steps, the host read of the drafts) is launch-bound, costing a step nearly as much for a few rows as for
all, so at a batch of PROBE_EVERY or more chunk-wise probes would have it run nearly every step, for one
or two rows, and keep most of the cost the policy turned drafting off to save. Each sequence still probes
once in PROBE_EVERY steps. A sampling chunk whose next chunk cannot verify drafts anyway (a grammar, or
min_tokens still holding eos back: the scheduler's `Request.takes_drafts`) does not ask, is never a
probe, and a step of only such chunks does not count toward the schedule.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

PROBE_EVERY = 16  # while drafting does not pay, one step in this many still probes (verifies a draft)
MIN_STEPS = 8  # steps observed before the cost fit is trusted
DECAY = 0.98  # weight of the older steps in the cost fit, per new step (~50 steps remembered)


@dataclass
class StepCost:
    """seconds ~ fixed + per_row x rows, exponentially weighted least squares over observed steps."""

    weight: float = 0.0
    rows: float = 0.0
    seconds: float = 0.0
    rows2: float = 0.0
    rows_seconds: float = 0.0
    steps: int = 0

    def observe(self, rows: int, seconds: float) -> None:
        self.weight = DECAY * self.weight + 1.0
        self.rows = DECAY * self.rows + rows
        self.seconds = DECAY * self.seconds + seconds
        self.rows2 = DECAY * self.rows2 + rows * rows
        self.rows_seconds = DECAY * self.rows_seconds + rows * seconds
        self.steps += 1

    def fit(self) -> tuple[float, float] | None:
        """(fixed, per_row) seconds, None until MIN_STEPS steps of at least two sizes were seen."""
        if self.steps < MIN_STEPS:
            return None
        variance = self.weight * self.rows2 - self.rows * self.rows
        if variance <= 1e-9 * max(1.0, self.rows2 * self.weight):
            return None  # every step the same size: the slope is unknown
        per_row = max(0.0, (self.weight * self.rows_seconds - self.rows * self.seconds) / variance)
        fixed = max(0.0, (self.seconds - per_row * self.rows) / self.weight)
        return fixed, per_row


class Drafting(enum.Enum):
    """What the policy wants of the proposer after a sampling chunk (`SpeculationPolicy.drafting_next`)."""

    ON = "on"  # drafting pays, or is not measured yet: the next chunks verify `draft_count` drafts
    PROBE = "probe"  # it does not, but the step is a probe: each next chunk verifies one draft
    OFF = "off"  # it does not: the next chunks verify none, so the proposer only keeps its state


@dataclass
class SpeculationPolicy:
    """The drafts each decode step verifies (see the module docstring)."""

    cost: StepCost
    reached: list[int]  # per draft position: verify chunks whose drafts before it were all accepted
    passed: list[int]  # of those, the chunks that accepted the draft at it too
    steps: int = 0  # steps asked while drafting did not pay (the probe schedule's count)

    @classmethod
    def fresh(cls) -> SpeculationPolicy:
        return cls(StepCost(), [], [])

    def observe_step(self, rows: int, seconds: float) -> None:
        """A step that forwarded `rows` tokens (drafts included) took `seconds`."""
        if rows > 0:
            self.cost.observe(rows, seconds)

    def observe_verify(self, carried: int, accepted: int) -> None:
        """A verify chunk carried `carried` drafts and accepted the first `accepted`."""
        grow = carried - len(self.reached)
        if grow > 0:
            self.reached += [0] * grow
            self.passed += [0] * grow
        for position in range(min(carried, accepted + 1)):
            self.reached[position] += 1
            if position < accepted:
                self.passed[position] += 1

    def acceptance(self, position: int) -> float:
        """Share of chunks reaching `position` that accepted its draft (a flat prior before any did)."""
        reached = self.reached[position] if position < len(self.reached) else 0
        passed = self.passed[position] if position < len(self.passed) else 0
        return (passed + 1) / (reached + 2)

    def expected_tokens(self, drafts: int) -> float:
        """Tokens a sequence gains from a verify step with `drafts` drafts (1 with none)."""
        total, reach = 1.0, 1.0
        for position in range(drafts):
            reach *= self.acceptance(position)
            total += reach
        return total

    def drafting_next(self, batch: int) -> Drafting:
        """Whether the proposer drafts after the sampling chunks of a `batch`-sequence step launched now,
        and whether as a probe: asked once per step that has sampling chunks able to take drafts, before
        it runs (its drafts are proposed as it lands), and the answer holds for all of those chunks.
        Drafting pays for some k exactly when it pays for k = 1 (each further draft gains no more than
        the one before it, at the same cost a row: see `_best`), so the proposer's K need not be known.
        Where it does not pay, the step counts toward the probe schedule: every PROBE_EVERY-th such step
        is a probe (whole steps: see the module docstring)."""
        best = self._best(batch, 1)
        if best is None or best > 0:
            return Drafting.ON
        self.steps += 1
        return Drafting.PROBE if self.steps % PROBE_EVERY == 0 else Drafting.OFF

    def draft_count(self, batch: int, proposed: int, probe: bool = False) -> int:
        """Drafts (0 .. `proposed`) a sequence of a `batch`-sequence decode step verifies now; `probe`: they
        were proposed for a probe step (`drafting_next`), which verifies one where drafting does not pay."""
        if proposed <= 0:
            return 0
        best = self._best(batch, proposed)
        if best is None:
            return proposed
        return best if best > 0 else int(probe)

    def _best(self, batch: int, most: int) -> int | None:
        """The k (0 .. `most`) with the most expected tokens per second, None until the cost is measured.
        Rates are E(k) / (fixed + per_row x batch x (k + 1)) with E's increments non-increasing (products of
        acceptances below 1): if the first draft gains no more than its row's share of the cost, no later
        one does, so k = 0 beats every k exactly when it beats k = 1."""
        fit = self.cost.fit()
        if fit is None:
            return None
        fixed, per_row = fit
        rates = [batch * self.expected_tokens(k) / (fixed + per_row * batch * (k + 1) + 1e-12)
                 for k in range(most + 1)]
        return max(range(most + 1), key=lambda k: (rates[k], -k))
