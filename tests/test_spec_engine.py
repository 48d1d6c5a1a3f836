"""Speculative decoding through the engine (issue 27): --speculative-config and its YAML key, the
scheduler handing each request's proposed drafts to its next decode chunk (cut to the budget,
max_tokens, max_model_len; none for prompts, under min_tokens' eos ban, under a grammar or after
preemption), vLLM's spec-decode counters, a served V4 model answering the official openai client with
the tokens and logprobs it gives without speculation (deterministic mode: bitwise) for MTP and n-gram
drafts, and the proposer skipping its drafting for a grammar-constrained request and one under min_tokens."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import time

import httpx
import openai
import pytest

from contract import (
    ChunkResult,
    EngineLimits,
    NewRequest,
    SamplingParams,
    StepResult,
    StructuredOutput,
    TokenLogprob,
)
from contract.config import ConfigFileError, load_config
from contract.features import unbuilt_features
from models.tiny import build_tiny_checkpoint
from scheduler.scheduler import Scheduler
from tests.serving import dropped_stream, running_server, settled_metrics

PROMPT = (5, 9, 2, 7, 11, 3, 8)


def spec(**fields) -> dict:
    return {"runtime.speculative_config": json.dumps(fields)}


def config_of(value: object):
    return load_config(None, [f"runtime.speculative_config={json.dumps(value)}"], {})


# -- configuration ------------------------------------------------------------------------------------
def test_speculative_config_reads_vllms_spellings():
    mtp = config_of({"method": "deepseek_mtp", "num_speculative_tokens": 3}).runtime.speculative_config
    assert (mtp.method, mtp.num_speculative_tokens) == ("mtp", 3)
    ngram = config_of({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}).runtime.speculative_config
    assert ngram.lookup_sizes == (1, 3)
    assert config_of({}).runtime.speculative_config is None and config_of(None).runtime.speculative_config is None
    dspark = config_of({"method": "dspark", "num_speculative_tokens": 5, "model": "draft"})
    assert dspark.runtime.speculative_config.model == "draft" and unbuilt_features(dspark) == []


@pytest.mark.parametrize("value, named", [
    ({"method": "mtp", "num_speculative_tokens": 2, "draft_model": "x"}, "draft_model"),
    ({"method": "mtp"}, "num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "prompt_lookup"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
])
def test_a_bad_speculative_config_is_a_config_error_naming_the_key(value, named):
    with pytest.raises(ConfigFileError) as error:
        config_of(value)
    assert "speculative_config" in str(error.value) and named in str(error.value)


# -- the scheduler ------------------------------------------------------------------------------------
def decoding(params: SamplingParams, max_model_len: int = 64, budget: int = 32) -> Scheduler:
    """A scheduler whose request "r" is past its prompt, its first token 20 drawn and drafts 21..25
    proposed; `budget`: the steps' token budget from then on."""
    scheduler = Scheduler(EngineLimits(2, 32, max_model_len, 32, eos_token_ids=(1,)))
    scheduler.add(NewRequest("r", PROMPT, params))
    plan = scheduler.schedule()
    assert plan.chunks[0].draft_token_ids == ()  # a prompt chunk verifies nothing
    scheduler.update(plan, StepResult((ChunkResult("r", TokenLogprob(20, -1.0), proposed=(21, 22, 23, 24, 25)),)))
    scheduler.limits = dataclasses.replace(scheduler.limits, max_num_batched_tokens=budget)
    return scheduler


def test_the_proposed_drafts_ride_the_next_decode_chunk_and_count():
    scheduler = decoding(SamplingParams(max_tokens=20))
    plan = scheduler.schedule()
    (chunk,) = plan.chunks
    assert chunk.token_ids == (20,) and chunk.draft_token_ids == (21, 22, 23, 24, 25)
    assert scheduler.last_step_tokens == 6  # the drafts take budget
    assert len(scheduler.blocks.table("r")) * 32 >= len(PROMPT) + 6  # and pages
    accepted = tuple(TokenLogprob(t, -0.1) for t in (21, 22))
    (output,) = scheduler.update(plan, StepResult((ChunkResult("r", TokenLogprob(30, -0.2), accepted=accepted,
                                                               proposed=(31, 32)),)))
    assert output.new_token_ids == (21, 22, 30)
    (chunk,) = scheduler.schedule().chunks
    assert (chunk.token_ids, chunk.position, chunk.draft_token_ids) == ((30,), len(PROMPT) + 3, (31, 32))
    counts = scheduler.stats().spec
    assert (counts.drafts, counts.draft_tokens, counts.accepted_tokens) == (1, 5, 2)
    assert counts.accepted_per_position == (1, 1, 0, 0, 0)


@pytest.mark.parametrize("params, limits, kept", [
    (SamplingParams(max_tokens=4), {}, 2),  # 20 drawn: at most 2 drafts + the token after them
    (SamplingParams(max_tokens=20), {"max_model_len": len(PROMPT) + 4}, 2),  # 8 tokens now: 2 + 1 more fit
    (SamplingParams(max_tokens=20), {"budget": 3}, 2),  # the token and 2 drafts
    (SamplingParams(max_tokens=20, min_tokens=3), {}, 0),  # eos banned for the first draw only: no drafts
    (SamplingParams(max_tokens=20, structured=StructuredOutput("regex", "[a-z]+")), {}, 0),  # a grammar's too
])
def test_drafts_are_cut_to_what_fits(params, limits, kept):
    scheduler = decoding(params, **limits)
    (chunk,) = scheduler.schedule().chunks
    assert chunk.draft_token_ids == (21, 22, 23, 24, 25)[:kept]


def test_a_preempted_request_forgets_its_drafts():
    scheduler = decoding(SamplingParams(max_tokens=20))
    (request,) = scheduler.running
    scheduler._preempt(request)
    plan = scheduler.schedule()
    assert plan.chunks[0].position == 0 and plan.chunks[0].draft_token_ids == ()
    assert request.drafts == ()


# -- served: the openai client, with and without speculation ------------------------------------------
@pytest.fixture(scope="module")
def v4_with_mtp(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "v4-mtp", seed=5, family="v4",
                                 num_nextn_predict_layers=1)


PROMPTS = ["Hello there", "def main(): return 1 + 2 + 3 + 1 + 2 + 3", "the cat sat on the mat, the cat sat"]


def completions(base: str, max_tokens: int = 24) -> list[tuple[list[str], list[float]]]:
    """Greedy completions of PROMPTS sent at once (a mixed batch), with logprobs: tokens and logprobs."""
    llm = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)

    def one(prompt: str) -> tuple[list[str], list[float]]:
        reply = llm.completions.create(model="spec", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       logprobs=1)
        return reply.choices[0].logprobs.tokens, reply.choices[0].logprobs.token_logprobs

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def spec_counters(base: str, *names: str) -> tuple[float, ...]:
    """vLLM's counters `names` (without the vllm: prefix and _total suffix), settled (tests/serving.py)."""
    return settled_metrics(base, *(f"vllm:{name}_total" for name in names))


def test_served_greedy_with_drafts_is_greedy_without_them(v4_with_mtp):
    """Deterministic mode, the tiny V4 with its MTP layer, 3 requests at once: MTP (K = 2) and n-gram
    (K = 3) drafting give the same tokens and bitwise the same logprobs as plain decoding; vLLM's
    spec-decode counters count the verify chunks, and a request asking for grammar-free sampling too."""
    common = ("--deterministic", "--max-model-len", "256")
    with running_server(v4_with_mtp, "spec", *common) as base:
        plain = completions(base)
    for method, k in (("mtp", 2), ("ngram", 3)):
        config = json.dumps({"method": method, "num_speculative_tokens": k})
        with running_server(v4_with_mtp, "spec", *common, "--speculative-config", config) as base:
            assert completions(base) == plain, method
            drafts, tokens, accepted = spec_counters(base, "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                                     "spec_decode_num_accepted_tokens")
            print(f"{method}: {drafts:.0f} verify chunks, {tokens:.0f} drafts, {accepted:.0f} accepted")
            assert drafts > 0 and drafts <= tokens <= k * drafts and 0 <= accepted <= tokens, (method, drafts, tokens)
            text = httpx.get(base + "/metrics").text
            assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{' in text and 'position="0"' in text


def draft_step_counts(base: str) -> tuple[float, float, float]:
    """(draft steps run, draft steps skipped, drafts accepted) since the server started."""
    text = httpx.get(base + "/metrics").text

    def total(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith((f"{name}_total{{", f"{name}_total ")))

    return (total("ds4serve:spec_decode_num_draft_steps"), total("ds4serve:spec_decode_num_skipped_draft_steps"),
            total("vllm:spec_decode_num_accepted_tokens"))


def draft_steps_of(base: str, send) -> tuple[int, int, int]:
    """(draft steps run, skipped, completion tokens) for the one request `send()` makes (it returns the
    reply's completion tokens): each sampling chunk yields one token and the drafts it accepted, so the
    engine's counters (sent every second) have settled once run + skipped + accepted moved by those."""
    before = draft_step_counts(base)
    tokens = send()
    deadline = time.monotonic() + 20
    while True:
        run, skipped, accepted = (now - then for now, then in zip(draft_step_counts(base), before))
        if run + skipped + accepted == tokens or time.monotonic() > deadline:
            assert run + skipped + accepted == tokens, (run, skipped, accepted, tokens)
            return int(run), int(skipped), tokens
        time.sleep(0.2)


def test_constrained_and_min_tokens_requests_skip_drafting(v4_with_mtp):
    """MTP (K = 2, fixed K so no timing enters), one request at a time through the openai client: a
    grammar-constrained request (structured outputs) cannot verify drafts, so the proposer skips its
    drafting after every one of its chunks; a request under min_tokens after the chunks whose next one is
    still under it (the first min_tokens - 1), then drafts; a free request drafts after every chunk but
    the one or two at its end whose next chunk has no room for a draft before max_tokens (the last, and
    the one before where it left max_tokens - 1 tokens)."""
    pytest.importorskip("xgrammar")
    config = json.dumps({"method": "mtp", "num_speculative_tokens": 2, "adaptive": False})
    with running_server(v4_with_mtp, "spec", "--deterministic", "--max-model-len", "256",
                        "--speculative-config", config) as base:
        llm = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)

        def send(**fields) -> int:
            reply = llm.completions.create(model="spec", prompt=PROMPTS[2], max_tokens=16, temperature=0, **fields)
            return reply.usage.completion_tokens

        constrained = {"structured_outputs": {"regex": "[a-z]{20,60}"}}
        run, skipped, tokens = draft_steps_of(base, lambda: send(extra_body=constrained))
        assert run == 0 and skipped == tokens > 1, (run, skipped, tokens)
        run, skipped, _ = draft_steps_of(base, lambda: send(extra_body={"min_tokens": 8, "ignore_eos": True}))
        assert skipped - (8 - 1) in (1, 2) and run >= 1, (run, skipped)
        run, skipped, _ = draft_steps_of(base, lambda: send(extra_body={"ignore_eos": True}))
        assert skipped in (1, 2) and run >= 1, (run, skipped)


def test_a_v41_without_an_mtp_layer_refuses_mtp_naming_the_flag(checkpoints):
    """The tiny random V4.1 has no MTP layer (the trained default has one: tests/test_default_model.py)."""
    from tests.test_cli import run_cli

    result = run_cli("serve", str(checkpoints["v41"]), "--speculative-config",
                     '{"method": "mtp", "num_speculative_tokens": 2}')
    assert result.returncode == 2 and "--speculative-config" in result.stderr and "ngram" in result.stderr, result.stderr


def test_served_v41_with_ngram_drafts_is_greedy_without_them(checkpoints):
    """The tiny V4.1 (Engram, shared kv sources): n-gram drafts (K = 3) through the openai client give
    plain greedy's tokens and bitwise logprobs in deterministic mode, 3 requests at once, with some
    drafts accepted (the rolled-back Engram look-back and shared-store groups are then exercised)."""
    common = ("--deterministic", "--max-model-len", "256")
    with running_server(checkpoints["v41"], "spec", *common) as base:
        plain = completions(base, max_tokens=40)
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})  # timing-free K
    with running_server(checkpoints["v41"], "spec", *common, "--speculative-config", config) as base:
        assert completions(base, max_tokens=40) == plain
        drafts, accepted = spec_counters(base, "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
        print(f"v41 ngram: {drafts:.0f} drafts, {accepted:.0f} accepted")
        assert drafts > accepted > 0  # some drafts passed, some were rolled back


# ~200-token prompts: their first 128-token page is a prefix-cache point the second round hits
LONG_PROMPTS = [f"{i}: " + " ".join(PROMPTS) * 4 for i in range(3)]


def stressed_workload(base: str) -> dict[str, object]:
    """What a served model answers under pressure, in a fixed order: 3 long greedy requests at once on
    too few KV pages (preemption), one of them twice more alone (prefix-cache hits), a seeded sampled request, and a
    greedy request beside a stream the client drops after 3 chunks (an abort)."""
    llm = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)

    def greedy(prompt: str, max_tokens: int = 150) -> tuple[list[str], list[float]]:
        reply = llm.completions.create(model="spec", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       logprobs=1, extra_body={"ignore_eos": True})
        return reply.choices[0].logprobs.tokens, reply.choices[0].logprobs.token_logprobs

    out: dict[str, object] = {}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        out["crowded"] = list(pool.map(greedy, LONG_PROMPTS))
        out["again"] = [greedy(LONG_PROMPTS[0], 20), greedy(LONG_PROMPTS[0], 20)]  # the second hits the first's point
        sampled = llm.completions.create(model="spec", prompt=PROMPTS[1], max_tokens=40, temperature=0.8, seed=7,
                                         extra_body={"ignore_eos": True})
        out["seeded"] = sampled.choices[0].text
        beside = pool.submit(greedy, PROMPTS[0], 60)
        pool.submit(dropped_stream, llm, "spec", PROMPTS[2]).result()
        out["beside_abort"] = beside.result()
    return out


def test_served_speculation_keeps_its_tokens_through_preemption_prefix_hits_aborts_and_seeds(v4_with_mtp):
    """The same workload on a plain and a drafting server (MTP, K = 3; deterministic mode; 7 KV pages of
    128 tokens where the 3 requests at once need 9): every greedy reply the same tokens and bitwise
    logprobs, the seeded sampled reply the same text (draws keyed by their index, not the drafts), and
    both servers preempted and hit their prefix cache, so those paths ran."""
    common = ("--deterministic", "--max-model-len", "512", "--set", "memory.num_kv_pages=7", "--max-num-seqs", "3")
    results = {}
    for name, extra in (("plain", ()), ("mtp", ("--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}'))):
        with running_server(v4_with_mtp, "spec", *common, *extra) as base:
            results[name] = stressed_workload(base)
            preempted, hits, verified = settled_metrics(base, "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total",
                                                        "vllm:spec_decode_num_drafts_total")
            print(f"{name}: {preempted:.0f} preemptions, {hits:.0f} prefix-hit tokens, {verified:.0f} verify chunks")
            assert preempted > 0 and hits > 0, name
            assert httpx.get(base + "/health").status_code == 200
    for key in results["plain"]:
        assert results["mtp"][key] == results["plain"][key], key


# -- adaptive K and the fallback to plain decoding ------------------------------------------------------
def policy_after(fixed_s: float, per_row_s: float, carried: int, accepted: int | tuple[int, ...], verifies: int = 200):
    """A policy that saw steps costing fixed + per_row x rows (1 to 64 rows) and `verifies` chunks that
    carried `carried` drafts and accepted the first `accepted` of them (a tuple: in turn)."""
    accepted = accepted if isinstance(accepted, tuple) else (accepted,)
    from scheduler.spec_policy import SpeculationPolicy

    policy = SpeculationPolicy.fresh()
    for rows in range(1, 65):
        policy.observe_step(rows, fixed_s + per_row_s * rows)
    for index in range(verifies):
        policy.observe_verify(carried, accepted[index % len(accepted)])
    return policy


def test_the_policy_verifies_every_draft_until_it_has_measured():
    from scheduler.spec_policy import SpeculationPolicy

    policy = SpeculationPolicy.fresh()
    assert policy.draft_count(batch=32, proposed=3) == 3
    for _ in range(20):
        policy.observe_step(8, 0.01)  # one step size only: the per-row cost is unknown
    assert policy.draft_count(batch=32, proposed=3) == 3


def test_small_launch_bound_batches_draft_and_large_compute_bound_ones_fall_back():
    """Costs like the H200 slice's (a step ~1.7 ms at one row, ~0.16 ms a further row) and half the first
    drafts accepted, no second: one sequence verifies a draft (1.5 tokens for 1.2x the step); 32
    sequences verify none (their rows cost), and the proposer drafts for none of them, except the probes
    (every PROBE_EVERY-th step, decided as it is launched, all its chunks at once) that keep acceptance
    measured; with every draft accepted 32 sequences draft again."""
    from scheduler.spec_policy import PROBE_EVERY, Drafting

    mediocre = policy_after(1.7e-3, 0.16e-3, carried=3, accepted=(0, 1))
    assert mediocre.draft_count(batch=1, proposed=3) >= 1 and mediocre.drafting_next(batch=1) is Drafting.ON
    wishes = [mediocre.drafting_next(batch=32) for _ in range(4 * PROBE_EVERY)]
    assert wishes.count(Drafting.PROBE) == 4 and wishes.count(Drafting.OFF) == 4 * PROBE_EVERY - 4
    assert wishes[PROBE_EVERY - 1] is Drafting.PROBE  # a probe step every PROBE_EVERY-th
    assert mediocre.draft_count(batch=32, proposed=3) == 0 and mediocre.draft_count(batch=32, proposed=3, probe=True) == 1
    perfect = policy_after(1.7e-3, 0.16e-3, carried=3, accepted=3)
    assert perfect.draft_count(batch=1, proposed=3) == 3 and perfect.draft_count(batch=32, proposed=3) >= 1
    assert perfect.drafting_next(batch=32) is Drafting.ON
    useless = policy_after(1.7e-3, 0.16e-3, carried=3, accepted=0)
    assert useless.draft_count(batch=1, proposed=3) == 0 and useless.drafting_next(batch=1) is Drafting.OFF


def test_the_scheduler_cuts_drafts_to_the_policy():
    scheduler = decoding(SamplingParams(max_tokens=20))
    scheduler.spec_policy = policy_after(1e-3, 1e-3, carried=5, accepted=0)  # rows costly, drafts useless
    assert scheduler.schedule().chunks[0].draft_token_ids == ()
    scheduler = decoding(SamplingParams(max_tokens=20))
    scheduler.spec_policy = None  # not adaptive: every draft
    assert scheduler.schedule().chunks[0].draft_token_ids == (21, 22, 23, 24, 25)


def mtp_rig(checkpoint, drafting: bool):
    """(config, its path, config.json) of the cpu-tiny rig serving `checkpoint`, drafting 2 tokens with
    its MTP layer or not drafting."""
    from tests.test_deploy_plan import rig

    overrides = [f"model.path={checkpoint}"]
    if drafting:
        overrides.append('runtime.speculative_config={"method": "mtp", "num_speculative_tokens": 2}')
    return rig("cpu-tiny", *overrides)


def drafting_state_bytes(checkpoint, config) -> int:
    """The slots' fixed state of a runner drafting 2 tokens with the MTP layer, counted on the objects
    the engine builds: the target cache with its rings' spare rows, and the proposer's own memory."""
    from engine.layout import max_model_len
    from models import load_model
    from worker import ModelRunner
    from worker.proposers import MTPProposer

    model = load_model(checkpoint, mtp=True)
    sched, max_len = config.scheduler, max_model_len(config, model.config)
    proposer = MTPProposer(model, sched.max_num_seqs, max_len, k=2)
    assert proposer.device_bytes() > 0
    runner = ModelRunner(model, sched.max_num_seqs, max_len, num_pages=1, block_tokens=sched.block_tokens,
                         snapshot_slots=sched.snapshot_slots, draft_tokens=2)
    return runner.cache.slot_bytes() + proposer.device_bytes()


def test_the_plan_counts_the_mtp_layer_when_it_drafts(v4_with_mtp):
    """`python -m server plan` with --speculative-config method mtp holds the MTP layer's weights as the
    engine loads them (a kind of their own), and its cache with the slots' fixed state; without it, as
    before."""
    from engine.memory_plan import model_bytes
    from engine.plan import build_plan
    from models import load_model

    slot_state = {}
    for drafting in (False, True):
        config, path, config_json = mtp_rig(v4_with_mtp, drafting)
        plan = build_plan(config, path, config_json)
        assert plan.weights_bytes == model_bytes(load_model(v4_with_mtp, mtp=drafting))
        assert any(t.kind == "MTP draft layer" for t in plan.weights) == drafting
        slot_state[drafting] = plan.kv.slot_state_bytes
    assert slot_state[True] == drafting_state_bytes(v4_with_mtp, config) > slot_state[False]


def test_the_plan_refuses_mtp_where_the_engine_would_by_its_key(checkpoints, tmp_path):
    """`python -m server plan` with method mtp runs the engine's own check: on a V4.1 or V4 checkpoint
    without an MTP layer it is a config error naming --speculative-config."""
    from contract.config import ConfigFileError
    from engine.plan import build_plan

    no_mtp = build_tiny_checkpoint(tmp_path / "v4", family="v4")
    for checkpoint, reason in ((checkpoints["v41"], "has no MTP layer.*dspark"), (no_mtp, "has no MTP layer")):
        config, path, config_json = mtp_rig(checkpoint, drafting=True)
        with pytest.raises(ConfigFileError, match=f"runtime.speculative_config .*method mtp.*{reason}"):
            build_plan(config, path, config_json)


def test_the_engines_memory_plan_keeps_room_for_the_mtp_cache(v4_with_mtp):
    """The engine's own plan (profiled at start) counts the MTP layer's cache and waiting rows with the
    slots' fixed state, so the KV pages it hands out never take the memory the proposer holds."""
    from engine.factory import build_engine_core
    from engine.plan import build_plan

    config, path, config_json = mtp_rig(v4_with_mtp, drafting=True)
    _, spec = build_engine_core(config, lambda output: None)
    assert spec.memory.slot_state_bytes == drafting_state_bytes(v4_with_mtp, config)
    assert build_plan(config, path, config_json).kv.slot_state_bytes == spec.memory.slot_state_bytes  # the CLI's
