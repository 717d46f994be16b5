"""The autoscaler's inputs (cluster.pools.build_snapshot) from fake workers' stats: sizes by pool,
load, rates and latency by the part each worker serves now, so a worker lent to the other role
counts once, where it serves."""

from __future__ import annotations

import pytest

from tandem.cluster.autoscaler import AutoscalerConfig, decode_want
from tandem.cluster.pools import build_snapshot
from tandem.wire.cluster import WorkerEntry
from tandem.wire.stats import Percentiles, WorkerStats

PERIOD_S = 5.0


def worker(wid: str, pool: str, role: str = "", state: str = "ready", **stats) -> WorkerEntry:
    """A worker as `cluster_state()` lists it; `role` "" serves its pool's."""
    return WorkerEntry(wid, pool, state, stats=WorkerStats(wid, pool, role=role, **stats), role=role or pool)


def p90(seconds: float) -> Percentiles:
    return Percentiles(p50=seconds / 2, p90=seconds, p99=seconds)


def test_a_decode_worker_lent_to_prefill_counts_in_the_prefill_load_and_the_decode_pool():
    workers = (
        worker("prefill-0", "prefill", queued_prompt_tokens=100, running=1, prefill_latency=p90(0.3),
               kv_blocks_total=50),
        worker("decode-0", "decode", running=5, waiting=1, kv_blocks_used=40, kv_blocks_waiting=3,
               kv_blocks_total=100, tpot=p90(0.02)),
        # lent: its prefill queue and latency are prefill's; its last decode window (TPOT) is stale
        worker("decode-1", "decode", "prefill", queued_prompt_tokens=500, running=2, waiting=4,
               kv_blocks_used=10, kv_blocks_total=100, prefill_latency=p90(0.9), tpot=p90(0.5)),
        worker("decode-2", "decode", state="draining", running=9, kv_blocks_used=90, kv_blocks_total=100),
    )
    snap, _ = build_snapshot(workers, None, 0.0, PERIOD_S)
    p, d = snap.prefill, snap.decode
    assert (p.size, p.draining, d.size, d.draining) == (1, 0, 2, 1)           # by pool
    assert (p.queued_prompt_tokens, p.ttft_p90) == (600, 0.9)
    assert (d.running_seqs, d.waiting_seqs, d.kv_blocks_used, d.kv_blocks_waiting) == (5, 1, 40, 3)
    assert d.tpot_p90 == 0.02
    assert d.kv_blocks_total == 200      # the decode pool's two ready workers: / size is one worker's KV


def test_a_prefill_worker_that_decodes_counts_in_the_decode_load_mixed_included():
    workers = (
        worker("prefill-0", "prefill", queued_prompt_tokens=100, prefill_latency=p90(0.3)),
        # mixed: it prefills for others only with slack, so its decode batch is what counts
        worker("prefill-1", "prefill", "mixed", running=7, waiting=2, kv_blocks_used=30, kv_blocks_total=50,
               queued_prompt_tokens=50, prefill_latency=p90(2.0), tpot=p90(0.04)),
        worker("decode-0", "decode", running=5, kv_blocks_used=40, kv_blocks_total=100, tpot=p90(0.02)),
    )
    snap, _ = build_snapshot(workers, None, 0.0, PERIOD_S)
    p, d = snap.prefill, snap.decode
    assert (p.size, d.size) == (2, 1)
    assert (p.queued_prompt_tokens, p.ttft_p90) == (100, 0.3)
    assert (d.running_seqs, d.waiting_seqs, d.kv_blocks_used, d.tpot_p90) == (12, 2, 70, 0.04)
    assert d.kv_blocks_total == 100
    lent_to_decode = (workers[0], worker("prefill-1", "prefill", "decode", running=7, tpot=p90(0.04)), workers[2])
    assert build_snapshot(lent_to_decode, None, 0.0, PERIOD_S)[0].decode.running_seqs == 12


def test_rates_count_each_workers_tokens_since_the_last_snapshot_for_the_part_it_serves_now():
    """A worker lent to prefill brings only its tokens since the last snapshot, not its history;
    one that left takes none away; capacity is measured on workers that only prefilled throughout."""
    before = (
        worker("prefill-0", "prefill", computed_tokens=1_000, busy_s=1.0),
        worker("prefill-1", "prefill", computed_tokens=50_000, busy_s=20.0),
        worker("decode-1", "decode", "mixed", computed_tokens=1_000_000, busy_s=500.0),
    )
    _, counters = build_snapshot(before, None, 100.0, PERIOD_S)
    after = (
        worker("prefill-0", "prefill", computed_tokens=21_000, busy_s=6.0),      # 20k tokens in 5 busy s
        worker("decode-1", "decode", "prefill", computed_tokens=1_010_000, busy_s=510.0),
        worker("prefill-2", "prefill", computed_tokens=2_000, busy_s=9.0),        # new: counted from zero
    )
    snap, _ = build_snapshot(after, counters, 110.0, PERIOD_S)
    assert snap.prefill.prompt_tokens_per_s == pytest.approx((20_000 + 10_000 + 2_000) / 10)
    assert snap.prefill.prefill_tokens_per_s_per_worker == pytest.approx(20_000 / 5.0)
    assert (snap.prefill.size, snap.decode.size) == (2, 1)


def test_a_worker_returned_to_decoding_takes_its_prefill_tokens_out_of_the_prefill_rate():
    lent = (worker("prefill-0", "prefill", computed_tokens=0, busy_s=0.0),
            worker("decode-1", "decode", "prefill", computed_tokens=5_000, busy_s=2.0))
    _, counters = build_snapshot(lent, None, 0.0, PERIOD_S)
    back = (worker("prefill-0", "prefill", computed_tokens=4_000, busy_s=1.0),
            worker("decode-1", "decode", "mixed", computed_tokens=9_000, busy_s=8.0, running=3))
    snap, _ = build_snapshot(back, counters, 10.0, PERIOD_S)
    assert snap.prefill.prompt_tokens_per_s == pytest.approx(4_000 / 10)
    assert snap.prefill.prefill_tokens_per_s_per_worker is None     # 1 busy s: too little to measure
    assert snap.decode.running_seqs == 3


def test_the_measured_prefill_capacity_holds_through_periods_too_idle_to_measure_one():
    """A period under 20% busy, or one holding only the busy time of tokens counted the period
    before (counted when scheduled), measures nothing; the last measurement stands, not the config's
    8000 tok/s default (which kept an idle H200 pool from shrinking)."""
    def at(tokens, busy):
        return (worker("prefill-0", "prefill", computed_tokens=tokens, busy_s=busy),)
    _, counters = build_snapshot(at(0, 0.0), None, 0.0, PERIOD_S)
    snap, counters = build_snapshot(at(80_000, 2.0), counters, 10.0, PERIOD_S)
    assert snap.prefill.prefill_tokens_per_s_per_worker == pytest.approx(40_000)
    snap, counters = build_snapshot(at(80_000, 4.0), counters, 20.0, PERIOD_S)    # busy, no new tokens
    assert snap.prefill.prefill_tokens_per_s_per_worker == pytest.approx(40_000)
    snap, counters = build_snapshot(at(81_000, 4.1), counters, 30.0, PERIOD_S)    # 1% busy
    assert snap.prefill.prefill_tokens_per_s_per_worker == pytest.approx(40_000)
    assert snap.prefill.prompt_tokens_per_s == pytest.approx(100)
    snap, _ = build_snapshot(at(141_000, 6.1), counters, 40.0, PERIOD_S)          # a new measurement
    assert snap.prefill.prefill_tokens_per_s_per_worker == pytest.approx(30_000)


def test_the_decode_workers_slots_reach_the_autoscaler():
    """The controller passes scheduler.max_num_seqs: a pool of 128-slot workers at 110 sequences
    each is 0.86 full, not the 0.43 the autoscaler's 256-slot default would read."""
    workers = tuple(worker(f"decode-{i}", "decode", running=110, kv_blocks_total=1000) for i in range(2))
    told, _ = build_snapshot(workers, None, 0.0, PERIOD_S, max_seqs_per_worker=128)
    default, _ = build_snapshot(workers, None, 0.0, PERIOD_S)
    assert (told.decode.max_seqs_per_worker, default.decode.max_seqs_per_worker) == (128, None)
    cfg = AutoscalerConfig()
    assert decode_want(told.decode, cfg).up > 2 >= decode_want(default.decode, cfg).up
