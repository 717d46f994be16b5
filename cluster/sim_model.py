"""The simulator's inputs and outputs: the SLO, the request shape it replays (`RequestLike`) and the
results it reports (per request, per run, pool sizes over time). Its service times are
tandem.perf_model's `PerfModel`. Plain values only; cluster/sim_engine.py runs the simulation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np



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
    prefill: str  # "remote" | "local" | "rejected" (prompt + output exceed a worker's KV, or the router refused it)
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
