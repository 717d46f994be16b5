"""How many workers only prefill, with hysteresis: the controller's role decisions (and the
simulator's, which runs this same policy). The prediction is tandem.placement's `plan_roles`, on the
one PerfModel; this module only decides when to act on it. Pure: the caller passes the clock.

Rules, in order:
1. a change holds at least `min_hold_s` (no flapping: a worker lent to prefill stays lent);
2. the plan's best split must beat the current split's predicted headroom by `margin`, unless the
   current split misses an SLO the best one meets (then any gain is enough);
3. one worker changes role per decision, toward the best split.
Every decision names its reason, for `tandem status`, the Admin API and metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.placement import Demand, RoleOption, plan_roles


@dataclass(frozen=True)
class RoleConfig:
    min_hold_s: float = 20.0     # a role change holds at least this long
    margin: float = 0.1          # headroom gain (fraction of an SLO) a change must bring
    period_s: float = 2.0        # how often the controller decides


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
    rescue = current.headroom < 0 <= best.headroom
    if gain < cfg.margin and not rescue:
        return keep(f"gain {gain:.2f} below margin {cfg.margin:g}")
    k = cur_k + (1 if best.prefill_workers > cur_k else -1)
    why = (f"{'lend a worker to prefill' if k > cur_k else 'return a prefill worker to decode'}: "
           f"predicted headroom {current.headroom:.2f} -> {best.headroom:.2f} with {best.prefill_workers} "
           f"prefill-only (TTFT {best.ttft_s * 1e3:.0f} ms, TPOT {best.tpot_s * 1e3:.1f} ms)")
    return RoleDecision(now, k, cur_k, why, best, current), RoleState(k, now)
