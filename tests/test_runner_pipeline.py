"""The runner's step pipeline (prepare -> forward -> sample -> report) and the multi-token seam: draft
tokens in a plan cross the tensor-parallel codec, a runner without draft rows refuses them (one with
them verifies them: tests/test_runner_drafts.py), and a result carrying several tokens is applied by the
scheduler one token at a time."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from contract import (
    ChunkResult,
    EngineLimits,
    NewRequest,
    SamplingParams,
    ScheduledChunk,
    StateCopy,
    StepPlan,
    StepResult,
    TokenLogprob,
)
from contract.codec import decode_plan, encode_plan
from models import load_model
from scheduler.scheduler import Scheduler
from worker import ModelRunner

PROMPT = (5, 9, 2, 7, 11, 3, 8)


def chunk(request_id: str, slot: int, params: SamplingParams, pages: tuple[int, ...] = (), **fields) -> ScheduledChunk:
    """A whole-prompt chunk that samples."""
    return ScheduledChunk(request_id=request_id, slot=slot, pages=pages, token_ids=PROMPT, position=0, sample=True,
                          logprob_targets=(), params=params, num_generated=0, **fields)


def slot_pages(runner: ModelRunner, slot: int) -> tuple[int, ...]:
    """The slot's block table in a runner whose cache gives every slot its own pages."""
    return tuple(runner.cache.default_pages(slot).tolist())


def test_a_plan_with_drafts_round_trips_the_codec():
    plan = StepPlan(
        chunks=(
            chunk("r", 0, SamplingParams(temperature=0.0), draft_token_ids=(4, 4, 17)),
            chunk("s", 1, SamplingParams(seed=3, logit_bias=((2, 1.5),))),
        ),
        saves=(StateCopy(0, 5),),
    )
    decoded = decode_plan(encode_plan(plan))
    assert decoded == plan
    assert decoded.chunks[0].draft_token_ids == (4, 4, 17) and decoded.chunks[1].draft_token_ids == ()
    assert plan.num_tokens == 2 * len(PROMPT) + 3


def drafting_step(scheduler: Scheduler, drafts: tuple[int, ...]) -> StepPlan:
    """The scheduler's next plan as a speculative scheduler would send it: each decode chunk with drafts."""
    plan = scheduler.schedule()
    return replace(plan, chunks=tuple(replace(c, draft_token_ids=drafts) for c in plan.chunks))


def result(plan: StepPlan, accepted: tuple[int, ...], sampled: int) -> StepResult:
    return StepResult(tuple(
        ChunkResult(c.request_id, TokenLogprob(sampled, -0.5), accepted=tuple(TokenLogprob(t, -0.25) for t in accepted))
        for c in plan.chunks
    ))


def decoding(params: SamplingParams) -> Scheduler:
    """A scheduler with one request past its prompt (first token 20 drawn)."""
    scheduler = Scheduler(EngineLimits(2, 64, 64, 32, eos_token_ids=(1,)))
    scheduler.add(NewRequest("r", PROMPT, params))
    plan = scheduler.schedule()
    scheduler.update(plan, StepResult((ChunkResult("r", TokenLogprob(20, -1.0)),)))
    return scheduler


def test_several_tokens_of_a_result_are_appended_in_order_with_their_logprobs():
    scheduler = decoding(SamplingParams(max_tokens=10, logprobs=0))
    plan = drafting_step(scheduler, (21, 22, 23))
    (output,) = scheduler.update(plan, result(plan, accepted=(21, 22), sampled=24))
    (request,) = scheduler.running
    assert output.new_token_ids == (21, 22, 24) and not output.finished
    assert [lp.logprob for lp in output.new_logprobs] == [-0.25, -0.25, -0.5]
    assert request.output_token_ids == [20, 21, 22, 24]
    # the input token and the accepted drafts are in the cache; the sampled token is the next input
    assert request.num_computed_tokens == len(PROMPT) + 1 + 2
    next_chunk = scheduler.schedule().chunks[0]
    assert (next_chunk.token_ids, next_chunk.position, next_chunk.num_generated) == ((24,), len(PROMPT) + 3, 4)


def test_a_stop_token_among_the_new_tokens_ends_the_request_and_drops_the_rest():
    scheduler = decoding(SamplingParams(max_tokens=10, stop_token_ids=(22,)))
    plan = drafting_step(scheduler, (21, 22, 23))
    (output,) = scheduler.update(plan, result(plan, accepted=(21, 22, 23), sampled=24))
    assert output.new_token_ids == (21, 22)
    assert output.finished and output.finish_reason == "stop"
    assert not scheduler.running
    scheduler.check_integrity()


def test_max_tokens_is_checked_after_each_new_token():
    scheduler = decoding(SamplingParams(max_tokens=3, ignore_eos=True))
    plan = drafting_step(scheduler, (1, 1))
    (output,) = scheduler.update(plan, result(plan, accepted=(1, 1), sampled=1))  # eos ignored
    assert output.new_token_ids == (1, 1)
    assert output.finished and output.finish_reason == "length"


def test_min_tokens_holds_a_stop_off_per_token():
    scheduler = decoding(SamplingParams(max_tokens=10, min_tokens=3))
    plan = drafting_step(scheduler, (1, 1, 1))
    (output,) = scheduler.update(plan, result(plan, accepted=(1, 1, 1), sampled=1))
    assert output.new_token_ids == (1, 1, 1) and output.finish_reason == "stop"  # eos as the 4th output token


@pytest.fixture(scope="module")
def model(checkpoints):
    return load_model(checkpoints["v41"])


def runner(model) -> ModelRunner:
    return ModelRunner(model, num_slots=4, max_model_len=64, deterministic=True)


def test_a_runner_without_draft_rows_refuses_drafts_before_touching_the_cache(model):
    refusing = runner(model)
    before = [t.clone() for t in refusing.cache.tensors()]
    plan = StepPlan(chunks=(chunk("r", 0, SamplingParams(temperature=0.0), slot_pages(refusing, 0), draft_token_ids=(3,)),),
                    restores=(StateCopy(0, 1),))
    with pytest.raises(ValueError, match=r"at most 0 \(draft_tokens\)"):
        refusing.execute(plan)
    assert all(torch.equal(a, b) for a, b in zip(before, refusing.cache.tensors(), strict=True))


MIXED = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy-top": SamplingParams(temperature=0.0, logprobs=3),
    "biased": SamplingParams(temperature=0.0, logit_bias=((6, 50.0),)),
    "seeded": SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=11, logprobs=2),
}


def test_a_step_of_mixed_params_draws_what_each_chunk_draws_alone(model):
    """One batched draw over a step whose rows want different things gives each row what it gets alone
    (deterministic mode: the logits themselves do not depend on the batch)."""
    batched = runner(model)
    chunks = tuple(chunk(rid, slot, params, slot_pages(batched, slot)) for slot, (rid, params) in enumerate(MIXED.items()))
    together = batched.execute(StepPlan(chunks)).chunks
    alone = [runner(model).execute(StepPlan((c,))).chunks[0] for c in chunks]
    assert together == tuple(alone)
    by_id = {r.request_id: r for r in together}
    assert by_id["biased"].sampled.token_id == 6
    assert len(by_id["greedy-top"].sampled.top) == 3 and by_id["greedy"].sampled.top == ()


def test_graph_partition_puts_a_steps_one_token_chunks_in_the_graph_beside_its_prefill_chunks():
    """A mixed step's decodes replay the graph while its prompt chunks run eagerly; without graphs, or
    when no captured bucket holds the decodes, the whole step is eager."""
    from worker.runner import graph_partition

    params = SamplingParams(temperature=0.0)
    decode = lambda i: ScheduledChunk(f"d{i}", i, (), (5,), 10, True, (), params, 1)  # noqa: E731
    prompt = chunk("p", 3, params)
    computed = [decode(0), prompt, decode(1), decode(2)]
    rows = [[0], [len(PROMPT) - 1], [0], []]  # d2 computes without a draw (it resumes a state point)
    offered: list[list[ScheduledChunk]] = []
    takes_all = lambda chunks: offered.append(chunks) or True  # noqa: E731
    assert graph_partition(computed, rows, takes_all) == (0, 2, 3)
    assert offered == [[computed[0], computed[2], computed[3]]]
    assert graph_partition(computed, rows, None) == ()
    assert graph_partition(computed, rows, lambda chunks: False) == ()
    assert graph_partition([prompt], [[len(PROMPT) - 1]], takes_all) == ()
