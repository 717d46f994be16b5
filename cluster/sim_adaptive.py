"""The adaptive layout in the simulation: every worker decodes and prefills (the engine's mixed
step), and the controller's role policy (cluster.roles, on tandem.placement's `plan_roles`) lends
some of them to prefill only, with hysteresis. Each request's prompt goes where tandem.placement's
`choose_prefill` predicts the most headroom inside both SLOs: its decode worker's own chunks (at the
chunk size picked), or another worker that ships the KV when done. The same functions the router
and the controller call, on what the simulation knows of its workers."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from tandem.cluster.roles import RoleDecision, RoleState, decide_roles
from tandem.placement import LOCAL, Demand, EngineLoad, choose_prefill, has_slack, prefill_options

if TYPE_CHECKING:
    from tandem.cluster.sim_engine import Simulation
    from tandem.cluster.sim_workers import SimDecodeWorker, SimSeq

PREFILL, DECODE = "prefill", "decode"


def load_of(w: SimDecodeWorker) -> EngineLoad:
    return EngineLoad(len(w.running), sum(s.context for s in w.running), w.local_queued())


def place(sim: Simulation, w: SimDecodeWorker, s: SimSeq, hit: int, now: float) -> None:
    """An admitted request's prefill: local chunks on `w`, or another worker's, by the cost model."""
    r, perf = s.spec, sim.perf
    others = {x.name: (load_of(x), x.cache.hit(r)) for x in sim.decodes
              if x is not w and x.up and not x.gone and has_slack(load_of(x), x.role == PREFILL, load_of(w))}
    best = choose_prefill(prefill_options(perf, r.input_tokens, w.name, load_of(w), hit, others),
                          sim.slo.ttft_s, sim.slo.tpot_s)
    sim.recent_admits.append((now, r.input_tokens - hit, r.input_tokens))
    s.chunk = best.chunk_tokens
    if best.where == LOCAL:
        s.kind, s.cached, s.prefill_left, s.context = "local", hit, r.input_tokens - hit, hit
        w.local.append(s)
        sim._step_if_idle(w, now)
        return
    x = next(x for x in sim.decodes if x.name == best.worker_id)
    cached = max(hit, x.cache.hit(r))          # it pulls the decode worker's longer prefix
    s.kind, s.cached, s.prefill_left, s.context = "remote", cached, r.input_tokens - cached, cached
    s.prefill_start_s, s.prefiller = now, x
    x.computed_tokens += r.input_tokens - cached
    w.awaiting_kv += 1
    x.local.append(s)
    sim._step_if_idle(x, now)


def prefilled_for(sim: Simulation, x: SimDecodeWorker, s: SimSeq, now: float) -> None:
    """`x` computed the last chunk of a prompt it prefills for another worker: it keeps the prefix
    cached, and the KV, streamed layer by layer, is usable on the decode worker once the slower of
    compute and link is done."""
    r, perf = s.spec, sim.perf
    x.cache.store(r, r.input_tokens)
    x.cache.evict_to(perf.kv_capacity_tokens - x.reserved)
    ready = max(now, s.prefill_start_s + perf.transfer_s(r.input_tokens - s.cached)) + perf.remote_overhead_s
    sim.push(ready, "kv_ready", s)


def demand(sim: Simulation, now: float) -> Demand:
    """What the live controller measures (cluster.roles.demand_over) over `roles.window_s`: the
    prompt tokens admitted and their sizes, and the decode batch sampled every period, averaged."""
    q, window = sim.recent_admits, sim.role_config.window_s
    while q and q[0][0] < now - window:
        q.popleft()
    live = [w for w in sim.decodes if w.up and not w.gone]
    batches = sim.role_batches
    batches.append((now, sum(len(w.running) + w.awaiting_kv + len(w.waiting) for w in live),
                    sum(s.context for w in live for s in w.running)))
    while batches[0][0] < now - window:
        batches.popleft()
    n, m = len(q) or 1, len(batches)
    return Demand(prompt_tokens_per_s=sum(x[1] for x in q) / window, mean_new_tokens=sum(x[1] for x in q) / n,
                  mean_prompt_tokens=sum(x[2] for x in q) / n,
                  decode_seqs=sum(b[1] for b in batches) / m, context_tokens=sum(b[2] for b in batches) / m)


def roles(sim: Simulation, now: float) -> None:
    """The controller's period: the role policy on the measured demand, then one worker changes."""
    live = [w for w in sim.decodes if w.up and not w.gone]
    measured = demand(sim, now)                           # sampled every period, as the controller does
    if now - sim.start_s >= sim.role_config.window_s:     # once a window's demand is measured
        d, sim.role_state = decide_roles(sim.perf, measured, len(live), sim.role_state, now,
                                         sim.slo.ttft_s, sim.slo.tpot_s, sim.role_config)
        if d.changed:
            apply(live, d)
            sim.role_log.append(d)
    if sim.done + len(sim.unsent) < len(sim.seqs):
        sim.push(now + sim.role_config.period_s, "roles")


def apply(live: list[SimDecodeWorker], d: RoleDecision) -> None:
    """Lend the decode worker with the fewest sequences to prefill, or return the prefill worker
    with the shortest queue to decode (ties: the smallest id)."""
    if d.prefill_workers > d.previous:
        pick = min((w for w in live if w.role == DECODE), key=lambda w: (w.load(), w.wid))
        pick.role = PREFILL
    else:
        pick = min((w for w in live if w.role == PREFILL), key=lambda w: (w.local_queued(), w.wid))
        pick.role = DECODE


def new_state() -> tuple[RoleState, deque, list, deque]:
    """The simulation's role state, admitted prompts, role log and decode-batch samples."""
    return RoleState(0), deque(), [], deque()
