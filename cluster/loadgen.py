"""`tandem bench`'s plans (pure): which requests a load sends, and when.

Session workloads (`agent`, `agent-small`): sessions start as a Poisson process at `rate` new
sessions per second; within a session each turn is sent its think time after the previous answer
ended (closed loop), and its prompt carries that real answer, as a coding agent's does. Trace
workloads (`mooncake:PATH`, `azure:PATH`): each request is its own session and arrives at its trace
time, scaled so that the trace's mean rate is `rate` requests per second (unscaled without one).
Nothing due past `duration_s` is sent; requests in flight then get `drain_timeout_s` more.

The asyncio driver that sends a plan through the gRPC API, and the command, are in
cluster/loadgen_client.py; records, summaries, the table and the output files in
cluster/loadgen_report.py. Every request is greedy, `ignore_eos`, with `max_tokens` = the spec's output length, sent as token
ids with its session id, so the router routes it by session.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Iterable, Iterator

from tandem.cluster.loadgen_report import SLO
from tandem.cluster.workloads import AgentProfile, RequestSpec, TokenizedRequest, coding_agent_sessions, iter_token_ids, \
    read_azure, read_mooncake

RATE_UNIT = {"sessions": "new sessions/s", "trace": "requests/s", "trace-unscaled": "trace timestamps"}
RATE_MEANING = {
    "sessions": "rate = new sessions per second (Poisson arrivals); each later turn of a session is sent "
                "its think time after the previous answer ends",
    "trace": "rate = mean requests per second (the trace's timestamps scaled to it)",
    "trace-unscaled": "arrivals = the trace's own timestamps (no --rate given)",
}


@dataclass(frozen=True)
class Session:
    session_id: str
    specs: tuple[RequestSpec, ...]  # its turns, in order
    start_s: float  # when its first turn is due, from the start of the run


def parse_workload(name: str) -> tuple[str, str | None]:
    """-> (kind, path): kind is agent, agent-small, mooncake or azure."""
    aliases = {"agent": "agent", "coding-agent": "agent", "agent-small": "agent-small",
               "coding-agent-small": "agent-small"}
    if name in aliases:
        return aliases[name], None
    kind, _, path = name.partition(":")
    if kind in ("mooncake", "azure") and path:
        return kind, path
    raise ValueError(f"unknown workload {name!r}: use agent, agent-small, mooncake:PATH or azure:PATH")


def group_sessions(specs: list[RequestSpec]) -> list[list[RequestSpec]]:
    """Specs by session, turns in order; sessions in the order of their first arrival."""
    by: dict[str, list[RequestSpec]] = {}
    for s in sorted(specs, key=lambda s: (s.arrival_s, s.turn)):
        by.setdefault(s.session_id, []).append(s)
    return [sorted(v, key=lambda s: s.turn) for v in by.values()]


def fit_context(spec: RequestSpec, max_context: int) -> RequestSpec:
    """Shorten a request so prompt + output fit `max_context` (the output keeps at least 1 token)."""
    out = max(1, min(spec.output_tokens, max_context - 1))
    inp = max(1, min(spec.input_tokens, max_context - out))
    return replace(spec, input_tokens=inp, output_tokens=out, shared_prefix_tokens=min(spec.shared_prefix_tokens, inp))


def trace_mean_rate(specs: list[RequestSpec]) -> float | None:
    """Requests per second over the trace's span; None when it has no span."""
    if len(specs) < 2:
        return None
    span = max(s.arrival_s for s in specs) - min(s.arrival_s for s in specs)
    return (len(specs) - 1) / span if span > 0 else None


def plan_sessions(sessions: list[list[RequestSpec]], *, session_workload: bool, rate: float | None,
                  duration_s: float, max_sessions: int | None = None) -> list[Session]:
    """Start times for one rate; sessions due at or past `duration_s` are left out.

    Session workloads were generated at 1 session/s, so start times divide by `rate`. Trace requests
    are scaled by (trace mean rate / rate), which makes their mean rate `rate`."""
    if session_workload:
        if not rate or rate <= 0:
            raise ValueError("session workloads need --rate (new sessions per second) > 0")
        scale = 1.0 / rate
    else:
        trace_rate = trace_mean_rate([s for ss in sessions for s in ss])
        scale = trace_rate / rate if rate and trace_rate else 1.0
    plan = [Session(ss[0].session_id, tuple(ss), ss[0].arrival_s * scale) for ss in sessions]
    plan = [s for s in plan if s.start_s < duration_s]
    return plan[:max_sessions] if max_sessions else plan


@dataclass(frozen=True)
class RampPlan:
    specs: list[RequestSpec]  # every step's turns; session ids `r<step>-<id>`, first turns at their start
    send_until_s: dict[str, float]  # session id -> its step's end: turns due from then on are not sent
    step_starts_s: tuple[float, ...]


def plan_ramp(sessions: list[list[RequestSpec]], rates: Iterable[float], step_s: float) -> RampPlan:
    """What `tandem bench --rates R1,R2,.. --duration S` sends to a session workload, on one
    timeline for the simulator: step i starts at i * S and is `plan_sessions` at rate R_i with fresh
    session ids, each session's turns cut at its step's end. The bench also waits between steps for
    the requests still in flight; here the steps run back to back."""
    specs: list[RequestSpec] = []
    until: dict[str, float] = {}
    starts = []
    for i, rate in enumerate(rates):
        t0 = i * step_s
        starts.append(t0)
        for sess in plan_sessions(sessions, session_workload=True, rate=rate, duration_s=step_s):
            sid = f"r{i}-{sess.session_id}"
            until[sid] = t0 + step_s
            first = sess.specs[0].arrival_s
            specs += [replace(t, session_id=sid, arrival_s=t0 + sess.start_s + t.arrival_s - first)
                      for t in sess.specs]
    specs.sort(key=lambda r: (r.arrival_s, r.session_id, r.turn))
    return RampPlan(specs, until, tuple(starts))


def load_sessions(kind: str, path: str | None, rng: random.Random, *, num_sessions: int,
                  max_context: int | None) -> list[list[RequestSpec]]:
    """The workload's sessions, each fitted to `max_context`. Agent sessions are generated at 1 new
    session per second (`plan_sessions` rescales); traces are read whole (`num_sessions` caps them)."""
    if kind in ("agent", "agent-small"):
        profile = AgentProfile() if kind == "agent" else AgentProfile.small()
        if max_context:
            profile = replace(profile, max_context_tokens=min(profile.max_context_tokens, max_context))
        specs = coding_agent_sessions(rng, num_sessions, 1.0, profile)
    else:
        specs = (read_mooncake if kind == "mooncake" else read_azure)(path, limit=num_sessions or None)
    if max_context:
        specs = [fit_context(s, max_context) for s in specs]
    return group_sessions(specs)


def sessions_needed(rate: float, duration_s: float) -> int:
    """Enough 1/s-generated sessions that a Poisson process at `rate` rarely outruns them in
    `duration_s` (mean + 4 standard deviations)."""
    mean = rate * duration_s
    return int(math.ceil(mean + 4 * math.sqrt(mean) + 5))


def splice_prompt(context: list[int], spec_prompt: list[int], shared_prefix_tokens: int) -> list[int]:
    """The prompt to send: the session's real context (previous prompt + the answer it really got)
    for the first `shared_prefix_tokens`, the spec's own ids after that; the length stays the spec's."""
    n = min(shared_prefix_tokens, len(context))
    return context[:n] + spec_prompt[n:]


def trace_prompts(specs: Iterable[RequestSpec], vocab_size: int, rng: random.Random) -> Iterator[TokenizedRequest]:
    """Token ids for trace requests, lazily, in order: one `iter_token_ids` over all of them, so equal
    hash ids give equal blocks; the session id is blanked so it keeps one context, not one per request."""
    return iter_token_ids((replace(s, session_id="trace") for s in specs), vocab_size, rng)


# ---- the bench's settings ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchConfig:
    target: str
    workload: str
    rates: tuple[float | None, ...]  # None: a trace at its own timestamps
    duration_s: float = 60.0
    drain_timeout_s: float = 120.0
    seed: int = 0
    max_sessions: int | None = None
    slo: SLO = SLO()
    max_context: int | None = None
    vocab_size: int | None = None  # None: ask the server
    out_dir: str = "bench-results"
    label: str | None = None
    progress: bool = False
    watch_pools_s: float = 0.0  # > 0: sample the Admin API's pool sizes this often (pool_timeline)
    api: str = "grpc"  # "openai": drive the OpenAI HTTP edge (target: its HOST:PORT or URL) instead
    # a turn refused before its first token (RESOURCE_EXHAUSTED, UNAVAILABLE) is sent again after
    # tandem.client.errors.backoff_s (the router's hint), up to this many times, as agents and the
    # SDKs retry; its latencies count from its first send. 0: the session goes on to its next turn
    retries: int = 0


def token_seed(seed: int, rate: float | None, repeat: int = 0, session_id: str | None = None) -> str:
    """The seed of a run's prompt token ids. `repeat`: how many earlier runs of this bench had the
    same rate (a ramp that comes back down): those get prompts of their own, or the cluster's
    prefix caches would still hold them from the earlier run. The first run of a rate keeps the
    seed it always had, so single-pass figures stay comparable across versions."""
    base = f"{seed}-{rate}" + (f"-r{repeat}" if repeat else "")
    return base if session_id is None else f"{base}-{session_id}"
