"""`tandem bench`: load on a running cluster through its gRPC API; latency, goodput and cache hits.

Session workloads (`agent`, `agent-small`): sessions start as a Poisson process at `rate` new
sessions per second; within a session each turn is sent its think time after the previous answer
ended (closed loop), and its prompt carries that real answer, as a coding agent's does. Trace
workloads (`mooncake:PATH`, `azure:PATH`): each request is its own session and arrives at its trace
time, scaled so that the trace's mean rate is `rate` requests per second (unscaled without one).
Nothing due past `duration_s` is sent; requests in flight then get `drain_timeout_s` more.

Layout: workload plans (pure) first, then the asyncio driver (one task per session), then the
command; records, summaries, the table and the output files are in cluster/loadgen_report.py.
Every request is greedy, `ignore_eos`, with `max_tokens` = the spec's output length, sent as token
ids with its session id, so the router routes it by session.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import sys
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterable, Iterator

from tandem.cluster.loadgen_report import SLO, RequestRecord, summarize, table_header, table_notes, table_row, write_outputs
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


# ---- the driver ---------------------------------------------------------------------------------
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


class _Progress:
    """A carriage-return status line on stderr, redrawn twice a second while a rate runs."""

    def __init__(self, enabled: bool, rate: float | None, duration_s: float):
        self.enabled, self.rate, self.duration_s = enabled, rate, duration_s
        self.planned = self.done = self.failed = self.in_flight = self.not_started = 0
        self.elapsed = 0.0
        self._width = 0  # of the last line drawn, to blank it

    def line(self) -> str:
        total = self.planned - self.not_started
        rate = "trace" if self.rate is None else f"{self.rate:g}/s"
        return (f"[rate {rate}] {self.done}/{total} done ({self.failed} failed), {self.in_flight} in flight, "
                f"{self.elapsed:.1f}/{self.duration_s:g} s")

    def draw(self, final: bool = False) -> None:
        if self.enabled:
            text = "" if final else self.line()
            sys.stderr.write("\r" + text.ljust(self._width) + ("\r" if final else ""))
            sys.stderr.flush()
            self._width = len(text)


def token_seed(seed: int, rate: float | None, repeat: int = 0, session_id: str | None = None) -> str:
    """The seed of a run's prompt token ids. `repeat`: how many earlier runs of this bench had the
    same rate (a ramp that comes back down): those get prompts of their own, or the cluster's
    prefix caches would still hold them from the earlier run. The first run of a rate keeps the
    seed it always had, so single-pass figures stay comparable across versions."""
    base = f"{seed}-{rate}" + (f"-r{repeat}" if repeat else "")
    return base if session_id is None else f"{base}-{session_id}"


async def run_rate(stub, sessions: list[Session], cfg: BenchConfig, *, session_workload: bool,
                   rate: float | None, vocab_size: int, run_tag: str, metadata=(),
                   progress: _Progress | None = None, repeat: int = 0) -> tuple[list[RequestRecord], int, float]:
    """Run one rate's plan; -> (records, requests not sent because due past the duration, wall s).
    `repeat`: earlier runs at this rate in the same bench (see `token_seed`)."""
    import grpc

    from tandem.protos.tandem.v1 import generation_pb2 as pb

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    now = lambda: loop.time() - t0  # noqa: E731
    deadline = cfg.duration_s + cfg.drain_timeout_s
    prog = progress or _Progress(False, rate, cfg.duration_s)
    prog.planned = sum(len(s.specs) for s in sessions)
    records: list[RequestRecord] = []
    trace_tokens = None if session_workload else trace_prompts(
        [s.specs[0] for s in sessions], vocab_size, random.Random(token_seed(cfg.seed, rate, repeat)))

    async def send(rec: RequestRecord, sid: str, prompt: list[int]) -> list[int]:
        req = pb.GenerateRequest(request_id=f"{sid}-t{rec.turn}", session_id=sid, prompt_token_ids=prompt,
                                 sampling=pb.SamplingParams(max_tokens=rec.max_tokens, temperature=0.0,
                                                            ignore_eos=True))
        out: list[int] = []
        prog.in_flight += 1
        try:
            async for resp in stub.Generate(req, timeout=max(0.01, deadline - now()), metadata=metadata):
                if resp.token_ids:
                    out.extend(resp.token_ids)
                    rec.token_times_s.extend([now() - rec.arrival_s] * len(resp.token_ids))
                if resp.finish_reason:
                    rec.finish_reason = pb.FinishReason.Name(resp.finish_reason)
                    u = resp.usage
                    rec.usage_prompt_tokens, rec.cached_prompt_tokens = u.prompt_tokens, u.cached_prompt_tokens
                    rec.completion_tokens, rec.draft_tokens = u.completion_tokens, u.draft_tokens
                    rec.accepted_draft_tokens = u.accepted_draft_tokens
            rec.e2e_s = now() - rec.arrival_s
            rec.status = "ABORTED" if rec.finish_reason == "ABORT" else "OK"
        except grpc.aio.AioRpcError as e:
            rec.status, rec.error = e.code().name, e.details() or ""
        except asyncio.CancelledError:
            rec.status = "CLIENT_CANCELLED"
            raise
        except Exception as e:  # noqa: BLE001 -- a client-side failure is counted, never fatal
            rec.status, rec.error = "CLIENT_ERROR", repr(e)
        finally:
            prog.in_flight -= 1
            prog.done += 1
            prog.failed += rec.status != "OK"
        return out

    async def drive(session: Session, tokens: Iterator[TokenizedRequest]) -> None:
        sid = f"{run_tag}-{session.session_id}"
        context: list[int] = []
        arrival = session.start_s
        for i, (spec, tok) in enumerate(zip(session.specs, tokens)):
            if i > 0:
                arrival = now() + spec.think_s
                if arrival >= cfg.duration_s:
                    prog.not_started += len(session.specs) - i
                    return
                await asyncio.sleep(arrival - now())
            prompt = splice_prompt(context, tok.prompt_token_ids, spec.shared_prefix_tokens)
            rec = RequestRecord(session.session_id, spec.turn, arrival, len(prompt), spec.output_tokens)
            records.append(rec)
            context = prompt + await send(rec, sid, prompt)

    async def draw() -> None:
        while True:
            prog.elapsed = now()
            prog.draw()
            await asyncio.sleep(0.5)

    drawer = asyncio.create_task(draw())
    tasks = []
    for s in sessions:  # in start order
        await asyncio.sleep(max(0.0, s.start_s - now()))
        tokens = iter([next(trace_tokens)]) if trace_tokens is not None else iter_token_ids(
            list(s.specs), vocab_size, random.Random(token_seed(cfg.seed, rate, repeat, s.session_id)))
        tasks.append(asyncio.create_task(drive(s, tokens)))
    if tasks:  # gRPC deadlines end every call by `deadline`; this is a backstop
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline + 10 - now()))
        for t in pending:
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, Exception):
                print(f"tandem bench: a session failed in the client: {r!r}", file=sys.stderr)
    elapsed = now()
    drawer.cancel()
    prog.draw(final=True)
    return records, prog.not_started, elapsed


class ProbeFailed(RuntimeError):
    """The server could not be asked for its model's limits (unreachable, auth, or an unknown answer)."""


_VOCAB = re.compile(r"vocabulary of (\d+)")
_CONTEXT = re.compile(r"context length (\d+)")


async def probe_model_limits(stub, metadata=()) -> tuple[int, int]:
    """(vocab size, context length) of the served model, read from the INVALID_ARGUMENT answers to
    two requests the router rejects before doing any work. Raises ProbeFailed when it cannot."""
    import grpc

    from tandem.protos.tandem.v1 import generation_pb2 as pb

    found = []
    for ids, max_tokens, pattern in (([2**32 - 1], 1, _VOCAB), ([3], 2**31 - 1, _CONTEXT)):
        req = pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(max_tokens=max_tokens))
        try:
            async for _ in stub.Generate(req, timeout=30, metadata=metadata):
                pass
        except grpc.aio.AioRpcError as e:
            m = pattern.search(e.details() or "") if e.code() == grpc.StatusCode.INVALID_ARGUMENT else None
            if m is None:
                raise ProbeFailed(f"{e.code().name}: {e.details()}") from None
            found.append(int(m.group(1)))
            continue
        raise ProbeFailed("the server accepted a probe it should reject; pass --vocab-size and --max-context")
    return found[0], found[1]


def _aio_channel(target: str, args):
    """grpc.aio channel with TLS when asked; -> (channel, per-call metadata carrying the token)."""
    import grpc

    from tandem.router.auth import auth_metadata, load_client_token
    from tandem.router.tls import ClientTLSConfig, channel_credentials, channel_options

    token = load_client_token(token_file=getattr(args, "auth_token_file", None))
    if getattr(args, "tls_ca_file", None):
        tls = ClientTLSConfig(ca_file=args.tls_ca_file, cert_file=args.tls_cert_file, key_file=args.tls_key_file,
                              server_name=args.tls_server_name)
        channel = grpc.aio.secure_channel(target, channel_credentials(tls), options=channel_options(tls))
    else:
        channel = grpc.aio.insecure_channel(target)
    return channel, auth_metadata(token)


async def run_bench(cfg: BenchConfig, args=None, out=sys.stdout) -> dict:
    """Every rate in turn against one channel; prints the table as rates finish; -> the report."""
    from tandem.protos.tandem.v1 import generation_pb2_grpc

    kind, path = parse_workload(cfg.workload)
    session_workload = kind.startswith("agent")
    if session_workload and not all(cfg.rates):
        raise ValueError("agent workloads need --rate or --rates (new sessions per second)")
    channel, metadata = _aio_channel(cfg.target, args)
    async with channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        if cfg.vocab_size and cfg.max_context:
            vocab, context = cfg.vocab_size, cfg.max_context
        else:
            vocab, context = await probe_model_limits(stub, metadata)
            vocab = cfg.vocab_size or vocab
        max_context = min(cfg.max_context or context, context)
        n = cfg.max_sessions or 0
        if session_workload:
            n = min(n or 10**9, sessions_needed(max(cfg.rates), cfg.duration_s))
        sessions = load_sessions(kind, path, random.Random(cfg.seed), num_sessions=n, max_context=max_context)
        mode = "sessions" if session_workload else "trace" if cfg.rates[0] else "trace-unscaled"
        meaning = RATE_MEANING[mode]
        print(f"tandem bench: {cfg.workload} against {cfg.target}, {cfg.duration_s:g} s per rate "
              f"(+ up to {cfg.drain_timeout_s:g} s for requests in flight, "
              f"which then end DEADLINE_EXCEEDED); {meaning}", file=out)
        print(table_header(cfg.slo), file=out, flush=True)
        runs, notes = [], []
        t_bench = time.monotonic()
        timeline: list[dict] = []
        watcher = (asyncio.ensure_future(watch_pools(channel, metadata, cfg.watch_pools_s, t_bench, timeline))
                   if cfg.watch_pools_s > 0 else None)
        for i, rate in enumerate(cfg.rates):
            started_s = time.monotonic() - t_bench
            plan = plan_sessions(sessions, session_workload=session_workload, rate=rate,
                                 duration_s=cfg.duration_s, max_sessions=cfg.max_sessions)
            prog = _Progress(cfg.progress, rate, cfg.duration_s)
            tag = f"bench-{uuid.uuid4().hex[:8]}-{i}"  # fresh sessions: no cache hits from an earlier run
            records, not_started, elapsed = await run_rate(
                stub, plan, cfg, session_workload=session_workload, rate=rate, vocab_size=vocab, run_tag=tag,
                metadata=metadata, progress=prog, repeat=list(cfg.rates[:i]).count(rate))
            summary = summarize(records, rate=rate, elapsed_s=elapsed, slo=cfg.slo, not_started=not_started)
            summary["sessions"] = len(plan)
            runs.append({"rate": rate, "session_prefix": f"{tag}-", "started_s": started_s, "summary": summary,
                         "requests": [r.to_json() for r in records]})
            print(table_row(summary), file=out, flush=True)
            notes.append(table_notes(summary))
        if watcher is not None:
            watcher.cancel()
    for line in filter(None, notes):
        print(line, file=out)
    config = {**asdict(cfg), "vocab_size": vocab, "max_context": max_context, "rate_definition": meaning,
              "rate_unit": RATE_UNIT[mode],
              "slo": {"ttft_ms": cfg.slo.ttft_s * 1e3, "tpot_ms": cfg.slo.tpot_s * 1e3}}
    config.pop("progress")
    report = {"label": cfg.label, "created_unix": time.time(), "config": config, "runs": runs}
    if cfg.watch_pools_s > 0:
        report["pool_timeline"] = timeline
    return report


async def watch_pools(channel, metadata, every_s: float, t0: float, timeline: list[dict]) -> None:
    """Append {t, pools: {name: {size, target, draining}}} every `every_s` seconds (t: seconds since
    the bench started) from the Admin API, until cancelled; a failed read is skipped."""
    import grpc

    from tandem.protos.tandem.v1 import admin_pb2, admin_pb2_grpc

    stub = admin_pb2_grpc.AdminStub(channel)
    while True:
        try:
            state = await stub.GetClusterState(admin_pb2.GetClusterStateRequest(), metadata=metadata, timeout=5)
            timeline.append({"t": round(time.monotonic() - t0, 3), "pools": {
                p.name: {"size": p.size, "target": p.target, "draining": p.draining} for p in state.pools}})
        except grpc.RpcError:
            pass
        await asyncio.sleep(every_s)


# ---- output files -------------------------------------------------------------------------------
def default_label(workload: str) -> str:
    kind, path = parse_workload(workload)
    name = kind if path is None else f"{kind}-{Path(path).stem}"
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def config_from_args(args) -> BenchConfig:
    if args.rates:
        rates = tuple(float(r) for r in args.rates.split(",") if r.strip())
    else:
        rates = (args.rate,)
    if any(r is not None and r <= 0 for r in rates):
        raise ValueError("rates must be > 0")
    if args.duration <= 0:
        raise ValueError("--duration must be > 0")
    label = re.sub(r"[^A-Za-z0-9._-]", "_", args.label) if args.label else default_label(args.workload)
    return BenchConfig(target=args.target, workload=args.workload, rates=rates, duration_s=args.duration,
                       drain_timeout_s=args.drain_timeout, seed=args.seed, max_sessions=args.sessions,
                       slo=SLO(args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3), max_context=args.max_context,
                       vocab_size=args.vocab_size, out_dir=args.out, label=label,
                       progress=sys.stderr.isatty() and not args.no_progress,
                       watch_pools_s=getattr(args, "watch_pools", 0) or 0.0)


def cmd_bench(args) -> int:
    cfg = config_from_args(args)
    try:
        report = asyncio.run(run_bench(cfg, args))
    except ProbeFailed as e:
        print(f"tandem bench: cannot run against {cfg.target}: {e}", file=sys.stderr)
        return 1
    for p in write_outputs(report, cfg.out_dir, cfg.label):
        print(f"wrote {p}")
    return 0
