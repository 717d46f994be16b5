"""tandem.placement: the local-or-remote prefill rules, overload limits, and the simulator and the
router making the same decision on the same inputs (the simulator's copy had drifted: it left a
saturated session worker and broke ties at random)."""

from __future__ import annotations

import random

import pytest

from tandem.cluster.sim_engine import Simulation
from tandem.cluster.sim_model import SLO
from tandem.perf_model import PerfModel
from tandem.cluster.sim_workers import SimSeq
from tandem.cluster.workloads import RequestSpec
from tandem.placement import (OverloadLimits, WorkerView, choose_worker, local_prefill_queue,
                              remote_prefill_offered, wants_remote_prefill)
from tandem.router.placing import Placer
from tandem.router.prefix_index import block_hashes
from tandem.router.sessions import SessionState

PERF = PerfModel(local_prefill_threshold=16, prefill_queue_limit=8000, max_batch=8, kv_capacity_tokens=64_000,
                 block_tokens=16)


def test_the_decode_worker_prefills_short_uncached_parts_itself():
    assert wants_remote_prefill(300, 0, 256)
    assert not wants_remote_prefill(300, 100, 256)      # 200 uncached
    assert not wants_remote_prefill(300, 300, 0)        # all cached: nothing to prefill remotely
    assert wants_remote_prefill(1, 0, 0)


def test_remote_prefill_needs_a_pool_and_a_finite_threshold():
    assert remote_prefill_offered(256, 1)
    assert not remote_prefill_offered(256, 0)
    assert not remote_prefill_offered(float("inf"), 4)   # colocated


def test_the_local_queue_weighed_is_the_sessions_else_the_shortest():
    queued = {"d0": 500, "d1": 100}
    assert local_prefill_queue("d0", queued, ["d0", "d1", "d2"]) == 500
    assert local_prefill_queue(None, queued, ["d0", "d1"]) == 100
    assert local_prefill_queue(None, queued, ["d0", "d1", "d2"]) == 0
    assert local_prefill_queue(None, queued, []) == 0


def test_overload_limits_unset_never_overload():
    busy = WorkerView("d0", "decode", running=10**6, waiting=10**6, kv_blocks_used=10, kv_blocks_total=10)
    assert not OverloadLimits()(busy)
    assert OverloadLimits(max_kv_usage=0.99)(busy) and OverloadLimits(max_load=10)(busy)
    assert choose_worker([busy], "d0", overload_fn=OverloadLimits(max_waiting=0)) is None


# ---- the simulator and the router: one policy --------------------------------------------------------

class _View:
    """The router's cluster view, built from the simulator's workers (what each would report)."""
    router_id = "router-test"

    def __init__(self, sim: Simulation, r, now: float):
        self.decode = [w.view(r, PERF.block_tokens, PERF.kv_capacity_tokens)
                       for w in sim.decodes if w.up and not w.gone]
        self.prefill = [p.view(r, now) for p in sim.prefills if p.accepting]
        self.inflight, self.queues = {}, {}

    def views(self, pool):
        return list(self.decode if pool == "decode" else self.prefill)


def _seq(session: str, tokens: int) -> SimSeq:
    return SimSeq(RequestSpec(session, 0, 0.0, tokens, 4), 0)


def random_cluster(rng: random.Random, overload: OverloadLimits) -> Simulation:
    """A simulation paused at t=1 s with random queues, batches, local prefills and session state."""
    sim = Simulation([], rng.randint(1, 3), rng.randint(1, 4), PERF, SLO(), None, 0, False, 0.0, False, False,
                     overload=overload)
    for w in sim.decodes:
        w.accepting = rng.random() > 0.2          # some draining
        w.waiting.extend(_seq("x", 100) for _ in range(rng.choice([0, 0, 1, 3])))
        w.awaiting_kv = rng.randint(0, 3)
        w.held = rng.randrange(0, PERF.kv_capacity_tokens, PERF.block_tokens)
        for _ in range(rng.randint(0, 2)):
            s = _seq("y", rng.choice([2000, 5000]))
            s.prefill_left = 1
            w.local.append(s)
    for p in sim.prefills:
        for _ in range(rng.randint(0, 3)):
            n = rng.choice([1000, 4000, 7000])
            p.jobs.append((0.5, rng.choice([0.8, 5.0]), n))
            p.queued.append((rng.choice([0.9, 6.0]), n))
            p.queued_tokens += n
    for sid in ("s0", "s1"):
        if rng.random() < 0.7:
            sim.session_decode[sid] = rng.choice(sim.decodes)
        if rng.random() < 0.7:
            sim.session_prefill[sid] = rng.choice(sim.prefills).name
    return sim


def router_for(sim: Simulation, r, now: float, overload: OverloadLimits) -> Placer:
    placer = Placer(_View(sim, r, now), PERF.block_tokens, 2, {}, local_prefill_threshold=PERF.local_prefill_threshold,
                    max_prefill_queued_tokens=PERF.prefill_queue_limit, overload=overload)
    for p in sim.prefills:
        p.deliver(now)
        if p.queued_tokens:
            placer.prefill_queued[p.name] = p.queued_tokens
    placer.local_queued = {w.name: w.local_queued() for w in sim.decodes if w.local_queued()}
    return placer


@pytest.mark.parametrize("overload", [OverloadLimits(), OverloadLimits(max_waiting=0, max_kv_usage=0.9)])
def test_the_simulator_and_the_router_make_the_same_decisions(overload):
    rng, now, compared = random.Random(7), 1.0, 0
    for _ in range(300):
        sim = random_cluster(rng, overload)
        sid = rng.choice(["s0", "s1", "new"])
        s = _seq(sid, rng.choice([500, 3000, 6000]))
        own = sim.session_decode.get(sid)
        s.session_decode = own.name if own else None
        sess = SessionState(decode_worker=s.session_decode, prefill_worker=sim.session_prefill.get(sid),
                            num_tokens=0) if sid in sim.session_decode or sid in sim.session_prefill else None
        placer = router_for(sim, s.spec, now, overload)
        picked = sim.pick_decode(s.spec)
        try:
            routed = placer.pick("decode", sess.decode_worker if sess else None, [])
        except Exception:   # noqa: BLE001 - no worker can take it: the simulator rejects it
            routed = None
        assert (picked.name if picked else None) == routed
        target = sim.pick_prefill(s, now)
        assert (target.name if target else None) == placer.prefill_target(sess, s.spec.input_tokens, [])
        compared += target is not None
    assert compared > 50      # the random clusters did reach remote placements


def test_the_simulator_keeps_a_saturated_session_worker_as_the_router_does():
    sim = Simulation([], 0, 2, PERF, SLO(), None, 0, False, 0.0, False, False)
    busy, idle = sim.decodes
    busy.waiting.extend(_seq("x", 100) for _ in range(3))
    busy.awaiting_kv = PERF.max_batch                # every slot taken, three queued
    sim.session_decode["s0"] = busy
    assert sim.pick_decode(_seq("s0", 100).spec) is busy
    assert sim.pick_decode(_seq("new", 100).spec) is idle
    sim.overload = OverloadLimits(max_waiting=2)     # past the router's limit: both leave it
    assert sim.pick_decode(_seq("s0", 100).spec) is idle


def test_the_simulators_ties_go_to_the_smallest_worker_id_whatever_the_seed():
    picks = set()
    for seed in range(5):
        sim = Simulation([], 2, 3, PERF, SLO(), None, seed, False, 0.0, False, False)
        s = _seq("new", 5000)
        picks.add((sim.pick_decode(s.spec).name, sim.pick_prefill(s, 0.0).name))
    assert picks == {("decode-0", "prefill-0")}



class _Roles:
    """A cluster view whose workers change part: `serving[w]` is the part w serves now."""
    router_id = "router-test"

    def __init__(self, serving: dict[str, str]):
        self.serving, self.inflight, self.queues = serving, {}, {}

    def views(self, pool):
        return [WorkerView(w, pool, "ready" if part in (pool, "mixed") else "draining")
                for w, part in sorted(self.serving.items())]


def test_a_worker_lent_to_prefill_is_still_known_to_cache_what_it_decoded():
    """One prefix index for the router, whatever part a worker serves: its KV cache stays through a
    role change (it used to be one index per pool, so the prefill choice missed that worker's cache)."""
    view = _Roles({"w-a": "prefill", "w-b": "decode"})
    placer = Placer(view, 16, 2, {}, local_prefill_threshold=0)
    prompt = list(range(100, 164))
    hashes = block_hashes(prompt, 16)
    assert placer.pick("decode", None, hashes) == "w-b"
    placer.prefix.record("w-b", hashes)            # as the router does when w-b's turn finishes
    view.serving = {"w-a": "prefill", "w-b": "prefill"}   # w-b lent to prefill
    assert placer.pick("prefill", None, hashes) == "w-b"  # its cached prefix beats the smaller id
    assert placer.pick("prefill", None, block_hashes(list(range(500, 564)), 16)) == "w-a"
    view.serving = {"w-a": "decode", "w-b": "decode"}     # and back, after w-a prefilled a prompt
    placer.prefix.record("w-a", hashes[:2])
    assert placer.pick("decode", None, hashes) == "w-b"   # the longer cached prefix
