"""The autoscaler in the simulation's loop: every period, the snapshot the live controller would
build (cluster.pools.build_snapshot) from the simulated workers, the policy's decision
(cluster.autoscaler.decide, the live one), and the pools resized to it; new workers start after a
delay, drained ones leave once idle."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from tandem.cluster.autoscaler import DecodeMetrics, MetricsSnapshot, PrefillMetrics, decide
from tandem.cluster.sim_model import PoolSample, pct
from tandem.cluster.sim_workers import SimDecodeWorker, SimPrefillWorker
from tandem.runtime.latency import LatencyWindow

if TYPE_CHECKING:
    from tandem.cluster.sim_engine import Simulation

LATENCY_WINDOW_S = LatencyWindow().window_s     # the workers' TTFT / TPOT window


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


def _trim_to_window(sim: Simulation, now: float) -> None:
    window = LATENCY_WINDOW_S
    for name in ("recent_ttft", "recent_tpot", "recent_prefill"):
        q = getattr(sim, name)
        if q and min(x[0] for x in q) < now - window:
            setattr(sim, name, deque(x for x in q if x[0] >= now - window))


def _prefill_metrics(sim: Simulation, now: float) -> PrefillMetrics:
    queued = running = 0
    for p in sim.prefills:
        while p.jobs and p.jobs[0][1] <= now:
            p.jobs.popleft()
        for start, end, n in p.jobs:
            if start > now:
                queued += n
            else:
                running += int(n * (end - now) / max(end - start, 1e-12))
    cap = None
    if sim.recent_prefill:
        n_mean = sum(j[1] for j in sim.recent_prefill) / len(sim.recent_prefill)
        ctx_mean = sum(j[2] for j in sim.recent_prefill) / len(sim.recent_prefill)
        if n_mean > 0:
            cap = n_mean / sim.perf.prefill_s(max(1, round(n_mean)), round(ctx_mean))
    ttft = [v for t, v in sim.recent_ttft if t <= now]
    period = sim.cfg.period_s
    return PrefillMetrics(
        size=sum(p.accepting for p in sim.prefills),
        draining=sum(p.draining and not p.gone for p in sim.prefills),
        queued_prompt_tokens=queued, running_prompt_tokens=running,
        prompt_tokens_per_s=sum(j[1] for j in sim.recent_prefill if j[0] > now - period) / period,
        prefill_tokens_per_s_per_worker=cap,
        ttft_p50=pct(ttft, 50) if ttft else None, ttft_p90=pct(ttft, 90) if ttft else None,
        ttft_p99=pct(ttft, 99) if ttft else None)


def _decode_metrics(sim: Simulation, now: float) -> DecodeMetrics:
    perf = sim.perf
    tpot = [v for t, v in sim.recent_tpot if t <= now]
    live_d = [w for w in sim.decodes if w.accepting]
    blocks = perf.kv_capacity_tokens // perf.block_tokens
    return DecodeMetrics(
        size=len(live_d), draining=sum(w.draining and not w.gone for w in sim.decodes),
        running_seqs=sum(w.slots_used() for w in live_d),
        waiting_seqs=sum(len(w.waiting) for w in live_d),
        kv_blocks_used=sum(w.held for w in live_d) // perf.block_tokens,
        kv_blocks_total=blocks * len(live_d),
        kv_blocks_waiting=sum(s.spec.input_tokens + s.spec.output_tokens
                              for w in live_d for s in w.waiting) // perf.block_tokens,
        kv_blocks_cached=sum(w.cache.tokens for w in live_d) // perf.block_tokens,
        tpot_p50=pct(tpot, 50) if tpot else None, tpot_p90=pct(tpot, 90) if tpot else None,
        tpot_p99=pct(tpot, 99) if tpot else None, max_seqs_per_worker=perf.max_batch)


def snapshot(sim: Simulation, now: float) -> MetricsSnapshot:
    """What the live controller is given (controller.build_snapshot): latency percentiles over the
    workers' window (LatencyWindow) of samples already taken, by then (a remote prefill's TTFT is
    stamped when its KV will be ready, which may be after now), and the prompt-token rate over the
    last period."""
    _trim_to_window(sim, now)
    return MetricsSnapshot(_prefill_metrics(sim, now), _decode_metrics(sim, now))
