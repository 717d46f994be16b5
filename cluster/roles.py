"""How many workers only prefill, with hysteresis: the controller's role decisions (and the
simulator's, which runs this same policy). The prediction is tandem.placement's `plan_roles`, on the
one PerfModel; this module only decides when to act on it. Pure: the caller passes the clock.

Rules, in order:
1. a change holds at least `min_hold_s` (no flapping: a worker lent to prefill stays lent);
2. the plan's best split must beat the current split's predicted headroom by `margin`, even when
   the current split is predicted to miss an SLO: a role change costs the lent worker's decode
   batch and prefix cache (its sessions move), which the plan does not price, and a prediction a
   few percent either side of an SLO is within the model's error (simulated on the agent grid,
   lending on any gain that crossed the SLO cost 6-14% goodput at TPOT 15 ms on 4 GPUs);
3. one worker changes role per decision, toward the best split.
Every decision names its reason, for `tandem status`, the Admin API and metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tandem.placement import Demand, RoleOption, plan_roles
from tandem.wire.errors import ConfigError


@dataclass(frozen=True)
class RoleConfig:
    """The `roles:` section of a cluster config. `enabled`: the adaptive layout's role policy runs
    (`tandem up --layout adaptive` turns it on with the router's cost placement)."""

    enabled: bool = False
    min_hold_s: float = 20.0     # a role change holds at least this long
    margin: float = 0.1          # headroom gain (fraction of an SLO) a change must bring
    period_s: float = 2.0        # how often the controller decides
    # the demand is measured over this window, and nothing moves until one has passed (the first
    # seconds of a run are every session's first prompt: a burst no split should be cut for)
    window_s: float = 30.0

    def __post_init__(self) -> None:
        if self.min_hold_s < 0 or self.margin < 0 or not self.period_s > 0 or not self.window_s > 0:
            raise ConfigError("roles: min_hold_s and margin must be >= 0, period_s and window_s > 0")


@dataclass(frozen=True)
class RoleDecision:
    time_s: float
    prefill_workers: int        # prefill-only workers after this decision
    previous: int
    reason: str
    best: RoleOption
    current: RoleOption

    @property
    def changed(self) -> bool:
        return self.prefill_workers != self.previous


@dataclass(frozen=True)
class RoleState:
    prefill_workers: int = 0
    changed_at_s: float = -math.inf


def decide_roles(perf, demand: Demand, workers: int, state: RoleState, now: float, slo_ttft_s: float,
                 slo_tpot_s: float, cfg: RoleConfig = RoleConfig()) -> tuple[RoleDecision, RoleState]:
    """The next number of prefill-only workers among `workers` (see the module docstring)."""
    plans = plan_roles(perf, demand, workers, slo_ttft_s, slo_tpot_s)
    best = plans[0]
    cur_k = min(state.prefill_workers, workers - 1)
    current = next(o for o in plans if o.prefill_workers == cur_k)

    def keep(reason: str) -> tuple[RoleDecision, RoleState]:
        return RoleDecision(now, cur_k, cur_k, reason, best, current), RoleState(cur_k, state.changed_at_s)

    if best.prefill_workers == cur_k:
        return keep("current split is the best predicted")
    if now - state.changed_at_s < cfg.min_hold_s:
        return keep(f"held: last change {now - state.changed_at_s:.1f}s ago < {cfg.min_hold_s:g}s")
    gain = best.headroom - current.headroom
    if gain < cfg.margin:
        return keep(f"gain {gain:.2f} below margin {cfg.margin:g}")
    k = cur_k + (1 if best.prefill_workers > cur_k else -1)
    why = (f"{'lend a worker to prefill' if k > cur_k else 'return a prefill worker to decode'}: "
           f"predicted headroom {current.headroom:.2f} -> {best.headroom:.2f} with {best.prefill_workers} "
           f"prefill-only (TTFT {best.ttft_s * 1e3:.0f} ms, TPOT {best.tpot_s * 1e3:.1f} ms)")
    return RoleDecision(now, k, cur_k, why, best, current), RoleState(k, now)


# ---- the live controller's inputs and moves -----------------------------------------------------
@dataclass(frozen=True)
class PromptCounters:
    """The cluster at one moment: its prompt counters (for rates between two moments) and its
    decode batch (averaged over the moments of a window)."""

    at: float = 0.0
    computed: int = 0
    completed: int = 0
    completed_tokens: int = 0
    decode_seqs: int = 0
    context_tokens: int = 0


def prompt_counters(workers, now: float, block_size: int) -> PromptCounters:
    """The cluster now, from the ready workers' latest stats (WorkerEntry)."""
    stats = [w.stats for w in workers if w.stats is not None]
    return PromptCounters(now, sum(s.prompt_tokens_computed for s in stats), sum(s.prompts_completed for s in stats),
                          sum(s.prompt_tokens_completed for s in stats), sum(s.running for s in stats),
                          sum(s.kv_blocks_used for s in stats) * block_size)


def demand_over(samples) -> Demand:
    """The demand the role policy plans for, over a window of samples (oldest first): the prompt
    tokens computed per second from the first to the last and their mean size, and the decode
    batch and its KV averaged over the samples (one moment's batch, 2 or 3 sequences either way,
    decided a lend near the margin on a live CPU cluster)."""
    prev, cur = samples[0], samples[-1]
    computed = max(0, cur.computed - prev.computed)
    done = max(0, cur.completed - prev.completed)
    rate = computed / (cur.at - prev.at) if cur.at > prev.at else 0.0
    new = computed / done if done else 0.0
    prompt = max(0, cur.completed_tokens - prev.completed_tokens) / done if done else 0.0
    n = len(samples)
    return Demand(rate, new, prompt, decode_seqs=sum(x.decode_seqs for x in samples) / n,
                  context_tokens=sum(x.context_tokens for x in samples) / n)


def role_move(workers, d: RoleDecision) -> tuple[str, str]:
    """(worker id, new role) that carries out `d` among the ready workers (WorkerEntry): lend the
    worker that decodes the fewest sequences to prefill, or give the prefill-only worker with the
    fewest queued prompt tokens back to decoding ("mixed": it prefills for others with slack too).
    Ties: the smallest id."""
    if d.prefill_workers > d.previous:
        pick = min((w for w in workers if w.role != "prefill"), key=lambda w: (w.stats.running, w.worker_id))
        return pick.worker_id, "prefill"
    pick = min((w for w in workers if w.role == "prefill"),
               key=lambda w: (w.stats.queued_prompt_tokens, w.worker_id))
    return pick.worker_id, "mixed"


def role_period(samples, live, now: float, block_size: int, perf, state: RoleState, slo_ttft_s: float,
                slo_tpot_s: float, cfg: RoleConfig) -> tuple[RoleDecision | None, RoleState, tuple[str, str] | None]:
    """One period of the controller's role policy (the live controller's and the simulator's):
    sample `prompt_counters` of the ready workers (WorkerEntry) into `samples` (a deque, kept to
    `cfg.window_s`), and once a window is measured over at least two workers, decide on its
    `demand_over` with the current split read from the workers' roles. -> (the decision, None
    before a window; the state to keep; `role_move`'s (worker id, new role) when it changed)."""
    samples.append(prompt_counters(live, now, block_size))
    while len(samples) > 1 and samples[1].at <= now - cfg.window_s:
        samples.popleft()
    if len(live) < 2 or now - samples[0].at < cfg.window_s:     # a window's demand not measured yet
        return None, state, None
    state = replace(state, prefill_workers=sum(w.role == "prefill" for w in live))
    d, state = decide_roles(perf, demand_over(samples), len(live), state, now, slo_ttft_s, slo_tpot_s, cfg)
    return d, state, role_move(live, d) if d.changed else None
