"""tandem.runtime.metrics (one registry, workers' deltas, the /metrics endpoint), the Grafana
dashboard's queries against it, and tandem.runtime.logging_setup (request ids on every line)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.runtime.logging_setup import bind_request, current_request_id, setup_logging
from tandem.runtime.metrics import (KV_TRANSFER_BUCKETS, METRIC_NAMES, MetricsHub, TransferTimes,
                                    WorkerCounters, WorkerMetricsSnapshot, start_metrics_server)
from tandem.wire.cluster import WorkerEntry
from tandem.wire.stats import WorkerStats

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tandem-dashboard.json"


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def exported_sample_names(hub: MetricsHub) -> set[str]:
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {family.name + s for family in hub.registry.collect() for s in suffixes[family.type]}


def test_every_metric_is_registered_under_its_name():
    hub = MetricsHub()
    assert {f.name for f in hub.registry.collect()} == set(METRIC_NAMES)
    assert all(name.startswith("tandem:") for name in METRIC_NAMES)


def test_endpoint_serves_router_and_worker_metrics():
    hub = MetricsHub()
    port = start_metrics_server(0, "127.0.0.1", registry=hub.registry)
    assert port > 0
    hub.record_queue_time(0.02)
    hub.record_first_token(0.3)
    hub.record_tokens(0.1, 4)  # 4 tokens in one message: 4 gaps of 25 ms
    hub.record_finished(code="OK", finish_reason="STOP", e2e_seconds=1.5)
    hub.record_finished(code="RESOURCE_EXHAUSTED", finish_reason="none", e2e_seconds=None)
    hub.record_migration("worker_lost")
    hub.set_pool("decode", size=3, target=4, roles={"decode": 2, "mixed": 1})
    hub.set_router_queue(running=5, waiting=2)

    d0 = WorkerCounters("d0", "decode", incarnation="pid1")
    d0.record_prefix_lookup(1000, 950)
    d0.record_speculation(40, 30)
    p0 = WorkerCounters("p0", "prefill", incarnation="pid2")
    p0.record_transfer(0.004, 2_000_000)
    p0.record_transfer(0.2, 8_000_000)
    hub.update_from_workers([
        d0.snapshot(running=7, waiting=1, kv_blocks_used=30, kv_blocks_total=120),
        p0.snapshot(running=2, waiting=3, kv_blocks_used=0, kv_blocks_total=10),
    ])
    # Next report: d0 did more work; the same numbers again from p0 add nothing.
    d0.record_prefix_lookup(100, 100)
    hub.update_from_workers([
        d0.snapshot(running=6, waiting=0, kv_blocks_used=60, kv_blocks_total=120),
        p0.snapshot(running=2, waiting=3, kv_blocks_used=0, kv_blocks_total=10).__dict__,  # a dict
    ])

    m = scrape(port)
    assert m[("tandem:time_to_first_token_seconds_count", ())] == 1
    assert m[("tandem:inter_token_latency_seconds_count", ())] == 4
    assert m[("tandem:inter_token_latency_seconds_sum", ())] == pytest.approx(0.1)
    assert m[("tandem:inter_token_latency_seconds_bucket", (("le", "0.03"),))] == 4
    assert m[("tandem:e2e_request_latency_seconds_count", ())] == 1
    assert m[("tandem:request_queue_time_seconds_count", ())] == 1
    assert m[("tandem:requests_total", (("code", "OK"), ("finish_reason", "stop")))] == 1
    assert m[("tandem:requests_total", (("code", "RESOURCE_EXHAUSTED"), ("finish_reason", "none")))] == 1
    assert m[("tandem:request_migrations_total", (("reason", "worker_lost"),))] == 1
    assert m[("tandem:pool_size", (("pool", "decode"),))] == 3
    assert m[("tandem:pool_target", (("pool", "decode"),))] == 4
    assert m[("tandem:pool_workers_by_role", (("pool", "decode"), ("role", "mixed")))] == 1
    assert m[("tandem:pool_workers_by_role", (("pool", "decode"), ("role", "prefill")))] == 0
    assert m[("tandem:num_requests_running", (("pool", "decode"),))] == 6
    assert m[("tandem:num_requests_waiting", (("pool", "prefill"),))] == 3
    assert m[("tandem:num_requests_waiting", (("pool", "router"),))] == 2
    assert m[("tandem:kv_cache_usage_perc", (("pool", "decode"), ("worker", "d0")))] == 0.5
    assert m[("tandem:prefix_cache_queries_total", (("pool", "decode"),))] == 1100
    assert m[("tandem:prefix_cache_hits_total", (("pool", "decode"),))] == 1050
    assert m[("tandem:spec_decode_draft_tokens_total", ())] == 40
    assert m[("tandem:spec_decode_accepted_tokens_total", ())] == 30
    assert m[("tandem:kv_transfer_bytes_total", ())] == 10_000_000
    assert m[("tandem:kv_transfer_seconds_count", ())] == 2
    assert m[("tandem:kv_transfer_seconds_sum", ())] == pytest.approx(0.204)
    assert m[("tandem:kv_transfer_seconds_bucket", (("le", "0.005"),))] == 1
    assert m[("tandem:kv_transfer_seconds_bucket", (("le", "0.25"),))] == 2
    assert m[("tandem:kv_transfer_seconds_bucket", (("le", "+Inf"),))] == 2


def test_transfers_a_worker_reports_fill_the_histograms_count_and_buckets():
    """The path a live cluster takes: a worker records each transfer's time, ships the result in
    its stats, the controller's cluster state carries them, and the hub reads them through
    `from_worker_stats`. Count and buckets must grow with the sum (they once stayed at zero)."""
    hub = MetricsHub()
    times = TransferTimes()                    # what a prefill or decode worker keeps

    def report():
        worker = WorkerEntry("p0", "prefill", "ready", pid=41, stats=WorkerStats("p0", "prefill", **times.stats()))
        hub.update_from_workers([WorkerMetricsSnapshot.from_worker_stats(worker)])

    def value(suffix, **labels):
        return hub.registry.get_sample_value("tandem:kv_transfer_seconds" + suffix, labels or None)

    times.record(0.003)
    times.record(0.2)
    report()
    assert value("_count") == 2
    assert value("_sum") == pytest.approx(0.203)
    assert value("_bucket", le="0.001") == 0
    assert value("_bucket", le="0.005") == 1
    assert value("_bucket", le="0.25") == 2
    assert value("_bucket", le="+Inf") == 2
    times.record(12.0)                         # slower than every finite bound but the last
    report()
    assert value("_count") == 3
    assert value("_bucket", le="10.0") == 2
    assert value("_bucket", le="30.0") == 3
    assert value("_bucket", le="+Inf") == 3


def test_a_workers_move_counters_become_its_move_series():
    """The path a live cluster takes: a decode worker's move counters (its stats, as the controller's
    cluster state carries them) advance `tandem:<counter>_total` by pool and worker, by what each
    report added."""
    hub = MetricsHub()
    moves = {"sequences_migrated": 2, "kv_tokens_migrated": 200, "tokens_recomputed": 5, "kv_tokens_precopied": 160,
             "move_precopy_seconds": 0.5, "move_tail_seconds": 0.02, "sequences_migrated_in": 1, "pressure_moves": 1,
             "migrations_resumed": 1}

    def report(times: int) -> None:
        stats = WorkerStats("decode-0", "decode", **{k: v * times for k, v in moves.items()})
        hub.update_from_workers([WorkerMetricsSnapshot.from_worker_stats(
            WorkerEntry("decode-0", "decode", "ready", pid=7, stats=stats))])

    report(1)
    report(3)
    got = {k: hub.registry.get_sample_value(f"tandem:{k}_total", {"pool": "decode", "worker": "decode-0"})
           for k in moves}
    assert got == pytest.approx({k: 3 * v for k, v in moves.items()})


def test_worker_restart_and_departure():
    hub = MetricsHub()

    def value(name, **labels):
        return hub.registry.get_sample_value(name, labels or None)

    first = WorkerMetricsSnapshot("d0", "decode", incarnation="a", prefix_queries=500,
                                  prefix_hits=400, draft_tokens=90, accepted_tokens=60,
                                  kv_blocks_used=5, kv_blocks_total=10)
    hub.update_from_workers([first])
    # Restarted under the same id: counters start again from zero; count them all, once.
    again = WorkerMetricsSnapshot("d0", "decode", incarnation="b", prefix_queries=20,
                                  prefix_hits=10, draft_tokens=100, accepted_tokens=70)
    hub.update_from_workers([again])
    assert value("tandem:prefix_cache_queries_total", pool="decode") == 520
    assert value("tandem:spec_decode_draft_tokens_total") == 190
    # A restart that kept its incarnation string is still caught by a counter going backwards.
    hub.update_from_workers([WorkerMetricsSnapshot("d0", "decode", incarnation="b",
                                                   prefix_queries=5, draft_tokens=100,
                                                   accepted_tokens=70)])
    assert value("tandem:prefix_cache_queries_total", pool="decode") == 525
    assert value("tandem:spec_decode_draft_tokens_total") == 290
    assert value("tandem:kv_cache_usage_perc", pool="decode", worker="d0") == 0.0
    # Gone from the report: its gauges go, its counts stay.
    hub.update_from_workers([])
    assert value("tandem:kv_cache_usage_perc", pool="decode", worker="d0") is None
    assert value("tandem:num_requests_running", pool="decode") == 0
    assert value("tandem:prefix_cache_queries_total", pool="decode") == 525
    # The hub (controller) restarted under a long-running worker: its history is not one spike.
    late_hub = MetricsHub(wall_clock=lambda: 2000.0)
    old_worker = WorkerMetricsSnapshot("d1", "decode", started_at=1000.0, draft_tokens=10**6)
    late_hub.update_from_workers([old_worker])
    late_hub.update_from_workers([WorkerMetricsSnapshot("d1", "decode", started_at=1000.0,
                                                        draft_tokens=10**6 + 5)])
    assert late_hub.registry.get_sample_value("tandem:spec_decode_draft_tokens_total") == 5
    assert len(KV_TRANSFER_BUCKETS) == len(WorkerCounters("x", "prefill").snapshot(
        running=0, waiting=0, kv_blocks_used=0, kv_blocks_total=0).kv_transfer_seconds_buckets)


def test_dashboard_queries_only_metrics_the_registry_defines():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    used = {name for e in exprs for name in re.findall(r"tandem:[A-Za-z0-9_:]+", e)}
    unknown = used - exported_sample_names(MetricsHub())
    assert not unknown, f"the dashboard queries metrics nobody exports: {sorted(unknown)}"
    families = {n for n in METRIC_NAMES if any(u.startswith(n) for u in used)}
    assert families == set(METRIC_NAMES), f"no panel for {sorted(set(METRIC_NAMES) - families)}"
    assert any(e.startswith("histogram_quantile(0.99") and "first_token" in e for e in exprs)


# --- logging ----------------------------------------------------------------------------------


def test_json_logs_carry_the_bound_request_id(monkeypatch):
    monkeypatch.setenv("TANDEM_LOG_LEVEL", "debug")
    out = io.StringIO()
    handler = setup_logging(stream=out)
    try:
        log = logging.getLogger("tandem.test")

        async def serve(rid: str):
            with bind_request(rid, session_id=f"s-{rid}"):
                await asyncio.sleep(0)
                log.debug("routed", extra={"worker": "d0"})
                await asyncio.sleep(0)
                log.info("done")

        async def main():
            await asyncio.gather(serve("r1"), serve("r2"))

        asyncio.run(main())
        log.warning("outside %s", "any request")
        assert current_request_id() is None
        lines = [json.loads(line) for line in out.getvalue().splitlines()]
        by_msg = {(r["msg"], r.get("request_id")): r for r in lines}
        assert by_msg[("routed", "r1")]["worker"] == "d0"
        assert by_msg[("routed", "r1")]["session_id"] == "s-r1"
        assert by_msg[("done", "r2")]["level"] == "info"
        assert "request_id" not in by_msg[("outside any request", None)]
        assert len(lines) == 5
    finally:
        logging.getLogger().removeHandler(handler)


def test_a_stream_closed_from_another_context_leaves_the_binding_cleanly():
    """A gRPC stream the client cancels is an async generator closed by the event loop's
    finalizer, in another context than it ran in: leaving bind_request there must not raise
    (the router logged "Task exception was never retrieved" for each such stream)."""
    import contextvars

    async def stream():
        with bind_request("r-cancelled"):
            yield 1
            yield 2

    async def main():
        gen = stream()
        assert await gen.__anext__() == 1
        closing = asyncio.get_running_loop().create_task(gen.aclose(), context=contextvars.Context())
        await closing                                # raised ValueError before

    asyncio.run(main())


def test_key_value_format_and_bad_level(monkeypatch):
    out = io.StringIO()
    handler = setup_logging(level="INFO", fmt="kv", stream=out)
    try:
        setup_logging(level="INFO", fmt="kv", stream=out)  # again: replaces, does not double
        handler = [h for h in logging.getLogger().handlers if h.get_name() == "tandem"]
        assert len(handler) == 1
        handler = handler[0]
        with bind_request("req-7"):
            logging.getLogger("router").info('said "hi" there')
        line = out.getvalue().strip()
        assert 'msg="said \\"hi\\" there"' in line and "request_id=req-7" in line
        assert "level=info" in line and "logger=router" in line
    finally:
        logging.getLogger().removeHandler(handler)
    monkeypatch.setenv("TANDEM_LOG_LEVEL", "chatty")
    with pytest.raises(ValueError, match="TANDEM_LOG_LEVEL"):
        setup_logging(stream=io.StringIO())
