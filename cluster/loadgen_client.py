"""`tandem bench`'s client side: the asyncio driver that sends a rate's plan through the gRPC API or
the OpenAI HTTP edge (`--api openai`; cluster/loadgen_transport.py sends each request) (one task
per session, each turn streamed to its end and recorded), the probe of the served
model's limits, the Admin API's pool sizes sampled alongside, and the command that runs every rate
and writes the report. The plans it sends are made in cluster/loadgen.py; the records, summaries
and output files are cluster/loadgen_report.py's."""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl
import re
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

import aiohttp
import grpc

from tandem.client.errors import backoff_s
from tandem.cluster.loadgen import (RATE_MEANING, RATE_UNIT, BenchConfig, Session, load_sessions, parse_workload,
                                    plan_sessions, sessions_needed, splice_prompt, token_seed, trace_prompts)
from tandem.cluster.loadgen_transport import GrpcTransport, OpenAITransport, SendFailed, Transport, Update
from tandem.cluster.loadgen_report import (SLO, RequestRecord, summarize, table_header, table_notes, table_row,
                                           write_outputs)
from tandem.cluster.workloads import TokenizedRequest, iter_token_ids
from tandem.protos.tandem.v1 import admin_pb2, admin_pb2_grpc, generation_pb2_grpc
from tandem.router.auth import auth_metadata, load_admin_token, load_client_token
from tandem.router.tls import ClientTLSConfig, channel_credentials, channel_options


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



def as_transport(stub_or_transport, metadata=()) -> Transport:
    """A Generation stub (grpc.aio) is sent to over gRPC; a Transport as it is."""
    if hasattr(stub_or_transport, "Generate"):
        return GrpcTransport(stub_or_transport, metadata)
    return stub_or_transport


class RateRun:
    """One rate's plan, sent over `transport` (or a Generation stub): a task per session (in start
    order), each turn sent when due and streamed to its end; its RequestRecords fill `records`.
    Times are seconds since the run started."""

    def __init__(self, transport, cfg: BenchConfig, *, rate: float | None, run_tag: str, metadata=(),
                 progress: _Progress | None = None):
        self.transport, self.cfg, self.run_tag = as_transport(transport, metadata), cfg, run_tag
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.deadline = cfg.duration_s + cfg.drain_timeout_s
        self.prog = progress or _Progress(False, rate, cfg.duration_s)
        self.records: list[RequestRecord] = []

    def now(self) -> float:
        return self.loop.time() - self.t0

    async def send(self, rec: RequestRecord, sid: str, prompt: list[int]) -> list[int]:
        """Stream one request; fills `rec` (token times, usage, status); -> the answer's token ids.
        A refusal before the first token is sent again (`cfg.retries`) while the wait ends before
        the run's duration; each attempt has a request id of its own."""
        out: list[int] = []
        self.prog.in_flight += 1
        try:
            while True:
                try:
                    rid = f"{sid}-t{rec.turn}" + (f"-r{rec.retries}" if rec.retries else "")
                    async for update in self.transport.stream(rid, sid, prompt, rec.max_tokens,
                                                              max(0.01, self.deadline - self.now())):
                        self._take(rec, update, out)
                    break
                except SendFailed as e:
                    wait = (backoff_s(e.status, e.retry_after_s, rec.retries)
                            if rec.retries < self.cfg.retries and not rec.token_times_s else None)
                    if wait is None or self.now() + wait >= self.cfg.duration_s:
                        raise
                    rec.retries += 1
                    await asyncio.sleep(wait)
            rec.e2e_s = self.now() - rec.arrival_s
            rec.status = "ABORTED" if rec.finish_reason == "ABORT" else "OK"
        except SendFailed as e:
            rec.status, rec.error = e.status, e.details
        except asyncio.CancelledError:
            rec.status = "CLIENT_CANCELLED"
            raise
        except Exception as e:  # noqa: BLE001 -- a client-side failure is counted, never fatal
            rec.status, rec.error = "CLIENT_ERROR", repr(e)
        finally:
            self.prog.in_flight -= 1
            self.prog.done += 1
            self.prog.failed += rec.status != "OK"
        return out

    def _take(self, rec: RequestRecord, update: Update, out: list[int]) -> None:
        if update.token_ids:
            out.extend(update.token_ids)
            rec.token_times_s.extend([self.now() - rec.arrival_s] * len(update.token_ids))
        if update.finish_reason:
            rec.finish_reason = update.finish_reason
        if update.usage is not None:
            u = update.usage
            rec.usage_prompt_tokens, rec.cached_prompt_tokens = u.prompt_tokens, u.cached_prompt_tokens
            rec.completion_tokens, rec.draft_tokens = u.completion_tokens, u.draft_tokens
            rec.accepted_draft_tokens, rec.draft_steps = u.accepted_draft_tokens, u.draft_steps

    async def drive(self, session: Session, tokens: Iterator[TokenizedRequest]) -> None:
        """A session's turns, each its think time after the previous answer; none due past the
        duration is sent."""
        sid = f"{self.run_tag}-{session.session_id}"
        context: list[int] = []
        arrival = session.start_s
        for i, (spec, tok) in enumerate(zip(session.specs, tokens)):
            if i > 0:
                arrival = self.now() + spec.think_s
                if arrival >= self.cfg.duration_s:
                    self.prog.not_started += len(session.specs) - i
                    return
                await asyncio.sleep(arrival - self.now())
            prompt = splice_prompt(context, tok.prompt_token_ids, spec.shared_prefix_tokens)
            rec = RequestRecord(session.session_id, spec.turn, arrival, len(prompt), spec.output_tokens)
            self.records.append(rec)
            context = prompt + await self.send(rec, sid, prompt)

    async def draw(self) -> None:
        while True:
            self.prog.elapsed = self.now()
            self.prog.draw()
            await asyncio.sleep(0.5)

    async def run(self, sessions: list[Session], token_streams: Iterator[Iterator[TokenizedRequest]]) -> float:
        """Start each session at its start time with its token stream; wait for all (gRPC deadlines
        end every call by the deadline; cancel what is left 10 s later); -> seconds it took."""
        drawer = asyncio.create_task(self.draw())
        tasks = []
        for s, tokens in zip(sessions, token_streams):  # in start order
            await asyncio.sleep(max(0.0, s.start_s - self.now()))
            tasks.append(asyncio.create_task(self.drive(s, tokens)))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, self.deadline + 10 - self.now()))
            for t in pending:
                t.cancel()
            for r in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(r, Exception):
                    print(f"tandem bench: a session failed in the client: {r!r}", file=sys.stderr)
        elapsed = self.now()
        drawer.cancel()
        self.prog.draw(final=True)
        return elapsed


def _token_streams(sessions: list[Session], cfg: BenchConfig, *, session_workload: bool, rate: float | None,
                   vocab_size: int, repeat: int) -> Iterator[Iterator[TokenizedRequest]]:
    """Each session's prompt token ids, in order: a trace's from one stream over all its requests,
    a session workload's seeded per session."""
    if not session_workload:
        trace_tokens = trace_prompts([s.specs[0] for s in sessions], vocab_size,
                                     random.Random(token_seed(cfg.seed, rate, repeat)))
        return (iter([next(trace_tokens)]) for _ in sessions)
    return (iter_token_ids(list(s.specs), vocab_size, random.Random(token_seed(cfg.seed, rate, repeat, s.session_id)))
            for s in sessions)


async def run_rate(stub, sessions: list[Session], cfg: BenchConfig, *, session_workload: bool,
                   rate: float | None, vocab_size: int, run_tag: str, metadata=(),
                   progress: _Progress | None = None, repeat: int = 0) -> tuple[list[RequestRecord], int, float]:
    """Run one rate's plan; -> (records, requests not sent because due past the duration, wall s).
    `repeat`: earlier runs at this rate in the same bench (see `token_seed`)."""
    run = RateRun(stub, cfg, rate=rate, run_tag=run_tag, metadata=metadata, progress=progress)
    run.prog.planned = sum(len(s.specs) for s in sessions)
    streams = _token_streams(sessions, cfg, session_workload=session_workload, rate=rate,
                             vocab_size=vocab_size, repeat=repeat)
    elapsed = await run.run(sessions, streams)
    return run.records, run.prog.not_started, elapsed


class ProbeFailed(RuntimeError):
    """The server could not be asked for its model's limits (unreachable, auth, or an unknown answer)."""


_VOCAB = re.compile(r"vocabulary of (\d+)")
_CONTEXT = re.compile(r"context length (\d+)")


async def probe_model_limits(stub, metadata=()) -> tuple[int, int]:
    """(vocab size, context length) of the served model, read from the INVALID_ARGUMENT answers to
    two requests the router rejects before doing any work (over either API). Raises ProbeFailed
    when it cannot."""
    transport, found = as_transport(stub, metadata), []
    for ids, max_tokens, pattern in (([2**32 - 1], 1, _VOCAB), ([3], 2**31 - 1, _CONTEXT)):
        try:
            message = await transport.rejection(ids, max_tokens)
        except (SendFailed, aiohttp.ClientError) as e:
            raise ProbeFailed(str(e)) from None
        if message is None:
            raise ProbeFailed("the server accepted a probe it should reject; pass --vocab-size and --max-context")
        m = pattern.search(message)
        if m is None:
            raise ProbeFailed(f"INVALID_ARGUMENT: {message}")
        found.append(int(m.group(1)))
    return found[0], found[1]


def _aio_channel(target: str, args):
    """grpc.aio channel with TLS when asked; -> (channel, per-call metadata carrying the token)."""
    token = load_client_token(token_file=getattr(args, "auth_token_file", None))
    if getattr(args, "tls_ca_file", None):
        tls = ClientTLSConfig(ca_file=args.tls_ca_file, cert_file=args.tls_cert_file, key_file=args.tls_key_file,
                              server_name=args.tls_server_name)
        channel = grpc.aio.secure_channel(target, channel_credentials(tls), options=channel_options(tls))
    else:
        channel = grpc.aio.insecure_channel(target)
    return channel, auth_metadata(token)


@contextlib.asynccontextmanager
async def open_transport(cfg: BenchConfig, args=None):
    """-> (transport for cfg.api, the grpc.aio channel for the Admin API or None over HTTP, metadata)."""
    if cfg.api != "openai":
        channel, metadata = _aio_channel(cfg.target, args)
        async with channel:
            yield GrpcTransport(generation_pb2_grpc.GenerationStub(channel), metadata), channel, metadata
        return
    token = load_client_token(token_file=getattr(args, "auth_token_file", None))
    ca = getattr(args, "tls_ca_file", None)
    base = cfg.target if "://" in cfg.target else f"{'https' if ca else 'http'}://{cfg.target}"
    ssl_ctx = ssl.create_default_context(cafile=ca) if ca else None
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ssl=ssl_ctx or True)) as http:
        try:
            transport = await OpenAITransport.connect(http, base, token)
        except (SendFailed, aiohttp.ClientError) as e:
            raise ProbeFailed(str(e)) from None
        yield transport, None, ()


async def run_bench(cfg: BenchConfig, args=None, out=sys.stdout) -> dict:
    """Every rate in turn against one channel; prints the table as rates finish; -> the report."""
    kind, path = parse_workload(cfg.workload)
    session_workload = kind.startswith("agent")
    if session_workload and not all(cfg.rates):
        raise ValueError("agent workloads need --rate or --rates (new sessions per second)")
    async with open_transport(cfg, args) as (transport, channel, metadata):
        if cfg.vocab_size and cfg.max_context:
            vocab, context = cfg.vocab_size, cfg.max_context
        else:
            vocab, context = await probe_model_limits(transport)
            vocab = cfg.vocab_size or vocab
        max_context = min(cfg.max_context or context, context)
        n = cfg.max_sessions or 0
        if session_workload:
            n = min(n or 10**9, sessions_needed(max(cfg.rates), cfg.duration_s))
        sessions = load_sessions(kind, path, random.Random(cfg.seed), num_sessions=n, max_context=max_context)
        mode = "sessions" if session_workload else "trace" if cfg.rates[0] else "trace-unscaled"
        meaning = RATE_MEANING[mode]
        print(f"tandem bench: {cfg.workload} against {cfg.target} ({cfg.api}), {cfg.duration_s:g} s per rate "
              f"(+ up to {cfg.drain_timeout_s:g} s for requests in flight, "
              f"which then end DEADLINE_EXCEEDED); {meaning}", file=out)
        print(table_header(cfg.slo), file=out, flush=True)
        runs, notes = [], []
        t_bench = time.monotonic()
        timeline: list[dict] = []
        admin = auth_metadata(load_admin_token(getattr(args, "admin_token_file", None)))   # Admin takes admin tokens
        watcher = (asyncio.ensure_future(watch_pools(channel, admin, cfg.watch_pools_s, t_bench, timeline))
                   if cfg.watch_pools_s > 0 and channel is not None else None)
        for i, rate in enumerate(cfg.rates):
            started_s, started_unix = time.monotonic() - t_bench, time.time()
            plan = plan_sessions(sessions, session_workload=session_workload, rate=rate,
                                 duration_s=cfg.duration_s, max_sessions=cfg.max_sessions)
            prog = _Progress(cfg.progress, rate, cfg.duration_s)
            tag = f"bench-{uuid.uuid4().hex[:8]}-{i}"  # fresh sessions: no cache hits from an earlier run
            records, not_started, elapsed = await run_rate(
                transport, plan, cfg, session_workload=session_workload, rate=rate, vocab_size=vocab, run_tag=tag,
                metadata=metadata, progress=prog, repeat=list(cfg.rates[:i]).count(rate))
            summary = summarize(records, rate=rate, elapsed_s=elapsed, slo=cfg.slo, not_started=not_started)
            summary["sessions"] = len(plan)
            runs.append({"rate": rate, "session_prefix": f"{tag}-", "started_s": started_s,
                         "started_unix": started_unix, "summary": summary, "requests": [r.to_json() for r in records]})
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
    if (getattr(args, "retries", 0) or 0) < 0:
        raise ValueError("--retries must be >= 0")
    label = re.sub(r"[^A-Za-z0-9._-]", "_", args.label) if args.label else default_label(args.workload)
    return BenchConfig(target=args.target, workload=args.workload, rates=rates, duration_s=args.duration,
                       drain_timeout_s=args.drain_timeout, seed=args.seed, max_sessions=args.sessions,
                       slo=SLO(args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3), max_context=args.max_context,
                       vocab_size=args.vocab_size, out_dir=args.out, label=label,
                       progress=sys.stderr.isatty() and not args.no_progress,
                       watch_pools_s=getattr(args, "watch_pools", 0) or 0.0, api=getattr(args, "api", "grpc"),
                       retries=getattr(args, "retries", 0) or 0)


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
