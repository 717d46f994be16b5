"""`tandem bench` as a user runs it (a separate process, the real command line) against a real
cluster: Ray actors, a gRPC router on 127.0.0.1, the tiny random model on CPU."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

from tandem.cluster.loadgen import load_sessions

ROOT = Path(__file__).resolve().parents[2]
# decode actors prefill locally and draft with n-gram lookup: the cache and draft figures are real
CLUSTER = {"model.name": "tiny-random", "cache.num_blocks": 512, "decode.local_prefill_threshold": 10**9,
           "prefill.replicas": 1, "decode.replicas": 1, "speculative.method": "ngram"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_sweeps_agent_sessions_and_reports_what_the_cluster_did(make_cluster, tmp_path):
    c = make_cluster(CLUSTER)
    cmd = [sys.executable, "-m", "tandem.cluster.cli", "bench", "--target", c.target, "--workload", "agent-small",
           "--rates", "2,4", "--duration", "3", "--sessions", "3", "--max-context", "400", "--seed", "1",
           "--out", str(tmp_path), "--label", "ci", "--watch-pools", "0.5"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "SLOs: TTFT <= 1000 ms and TPOT <= 40 ms" in proc.stdout
    assert "rate = new sessions per second" in proc.stdout
    assert "\r" not in proc.stderr  # no progress line when stderr is not a terminal

    report = json.loads((tmp_path / "bench-ci.json").read_text())
    assert report["config"]["vocab_size"] == 512  # asked of the server
    assert report["config"]["max_context"] == 400
    assert [r["rate"] for r in report["runs"]] == [2.0, 4.0]
    # what each request should have been: the workload's specs, as the command builds them
    expected = {(s.session_id, s.turn): s for turns in load_sessions(
        "agent-small", None, random.Random(1), num_sessions=3, max_context=400) for s in turns}
    for run in report["runs"]:
        s, reqs = run["summary"], run["requests"]
        assert s["requests"] == s["ok"] == len(reqs) > 0 and s["failed"] == 0 and s["errors"] == {}
        assert s["sessions"] == 3
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
            assert 0 < s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"]
        assert s["throughput_rps"] > 0 and s["output_tok_s"] > 0 and 0 < s["goodput_rps"] <= s["throughput_rps"]
        assert s["output_tokens"] == sum(r["max_tokens"] for r in reqs)
        # every session here has 8+ turns, and each turn repeats the last one's prompt and answer
        assert max(r["turn"] for r in reqs) >= 1
        assert s["cached_ratio"] > 0.5
        assert 0 <= s["accepted_draft_tokens"] <= s["draft_tokens"]
        for r in reqs:
            spec = expected[(r["session_id"], r["turn"])]
            assert r["status"] == "OK" and r["finish_reason"] == "LENGTH"
            assert r["max_tokens"] == spec.output_tokens == r["completion_tokens"] == len(r["token_times_s"])
            assert r["prompt_tokens"] == spec.input_tokens == r["usage_prompt_tokens"]
            assert r["ttft_s"] == r["token_times_s"][0] <= r["e2e_s"]
            if r["turn"] > 0:
                assert r["cached_prompt_tokens"] > 0, r
    # the pools' sizes through the Admin API, sampled over the whole bench (an autoscaled ramp's plot)
    tl = report["pool_timeline"]
    assert len(tl) >= 4 and all(a["t"] < b["t"] for a, b in zip(tl, tl[1:]))
    assert all(p["pools"]["prefill"]["size"] == 1 and p["pools"]["decode"] == {"size": 1, "target": 1, "draining": 0}
               for p in tl)
    assert report["runs"][0]["started_s"] < report["runs"][1]["started_s"] < tl[-1]["t"] + 1
    for name in ("bench-ci-cdf.png", "bench-ci-goodput.png", "bench-ci-timeline.png"):  # `make setup` installs matplotlib
        assert (tmp_path / name).is_file(), f"{name} missing; stderr: {proc.stderr}"
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC, name


def test_bench_retries_what_a_one_slot_router_sheds(make_cluster, tmp_path):
    """--retries against a router that runs one request at a time and queues none: sessions that
    arrive together are shed (RESOURCE_EXHAUSTED with the limiter's hint) and come back after it,
    and turns are served after one or more retries; a refusal whose wait would end past the
    duration stays a failure. The report and each record count the retries."""
    c = make_cluster({**CLUSTER, "router.max_in_flight": 1, "router.max_queue": 0})
    cmd = [sys.executable, "-m", "tandem.cluster.cli", "bench", "--target", c.target, "--workload", "agent-small",
           "--rate", "8", "--duration", "3", "--sessions", "3", "--max-context", "300", "--seed", "2",
           "--out", str(tmp_path), "--label", "retry", "--retries", "50"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    run = json.loads((tmp_path / "bench-retry.json").read_text())["runs"][0]
    s, reqs = run["summary"], run["requests"]
    assert set(s["errors"]) <= {"RESOURCE_EXHAUSTED"}, s["error_examples"]
    served_after_retry = [r for r in reqs if r["retries"] and r["status"] == "OK"]
    assert served_after_retry and all(r["ttft_s"] >= 0.05 * r["retries"] for r in served_after_retry)
    assert s["retries"] == sum(r["retries"] for r in reqs) and s["retried_ok"] == len(served_after_retry)
    assert s["ok"] > s["failed"] and "retries after refusals" in proc.stdout
