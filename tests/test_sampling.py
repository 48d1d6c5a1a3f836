"""The sampler's features, each checked by a draw that would differ if the feature were ignored, and
the scheduler's part in them (token histories for penalties and bad words, min_tokens against eos /
stop ids), and the runner's (a chunk's grammar bitmask reaches the draw)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from contract import (
    ChunkResult,
    EngineLimits,
    InvalidSamplingParams,
    NewRequest,
    RequestOutput,
    SamplingParams,
    ScheduledChunk,
    StepPlan,
    StepResult,
    TokenLogprob,
)
from kernels import stable_topk
from models import load_model
from scheduler.scheduler import Scheduler
from worker import ModelRunner
from worker.sampler import NOT_DRAWABLE, DrawRow, sample, sample_rows


def row(*values: float, vocab: int = 8) -> torch.Tensor:
    """A logits row whose first entries are `values`, the rest far below."""
    logits = torch.full((vocab,), -10.0)
    logits[: len(values)] = torch.tensor(values)
    return logits


def greedy(logits: torch.Tensor, prompt: tuple[int, ...] = (), output: tuple[int, ...] = (), **params) -> int:
    chosen = sample(logits, SamplingParams(temperature=0.0, **params), len(output), prompt, output)
    return chosen.token_id


def test_greedy_takes_the_lowest_id_among_ties():
    assert greedy(row(1.0, 3.0, 3.0, 3.0)) == 1


def test_logit_bias_moves_the_draw_but_not_the_reported_logprobs():
    logits = row(2.0, 1.0, 0.0)
    raw = torch.log_softmax(logits, -1)
    chosen = sample(logits, SamplingParams(temperature=0.0, logit_bias=((2, 5.0),), logprobs=2), 0)
    assert chosen.token_id == 2
    assert chosen.logprob == pytest.approx(raw[2].item())
    assert [t for t, _ in chosen.top] == [0, 1]  # the model's own best, not the biased ones
    assert greedy(logits, logit_bias=((0, -1.5),)) == 1
    for seed in range(20):  # sampling too: -100 rules the favourite out, +100 forces a token
        assert sample(logits, SamplingParams(seed=seed, logit_bias=((0, -100.0), (1, -100.0))), 0).token_id == 2
        assert sample(logits, SamplingParams(seed=seed, logit_bias=((5, 100.0),)), 0).token_id == 5


def test_min_tokens_bans_stop_ids_until_reached():
    logits = row(5.0, 1.0, 0.0)
    params = SamplingParams(temperature=0.0, stop_token_ids=(0,), min_tokens=2)
    assert [sample(logits, params, i).token_id for i in range(3)] == [1, 1, 0]
    for seed in range(20):
        assert sample(logits, SamplingParams(seed=seed, stop_token_ids=(0, 1), min_tokens=1), 0).token_id == 2


def test_eos_joins_the_banned_ids_only_while_min_tokens_is_pending():
    params = SamplingParams(stop_token_ids=(7,), min_tokens=2)
    assert params.for_draw(1, (1,)).stop_token_ids == (7, 1)
    assert params.for_draw(2, (1,)) is params
    assert SamplingParams(min_tokens=2, ignore_eos=True).for_draw(0, (1,)).stop_token_ids == ()


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    # a seen positive logit 3 -> 1.5 falls below 2; multiplying it would keep it first
    assert greedy(row(3.0, 2.0), prompt=(0,), repetition_penalty=2.0) == 1
    # a seen negative logit -1 -> -2 falls below -1.5; dividing it would raise it
    assert greedy(row(-1.0, -1.5), output=(0,), repetition_penalty=2.0) == 1
    assert greedy(row(3.0, 2.0), prompt=(1,), repetition_penalty=2.0) == 0  # only seen tokens
    assert greedy(row(2.0, 3.0), prompt=(0, 1), output=(1,), repetition_penalty=0.5) == 1


def test_frequency_counts_each_occurrence_presence_counts_once():
    logits = row(3.0, 2.5)
    assert greedy(logits, output=(0,), frequency_penalty=0.4) == 0  # 2.6 > 2.5
    assert greedy(logits, output=(0, 0), frequency_penalty=0.4) == 1  # 2.2 < 2.5
    assert greedy(logits, output=(0, 0, 0), presence_penalty=0.4) == 0  # 2.6 whatever the count
    assert greedy(logits, output=(0,), presence_penalty=0.6) == 1
    assert greedy(logits, output=(1,), presence_penalty=-1.0) == 1  # negative: encourages repeats


def test_frequency_and_presence_ignore_the_prompt():
    assert greedy(row(3.0, 2.5), prompt=(0, 0, 0), frequency_penalty=2.0, presence_penalty=2.0) == 0


def test_penalties_leave_logprobs_raw_and_seeded_draws_reproducible():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(seed=7, frequency_penalty=1.0, repetition_penalty=1.3, logprobs=3)
    output = (5, 5, 9)
    first, second = (sample(logits, params, 3, (1, 2), output) for _ in range(2))
    assert first == second
    assert first.logprob == pytest.approx(torch.log_softmax(logits, -1)[first.token_id].item())


def test_penalties_change_the_sampled_distribution():
    logits = row(2.0, 2.0, vocab=2)
    plain = [sample(logits, SamplingParams(seed=s), 1, (), (0,)).token_id for s in range(200)]
    penalized = SamplingParams(frequency_penalty=2.0)
    drawn = [sample(logits, replace(penalized, seed=s), 1, (), (0,)).token_id for s in range(200)]
    assert 60 < plain.count(0) < 140
    assert drawn.count(0) < 40  # p(0) = 1 / (1 + e^2) ~ 0.12


def test_validate_rejects_ids_outside_the_vocabulary_and_min_tokens_above_max_tokens():
    SamplingParams(logit_bias=((7, 1.0),), stop_token_ids=(3,), min_tokens=4, max_tokens=4).validate(8)
    for params, param in (
        (SamplingParams(logit_bias=((8, 1.0),)), "logit_bias"),
        (SamplingParams(logit_bias=((-1, 1.0),)), "logit_bias"),
        (SamplingParams(stop_token_ids=(9,)), "stop_token_ids"),
        (SamplingParams(min_tokens=5, max_tokens=4), "min_tokens"),
    ):
        with pytest.raises(InvalidSamplingParams) as error:
            params.validate(8)
        assert error.value.param == param


def scheduler() -> Scheduler:
    return Scheduler(EngineLimits(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, vocab_size=32, eos_token_ids=(1,)))


def step(sched: Scheduler, token: int) -> tuple[StepPlan, list[RequestOutput]]:
    """One step in which every sampling chunk draws `token`."""
    plan = sched.schedule()
    results = tuple(
        ChunkResult(c.request_id, TokenLogprob(token, 0.0) if c.sample else None) for c in plan.chunks
    )
    return plan, sched.update(plan, StepResult(chunks=results))


def test_scheduler_sends_histories_only_to_penalized_requests():
    sched = scheduler()
    sched.add(NewRequest("plain", [3, 4, 5], SamplingParams()))
    sched.add(NewRequest("presence", [3, 4, 5], SamplingParams(presence_penalty=1.0)))
    sched.add(NewRequest("repeat", [3, 4, 5], SamplingParams(repetition_penalty=1.2)))
    step(sched, 9)
    chunks = {c.request_id: c for c in step(sched, 9)[0].chunks}
    assert (chunks["plain"].prompt_token_ids, chunks["plain"].output_token_ids) == ((), ())
    assert (chunks["presence"].prompt_token_ids, chunks["presence"].output_token_ids) == ((), (9,))
    assert (chunks["repeat"].prompt_token_ids, chunks["repeat"].output_token_ids) == ((3, 4, 5), (9,))


def test_eos_and_stop_ids_do_not_end_a_request_before_min_tokens():
    sched = scheduler()
    sched.add(NewRequest("r", [3, 4, 5], SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(6,))))
    plan, outputs = step(sched, 1)
    assert plan.chunks[0].params.stop_token_ids == (6, 1)  # eos banned for this draw
    assert not outputs[0].finished
    plan, outputs = step(sched, 6)
    assert plan.chunks[0].params.stop_token_ids == (6, 1) and not outputs[0].finished
    plan, outputs = step(sched, 6)
    assert plan.chunks[0].params.stop_token_ids == (6,)  # min_tokens reached: as the client sent them
    assert outputs[0].finished and outputs[0].finish_reason == "stop"


def test_batched_argmax_draws_what_sample_draws():
    """The runner draws plain greedy rows of a step together: same tokens (ties to the lowest id) and
    the same logprobs as one `sample` call per row."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(4))
    logits[2, 17] = logits[2, 40] = logits[2].max() + 1.0  # a tie
    params = SamplingParams(temperature=0.0, max_tokens=4)
    assert params.plain_at(0)
    assert not SamplingParams(temperature=0.0, max_tokens=4, logprobs=2).plain_at(0)
    assert not SamplingParams(temperature=0.0, max_tokens=4, presence_penalty=0.5).plain_at(0)
    assert not SamplingParams(temperature=0.7, max_tokens=4).plain_at(0)
    batched = sample_rows(logits, [DrawRow(params, 0)] * 5)
    assert batched[2].token_id == 17
    assert batched == [sample(row, params, 0) for row in logits]


def test_scheduler_sends_the_output_to_multi_id_bad_words_only():
    """A one-id bad word is banned whatever came before it; a longer one needs the output so far."""
    sched = scheduler()
    sched.add(NewRequest("one", [3, 4, 5], SamplingParams(bad_words=((7,),))))
    sched.add(NewRequest("two", [3, 4, 5], SamplingParams(bad_words=((7,), (9, 8)))))
    step(sched, 9)
    chunks = {c.request_id: c for c in step(sched, 9)[0].chunks}
    assert (chunks["one"].prompt_token_ids, chunks["one"].output_token_ids) == ((), ())
    assert (chunks["two"].prompt_token_ids, chunks["two"].output_token_ids) == ((), (9,))


def test_plain_at_follows_the_min_tokens_ban_over_draw_indices():
    params = SamplingParams(temperature=0.0, stop_token_ids=(3,), min_tokens=2)
    assert [params.plain_at(i) for i in range(3)] == [False, False, True]
    assert SamplingParams(temperature=0.0, min_tokens=2).plain_at(0)  # nothing to ban


# -- masks: allowed_token_ids, bad_words, the grammar's token bitmask -----------------------------


def bitmask(allowed: set[int], words: int) -> tuple[int, ...]:
    """xgrammar's layout: token t is bit t % 32 of word t // 32, each word an int32 value."""
    packed = [sum(1 << (t % 32) for t in allowed if t // 32 == w) for w in range(words)]
    return tuple(word - (1 << 32) if word >= 1 << 31 else word for word in packed)


def drawn_tokens(logits: torch.Tensor, params: SamplingParams, output: tuple[int, ...] = (),
                 mask: tuple[int, ...] = (), draws: int = 200) -> set[int]:
    """The tokens `draws` seeded draws of one row take."""
    return {sample(logits, replace(params, seed=seed), len(output), (), output, mask).token_id for seed in range(draws)}


def test_allowed_token_ids_limit_the_draw_greedy_to_the_best_allowed():
    logits = row(5.0, 4.0, 3.0, 2.0)
    raw = torch.log_softmax(logits, -1)
    assert greedy(logits, allowed_token_ids=(3, 2)) == 2
    chosen = sample(logits, SamplingParams(temperature=0.0, allowed_token_ids=(3, 6), logprobs=2), 0)
    assert chosen.token_id == 3 and chosen.logprob == pytest.approx(raw[3].item())
    assert [t for t, _ in chosen.top] == [0, 1]  # the model's own best, not the allowed ones
    logits = row(5.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0)
    assert drawn_tokens(logits, SamplingParams(allowed_token_ids=(1, 2, 7))) == {1, 2, 7}


def test_a_one_id_bad_word_is_always_banned():
    logits = row(5.0, 4.0, 4.0)
    assert greedy(logits, bad_words=((0,),)) == 1
    assert greedy(logits, output=(0, 0), bad_words=((0,), (1,))) == 2
    assert 0 not in drawn_tokens(logits, SamplingParams(bad_words=((0,),)))


def test_a_bad_word_of_several_ids_bans_its_last_id_only_right_after_the_others():
    logits = row(5.0, 4.0, 3.0)
    two = ((2, 0),)
    assert [greedy(logits, output=output, bad_words=two) for output in ((), (1,), (2,), (2, 1), (0, 2))] == [0, 0, 1, 0, 1]
    three = ((1, 2, 0),)
    assert [greedy(logits, output=output, bad_words=three) for output in ((2,), (0, 2), (1, 2), (1, 2, 1))] == [0, 0, 1, 0]
    sampling = SamplingParams(bad_words=two)
    assert 0 not in drawn_tokens(logits, sampling, output=(2,))
    assert 0 in drawn_tokens(logits, sampling, output=(1,))


def test_the_bitmask_unpacks_every_bit_of_its_words_negative_ones_included():
    """Row t peaks at token t, so its greedy draw is t exactly when the bitmask allows t: every bit of
    every word is read (bit 31 makes a word negative), bits past the vocabulary are ignored."""
    vocab = 70  # three words, the last one past the vocabulary from bit 6 on
    allowed = {0, 5, 31, 32, 63, 64, 69}
    mask = bitmask(allowed | {95}, 3)
    assert mask[0] < 0 and mask[1] < 0 and mask[2] < 0
    logits = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(1)) + 10 * torch.eye(vocab)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=1)):  # plain or not
        drawn = sample_rows(logits, [DrawRow(params, 0, token_bitmask=mask)] * vocab)
        assert {t for t in range(vocab) if drawn[t].token_id == t} == allowed
        assert all(d.token_id in allowed for d in drawn)
        for t in allowed:  # greedy takes the best allowed token; the logprob stays the model's own
            best = max(allowed, key=lambda a: logits[t, a].item())
            assert drawn[t].token_id == best
            assert drawn[t].logprob == pytest.approx(torch.log_softmax(logits[t], -1)[best].item(), abs=1e-6)
    assert drawn_tokens(torch.zeros(vocab), SamplingParams(), mask=mask, draws=400) == allowed


def test_tokens_past_the_bitmask_words_are_excluded():
    vocab = 70
    logits = torch.arange(vocab, dtype=torch.float32)  # the higher the id, the better
    assert greedy(logits) == 69
    assert sample(logits, SamplingParams(temperature=0.0), 0, token_bitmask=bitmask(set(range(vocab)), 2)).token_id == 63
    assert sample(logits, SamplingParams(temperature=0.0), 0, token_bitmask=bitmask(set(range(vocab)), 5)).token_id == 69


def test_every_token_excluded_fails_the_row_alone():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(2))
    others = [DrawRow(SamplingParams(temperature=0.0, logprobs=2), 0), DrawRow(SamplingParams(seed=4, top_p=0.8), 1)]
    for excluded in (
        DrawRow(SamplingParams(temperature=0.0), 0, token_bitmask=(0, 0)),
        DrawRow(SamplingParams(seed=3), 0, token_bitmask=(0,)),
        DrawRow(SamplingParams(seed=3, top_k=5, min_p=0.1, allowed_token_ids=(3,)), 0, token_bitmask=bitmask({1, 2}, 2)),
        DrawRow(SamplingParams(temperature=0.0, allowed_token_ids=(3, 4), bad_words=((3,), (7, 4))), 1, (), (7,)),
    ):
        drawn = sample_rows(logits[:3], [others[0], excluded, others[1]])
        assert drawn[1] is None
        assert [drawn[0], drawn[2]] == sample_rows(logits[[0, 2]], others)


def test_masks_leave_the_other_rows_bitwise_as_they_are_alone():
    vocab = 97
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3)) * 3
    plain = [DrawRow(SamplingParams(temperature=0.0), 0), DrawRow(SamplingParams(seed=5, top_p=0.7, logprobs=3), 2),
             DrawRow(SamplingParams(seed=6, frequency_penalty=0.5), 1, (), (4, 4))]
    masked = [DrawRow(SamplingParams(seed=1, allowed_token_ids=(1, 50)), 0),
              DrawRow(SamplingParams(temperature=0.0, bad_words=((4, 9),)), 1, (), (4,)),
              DrawRow(SamplingParams(seed=2), 0, token_bitmask=bitmask({7, 90}, 4))]
    drawn = sample_rows(logits, [plain[0], masked[0], plain[1], masked[1], masked[2], plain[2]])
    assert [drawn[0], drawn[2], drawn[5]] == sample_rows(logits[[0, 2, 5]], plain)
    assert drawn[1].token_id in (1, 50) and drawn[3].token_id != 9 and drawn[4].token_id in (7, 90)


@pytest.fixture(scope="module")
def model(checkpoints):
    return load_model(checkpoints["v41"])


def test_the_runner_draws_within_a_chunk_bitmask(model):
    """The chunk's bitmask reaches the draw: a greedy chunk takes the one token its bitmask allows, a
    chunk whose bitmask allows nothing fails alone."""
    vocab = model.config.vocab_size
    words = -(-vocab // 32)
    runner = ModelRunner(model, num_slots=3, max_model_len=64, deterministic=True)

    def chunk(request_id: str, slot: int, mask: tuple[int, ...]) -> ScheduledChunk:
        return ScheduledChunk(request_id=request_id, slot=slot, pages=tuple(runner.cache.default_pages(slot).tolist()),
                              token_ids=(5, 9, 2, 7), position=0, sample=True, logprob_targets=(),
                              params=SamplingParams(temperature=0.0), num_generated=0, token_bitmask=mask)

    free, only, none = runner.execute(StepPlan((chunk("free", 0, ()), chunk("only", 1, bitmask({vocab - 1}, words)),
                                                chunk("none", 2, (0,) * words)))).chunks
    assert free.sampled.token_id != vocab - 1  # else the bitmask would prove nothing
    assert only.sampled.token_id == vocab - 1
    assert none.sampled is None and none.error == NOT_DRAWABLE


# -- the batched sampler against the per-row sampler it replaced ----------------------------------


def reference_adjusted(logits, params, draw_index, prompt, output):
    """The per-row sampler's adjustments as they were before the batched sampler (the reference)."""
    banning = draw_index < params.min_tokens and bool(params.stop_token_ids)
    if not (params.logit_bias or banning or params.penalizes_output):
        return logits
    logits = logits.clone()
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias)
        logits.index_add_(0, torch.tensor(ids), torch.tensor(biases, dtype=logits.dtype))
    if banning:
        logits[torch.tensor(params.stop_token_ids)] = float("-inf")
    if params.penalizes_prompt:
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[torch.tensor([*prompt, *output], dtype=torch.long)] = True
        penalized = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if output and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output), minlength=logits.shape[-1]).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def reference_filtered(logits, params):
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = stable_topk(logits, params.top_k)[0][-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.min_p > 0:
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(logits.softmax(-1), descending=True, stable=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > params.top_p
        logits = logits.masked_fill(torch.zeros_like(outside).scatter(0, order, outside), float("-inf"))
    return logits


def reference_masked(logits: torch.Tensor, row: DrawRow) -> torch.Tensor:
    """vLLM's masks, one row and one token at a time: the grammar's bitmask, allowed_token_ids, then
    bad words as vLLM's _apply_bad_words_single_batch checks them."""
    vocab = logits.shape[-1]
    params, mask, output = row.params, row.token_bitmask, list(row.output_token_ids)
    excluded = set()
    if mask:
        excluded |= {t for t in range(vocab) if t // 32 >= len(mask) or not (mask[t // 32] >> (t % 32)) & 1}
    if params.allowed_token_ids:
        excluded |= set(range(vocab)) - set(params.allowed_token_ids)
    for word in params.bad_words:
        if len(word) <= len(output) + 1 and (len(word) == 1 or output[-(len(word) - 1):] == list(word[:-1])):
            excluded.add(word[-1])
    if not excluded:
        return logits
    logits = logits.clone()
    logits[sorted(excluded)] = float("-inf")
    return logits


def reference_sample(logits, row: DrawRow) -> TokenLogprob | None:
    """One row, one draw: the sampler as it was before rows were drawn together, after vLLM's masks;
    None where they exclude every token."""
    params, draw_index = row.params, row.draw_index
    logprobs = torch.log_softmax(logits, dim=-1)
    adjusted = reference_adjusted(reference_masked(logits, row), params, draw_index, row.prompt_token_ids,
                                  row.output_token_ids)
    if not torch.isfinite(adjusted).any():
        return None
    if params.greedy:
        token = int(torch.argmax(adjusted))
    else:
        generator = torch.Generator()
        if params.seed is not None:
            generator.manual_seed((params.seed * 1_000_003 + draw_index) % (1 << 63))
        else:
            generator.seed()
        token = int(torch.multinomial(reference_filtered(adjusted, params).softmax(-1), 1, generator=generator))
    top = ()
    if params.logprobs:
        values, ids = stable_topk(logprobs, params.logprobs)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logprobs[token]), top)


def mixed_rows(count: int, vocab: int, seed: int) -> list[DrawRow]:
    """Rows of every kind: greedy and seeded sampling, each with a random mix of top-k / top-p / min-p,
    penalties, logit_bias, logprobs and a min_tokens ban that holds for some draw indices."""
    rng = torch.Generator().manual_seed(seed)

    def pick(*choices):
        return choices[int(torch.randint(len(choices), (1,), generator=rng))]

    rows = []
    for i in range(count):
        output = tuple(torch.randint(vocab, (pick(0, 1, 6),), generator=rng).tolist())
        params = SamplingParams(
            temperature=pick(0.0, 0.0, 0.6, 1.0, 1.7),
            top_k=pick(0, 0, 1, 5, 40), top_p=pick(1.0, 0.9, 0.5), min_p=pick(0.0, 0.0, 0.05, 0.3),
            seed=100 + i,  # unseeded draws are random: test_unseeded_rows_draw_inside_their_filtered_support
            presence_penalty=pick(0.0, 0.0, 0.8, -0.5), frequency_penalty=pick(0.0, 0.0, 0.4),
            repetition_penalty=pick(1.0, 1.0, 1.3, 0.7),
            logit_bias=pick((), (), ((3, 4.0), (vocab - 1, -2.5)), ((int(output[0]) if output else 0, 9.0),)),
            stop_token_ids=pick((), (2,), (2, 5)), min_tokens=pick(0, 0, 3),
            logprobs=pick(None, 0, 3),
        )
        history = params.penalizes_output
        prompt = tuple(torch.randint(vocab, (5,), generator=rng).tolist()) if history and params.penalizes_prompt else ()
        rows.append(DrawRow(params, pick(0, 2, 7), prompt, output if history else ()))
    return rows


def masked_rows(count: int, vocab: int, seed: int) -> list[DrawRow]:
    """mixed_rows with a random mix of masks on some rows: allowed_token_ids, bad words (one id, several
    ids that match the output's end or not, longer than the output) and bitmasks (random words,
    negative ones included; fewer words than the vocabulary needs, or more)."""
    rng = torch.Generator().manual_seed(seed + 1000)

    def pick(*choices):
        return choices[int(torch.randint(len(choices), (1,), generator=rng))]

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(vocab, (n,), generator=rng).tolist())

    rows = []
    for row in mixed_rows(count, vocab, seed):
        kind = pick("none", "none", "allowed", "bad", "bitmask", "all")
        params, output, mask = row.params, row.output_token_ids, ()
        if kind in ("allowed", "all"):
            params = replace(params, allowed_token_ids=ids(pick(1, 3, 20)))
        if kind in ("bad", "all"):
            output = output or ids(pick(1, 3))
            words = (ids(1), (output[-1], *ids(1)), ((output[-1] + 1) % vocab, *ids(1)), (*output[-2:], *ids(1)),
                     ids(len(output) + 2))
            params = replace(params, bad_words=tuple(w for w in words if pick(True, False)))
        if kind in ("bitmask", "all"):
            mask = tuple(torch.randint(-(1 << 31), 1 << 31, (pick(2, 4, 4, 5),), generator=rng).tolist())
        rows.append(DrawRow(params, row.draw_index, row.prompt_token_ids, output, mask))
    return rows


@pytest.mark.parametrize("masks", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_batched_sampler_draws_what_the_per_row_sampler_drew(seed, masks):
    vocab = 97
    logits = torch.randn(48, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    logits[5, 10] = logits[5, 11] = logits[5].max() + 1.0  # a tie
    rows = (masked_rows if masks else mixed_rows)(len(logits), vocab, seed)
    batched = sample_rows(logits, rows)
    for got, row, logit_row in zip(batched, rows, logits):
        want = reference_sample(logit_row, row)
        if want is None:
            assert got is None, row
            continue
        assert got.token_id == want.token_id, row
        assert got.logprob == pytest.approx(want.logprob, abs=1e-6)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
        assert [lp for _, lp in got.top] == pytest.approx([lp for _, lp in want.top], abs=1e-6)
    for i in (7, 8):  # a row alone draws what it draws in the batch
        assert sample(logits[i], rows[i].params, rows[i].draw_index, rows[i].prompt_token_ids,
                      rows[i].output_token_ids, rows[i].token_bitmask) == batched[i]
    unmasked = [i for i, row in enumerate(rows) if not (row.token_bitmask or row.params.allowed_token_ids
                                                        or row.params.bad_words)]
    assert [batched[i] for i in unmasked] == sample_rows(logits[unmasked], [rows[i] for i in unmasked])


def test_unseeded_rows_draw_inside_their_filtered_support():
    vocab = 64
    logits = torch.randn(16, vocab, generator=torch.Generator().manual_seed(9))
    rows = [DrawRow(replace(row.params, seed=None), row.draw_index, row.prompt_token_ids, row.output_token_ids)
            for row in mixed_rows(len(logits), vocab, 9)]
    for got, row, logit_row in zip(sample_rows(logits, rows), rows, logits):
        adjusted = reference_adjusted(logit_row, row.params, row.draw_index, row.prompt_token_ids, row.output_token_ids)
        if row.params.greedy:
            assert got.token_id == int(torch.argmax(adjusted))
        else:
            assert reference_filtered(adjusted, row.params)[got.token_id] > float("-inf")
        assert got.logprob == pytest.approx(torch.log_softmax(logit_row, -1)[got.token_id].item(), abs=1e-6)
