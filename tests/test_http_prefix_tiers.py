"""The prefix cache's disk tier across a restart, through HTTP (`python -m server` on the tiny V4.1, the
official openai client): a chat's follow-up after a graceful stop and a start on the same
prefix_cache.dir resumes from the first turn's state points and returns the cold run's tokens; a spill
file corrupted between the stop and the start is caught by its checksums (that follow-up recomputes,
the server stays up); a start with another cache layout is refused, naming the directory.

Two servers in all (each start costs ~10 s of CPU here): the first runs one first turn for each of two
tenants (cache_salt "intact" and "corrupted", the same chat: a salt is part of every point's key in
every tier, so their points share no record) and stops; every page record of the "corrupted" tenant
then gets a flipped byte, and the second server serves both follow-ups and the cold run. The points
reach the disk both ways: the first turns leave more points than the GPU's snapshot slots, so some are
evicted (and written) while the server runs, and the stop flushes the rest (engine/loop.py).

The cold run is the follow-up under a cache_salt no request used: nothing matches it, so the engine
prefills from token 0, in the same process and config (the tiers never change what a forward computes:
a server without them gives the same). Default (not batch-invariant) mode, as served: a hit computes
the prompt's tail in other chunk shapes than a cold prefill, so tokens are compared exactly and
logprobs to 1e-4 (tests/test_prefix_cache.py's default-mode bound); deterministic mode would add ~40 s
of start-up profiling to each server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from engine.prefix_catalog import CATALOG, HEADER_LENGTH, MAGIC, Fingerprint, load_catalog
from engram_store.format import PAGE, check_page
from scheduler.prefix_tiers import DiskEntry
from tests.serving import REPO, free_port, server_process
from tests.test_metrics import scrape, value
from worker.prefix_tiers import disk_record_pages

NO_THINK = {"chat_template_kwargs": {"thinking": False}, "ignore_eos": True, "return_token_ids": True}
# a short start-up profile; 8 snapshot slots (4 a sequence) for the first turns' ~12 points
SMALL = ("--max-model-len", "2048", "--max-num-seqs", "2", "--max-num-batched-tokens", "256")
TENANTS = ("intact", "corrupted")
HISTORY = " ".join(f"[{i}] The quick brown fox jumps over the lazy dog near the river bank." for i in range(24))
TURN1 = [{"role": "user", "content": HISTORY}]


def tier_args(directory: Path) -> tuple[str, ...]:
    return (*SMALL, "--set", "prefix_cache.host_gb=0.01", "--set", "prefix_cache.disk_gb=0.01",
            "--set", f"prefix_cache.dir={directory}")


def chat(base: str, messages: list[dict], salt: str):
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=8,
                                          logprobs=True, extra_body=NO_THINK | {"cache_salt": salt})


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def catalog(directory: Path) -> tuple[Fingerprint, list[DiskEntry]]:
    """The catalog's fingerprint and committed points, read with the fingerprint it holds (the server
    writes one at start, so it exists while one runs)."""
    data = (directory / CATALOG).read_bytes()
    (length,) = HEADER_LENGTH.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + HEADER_LENGTH.size
    fingerprint = Fingerprint.of(json.loads(data[start:start + length])["fingerprint"])
    return fingerprint, load_catalog(directory, fingerprint)


def corrupt_records(directory: Path, salt: str) -> Path:
    """Flips the first byte of every page record the salt's points use; returns the file."""
    fingerprint, entries = catalog(directory)
    disk_pages = disk_record_pages(int(dict(fingerprint.parts)["page record bytes"]))  # 4 KiB pages a record
    records = sorted({page for e in entries if e.salt == salt for page in e.pages})
    assert records
    path = directory / "rank0" / "pages.bin"
    with path.open("r+b") as f:
        for record in records:
            f.seek(record * disk_pages * PAGE)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0xFF]))
    return path


def unverified_records(directory: Path, salt: str, tokens: list[int]) -> list[int]:
    """The page records failing their seal check (engram_store's trailer) among the salt's cataloged
    points that `tokens` start with: what a request of those tokens would fetch."""
    fingerprint, entries = catalog(directory)
    disk_pages = disk_record_pages(int(dict(fingerprint.parts)["page record bytes"]))
    failing = set()
    with (directory / "rank0" / "pages.bin").open("rb") as f:
        for entry in (e for e in entries if e.salt == salt and tuple(tokens[:len(e.tokens)]) == e.tokens):
            for record, seal in zip(entry.pages, entry.seals[1:], strict=True):
                for page_no in range(record * disk_pages, (record + 1) * disk_pages):
                    f.seek(page_no * PAGE)
                    if check_page(f.read(PAGE), page_no, seal) is not None:
                        failing.add(record)
    return sorted(failing)


def stop(server) -> None:
    """SIGTERM, as `docker stop` sends: the server drains and exits 0."""
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(60) == 0, server.output


@pytest.fixture(scope="module")
def spilled(checkpoints, tmp_path_factory) -> tuple[Path, list[dict], int, Path]:
    """(a prefix_cache.dir after both tenants' first turn, a graceful stop and the corruption, the
    follow-up's messages, the first prompt's tokens, the corrupted file)."""
    directory = tmp_path_factory.mktemp("prefix-tiers") / "dir"
    with server_process(checkpoints["v41"], "tiny", *tier_args(directory)) as server:
        first = [chat(server.base, TURN1, salt) for salt in TENANTS]
        stop(server)
    assert first[0].choices[0].model_extra["token_ids"] == first[1].choices[0].model_extra["token_ids"]
    follow_up = TURN1 + [{"role": "assistant", "content": first[0].choices[0].message.content},
                         {"role": "user", "content": "And then?"}]
    return directory, follow_up, first[0].usage.prompt_tokens, corrupt_records(directory, "corrupted")


@pytest.fixture(scope="module")
def restarted(checkpoints, spilled) -> dict:
    """The second server's answers, in the order a restart meets them: each tenant's follow-up, the cold
    run, the corrupted tenant's follow-up again; then its /health, its /metrics once they count every
    hit, and its output."""
    directory, follow_up = spilled[:2]
    with server_process(checkpoints["v41"], "tiny", *tier_args(directory)) as server:
        out = {salt: chat(server.base, follow_up, salt) for salt in TENANTS}
        out["cold"] = chat(server.base, follow_up, uuid.uuid4().hex)
        out["again"] = chat(server.base, follow_up, "corrupted")
        out["metrics"] = counted(server.base, sum(map(cached, out.values())))
        out["health"] = httpx.get(server.base + "/health").status_code
        stop(server)  # the catalog's last write: what a third start would read
        out["output"] = server.output
    return out


def counted(base: str, hits: int) -> dict:
    """A /metrics scrape once its prefix hits reach `hits` (the engine's stats come every second)."""
    deadline = time.monotonic() + 10
    while (samples := scrape(base)) and metric(samples, "ds4serve:prefix_cache_hits_total") < hits:
        assert time.monotonic() < deadline, "the prefix hits never reached /metrics"
        time.sleep(0.2)
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    return value(samples, name, model_name="tiny", **labels) if any(n == name for n, _ in samples) else 0


def assert_same_output(warm, cold) -> None:
    warm_choice, cold_choice = warm.choices[0], cold.choices[0]
    assert warm_choice.model_extra["token_ids"] == cold_choice.model_extra["token_ids"]
    for a, b in zip(warm_choice.logprobs.content, cold_choice.logprobs.content, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-4


def test_a_follow_up_after_a_restart_resumes_from_the_disk_tier(spilled, restarted):
    warm, cold = restarted["intact"], restarted["cold"]
    assert cached(cold) == 0
    assert warm.usage.prompt_tokens == cold.usage.prompt_tokens
    # the first turn's whole prompt at least, and >= 80% of the follow-up's
    assert cached(warm) >= max(spilled[2], 0.8 * warm.usage.prompt_tokens)
    assert_same_output(warm, cold)
    assert metric(restarted["metrics"], "ds4serve:prefix_cache_hits_by_tier_total", tier="disk") == cached(warm)


def test_a_corrupted_spill_file_is_recomputed(spilled, restarted):
    """Each of the tenant's fetches fails its checksum and its point is dropped; the request looks up
    again (a shorter point, failed in turn) and at last prefills the whole prompt."""
    warm, output = restarted["corrupted"], restarted["output"]
    assert "checksum mismatch" in output and str(spilled[3]) in output
    assert metric(restarted["metrics"], "ds4serve:prefix_cache_fetch_failures_total") >= 1
    assert cached(warm) == 0
    assert_same_output(warm, restarted["cold"])
    assert restarted["health"] == 200
    assert cached(restarted["again"]) > 0  # the recomputed points serve the tenant's next request


def test_the_recomputed_points_are_written_whole(spilled, restarted):
    """After the corrupted tenant recomputed, the disk points its next follow-up would fetch verify: a
    failed fetch drops every disk point holding one of its pages, so the recomputed points' write-through
    writes those pages anew instead of linking the bad records (scheduler/prefix_tiers.py)."""
    prompt = restarted["corrupted"].model_extra["prompt_token_ids"]
    assert unverified_records(spilled[0], "corrupted", prompt) == []


def test_a_restart_with_another_layout_is_refused(checkpoints, spilled):
    directory = spilled[0]
    result = subprocess.run(
        [sys.executable, "-m", "server", "--model", str(checkpoints["v41"]), "--port", str(free_port()),
         "--log-level", "warning", *tier_args(directory), "--block-size", "64"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=120,
    )
    assert result.returncode != 0
    assert f"prefix_cache.dir {directory}: its catalog was written for another checkpoint or cache layout" in result.stdout
    assert "block_tokens 128 -> 64" in result.stdout
