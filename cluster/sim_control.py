"""The autoscaler in the simulation's loop: every period, the snapshot the live controller builds
(cluster.pools.build_snapshot, called on what the simulated workers report), the policy's decision
(cluster.autoscaler.decide, the live one), and the pools resized to it; new workers start after a
delay, drained ones leave once idle."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.cluster.autoscaler import MetricsSnapshot, decide
from tandem.cluster.pools import build_snapshot
from tandem.cluster.sim_model import PoolSample
from tandem.cluster.sim_workers import SimDecodeWorker, SimPrefillWorker

if TYPE_CHECKING:
    from tandem.cluster.sim_engine import Simulation


def control(sim: Simulation, now: float) -> None:
    cfg = sim.cfg
    for w in sim.prefills + sim.decodes:
        if w.draining and not w.gone and w.idle(now):
            w.gone = True
    snap = snapshot(sim, now)
    d = decide(snap, cfg, sim.policy, now)
    sim.policy = d.state
    p_target = 0 if sim.colocated else d.prefill_target
    resize(sim, sim.prefills, SimPrefillWorker, p_target, now)
    resize(sim, sim.decodes, SimDecodeWorker, d.decode_target, now)
    sim.start_pending(now)
    sim.samples.append(PoolSample(now, snap.prefill.size, snap.decode.size, p_target, d.decode_target,
                                  snap.prefill.draining, snap.decode.draining))
    if sim.done + len(sim.unsent) < len(sim.seqs):  # unsent turns never finish
        sim.push(now + cfg.period_s, "control")


def resize(sim: Simulation, pool: list, cls: type, target: int, now: float) -> None:
    live = [w for w in pool if not w.draining and not w.gone]
    for _ in range(target - len(live)):
        sim.add_worker(pool, cls, now)
    # shrink: cancel workers still starting (newest first), then drain the least loaded
    victims = sorted(live, key=lambda w: (w.accepting, w.load() if isinstance(w, SimDecodeWorker)
                                          else w.free_s, -w.wid))
    for w in victims[:max(0, len(live) - target)]:
        w.accepting, w.draining = False, True
        if not w.up or w.idle(now):
            w.gone = True


def snapshot(sim: Simulation, now: float) -> MetricsSnapshot:
    """The live controller's inputs, from the live function (cluster.pools.build_snapshot) on what
    the simulated workers report now (`SimWorker.entry`); it keeps the counters for the next
    period's rates, as the controller does."""
    workers = tuple(w.entry(now, sim.perf) for w in sim.prefills + sim.decodes if not w.gone)
    snap, sim.rates = build_snapshot(workers, sim.rates, now, sim.cfg.period_s, sim.perf.max_batch)
    return snap
