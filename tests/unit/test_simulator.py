"""What-if simulator: small synthetic workloads, a simple perf model, deterministic results."""

import json
import math
import random
from dataclasses import replace

import pytest

from tandem.cluster.workloads import PROFILES, RequestSpec, coding_agent_sessions, prefix_reuse_ratio, read_mooncake
from tandem.cluster.autoscaler import AutoscalerConfig, ratio_ok
from tandem.cluster.sim_model import SLO
from tandem.perf_model import PerfModel
from tandem.cluster.sim_workers import PrefixCache
from tandem.cluster.simulator import format_table, simulate, sweep

# Round numbers so expectations are easy to reason about.
PERF = PerfModel(prefill_base_s=0.001, prefill_per_token_s=1e-4, prefill_attn_s=0.0,
                 decode_base_s=0.005, decode_per_seq_s=0.002, decode_per_ctx_token_s=0.0,
                 transfer_base_s=0.0, transfer_per_token_s=1e-6, local_prefill_threshold=16,
                 max_batch=64, max_step_tokens=512, kv_capacity_tokens=400_000, block_tokens=16)
SLO_ = SLO(ttft_s=1.0, tpot_s=0.05)


def burst(n: int, input_tokens: int, output_tokens: int, over_s: float = 1.0) -> list[RequestSpec]:
    return [RequestSpec(f"s{i}", 0, over_s * i / n, input_tokens, output_tokens) for i in range(n)]


def agent_workload(seed: int = 0, sessions: int = 12) -> list[RequestSpec]:
    return coding_agent_sessions(random.Random(seed), sessions, 4.0, PROFILES["coding-agent-small"])


def test_more_decode_workers_lower_tpot_when_decode_bound():
    reqs = burst(60, 64, 200, over_s=0.1)
    one = simulate(reqs, 1, 1, PERF, SLO_).summary
    four = simulate(reqs, 1, 4, PERF, SLO_).summary
    assert four.tpot_p50 < 0.5 * one.tpot_p50
    assert four.rejected == one.rejected == 0


def test_prefill_queue_limit_sends_the_overflow_to_local_prefill():
    """The router's prefill.max_queued_tokens: past it, prompts are prefilled by their decode
    worker. Under a prompt burst one prefill worker cannot keep up with, the cap turns its queue
    into local prefills and TTFT drops; without it every prompt waits in that queue."""
    reqs = burst(20, 4000, 2, over_s=4.0)          # 20 x 0.4 s of prefill in 4 s
    queued = simulate(reqs, 1, 1, PERF, SLO_)
    capped = simulate(reqs, 1, 1, replace(PERF, prefill_queue_limit=8000), SLO_)
    assert all(r.prefill == "remote" for r in queued.requests)
    kinds = [r.prefill for r in capped.requests]
    assert kinds.count("remote") >= 5 and kinds.count("local") >= 5, kinds
    assert capped.summary.ttft_p90 < 0.5 * queued.summary.ttft_p90
    # an idle prefill worker takes a prompt longer than the limit
    assert simulate(burst(1, 4000, 2), 1, 1, replace(PERF, prefill_queue_limit=100), SLO_).requests[0].prefill == "remote"


def test_past_both_queues_the_overflow_is_split_not_all_sent_to_the_decode_worker():
    """A burst beyond what both GPUs prefill in time: the router's rule sends a prompt to the
    decode worker only while its own prefill queue is the shorter, so the two queues share the
    burst. (Sending all of the overflow to the decode worker, the rule before, prefilled 56 of these
    60 there and doubled TTFT p90: 20.0 s against 10.4 s.)"""
    reqs = burst(60, 4000, 2, over_s=1.0)
    out = simulate(reqs, 1, 1, replace(PERF, prefill_queue_limit=8000), SLO_)
    kinds = [r.prefill for r in out.requests]
    assert abs(kinds.count("remote") - kinds.count("local")) <= 6, kinds
    assert out.summary.ttft_p90 < 12.0


def test_more_prefill_workers_lower_ttft_when_prefill_heavy():
    reqs = burst(40, 4000, 2, over_s=1.0)
    one = simulate(reqs, 1, 1, PERF, SLO_).summary
    four = simulate(reqs, 4, 1, PERF, SLO_).summary
    assert four.ttft_p50 < 0.5 * one.ttft_p50
    assert all(r.prefill == "remote" for r in simulate(reqs, 4, 1, PERF, SLO_).requests)


def test_sweep_returns_every_split_and_a_table():
    reqs = agent_workload()
    results = sweep(reqs, 4, PERF, SLO_)
    labels = [r.summary.label for r in results]
    assert labels == ["1P:3D", "2P:2D", "3P:1D", "colocated x4"]
    assert all(r.summary.requests == len(reqs) for r in results)
    table = format_table(results)
    assert all(label in table for label in labels) and "TTFT p50" in table and "goodput" in table
    assert table.count("*") == sum(r.summary.goodput_rps == max(x.summary.goodput_rps for x in results)
                                   for r in results)


def test_results_are_deterministic_for_a_seed():
    reqs = agent_workload(seed=3)
    a = simulate(reqs, 2, 2, PERF, SLO_, seed=5, closed_loop=True)
    b = simulate(list(reqs), 2, 2, PERF, SLO_, seed=5, closed_loop=True)
    assert a.requests == b.requests
    assert repr(a.summary) == repr(b.summary)


def test_colocated_cache_hits_match_the_workloads_prefix_reuse():
    reqs = agent_workload()
    res = simulate(reqs, 0, 2, PERF, SLO_, colocated=True, closed_loop=True)
    reuse = prefix_reuse_ratio(reqs)
    # block granularity (16 tokens) and the always-computed last token cost a few percent
    assert reuse - 0.08 < res.summary.cached_token_ratio <= reuse
    assert all(r.prefill == "local" for r in res.requests)


def test_closed_loop_waits_for_the_previous_turn():
    reqs = agent_workload()
    res = simulate(reqs, 1, 1, PERF, SLO_, closed_loop=True)
    by_session: dict[str, list] = {}
    for r in res.requests:
        by_session.setdefault(r.session_id, []).append(r)
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.arrival_s >= prev.arrival_s + prev.e2e_s - 1e-9


def test_requests_too_big_for_a_worker_are_rejected_not_stuck():
    reqs = burst(3, 100, 10) + [RequestSpec("huge", 0, 0.5, 500_000, 10)]
    res = simulate(reqs, 1, 1, PERF, SLO_)
    huge = next(r for r in res.requests if r.session_id == "huge")
    assert huge.prefill == "rejected" and huge.ttft_s is None
    assert res.summary.rejected == 1 and res.summary.slo_attainment <= 0.75


def test_hash_id_traces_share_prefixes_across_requests():
    reqs = read_mooncake("bench/traces/mooncake_sample.jsonl")
    res = simulate(reqs, 1, 1, PERF, SLO_)
    cached = {r.session_id: r.cached_tokens for r in res.requests}
    assert cached["mooncake-0"] == 0 and cached["mooncake-1"] >= 1024 and cached["mooncake-6"] >= 3000


def test_autoscaler_in_the_loop_grows_prefill_under_a_prompt_burst():
    reqs = burst(300, 3000, 4, over_s=30.0)  # ~30k prompt tokens/s: about 3 prefill workers' worth
    cfg = AutoscalerConfig(prefill_min=1, prefill_max=6, decode_min=1, decode_max=4, max_ratio=4.0,
                           upscale_delay_s=0.0, downscale_delay_s=5.0, period_s=1.0, ttft_target_s=1.0)
    fixed = simulate(reqs, 1, 1, PERF, SLO_)
    scaled = simulate(reqs, 1, 1, PERF, SLO_, autoscaler=cfg, worker_startup_s=2.0)
    sizes = scaled.pool_sizes
    assert sizes and max(s.prefill_target for s in sizes) >= 3
    assert all(cfg.prefill_min <= s.prefill_target <= cfg.prefill_max and
               cfg.decode_min <= s.decode_target <= cfg.decode_max and
               ratio_ok(s.prefill_target, s.decode_target, cfg) for s in sizes)
    assert scaled.summary.ttft_p90 < 0.5 * fixed.summary.ttft_p90
    assert scaled.summary.mean_workers > 2
    assert scaled.summary.rejected == 0 and all(r.e2e_s is not None for r in scaled.requests)


def test_prefix_cache_is_lru_and_keeps_pinned_entries():
    cache = PrefixCache(block_tokens=16)
    a, b, c = (RequestSpec(x, 1, 0.0, 1000, 10, shared_prefix_tokens=500) for x in "abc")
    for r in (a, b, c):
        cache.store(r, 400)
    assert cache.tokens == 1200 and cache.hit(a) == 400
    cache.pin(cache.hit_keys(a, cache.hit(a)))
    cache.evict_to(500)  # a is the oldest, but pinned: b and c go
    assert cache.hit(a) == 400 and cache.hit(b) == cache.hit(c) == 0 and cache.tokens == 400
    cache.unpin(cache.hit_keys(a, 400))
    cache.evict_to(0)
    assert cache.tokens == 0


def test_fit_recovers_known_coefficients():
    truth = PerfModel(prefill_base_s=0.004, prefill_per_token_s=8e-5, prefill_attn_s=1.5e-9,
                      decode_base_s=0.011, decode_per_seq_s=1.2e-4, decode_per_ctx_token_s=3e-8,
                      transfer_base_s=4e-4, transfer_per_token_s=2e-6)
    rng = random.Random(0)
    samples = []
    for _ in range(60):
        n, ctx = rng.randint(16, 8192), rng.randint(0, 32768)
        samples.append(("prefill", (n, ctx + n), truth.prefill_s(n, ctx + n) * rng.uniform(0.999, 1.001)))
        b, c = rng.randint(1, 256), rng.randint(1000, 2_000_000)
        samples.append(("decode", {"batch_size": b, "total_context_tokens": c}, truth.decode_step_s(b, c)))
        t = rng.randint(16, 32768)
        samples.append(("transfer", (t,), truth.transfer_s(t)))
    fit = PerfModel.fit(samples, max_batch=128)
    for name in ("prefill_base_s", "prefill_per_token_s", "prefill_attn_s", "decode_base_s",
                 "decode_per_seq_s", "decode_per_ctx_token_s", "transfer_base_s", "transfer_per_token_s"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=0.05), name
    assert fit.max_batch == 128
    with pytest.raises(ValueError):
        PerfModel.fit([("attention", (1,), 1.0)])


def test_perf_model_json_round_trip():
    for perf in (PERF, PerfModel(local_prefill_threshold=math.inf), replace(PERF, prefill_queue_limit=8000)):
        text = json.dumps(perf.to_dict())
        assert "Infinity" not in text
        assert PerfModel.from_dict(json.loads(text)) == perf


def test_control_path_terms_delay_what_the_client_sees():
    """request_overhead_s is added to every request's TTFT and end (not to TPOT); a remote
    prefill's KV is usable remote_overhead_s later; a local one does not pay that."""
    from dataclasses import replace

    one_local = [RequestSpec("a", 0, 0.0, 8, 10)]            # under the threshold (16): local
    one_remote = [RequestSpec("b", 0, 0.0, 400, 10)]         # over it: a prefill worker
    base = {name: simulate(reqs, 1, 1, PERF, SLO_).requests[0] for name, reqs in
            (("local", one_local), ("remote", one_remote))}
    perf = replace(PERF, request_overhead_s=0.030, remote_overhead_s=0.100)
    slow = {name: simulate(reqs, 1, 1, perf, SLO_).requests[0] for name, reqs in
            (("local", one_local), ("remote", one_remote))}
    assert slow["local"].ttft_s == pytest.approx(base["local"].ttft_s + 0.030)
    assert slow["local"].tpot_s == pytest.approx(base["local"].tpot_s)
    assert slow["remote"].ttft_s == pytest.approx(base["remote"].ttft_s + 0.130)
    assert slow["remote"].e2e_s == pytest.approx(base["remote"].e2e_s + 0.130)
    with pytest.raises(Exception):
        replace(PERF, remote_overhead_s=-1.0)


def test_closed_loop_stops_sending_at_the_runs_end_like_the_bench():
    """`send_until_s`: a session's turn due at or after the cut-off is not sent, nor its later
    turns (as `tandem bench` stops at its duration); only sent turns are in the result."""
    specs = [RequestSpec("a", t, 0.0, 200, 20, shared_prefix_tokens=0 if t == 0 else 150, think_s=5.0)
             for t in range(6)]
    full = simulate(specs, 1, 1, PerfModel(), closed_loop=True)
    cut = simulate(specs, 1, 1, PerfModel(), closed_loop=True, send_until_s=12.0)
    assert len(full.requests) == 6
    sent = cut.requests
    assert [r.turn for r in sent] == list(range(len(sent))) and 1 < len(sent) < 6
    assert all(r.arrival_s < 12.0 for r in sent)                      # every sent turn was due in time
    finish = sent[-1].arrival_s + sent[-1].e2e_s
    assert finish + 5.0 >= 12.0                                       # the next turn would have been late
    assert cut.summary.requests == len(sent) and cut.summary.rejected == 0


def test_the_routers_admission_limiter_sheds_an_overload_in_the_simulation():
    """With the router's admission limits, a request whose predicted wait for its first token is
    past max_expected_wait_s is refused at arrival (router/admission.py, on the simulation's
    clock): under a prompt burst 4x what the worker prefills, some are refused and the served
    ones' TTFT stays near the limit; without the limits none is refused and the queue grows."""
    from tandem.router.admission import AdmissionConfig

    reqs = burst(100, 4000, 2, over_s=10.0)           # 100 x 0.4 s of prefill in 10 s
    free = simulate(reqs, 0, 1, PERF, SLO_, colocated=True)
    limits = AdmissionConfig(max_expected_wait_s=3.0, min_start_samples=4)
    shed = simulate(reqs, 0, 1, PERF, SLO_, colocated=True, admission=limits)
    assert free.summary.rejected == 0 and free.summary.ttft_p90 > 15.0
    assert 40 <= shed.summary.rejected <= 85, shed.summary.rejected
    assert shed.summary.ttft_p90 < 5.0
    refused = [r for r in shed.requests if r.ttft_s is None]
    assert min(r.arrival_s for r in refused) > 1.0     # only once a backlog has built up
    # a limit nothing reaches refuses nothing and changes nothing
    calm = simulate(burst(20, 400, 2, over_s=10.0), 0, 1, PERF, SLO_, colocated=True, admission=limits)
    assert calm.summary.rejected == 0
    assert calm.summary == simulate(burst(20, 400, 2, over_s=10.0), 0, 1, PERF, SLO_, colocated=True).summary


def test_retried_refusals_come_back_after_the_hint_and_count_from_their_first_send():
    """`retries` (tandem bench --retries): a request the limiter refuses is sent again after its
    hint. The limiter spaces the hints of refusals that come together (one start at the recent rate
    apart), so under a burst 4x the worker's rate two retries serve every request, in turn: the
    queue holds more and TTFT, counted from the first send, grows past the limit. None is sent
    again at or past `retry_until_s`."""
    from tandem.router.admission import AdmissionConfig

    reqs = burst(100, 4000, 2, over_s=10.0)
    limits = AdmissionConfig(max_expected_wait_s=3.0, min_start_samples=4)
    runs = {n: simulate(reqs, 0, 1, PERF, SLO_, colocated=True, admission=limits, retries=n) for n in (0, 1, 2)}
    rejected = {n: r.summary.rejected for n, r in runs.items()}
    assert rejected[2] == 0 < rejected[1] < rejected[0], rejected
    assert runs[2].summary.ttft_p90 > 3 * runs[0].summary.ttft_p90 > limits.max_expected_wait_s
    assert [r.arrival_s for r in runs[2].requests] == [r.arrival_s for r in runs[0].requests]   # as first sent
    cut = simulate(reqs, 0, 1, PERF, SLO_, colocated=True, admission=limits, retries=2, retry_until_s=10.0)
    assert cut.summary.rejected >= rejected[0] - 5   # the burst's own 10 s: hardly any gets back in


def test_a_request_no_worker_can_take_is_retried_after_the_workers_hint():
    """Every decode worker past its overload limit: RESOURCE_EXHAUSTED with the router's 1 s hint
    (WORKERS_RETRY_AFTER_S); the retry is served once the worker has room."""
    from tandem.placement import OverloadLimits
    from tandem.wire.errors import WORKERS_RETRY_AFTER_S

    reqs = burst(6, 64, 400, over_s=0.05)
    one_waiting = OverloadLimits(max_waiting=0, max_load=2)
    shed = simulate(reqs, 0, 1, PERF, SLO_, colocated=True, overload=one_waiting)
    again = simulate(reqs, 0, 1, PERF, SLO_, colocated=True, overload=one_waiting, retries=50)
    assert shed.summary.rejected > 0 and again.summary.rejected == 0
    retried = sorted(r.ttft_s for r in again.requests)[-shed.summary.rejected:]
    assert all(t >= WORKERS_RETRY_AFTER_S for t in retried)


def test_clients_every_worker_refused_together_come_back_spaced():
    """With the router's limiter (which spaces the workers' refusals by the rate served requests
    end at), a burst four times what the one worker holds is served in full after 4 retries; with
    the plain 1 s hint for all, every retry wave meets the same full worker and most fail."""
    from tandem.placement import OverloadLimits
    from tandem.router.admission import AdmissionConfig

    reqs = burst(40, 64, 100, over_s=0.05)
    holds_four = OverloadLimits(max_waiting=0, max_load=4)
    plain = simulate(reqs, 0, 1, PERF, SLO_, colocated=True, overload=holds_four, retries=4)
    spaced = simulate(reqs, 0, 1, PERF, SLO_, colocated=True, overload=holds_four, retries=4,
                      admission=AdmissionConfig(max_expected_wait_s=None))
    assert plain.summary.rejected > 20 and spaced.summary.rejected == 0


def test_a_request_running_at_the_clients_deadline_failed():
    """`cancel_at_s` (tandem bench's duration + drain timeout): a request still running then is
    counted failed, as the bench counts it; the others are as without it."""
    from tandem.cluster.layouts import bench_deadline

    reqs = burst(30, 4000, 2, over_s=3.0)              # 12 s of prefill: the last ones end past 8 s
    full = simulate(reqs, 0, 1, PERF, SLO_, colocated=True)
    cut = simulate(reqs, 0, 1, PERF, SLO_, colocated=True, cancel_at_s=8.0)
    late = [a for a in full.requests if a.arrival_s + a.e2e_s > 8.0]
    assert 5 <= len(late) < 30
    assert cut.summary.rejected == len(late)
    for a, b in zip(full.requests, cut.requests):
        assert b == (a if a.arrival_s + a.e2e_s <= 8.0 else replace(a, cached_tokens=0, prefill="rejected",
                                                                     ttft_s=None, tpot_s=None, e2e_s=None))
    assert bench_deadline({"duration_s": 60.0, "drain_timeout_s": 20.0}) == 80.0
    assert bench_deadline({"duration_s": 60.0}) is None


def test_simulated_workers_report_over_the_autoscalers_latency_window():
    """A simulated worker's TTFT and TPOT reports span autoscaler.latency_window_s, as a live one's."""
    from tandem.cluster.sim_engine import Simulation

    cfg = AutoscalerConfig(latency_window_s=7.0)
    sim = Simulation(burst(2, 64, 4), 1, 1, PERF, SLO_, cfg, 0, False, 0.0, False, False)
    assert [w.prefill_latency.window_s for w in sim.prefills + sim.decodes] == [7.0, 7.0]
    assert sim.decodes[0].tpot.window_s == 7.0
