"""Autoscaling policy: a pure function from a metrics snapshot to the two pools' target sizes.

`decide(snapshot, config, state, now) -> Decision`. No clock, no I/O, no Ray: the controller gathers
a `MetricsSnapshot` every `config.period_s`, calls `decide`, keeps `Decision.state` for the next call
and creates or drains actors to reach the targets. Each pool is sized from its own signals only:

- prefill: prompt tokens waiting and arriving against per-worker throughput; TTFT against its target;
- decode: KV blocks held and sequences against per-worker capacity; TPOT against its target.
A pool's signals are those of the part it is named for, wherever that part is served now: a worker
lent to the other role counts in that role's load (cluster.pools.build_snapshot), in its pool's size.

The steps, in order (each a small function below):
  want (per pool, up and down thresholds) -> step limits -> delay -> min/max -> prefill:decode ratio
  -> the budget of workers both pools share (`max_workers`, the GPUs: `fit_budget`).
Scale-up and scale-down use different thresholds (a dead band), and a change must be wanted for the
whole delay before it happens, so a steady load settles on one size and stays there.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from tandem.runtime.latency import DEFAULT_WINDOW_S
from tandem.wire.errors import ConfigError

_EPS = 1e-9
PERCENTILES = ("p50", "p90", "p99")


def _ceil(x: float) -> int:
    # ceil that forgives float noise: 2.0000000001 workers is 2 workers
    return max(0, math.ceil(x - _EPS))


@dataclass(frozen=True)
class PrefillMetrics:
    size: int  # live actors taking new work (draining ones excluded)
    draining: int = 0
    queued_prompt_tokens: int = 0  # uncached prompt tokens waiting for a prefill actor
    running_prompt_tokens: int = 0  # uncached prompt tokens being prefilled now
    prompt_tokens_per_s: float = 0.0  # arrival rate of uncached prompt tokens sent to prefill-only workers
    prefill_tokens_per_s_per_worker: float | None = None  # measured; None: config's default
    # TTFT as this pool controls it: from the request reaching the prefill pool to its KV ready on
    # the decode actor (queue + compute + transfer). Time spent waiting for a decode slot before
    # that belongs to the decode pool's signals, so the controller must leave it out.
    # Seconds, over the controller's window; None: no samples.
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    ttft_p99: float | None = None


@dataclass(frozen=True)
class DecodeMetrics:
    size: int  # live actors taking new work (draining ones excluded)
    draining: int = 0
    running_seqs: int = 0
    waiting_seqs: int = 0  # routed here, not yet admitted (no batch slot or no KV)
    # Blocks held by running and waiting sequences on the workers decoding now. Evictable blocks of
    # the prefix cache do NOT count (they fill any idle memory); report them in kv_blocks_cached.
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0  # of the `size` actors: kv_blocks_total / size is one worker's KV
    kv_blocks_waiting: int = 0  # blocks the waiting sequences will need once admitted
    kv_blocks_cached: int = 0  # informational only
    tpot_p50: float | None = None
    tpot_p90: float | None = None
    tpot_p99: float | None = None
    max_seqs_per_worker: int | None = None  # None: config's default


@dataclass(frozen=True)
class MetricsSnapshot:
    prefill: PrefillMetrics
    decode: DecodeMetrics


@dataclass(frozen=True)
class AutoscalerConfig:
    prefill_min: int = 1  # 0 is allowed: decode actors then prefill everything themselves
    prefill_max: int = 8
    decode_min: int = 1
    decode_max: int = 8
    min_ratio: float | None = None  # lower bound on prefill/decode; None: unbounded
    max_ratio: float | None = None  # upper bound on prefill/decode; None: unbounded
    # Workers both pools may hold together (one GPU each): a pool's growth never takes the GPU the
    # other pool needs, and workers a pool holds beyond its need go to the other when it needs them.
    # None: each pool bounded only by its own max.
    max_workers: int | None = None
    ttft_target_s: float = 2.0
    tpot_target_s: float = 0.05
    slo_percentile: str = "p90"  # which percentile of TTFT/TPOT is held to the target
    # Scale down only while the SLO percentile is below this fraction of its target (dead band).
    slo_low_fraction: float = 0.5
    # One SLO reading may multiply a pool by at most this much (before step limits).
    max_slo_factor: float = 2.0
    # Compute utilization bands: grow when the load would put workers above `high_utilization`,
    # shrink only when the smaller pool would still run below `low_utilization`.
    high_utilization: float = 0.8
    low_utilization: float = 0.5
    kv_high_watermark: float = 0.85  # grow decode when held KV would exceed this fraction
    kv_low_watermark: float = 0.5  # shrink decode only if the smaller pool stays below this
    upscale_delay_s: float = 15.0  # a scale-up must be wanted this long before it happens
    downscale_delay_s: float = 180.0  # a scale-down must be wanted this long before it happens
    max_step_up: int = 2  # workers added to one pool per decision
    max_step_down: int = 1  # workers removed from one pool per decision
    period_s: float = 5.0  # how often the controller calls decide()
    # the span of recent requests each worker's TTFT and TPOT percentiles cover (its reports): how
    # long a burst's slow requests keep counting, and so keep a pool grown
    latency_window_s: float = DEFAULT_WINDOW_S
    # Defaults for per-worker capacity when the snapshot has no measurement.
    prefill_tokens_per_s_per_worker: float = 8000.0
    max_seqs_per_worker: int = 256

    def __post_init__(self) -> None:
        def fail(msg: str) -> None:
            raise ConfigError(f"autoscaler: {msg}")

        if self.prefill_min < 0 or self.decode_min < 1:
            fail(f"prefill_min must be >= 0 and decode_min >= 1, got {self.prefill_min}, {self.decode_min}")
        if self.prefill_max < self.prefill_min or self.decode_max < self.decode_min:
            fail("each pool's max must be >= its min")
        for name in ("min_ratio", "max_ratio"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                fail(f"{name} must be > 0 or null, got {v}")
        if self.min_ratio is not None and self.max_ratio is not None and self.min_ratio > self.max_ratio:
            fail(f"min_ratio ({self.min_ratio}) must be <= max_ratio ({self.max_ratio})")
        for name in ("ttft_target_s", "tpot_target_s", "period_s", "prefill_tokens_per_s_per_worker",
                     "latency_window_s"):
            if not getattr(self, name) > 0:
                fail(f"{name} must be > 0, got {getattr(self, name)}")
        if self.slo_percentile not in PERCENTILES:
            fail(f"slo_percentile must be one of {PERCENTILES}, got {self.slo_percentile!r}")
        if not 0 < self.slo_low_fraction < 1:
            fail("slo_low_fraction must be in (0, 1)")
        if not self.max_slo_factor > 1:
            fail("max_slo_factor must be > 1")
        if not 0 < self.low_utilization < self.high_utilization <= 1:
            fail("need 0 < low_utilization < high_utilization <= 1")
        if not 0 < self.kv_low_watermark < self.kv_high_watermark <= 1:
            fail("need 0 < kv_low_watermark < kv_high_watermark <= 1")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            fail("delays must be >= 0")
        if self.max_step_up < 1 or self.max_step_down < 1 or self.max_seqs_per_worker < 1:
            fail("max_step_up, max_step_down and max_seqs_per_worker must be >= 1")
        if self.max_workers is not None and self.max_workers < self.prefill_min + self.decode_min:
            fail(f"max_workers ({self.max_workers}) must hold prefill_min + decode_min "
                 f"({self.prefill_min + self.decode_min})")
        if not feasible_pairs(self):
            fail(f"no prefill:decode pair within prefill [{self.prefill_min}, {self.prefill_max}], "
                 f"decode [{self.decode_min}, {self.decode_max}] meets ratio bounds "
                 f"[{self.min_ratio}, {self.max_ratio}]"
                 + (f" within max_workers {self.max_workers}" if self.max_workers is not None else ""))

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "AutoscalerConfig":
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"autoscaler: unknown key(s) {sorted(unknown)}; known: {sorted(names)}")
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"autoscaler: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def ratio_ok(p: int, d: int, cfg: AutoscalerConfig) -> bool:
    if cfg.min_ratio is not None and p < cfg.min_ratio * d - _EPS:
        return False
    return cfg.max_ratio is None or p <= cfg.max_ratio * d + _EPS


def feasible_pairs(cfg: AutoscalerConfig) -> list[tuple[int, int, int]]:
    """(decode, lowest prefill, highest prefill) for each decode size that some in-bounds prefill size
    pairs with inside the ratio bounds and the workers' budget."""
    out = []
    for d in range(cfg.decode_min, cfg.decode_max + 1):
        lo, hi = cfg.prefill_min, cfg.prefill_max
        if cfg.max_workers is not None:
            hi = min(hi, cfg.max_workers - d)
        if cfg.min_ratio is not None:
            lo = max(lo, _ceil(cfg.min_ratio * d))
        if cfg.max_ratio is not None:
            hi = min(hi, math.floor(cfg.max_ratio * d + _EPS))
        if lo <= hi:
            out.append((d, lo, hi))
    return out


@dataclass(frozen=True)
class PoolState:
    target: int | None = None  # last decided target; None before the first decision
    up_since: float | None = None  # when a scale-up started being wanted without a break
    down_since: float | None = None


@dataclass(frozen=True)
class PolicyState:
    prefill: PoolState = field(default_factory=PoolState)
    decode: PoolState = field(default_factory=PoolState)


@dataclass(frozen=True)
class Decision:
    prefill_target: int
    decode_target: int
    state: PolicyState
    reasons: list[str]


@dataclass(frozen=True)
class Want:
    """What one pool's own signals ask for.

    `up`: the size the scale-up thresholds need. `down`: the smallest size that would still sit under
    the (lower) scale-down thresholds, so down >= up; None when an SLO forbids shrinking now.
    """
    up: int
    down: int | None
    why: str


def _slo_term(size: int, value: float | None, target: float, cfg: AutoscalerConfig,
              name: str) -> tuple[int, bool, str]:
    """(workers the SLO asks for, whether it allows shrinking, text)."""
    if value is None:
        return 0, True, f"no {name} samples"
    text = f"{name} {cfg.slo_percentile} {value:.3g} s vs target {target:.3g} s"
    if value > target:
        factor = min(value / target, cfg.max_slo_factor)
        return max(size + 1, _ceil(max(size, 1) * factor)), False, text + " (over)"
    return 0, value < cfg.slo_low_fraction * target, text


def prefill_want(m: PrefillMetrics, cfg: AutoscalerConfig) -> Want:
    cap = m.prefill_tokens_per_s_per_worker or cfg.prefill_tokens_per_s_per_worker
    backlog = m.queued_prompt_tokens + m.running_prompt_tokens
    # Workers kept 100 % busy: by the arrival rate, and by draining the backlog within the TTFT target.
    arrival_load = m.prompt_tokens_per_s / cap
    backlog_load = backlog / (cap * cfg.ttft_target_s)
    load = max(arrival_load, backlog_load)
    up, down = _ceil(load / cfg.high_utilization), _ceil(load / cfg.low_utilization)
    slo_up, slo_allows_down, slo_text = _slo_term(
        m.size, getattr(m, f"ttft_{cfg.slo_percentile}"), cfg.ttft_target_s, cfg, "TTFT")
    why = (f"{backlog} tokens waiting = {backlog / cap:.2f} s of work and {m.prompt_tokens_per_s:.0f} tok/s "
           f"arriving, at {cap:.0f} tok/s per worker -> {load:.2f} workers busy; {slo_text}")
    return Want(max(up, slo_up), down if slo_allows_down else None, why)


def decode_want(m: DecodeMetrics, cfg: AutoscalerConfig) -> Want:
    kv_load = 0.0  # in workers' worth of KV, held plus wanted by waiting sequences
    if m.size > 0 and m.kv_blocks_total > 0:
        kv_load = (m.kv_blocks_used + m.kv_blocks_waiting) / (m.kv_blocks_total / m.size)
    seq_cap = m.max_seqs_per_worker or cfg.max_seqs_per_worker
    seqs = m.running_seqs + m.waiting_seqs
    seq_load = seqs / seq_cap
    up = max(_ceil(kv_load / cfg.kv_high_watermark), _ceil(seq_load / cfg.high_utilization))
    down = max(_ceil(kv_load / cfg.kv_low_watermark), _ceil(seq_load / cfg.low_utilization))
    slo_up, slo_allows_down, slo_text = _slo_term(
        m.size, getattr(m, f"tpot_{cfg.slo_percentile}"), cfg.tpot_target_s, cfg, "TPOT")
    kv_frac = m.kv_blocks_used / m.kv_blocks_total if m.kv_blocks_total else 0.0
    why = (f"KV {kv_frac:.0%} used, {kv_load:.2f} workers' worth with waiting seqs; "
           f"{m.running_seqs} running + "
           f"{m.waiting_seqs} waiting seqs at {seq_cap} per worker; {slo_text}")
    return Want(max(up, slo_up), down if slo_allows_down else None, why)


def propose(current: int, want: Want) -> int:
    """Grow to `want.up` if above; shrink to `want.down` if below; otherwise hold (the dead band)."""
    if want.up > current:
        return want.up
    if want.down is not None and want.down < current:
        return want.down
    return current


def limit_step(current: int, desired: int, cfg: AutoscalerConfig) -> int:
    return max(current - cfg.max_step_down, min(current + cfg.max_step_up, desired))


def apply_delay(current: int, proposed: int, ps: PoolState, cfg: AutoscalerConfig,
                now: float) -> tuple[int, PoolState, str]:
    """Let a change through only once it has been wanted, in the same direction, for its delay."""
    if proposed == current:
        return current, PoolState(current), ""
    up = proposed > current
    since = (ps.up_since if up else ps.down_since)
    since = now if since is None else since
    delay = cfg.upscale_delay_s if up else cfg.downscale_delay_s
    waited = now - since
    if waited + _EPS >= delay:
        return proposed, PoolState(proposed), ""
    new = PoolState(current, up_since=since if up else None, down_since=None if up else since)
    direction = "up" if up else "down"
    return current, new, f"wants {proposed}, {direction} for {waited:.0f} s of {delay:.0f} s delay"


def clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, n))


def apply_ratio(p: int, d: int, cfg: AutoscalerConfig) -> tuple[int, int]:
    """Meet the prefill:decode ratio bounds, starting from in-bounds sizes `p`, `d`.

    Conflict rule: prefer adding workers to the side that is short (capacity over cost); cut a pool
    below what its own signals asked for only when the other pool's max forbids adding, and then by
    as few workers as possible. Ties go to the smaller total. The result is always within min/max.
    """
    if ratio_ok(p, d, cfg):
        return p, d

    def cost(pair: tuple[int, int]) -> tuple[int, int, int, int]:
        pp, dd = pair
        shortfall = max(0, p - pp) + max(0, d - dd)
        added = max(0, pp - p) + max(0, dd - d)
        return shortfall, added, pp + dd, pp
    # For each decode size the prefill size closest to `p` is the best one, so one pass suffices.
    return min(((clamp(p, lo, hi), dd) for dd, lo, hi in feasible_pairs(cfg)), key=cost)


def fit_budget(p: int, d: int, need: tuple[int, int], current: tuple[int, int],
               cfg: AutoscalerConfig) -> tuple[int, int]:
    """Keep prefill + decode within `cfg.max_workers`, from targets `p`, `d` (each within its own
    bounds), what each pool's signals need (`Want.up`, within bounds) and the sizes it has now.

    Each pool first keeps what it needs (no more than its target). If both needs fit, what is left
    keeps the workers a pool holds beyond its need (a scale-down waiting out its delay), decode's
    first (they hold live sessions' KV): so a pool that no longer needs a worker gives it up at once
    to the other pool when that one needs it. If the needs do not fit, no pool is cut below what it
    has, and the GPUs left go one at a time to the pool furthest short of its need, relative to its
    size."""
    budget = cfg.max_workers
    if budget is None or p + d <= budget:
        return p, d
    keep_p = min(p, max(need[0], cfg.prefill_min))
    keep_d = min(d, max(need[1], cfg.decode_min))
    if keep_p + keep_d <= budget:
        room = budget - keep_p - keep_d
        d2 = keep_d + min(d - keep_d, room)
        return keep_p + min(p - keep_p, budget - keep_p - d2), d2
    base_p = max(cfg.prefill_min, min(keep_p, current[0]))
    base_d = max(cfg.decode_min, min(keep_d, current[1]))
    while base_p + base_d > budget:            # the budget was lowered under running pools
        if base_p - cfg.prefill_min >= base_d - cfg.decode_min and base_p > cfg.prefill_min:
            base_p -= 1
        else:
            base_d -= 1
    for _ in range(budget - base_p - base_d):
        short_p = (keep_p - base_p) / max(base_p, 1)
        short_d = (keep_d - base_d) / max(base_d, 1)
        if short_p <= 0 and short_d <= 0:
            break
        if short_p > short_d:
            base_p += 1
        else:
            base_d += 1
    return base_p, base_d


def decide(snapshot: MetricsSnapshot, config: AutoscalerConfig, state: PolicyState,
           now: float) -> Decision:
    """The two pools' targets for this period. Call every `config.period_s` with the state the
    previous call returned (a fresh `PolicyState()` at start: the live sizes are the baseline)."""
    cfg = config
    reasons: list[str] = []
    targets: dict[str, int] = {}
    states: dict[str, PoolState] = {}
    needs: dict[str, int] = {}
    currents: dict[str, int] = {}
    pools = (("prefill", snapshot.prefill, prefill_want, cfg.prefill_min, cfg.prefill_max),
             ("decode", snapshot.decode, decode_want, cfg.decode_min, cfg.decode_max))
    for name, metrics, want_fn, lo, hi in pools:
        ps: PoolState = getattr(state, name)
        current = metrics.size if ps.target is None else ps.target
        want = want_fn(metrics, cfg)
        stepped = limit_step(current, propose(current, want), cfg)
        delayed, ps, wait_note = apply_delay(current, stepped, ps, cfg, now)
        target = clamp(delayed, lo, hi)
        targets[name], states[name] = target, dataclasses.replace(ps, target=target)
        needs[name], currents[name] = clamp(want.up, lo, hi), current
        move = f"{current} -> {target}" if target != current else f"holds at {current}"
        notes = [n for n in (wait_note, f"bounds [{lo}, {hi}]" if target != delayed else "") if n]
        reasons.append(f"{name} {move}: {want.why}" + "".join(f"; {n}" for n in notes))

    p, d = fit_budget(targets["prefill"], targets["decode"], (needs["prefill"], needs["decode"]),
                      (currents["prefill"], currents["decode"]), cfg)
    if (p, d) != (targets["prefill"], targets["decode"]):
        reasons.append(f"budget of {cfg.max_workers} workers moves prefill:decode "
                       f"{targets['prefill']}:{targets['decode']} -> {p}:{d} (needs "
                       f"{needs['prefill']}:{needs['decode']}, had {currents['prefill']}:{currents['decode']})")
    p2, d2 = apply_ratio(p, d, cfg)
    if (p2, d2) != (p, d):
        reasons.append(f"ratio bounds [{cfg.min_ratio}, {cfg.max_ratio}] move prefill:decode "
                       f"{p}:{d} -> {p2}:{d2}")
    p, d = p2, d2
    if (p, d) != (targets["prefill"], targets["decode"]):
        states["prefill"] = dataclasses.replace(states["prefill"], target=p)
        states["decode"] = dataclasses.replace(states["decode"], target=d)
    return Decision(p, d, PolicyState(states["prefill"], states["decode"]), reasons)
