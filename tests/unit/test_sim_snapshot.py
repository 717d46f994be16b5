"""The simulated controller's inputs are the live function's (cluster.pools.build_snapshot) on what
the simulated workers report (`SimWorker.entry`): sizes by pool, load and latency by the part a
worker serves, rates from counters kept as the simulation runs. Pure, time passed in."""

from __future__ import annotations

import pytest

from tandem.cluster import sim_control
from tandem.cluster.autoscaler import AutoscalerConfig
from tandem.cluster.sim_engine import Simulation
from tandem.cluster.sim_model import SLO
from tandem.cluster.sim_workers import SimDecodeWorker, SimSeq
from tandem.cluster.workloads import RequestSpec
from tandem.perf_model import PerfModel

PERF = PerfModel(prefill_base_s=0.001, prefill_per_token_s=2e-4, prefill_attn_s=0.0,
                 decode_base_s=0.005, decode_per_seq_s=0.002, decode_per_ctx_token_s=0.0,
                 transfer_base_s=0.0, transfer_per_token_s=1e-6, local_prefill_threshold=16,
                 max_batch=64, max_step_tokens=512, kv_capacity_tokens=400_000, block_tokens=16)
AUTO = AutoscalerConfig(prefill_min=1, prefill_max=3, decode_min=1, decode_max=4, period_s=1.0)
BLOCKS = PERF.kv_capacity_tokens // PERF.block_tokens


def sim_of(prefill: int, decode: int, requests=(), autoscaler=AUTO) -> Simulation:
    return Simulation(list(requests), prefill, decode, PERF, SLO(0.5, 0.05), autoscaler, seed=0, colocated=False,
                      worker_startup_s=0.0, closed_loop=False, pull_prefix=False)


def seq(tokens: int = 100, output: int = 4) -> SimSeq:
    return SimSeq(RequestSpec("s", 0, 0.0, tokens, output), 0)


def test_the_snapshot_is_build_snapshots_on_the_workers_a_lent_one_counted_where_it_serves(monkeypatch):
    sim = sim_of(1, 3)
    p, d0, lent, gone_soon = sim.prefills[0], *sim.decodes
    p.take(0.0, 4000, 2.0)                     # half done at t=1
    p.take(0.0, 1000, 1.0)                     # queued behind it
    p.prefill_latency.add(0.5, 0.3)
    d0.running.extend([seq(), seq()])
    d0.waiting.append(seq(150, 10))
    d0.awaiting_kv, d0.held = 1, 3200
    d0.tpot.add(0.9, 0.02)
    lent.role = "prefill"                      # adaptive: a decode worker lent to prefill only
    other = seq(900)
    other.prefill_left = 700
    lent.local.append(other)
    lent.prefill_latency.add(0.8, 0.9)
    lent.tpot.add(0.5, 0.5)                    # its decode window, from before it was lent
    gone_soon.running.append(seq())
    gone_soon.accepting, gone_soon.draining = False, True
    sim.add_worker(sim.decodes, SimDecodeWorker, 0.0)          # starting: no stats yet

    calls = []
    real = sim_control.build_snapshot

    def spy(workers, prev, now, period_s, *slots):
        calls.append((workers, real(workers, prev, now, period_s, *slots)))
        return calls[-1][1]
    monkeypatch.setattr(sim_control, "build_snapshot", spy)
    snap = sim._snapshot(1.0)

    (workers, (out, _)), = calls
    assert snap is out                         # the live function's output, as it is
    assert {w.worker_id: (w.pool, w.state, w.role) for w in workers} == {
        "prefill-0": ("prefill", "ready", "prefill"), "decode-0": ("decode", "ready", "decode"),
        "decode-1": ("decode", "ready", "prefill"), "decode-2": ("decode", "draining", "decode"),
        "decode-3": ("decode", "starting", "decode")}
    assert workers[-1].stats is None
    p_, d = snap.prefill, snap.decode
    assert (p_.size, d.size, d.draining) == (1, 2, 1)                  # by pool: the lent one is decode's
    assert (p_.queued_prompt_tokens, p_.ttft_p90) == (2000 + 1000 + 700, 0.9)
    assert (d.running_seqs, d.waiting_seqs, d.kv_blocks_used) == (2, 2, 200)   # the lent one's batch is not
    assert d.kv_blocks_waiting == 160 // PERF.block_tokens
    assert d.tpot_p90 == 0.02                                          # nor its stale TPOT
    assert d.kv_blocks_total == 2 * BLOCKS


def test_rates_come_from_the_workers_counters_between_two_periods():
    sim = sim_of(1, 1)
    p = sim.prefills[0]
    assert sim._snapshot(0.0).prefill.prompt_tokens_per_s == 0.0      # no earlier counters yet
    p.take(0.0, 8000, 2.0)
    p.take(0.5, 2000, 0.4)                     # runs 2.0-2.4: 0.25 s of it by t=2.25
    snap = sim._snapshot(2.25)
    assert snap.prefill.prompt_tokens_per_s == pytest.approx(10_000 / 2.25)   # counted when taken, as live
    assert snap.prefill.prefill_tokens_per_s_per_worker == pytest.approx(10_000 / 2.25)
    assert snap.prefill.queued_prompt_tokens == pytest.approx(2000 * 0.15 / 0.4, abs=1)
    later = sim._snapshot(5.0)
    assert later.prefill.prompt_tokens_per_s == 0.0
    # 0.15 busy s of a 1 s period is too few to measure: the capacity measured before holds
    assert later.prefill.prefill_tokens_per_s_per_worker == pytest.approx(10_000 / 2.25)


def test_the_workers_stats_accumulate_as_the_simulation_runs():
    """Each remote prefill's tokens and compute time on its prefill worker, its latency (reserve to
    KV ready) once the KV is ready, and each sequence's TPOT on its decode worker."""
    specs = [RequestSpec(f"s{i}", 0, float(i), 500 + 100 * i, 5) for i in range(3)]
    sim = sim_of(1, 1, specs, autoscaler=None)
    sim.run()
    res = sim.result("t", 1, 1)
    p, d = sim.prefills[0], sim.decodes[0]
    end = max(r.arrival_s + r.e2e_s for r in res.requests)
    ps, ds = p.stats(end, PERF), d.stats(end, PERF)
    assert all(r.prefill == "remote" for r in res.requests)
    assert ps.computed_tokens == sum(r.input_tokens - r.cached_tokens for r in res.requests)
    assert ps.busy_s == pytest.approx(sum(PERF.prefill_s(r.input_tokens, r.input_tokens) for r in res.requests))
    assert ps.queued_prompt_tokens == 0 and ds.running == ds.waiting == 0
    # nothing waited for a decode slot: each prefill's latency is its TTFT
    assert sorted(x for _, x in p.prefill_latency.samples) == pytest.approx(sorted(r.ttft_s for r in res.requests))
    assert sorted(x for _, x in d.tpot.samples) == pytest.approx(sorted(r.tpot_s for r in res.requests))
    assert ps.prefill_latency.p99 == pytest.approx(max(r.ttft_s for r in res.requests))
    assert p.stats(end + 31.0, PERF).prefill_latency.p50 is None        # out of the workers' 30 s window


def test_a_decode_workers_busy_time_counts_its_step_in_progress():
    sim = sim_of(0, 1, autoscaler=None)
    d = sim.decodes[0]
    d.busy_s, d.stepping, d.step_started_s = 0.5, True, 1.0
    assert d.stats(1.25, PERF).busy_s == pytest.approx(0.75)
