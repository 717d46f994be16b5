"""The controller's pools (cluster.pools) without Ray: workers are fake members whose readiness and
health the test sets, time is a fake clock, and every assertion goes through the public methods
(`check`, `state`, `drain_worker`, `set_bounds`, `set_role`, `maybe_autoscale`, `stop_all`)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tandem.cluster.config import ADAPTIVE, load_config
from tandem.cluster.members import Probe, ProbeResult
from tandem.cluster.pools import DRAINED_STOP_TIMEOUT_S, Pools
from tandem.wire.cluster import PoolState
from tandem.wire.errors import InvalidPoolBounds, InvalidRole, UnknownPool, UnknownWorker, WorkerUnavailable
from tandem.wire.stats import Percentiles, WorkerInfo
from tandem.perf_model import PerfModel
from tests.unit.pool_factories import BUSY, IDLE, FakeClock, FakeFleet, FakeMember, make_pools

H200_PERF = PerfModel(prefill_base_s=0.0028, prefill_per_token_s=2e-5, prefill_attn_s=8.4e-10, decode_base_s=0.0056,
                      decode_per_seq_s=1.2e-5, decode_per_ctx_token_s=3.4e-8, transfer_base_s=0.003,
                      transfer_per_token_s=4e-7, request_overhead_s=0.005, remote_overhead_s=0.015,
                      max_batch=256, max_step_tokens=8192)


def states(pools) -> dict[str, str]:
    return {w.worker_id: w.state for w in pools.state().workers}


def test_workers_start_to_target_and_are_ready_once_their_check_passes():
    pools, fleet, _ = make_pools(ready=False)
    assert states(pools) == {"prefill-0": "starting", "decode-0": "starting", "decode-1": "starting"}
    pools.check()
    assert not pools.all_ready() and set(states(pools).values()) == {"starting"}
    for m in fleet.members.values():
        m.ready = ProbeResult(Probe.OK, WorkerInfo(m.worker_id, m.pool, pid=7, node="n1"))
    pools.check()
    assert pools.all_ready()
    w = pools.state().worker("decode-1")
    assert w.pid == 7 and w.node == "n1" and w.stats == BUSY   # stats in the same round
    assert pools.state().pools["decode"] == PoolState(size=2, target=2, min=2, max=2, draining=0, target_pinned=False)


def test_a_worker_that_fails_to_start_is_replaced():
    pools, fleet, _ = make_pools(ready=False)
    fleet.members["prefill-0"].ready = ProbeResult(Probe.FAILED, error=RuntimeError("no GPU"), dead=True)
    pools.check()
    assert fleet.members["prefill-0"].killed
    assert states(pools) == {"decode-0": "starting", "decode-1": "starting", "prefill-1": "starting"}


def test_a_dead_actor_is_killed_forgotten_and_replaced_at_once():
    pools, fleet, _ = make_pools()
    pools.check()
    fleet.members["decode-0"].health = ProbeResult(Probe.FAILED, error=RuntimeError("actor died"), dead=True)
    pools.check()
    assert fleet.members["decode-0"].killed
    assert states(pools) == {"prefill-0": "ready", "decode-1": "ready", "decode-2": "starting"}
    pools.check()
    assert states(pools)["decode-2"] == "ready" and pools.all_ready()


def test_missed_checks_in_a_row_make_a_worker_dead_and_an_answer_resets_the_count():
    pools, fleet, clock = make_pools()
    pools.check()
    m = fleet.members["prefill-0"]
    missed = ProbeResult(Probe.FAILED, error=TimeoutError("stats() unanswered"))
    for health in (missed, missed, ProbeResult(Probe.OK, IDLE), missed, missed):
        m.health = health
        pools.check()
        clock.advance(1.0)
        assert states(pools)["prefill-0"] == "ready"
    # a call still in flight counts as nothing, either way
    m.health = ProbeResult.pending()
    pools.check()
    assert states(pools)["prefill-0"] == "ready"
    m.health = missed
    pools.check()          # the third miss in a row
    assert m.killed and "prefill-0" not in states(pools) and states(pools)["prefill-1"] == "starting"


def test_a_drained_worker_is_not_replaced_and_leaves_once_idle():
    pools, fleet, clock = make_pools()
    pools.check()
    drained = pools.drain_worker("decode-1")
    assert (drained.worker_id, drained.pool, drained.state) == ("decode-1", "decode", "draining")
    m = fleet.members["decode-1"]
    assert m.draining and pools.state().pools["decode"].target == 1
    pools.check()                      # still busy: it stays, draining, and nobody replaces it
    assert states(pools) == {"prefill-0": "ready", "decode-0": "ready", "decode-1": "draining"}
    assert pools.state().pools["decode"].draining == 1
    m.health = ProbeResult(Probe.OK, IDLE)
    clock.advance(1.0)
    pools.check()                      # idle: asked to shut down, out of the membership at once
    assert "decode-1" not in states(pools) and m.stop_deadline == clock() + DRAINED_STOP_TIMEOUT_S
    assert not m.killed
    m.shut_down = True
    pools.check()
    assert m.killed and set(fleet.members) == {"prefill-0", "decode-0", "decode-1"}
    with pytest.raises(UnknownWorker, match="decode-1"):
        pools.drain_worker("decode-1")


def test_an_idle_answer_asked_for_before_the_drain_does_not_stop_the_worker():
    """A stats call in flight when the drain came may have been answered before the worker took
    the requests it now holds: only an answer to a call sent after the drain may stop it."""
    pools, fleet, clock = make_pools()
    pools.check()
    m = fleet.members["decode-1"]
    clock.advance(1.0)
    pools.drain_worker("decode-1")
    m.health, m.answer_lag_s = ProbeResult(Probe.OK, IDLE), 1.5   # sent before the drain
    clock.advance(1.0)
    pools.check()
    assert states(pools)["decode-1"] == "draining" and m.stop_deadline is None
    m.answer_lag_s = 0.5                                           # sent after it
    clock.advance(1.0)
    pools.check()
    assert "decode-1" not in states(pools) and m.stop_deadline is not None


def test_a_drained_worker_that_never_finishes_its_shutdown_is_killed_after_the_timeout():
    pools, fleet, clock = make_pools()
    pools.check()
    pools.drain_worker("prefill-0")
    fleet.members["prefill-0"].health = ProbeResult(Probe.OK, IDLE)
    clock.advance(1.0)
    pools.check()
    clock.advance(DRAINED_STOP_TIMEOUT_S - 0.5)
    pools.check()
    assert not fleet.members["prefill-0"].killed
    clock.advance(1.0)
    pools.check()
    assert fleet.members["prefill-0"].killed


def test_pinning_a_target_starts_workers_and_lowering_it_drains_the_youngest():
    pools, fleet, clock = make_pools()
    pools.check()
    clock.advance(5)
    assert pools.set_bounds("decode", 1, 4, target=4).target_pinned
    assert [w for w, s in states(pools).items() if s == "starting"] == ["decode-2", "decode-3"]
    pools.check()
    clock.advance(5)
    pools.set_bounds("decode", 1, 4, target=2)
    assert [w for w, m in fleet.members.items() if m.draining] == ["decode-2", "decode-3"]
    assert pools.set_bounds("decode", 1, 3).target_pinned is False
    with pytest.raises(UnknownPool, match="unknown pool"):
        pools.set_bounds("embed", 0, 1)
    with pytest.raises(InvalidPoolBounds, match="0 <= min <= max"):
        pools.set_bounds("decode", 3, 1)


def test_the_autoscaler_decides_once_a_period_and_leaves_a_pinned_pool():
    pools, fleet, clock = make_pools({"autoscaler.enabled": True, "autoscaler.period_s": 5.0,
                                      "autoscaler.upscale_delay_s": 0.0, "autoscaler.prefill_max": 4})
    pools.check()
    pools.set_bounds("decode", 1, 8, target=2)
    heavy = dataclasses.replace(IDLE, queued_prompt_tokens=10**6, prefill_latency=Percentiles(9.0, 9.0, 9.0))
    fleet.members["prefill-0"].health = ProbeResult(Probe.OK, heavy)
    pools.check()
    pools.maybe_autoscale()
    d = pools.state().last_decision
    assert len(pools.decisions) == 1 and d == pools.decisions[0] and d.at_unix_s == 1.7e9 + clock()
    assert d.prefill_target > 1 and (d.prefill_size, d.decode_size) == (1, 2)
    assert pools.state().pools["prefill"].target > 1 and pools.state().pools["decode"].target == 2
    clock.advance(4.9)
    pools.maybe_autoscale()
    assert len(pools.decisions) == 1             # not yet a period later
    clock.advance(0.2)
    pools.maybe_autoscale()
    assert len(pools.decisions) == 2


def test_stop_all_asks_every_worker_and_kills_each_once_stopped_or_timed_out():
    pools, fleet, clock = make_pools()
    pools.check()
    pools.stop_all(timeout_s=5.0)
    assert pools.state().workers == () and not pools.all_stopped()
    fleet.members["decode-0"].shut_down = True
    assert not pools.all_stopped() and fleet.members["decode-0"].killed
    clock.advance(5.0)
    assert pools.all_stopped() and all(m.killed for m in fleet.members.values())


def test_a_role_change_reaches_the_worker_shows_in_its_entry_and_is_logged_with_its_reason():
    pools, fleet, clock = make_pools()
    pools.check()
    assert {w.worker_id: w.role for w in pools.state().workers} == {
        "prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}
    entry = pools.set_role("prefill-0", "decode", reason="decode-heavy load")
    assert fleet.members["prefill-0"].role == "decode"
    assert entry.role == "decode" and entry.pool == "prefill" and entry.serves("decode") and not entry.serves("prefill")
    pools.set_role("decode-1", "mixed")
    state = pools.state()
    assert state.worker("decode-1").serves("prefill") and state.worker("decode-1").serves("decode")
    assert [(c.worker_id, c.from_role, c.to_role, c.reason) for c in state.role_changes] == [
        ("prefill-0", "prefill", "decode", "decode-heavy load"), ("decode-1", "decode", "mixed", "")]
    assert state.role_changes[0].at_unix_s == 1.7e9 + clock.t
    assert state.pools["prefill"].size == 1 and state.pools["decode"].size == 2   # pools stay by where they started
    pools.check()
    assert pools.state().worker("prefill-0").role == "decode"   # a health round keeps it
    with pytest.raises(InvalidRole):
        pools.set_role("decode-0", "both")
    with pytest.raises(UnknownWorker):
        pools.set_role("decode-9", "prefill")
    pools.drain_worker("decode-0")
    with pytest.raises(WorkerUnavailable):
        pools.set_role("decode-0", "prefill")
    assert len(pools.role_changes) == 2


def test_the_role_policy_lends_a_worker_to_prefill_under_prompt_load_and_holds_it(tmp_path):
    """The adaptive layout's loop (Pools.maybe_roles) on fake workers: 70k prompt tokens/s beside
    64 decoding sequences on 4 mixed workers, TPOT 12 ms: the policy lends one worker to prefill
    (the one decoding the least), holds it, then lends a second; the reason is in the log."""
    perf = tmp_path / "perf.json"
    perf.write_text(json.dumps(H200_PERF.to_dict()))
    pools, fleet, clock = make_pools({**ADAPTIVE, "prefill.replicas": 0, "decode.replicas": 4,
                                      "router.perf_model": str(perf), "router.slo_ttft_ms": 1000,
                                      "router.slo_tpot_ms": 12, "roles.period_s": 2.0, "roles.min_hold_s": 10.0,
                                      "roles.window_s": 2.0})
    assert {w.role for w in pools.state().workers} == {"mixed"}

    def serve(seconds_in: float, running=(16, 16, 16, 16)):
        for i, m in enumerate(sorted(fleet.members.values(), key=lambda m: m.worker_id)):
            t = seconds_in
            m.health = ProbeResult(Probe.OK, dataclasses.replace(
                IDLE, running=running[i], kv_blocks_used=running[i] * 4000 // 16,
                prompt_tokens_computed=int(17_500 * t), prompts_completed=int(8.75 * t),
                prompt_tokens_completed=int(35_000 * t)))
        pools.check()

    serve(0.0, running=(16, 16, 10, 16))
    pools.maybe_roles()                          # the first sample: no rate yet, nothing moves
    assert not pools.state().role_changes
    clock.advance(2.0)
    serve(2.0, running=(16, 16, 10, 16))
    pools.maybe_roles()
    changes = pools.state().role_changes
    assert [(c.worker_id, c.to_role) for c in changes] == [("decode-2", "prefill")]   # the least busy
    assert "lend a worker to prefill" in changes[0].reason and fleet.members["decode-2"].role == "prefill"
    assert pools.role_decision.best.prefill_workers == 2
    for t in (4.0, 6.0, 8.0):                    # held for min_hold_s
        clock.advance(2.0)
        serve(t)
        pools.maybe_roles()
        assert len(pools.state().role_changes) == 1 and pools.role_decision.reason.startswith("held")
    clock.advance(4.0)
    serve(12.0)
    pools.maybe_roles()
    assert [c.to_role for c in pools.state().role_changes] == ["prefill", "prefill"]


def test_without_the_adaptive_layout_roles_never_move():
    pools, fleet, clock = make_pools()
    pools.check()
    for _ in range(3):
        clock.advance(5.0)
        pools.maybe_roles()
    assert pools.role_decision is None and not pools.state().role_changes


def test_the_role_policy_waits_for_a_whole_window_of_demand(tmp_path):
    """The first seconds of a run are every session's first prompt: nothing moves on them."""
    perf = tmp_path / "perf.json"
    perf.write_text(json.dumps(H200_PERF.to_dict()))
    pools, fleet, clock = make_pools({**ADAPTIVE, "prefill.replicas": 0, "decode.replicas": 4,
                                      "router.perf_model": str(perf), "router.slo_tpot_ms": 12,
                                      "roles.period_s": 2.0, "roles.window_s": 10.0})
    for t in range(0, 10, 2):
        for m in fleet.members.values():
            m.health = ProbeResult(Probe.OK, dataclasses.replace(
                IDLE, running=16, kv_blocks_used=4000, prompt_tokens_computed=17_500 * t,
                prompts_completed=9 * t, prompt_tokens_completed=35_000 * t))
        pools.check()
        pools.maybe_roles()
        assert pools.role_decision is None, t
        clock.advance(2.0)
    pools.check()
    pools.maybe_roles()                       # 10 s measured: now it decides
    assert pools.role_decision is not None


def test_the_demand_averages_the_batch_over_the_window_and_rates_the_prompts_end_to_end():
    from tandem.cluster.roles import PromptCounters, demand_over
    samples = [PromptCounters(0.0, 0, 0, 0, decode_seqs=2, context_tokens=2000),
               PromptCounters(2.0, 4000, 2, 6000, decode_seqs=3, context_tokens=3000),
               PromptCounters(4.0, 8000, 4, 12_000, decode_seqs=4, context_tokens=4000)]
    d = demand_over(samples)
    assert d.prompt_tokens_per_s == 2000 and d.mean_new_tokens == 2000 and d.mean_prompt_tokens == 3000
    assert d.decode_seqs == 3 and d.context_tokens == 3000       # the mean, not the last moment's 4


def test_a_restarted_controller_adopts_the_workers_it_finds_and_starts_only_what_is_missing():
    config = load_config(None, {"prefill.replicas": 1, "decode.replicas": 2})
    fleet, clock = FakeFleet(), FakeClock()
    pools = Pools(config, fleet, clock, wall_clock=lambda: 1.7e9 + clock.t)
    found = {"decode-3": dataclasses.replace(BUSY, role="decode"),
             "decode-5": dataclasses.replace(IDLE, role="prefill"),          # lent to prefill before the crash
             "decode-7": dataclasses.replace(BUSY, role="decode", draining=True)}
    for wid, stats in found.items():
        pools.adopt(FakeMember(wid, "decode"), WorkerInfo(wid, "decode", pid=7), dataclasses.replace(stats, worker_id=wid))
    pools.reconcile()
    assert not any(w.startswith("decode") for w in fleet.members)    # two ready decode workers: none started
    assert set(fleet.members) == {"prefill-0"}
    assert states(pools) == {"decode-3": "ready", "decode-5": "ready", "decode-7": "draining", "prefill-0": "starting"}
    assert {w.worker_id: w.role for w in pools.state().workers}["decode-5"] == "prefill"
    pools.set_bounds("decode", 0, 4, target=3)
    pools.reconcile()
    assert "decode-8" in fleet.members                              # ids go on after the adopted ones
