"""The simulator's inputs and outputs: the fitted service times (`PerfModel`), the SLO, the request
shape it replays (`RequestLike`) and the results it reports (per request, per run, pool sizes over
time). Plain values only; cluster/sim_engine.py runs the simulation."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, Sequence

import numpy as np

from tandem.wire.errors import ConfigError


class RequestLike(Protocol):  # cluster.workloads.RequestSpec has these fields
    session_id: str
    turn: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    shared_prefix_tokens: int
    hash_ids: tuple[int, ...]
    hash_block_tokens: int


@dataclass(frozen=True)
class PerfModel:
    """Fitted service times. Defaults: an ASSUMED Llama-3-8B on one H200 (bf16), see docs/operations.md.

    prefill s     = prefill_base_s + prefill_per_token_s * n + prefill_attn_s * n * context
                    (n: tokens computed, context: prompt length once they are in)
    decode step s = decode_base_s + decode_per_seq_s * batch + decode_per_ctx_token_s * sum(context)
    transfer s    = transfer_base_s + transfer_per_token_s * tokens
    control path  = request_overhead_s on every request's client-visible times (router, actor
                    RPCs, streaming), + remote_overhead_s before a remote prefill's KV is usable
                    (RPCs to the prefill actor, the decode step after the KV lands); both fitted
                    on a running cluster by `tandem profile --target` (fit_control_path)
    """
    prefill_base_s: float = 0.005
    prefill_per_token_s: float = 1 / 12000
    prefill_attn_s: float = 1.3e-9
    decode_base_s: float = 0.012
    decode_per_seq_s: float = 1e-4
    decode_per_ctx_token_s: float = 3e-8
    transfer_base_s: float = 0.0005
    transfer_per_token_s: float = 2.6e-6
    request_overhead_s: float = 0.0
    remote_overhead_s: float = 0.0
    local_prefill_threshold: float = 256  # uncached tokens a decode worker prefills itself
    # prefill.max_queued_tokens: prompt tokens queued on a prefill worker past which requests are
    # prefilled by their decode worker instead (the router's rule); inf: always remote
    prefill_queue_limit: float = math.inf
    max_batch: int = 256  # sequences per decode worker
    max_step_tokens: int = 2048  # tokens per decode step (decodes + local prefill chunks)
    kv_capacity_tokens: int = 700_000  # KV per worker (decode: running + prefix cache)
    block_tokens: int = 16  # prefix-cache granularity

    def __post_init__(self) -> None:
        coeffs = ("prefill_base_s", "prefill_per_token_s", "prefill_attn_s", "decode_base_s",
                  "decode_per_seq_s", "decode_per_ctx_token_s", "transfer_base_s", "transfer_per_token_s",
                  "request_overhead_s", "remote_overhead_s")
        if any(getattr(self, c) < 0 for c in coeffs) or self.local_prefill_threshold < 0:
            raise ConfigError("perf model: coefficients and local_prefill_threshold must be >= 0")
        if not self.prefill_queue_limit > 0:
            raise ConfigError("perf model: prefill_queue_limit must be > 0 (inf: no limit)")
        if min(self.max_batch, self.max_step_tokens, self.kv_capacity_tokens, self.block_tokens) < 1:
            raise ConfigError("perf model: max_batch, max_step_tokens, kv_capacity_tokens and "
                              "block_tokens must be >= 1")

    def prefill_s(self, n: int, context: int) -> float:
        if not n:
            return 0.0
        return self.prefill_base_s + n * (self.prefill_per_token_s + self.prefill_attn_s * context)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return (self.decode_base_s + self.decode_per_seq_s * batch
                + self.decode_per_ctx_token_s * context_tokens)

    def transfer_s(self, tokens: int) -> float:
        return self.transfer_base_s + self.transfer_per_token_s * tokens if tokens else 0.0

    @classmethod
    def fit(cls, samples: Iterable[tuple[str, Sequence[float] | dict[str, float], float]],
            base: "PerfModel | None" = None, **fixed: Any) -> "PerfModel":
        """Least squares from profiling samples `(kind, features, seconds)`:
        ("prefill", (new_tokens, context), s), ("decode", (batch_size, total_context_tokens), s),
        ("transfer", (tokens,), s); features may also be dicts with those names. Kinds without
        samples keep `base`'s coefficients; negative fits are clipped to 0; `fixed` sets the rest."""
        names = {"prefill": ("new_tokens", "context"), "decode": ("batch_size", "total_context_tokens"),
                 "transfer": ("tokens",)}
        rows: dict[str, list[tuple[list[float], float]]] = {k: [] for k in names}
        for kind, feats, seconds in samples:
            if kind not in names:
                raise ValueError(f"unknown sample kind {kind!r}; expected one of {sorted(names)}")
            f = [feats[n] for n in names[kind]] if isinstance(feats, dict) else list(feats)
            x = {"prefill": lambda: [1.0, f[0], f[0] * f[1]],
                 "decode": lambda: [1.0, f[0], f[1]],
                 "transfer": lambda: [1.0, f[0]]}[kind]()
            rows[kind].append((x, float(seconds)))
        fields = {"prefill": ("prefill_base_s", "prefill_per_token_s", "prefill_attn_s"),
                  "decode": ("decode_base_s", "decode_per_seq_s", "decode_per_ctx_token_s"),
                  "transfer": ("transfer_base_s", "transfer_per_token_s")}
        values: dict[str, Any] = {}
        for kind, data in rows.items():
            if not data:
                continue
            a = np.array([x for x, _ in data], dtype=np.float64)
            y = np.array([s for _, s in data], dtype=np.float64)
            scale = np.maximum(np.abs(a).max(axis=0), 1e-30)  # columns span 1 .. 1e9: normalize
            coef = np.linalg.lstsq(a / scale, y, rcond=None)[0] / scale
            values.update({name: max(0.0, float(c)) for name, c in zip(fields[kind], coef)})
        return dataclasses.replace(base or cls(), **values, **fixed)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for key in _MAYBE_INF:
            if math.isinf(d[key]):
                d[key] = "inf"  # JSON has no infinity
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PerfModel":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"perf model: unknown key(s) {sorted(unknown)}")
        d = dict(d)
        for key in _MAYBE_INF:
            if isinstance(d.get(key), str):
                d[key] = float(d[key])
        return cls(**d)


_MAYBE_INF = ("local_prefill_threshold", "prefill_queue_limit")


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 2.0
    tpot_s: float = 0.05


@dataclass(frozen=True)
class RequestResult:
    session_id: str
    turn: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int  # prompt tokens not computed (prefix-cache hits)
    prefill: str  # "remote" | "local" | "rejected" (prompt + output exceed a worker's KV)
    ttft_s: float | None
    tpot_s: float | None  # None when output_tokens == 1 or rejected
    e2e_s: float | None


@dataclass(frozen=True)
class PoolSample:
    time_s: float
    prefill_live: int
    decode_live: int
    prefill_target: int
    decode_target: int
    prefill_draining: int = 0
    decode_draining: int = 0


@dataclass(frozen=True)
class SimSummary:
    label: str
    prefill: int  # initial pool sizes (colocated: prefill 0)
    decode: int
    requests: int
    rejected: int
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tpot_p50: float
    tpot_p90: float
    tpot_p99: float
    e2e_p50: float
    e2e_p90: float
    goodput_rps: float  # requests meeting both SLOs per second of the run
    slo_attainment: float  # fraction of requests meeting both SLOs
    cached_token_ratio: float
    output_tok_s: float
    duration_s: float
    mean_workers: float  # time-averaged live workers of both pools


@dataclass
class SimResult:
    summary: SimSummary
    requests: list[RequestResult]
    pool_sizes: list[PoolSample] = field(default_factory=list)



def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def summarize(reqs: list[RequestResult], slo: SLO, label: str, prefill: int, decode: int,
              samples: list[PoolSample] = ()) -> SimSummary:
    ok = [r for r in reqs if r.ttft_s is not None]
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    e2e = [r.e2e_s for r in ok]
    good = sum(r.ttft_s <= slo.ttft_s and (r.tpot_s is None or r.tpot_s <= slo.tpot_s) for r in ok)
    start = min((r.arrival_s for r in reqs), default=0.0)
    end = max((r.arrival_s + r.e2e_s for r in ok), default=start)
    duration = max(end - start, 1e-9)
    prompt = sum(r.input_tokens for r in ok)
    mean_workers = float(prefill + decode)
    if len(samples) > 1:  # time-weighted live workers while the autoscaler ran
        t = [x.time_s for x in samples]
        live = [x.prefill_live + x.decode_live for x in samples]
        mean_workers = sum(n * (b - a) for n, a, b in zip(live, t, t[1:])) / max(t[-1] - t[0], 1e-9)
    return SimSummary(
        label=label, prefill=prefill, decode=decode, requests=len(reqs), rejected=len(reqs) - len(ok),
        ttft_p50=pct(ttft, 50), ttft_p90=pct(ttft, 90), ttft_p99=pct(ttft, 99),
        tpot_p50=pct(tpot, 50), tpot_p90=pct(tpot, 90), tpot_p99=pct(tpot, 99),
        e2e_p50=pct(e2e, 50), e2e_p90=pct(e2e, 90),
        goodput_rps=good / duration, slo_attainment=good / len(reqs) if reqs else 0.0,
        cached_token_ratio=sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        output_tok_s=sum(r.output_tokens for r in ok) / duration, duration_s=duration,
        mean_workers=mean_workers)
