"""What the OpenAI HTTP edge adds to TTFT over gRPC, on one local CPU cluster (the same router
serves both), measured from a client in its own process (the router's GIL is not the client's):

1. closed loop: one request at a time, the same token-id prompt (its KV cached after the first, so
   the model's share is small and steady), gRPC and HTTP alternating; TTFT = send -> first token;
   the p50 of each and the p50 of the paired differences (HTTP - gRPC, neighbouring requests);
2. the servers alone: a gRPC health Check against GET /health, round trip;
3. `tandem bench`'s own driver (cluster/loadgen_client.run_rate) with the agent-small workload over
   each API in turn (gRPC, HTTP, gRPC, HTTP), TTFT p50 per run.

    .venv/bin/python bench/http_overhead.py [--requests 300] [--rate 0.5 --duration 30 --runs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.cluster.loadgen import BenchConfig, load_sessions, plan_sessions
from tandem.cluster.loadgen_client import probe_model_limits, run_rate
from tandem.cluster.loadgen_report import summarize
from tandem.cluster.loadgen_transport import GrpcTransport, OpenAITransport
from tandem.protos.tandem.v1 import generation_pb2 as pb, generation_pb2_grpc


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


async def grpc_ttft(stub, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True))
    call = stub.Generate(req, timeout=60)
    first = None
    async for resp in call:
        if first is None and resp.token_ids:
            first = time.perf_counter() - t0
    return first


async def http_ttft(http: aiohttp.ClientSession, url: str, model: str, prompt: list[int]) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    first = None
    async with http.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
    return first


async def closed_loop(grpc_target: str, url: str, n: int, prompt_tokens: int) -> dict:
    async with grpc.aio.insecure_channel(grpc_target) as channel, aiohttp.ClientSession() as http:
        stub, health = generation_pb2_grpc.GenerationStub(channel), health_pb2_grpc.HealthStub(channel)
        vocab, _ = await probe_model_limits(GrpcTransport(stub))
        rng = random.Random(0)
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_tokens)]
        model = (await (await http.get(f"{url}/v1/models")).json())["data"][0]["id"]
        for _ in range(10):    # warm both paths (connections, the prompt's KV in the prefix cache)
            await grpc_ttft(stub, prompt)
            await http_ttft(http, url, model, prompt)
        g, h, hg, hh = [], [], [], []
        for i in range(n):
            pair = [grpc_ttft(stub, prompt), http_ttft(http, url, model, prompt)]
            if i % 2:
                pair.reverse()     # alternate who goes first
            a, b = pair
            x, y = await a, await b
            (g if i % 2 == 0 else h).append(x)
            (h if i % 2 == 0 else g).append(y)
            t0 = time.perf_counter()
            await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            hg.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            async with http.get(f"{url}/health") as r:
                await r.read()
            hh.append(time.perf_counter() - t0)
    return {"ttft_grpc": g, "ttft_http": h, "health_grpc": hg, "health_http": hh}


async def bench_runs(grpc_target: str, url: str, rate: float, duration: float, runs: int) -> list[dict]:
    """`tandem bench`'s driver over each API in turn; fresh prompts per run (no cross-run cache hits)."""
    cfg = BenchConfig(target=grpc_target, workload="agent-small", rates=(rate,), duration_s=duration,
                      drain_timeout_s=120)
    out = []
    async with grpc.aio.insecure_channel(grpc_target) as channel, aiohttp.ClientSession() as http:
        transports = {"grpc": GrpcTransport(generation_pb2_grpc.GenerationStub(channel)),
                      "openai": await OpenAITransport.connect(http, url)}
        vocab, context = await probe_model_limits(transports["grpc"])
        sessions = load_sessions("agent-small", None, random.Random(0), num_sessions=200, max_context=context)
        for i in range(2 * runs):
            api = ("grpc", "openai")[i % 2]
            plan = plan_sessions(sessions, session_workload=True, rate=rate, duration_s=duration)
            records, not_started, elapsed = await run_rate(transports[api], plan, cfg, session_workload=True,
                                                           rate=rate, vocab_size=vocab, run_tag=f"ovh-{i}", repeat=i)
            s = summarize(records, rate=rate, elapsed_s=elapsed, slo=cfg.slo, not_started=not_started)
            out.append({"api": api, "ok": s["ok"], "failed": s["failed"], "ttft_p50_ms": s["ttft_ms"]["p50"]})
    return out


def client_main(args) -> None:
    res = asyncio.run(closed_loop(args.grpc, args.http, args.requests, args.prompt_tokens))
    if args.runs:
        res["bench"] = asyncio.run(bench_runs(args.grpc, args.http, args.rate, args.duration, args.runs))
    print(json.dumps(res))


def print_table(res: dict) -> None:
    ms = lambda x: 1e3 * x  # noqa: E731
    g, h = res["ttft_grpc"], res["ttft_http"]
    diffs = [ms(b - a) for a, b in zip(g, h)]
    print(f"\n{'measure':34} {'gRPC p50':>9} {'HTTP p50':>9} {'HTTP - gRPC':>12}")
    print(f"{'TTFT, closed loop (ms)':34} {ms(p50(g)):9.2f} {ms(p50(h)):9.2f} {ms(p50(h)) - ms(p50(g)):12.2f}")
    print(f"{'  paired differences, p50 (ms)':34} {'':9} {'':9} {p50(diffs):12.2f}")
    hg, hh = res["health_grpc"], res["health_http"]
    print(f"{'health round trip (ms)':34} {ms(p50(hg)):9.2f} {ms(p50(hh)):9.2f} {ms(p50(hh)) - ms(p50(hg)):12.2f}")
    for api in ("grpc", "openai"):
        runs = [r for r in res.get("bench", []) if r["api"] == api]
        if runs:
            figs = ", ".join(f"{r['ttft_p50_ms']:.1f}" for r in runs)
            print(f"  bench agent-small, {api:6}: TTFT p50 per run (ms) {figs}; "
                  f"ok {sum(r['ok'] for r in runs)}, failed {sum(r['failed'] for r in runs)}")
    print(f"({len(g)} + {len(h)} closed-loop requests)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-random", help="a small model keeps the engine's share (and its noise) small")
    ap.add_argument("--requests", type=int, default=300, help="closed-loop requests per API")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--rate", type=float, default=0.5, help="agent-small sessions per second (bench runs)")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--runs", type=int, default=2, help="bench runs per API (0: none)")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--grpc", help=argparse.SUPPRESS)
    ap.add_argument("--http", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        client_main(args)
        return 0
    from tandem.cluster.local import RunningCluster  # noqa: PLC0415 - only the orchestrator starts Ray

    cluster = RunningCluster({"model.name": args.model, "prefill.replicas": 1, "decode.replicas": 1})
    try:
        url = f"http://127.0.0.1:{cluster.routers[0][1].http_port}"
        cmd = [sys.executable, __file__, "--client", "--grpc", cluster.target, "--http", url,
               "--requests", str(args.requests), "--prompt-tokens", str(args.prompt_tokens), "--rate", str(args.rate),
               "--duration", str(args.duration), "--runs", str(args.runs)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            return 1
    finally:
        cluster.close()
    print_table(json.loads(out.stdout.strip().splitlines()[-1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
