"""The adaptive layout in the simulation: every worker decodes and prefills (the engine's mixed
step), and the controller's role policy lends some of them to prefill only, with hysteresis. Each
request's prompt goes where tandem.placement's `choose_prefill` predicts the most headroom inside
both SLOs: its decode worker's own chunks (at the chunk size picked), or another worker that ships
the KV when done. The role policy runs as the live controller's period does (cluster.pools
`maybe_roles`): cluster.roles' `prompt_counters`, `demand_over`, `decide_roles` and `role_move` on
the `WorkerEntry` each simulated worker reports. The same functions the router and the controller
call, on what the simulation knows of its workers."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from tandem.cluster.roles import PromptCounters, RoleDecision, RoleState, role_period
from tandem.placement import LOCAL, EngineLoad, choose_prefill, has_slack, prefill_options

if TYPE_CHECKING:
    from tandem.cluster.sim_engine import Simulation
    from tandem.cluster.sim_workers import SimDecodeWorker, SimSeq

PREFILL, MIXED = "prefill", "mixed"   # the roles the policy gives (WorkerEntry.role)


def load_of(w: SimDecodeWorker) -> EngineLoad:
    return EngineLoad(len(w.running), sum(s.context for s in w.running), w.local_queued())


def place(sim: Simulation, w: SimDecodeWorker, s: SimSeq, hit: int, now: float) -> None:
    """An admitted request's prefill: local chunks on `w`, or another worker's, by the cost model."""
    r, perf = s.spec, sim.perf
    others = {x.name: (load_of(x), x.cache.hit(r)) for x in sim.decodes
              if x is not w and x.up and not x.gone and has_slack(load_of(x), x.role == PREFILL, load_of(w))}
    best = choose_prefill(prefill_options(perf, r.input_tokens, w.name, load_of(w), hit, others),
                          sim.slo.ttft_s, sim.slo.tpot_s)
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


def roles(sim: Simulation, now: float) -> None:
    """The controller's period, the live one (cluster.roles `role_period`, as cluster.pools
    `maybe_roles` runs it) on what the simulated workers report: when the policy moves, the worker
    `role_move` picks changes role."""
    cfg, perf = sim.role_config, sim.perf
    live = [e for e in (w.entry(now, perf) for w in sim.decodes if not w.gone)
            if e.state == "ready" and e.stats is not None]
    d, sim.role_state, move = role_period(sim.role_samples, live, now, perf.block_tokens, perf, sim.role_state,
                                          sim.slo.ttft_s, sim.slo.tpot_s, cfg)
    if move is not None:
        wid, role = move
        next(w for w in sim.decodes if w.name == wid).role = role
        sim.role_log.append(d)
    if sim.done + len(sim.unsent) < len(sim.seqs):
        sim.push(now + cfg.period_s, "roles")


def new_state() -> tuple[RoleState, deque[PromptCounters], list[RoleDecision]]:
    """The simulation's role state, prompt-counter samples over the window, and role log."""
    return RoleState(), deque(), []
