"""Cluster subcommands of `tandem`: `up` (serve), `chat` (interactive client), `status` (Admin),
`scale`, `bench` (load generator, in cluster/loadgen_client.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time

import grpc
from google.protobuf.json_format import MessageToDict

from tandem.client import Client, TandemError
from tandem.cluster import launch, lifecycle, loadgen_client, profiling
from tandem.cluster.config import ADAPTIVE, load_config
from tandem.engine.config import SPECULATIVE_METHODS
from tandem.protos.tandem.v1 import admin_pb2, admin_pb2_grpc, generation_pb2 as pb
from tandem.router.auth import (ADMIN_TOKEN_ENV, BearerTokenInterceptor, TokenStore, auth_metadata, call_credentials,
                                load_admin_token, load_client_token, resolve_auth, with_metadata)
from tandem.router.tls import (ClientTLSConfig, TLSConfig, channel_credentials, channel_options, server_credentials,
                               server_ssl_context)
from tandem.runtime.logging_setup import setup_logging
from tandem.runtime.metrics import start_metrics_server
from tandem.runtime.process import after_startup

DEFAULT_TARGET = "127.0.0.1:50051"


def register(sub) -> None:
    up = sub.add_parser("up", help="start a cluster (local Ray, or the one RAY_ADDRESS names) and serve gRPC")
    up.add_argument("--config", help="cluster YAML (see cluster/config.py)")
    up.add_argument("--model")
    up.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="model.dtype (default float32)")
    up.add_argument("--device", help="model.device: cpu, cuda (default cpu)")
    up.add_argument("--tensor-parallel", type=int, metavar="N", help="ranks per worker (a pool's tensor_parallel_size in --config wins)")
    up.add_argument("--quantization",
                    help="weight quantization: none (default) or fp8 (FP8 e4m3 weights, per-channel scales, at load)")
    up.add_argument("--prefill", type=int, help="prefill actors")
    up.add_argument("--decode", type=int, help="decode actors")
    up.add_argument("--host")
    up.add_argument("--port", type=int)
    up.add_argument("--http-port", type=int,
                    help="OpenAI-compatible HTTP API port (default 8000; 0 picks one; router.http_port: null turns it off)")
    up.add_argument("--redis-url", help="share sessions between routers through Redis")
    up.add_argument("--local-prefill-threshold", type=float,
                    help="uncached prompt tokens up to which decode actors prefill locally (inf = colocated)")
    up.add_argument("--prefill-queue-limit", type=float,
                    help="prompt tokens a router keeps queued on one prefill actor; past it decode actors "
                         "prefill locally while their own prefill queue is the shorter "
                         "(prefill.max_queued_tokens; default inf)")
    up.add_argument("--num-blocks", type=int, help="KV cache blocks per actor")
    _speculative_flags(up)
    up.add_argument("--autoscale", action="store_true", help="size each pool from its own load (bounds in config)")
    up.add_argument("--layout", choices=["static", "adaptive"], default="static",
                    help="adaptive: decode workers decode and prefill, the router places each prompt by the "
                         "cost model (router.perf_model, router.slo_*_ms) and the controller lends workers "
                         "to prefill only under prompt load (roles: section); static: the pools as configured")
    up.add_argument("--log-level", help="DEBUG, INFO, WARNING (default: $TANDEM_LOG_LEVEL or INFO)")
    _security_flags(up)
    _attach_flags(up)
    up.add_argument("--namespace", help="the cluster's Ray namespace with --detached (default tandem)")
    up.add_argument("--drain-timeout", type=float, metavar="S",
                    help="on SIGTERM, let streams finish for up to S seconds (router.drain_timeout_s, default 90)")
    up.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (default 8080; 0 picks one)")
    up.add_argument("--metrics-host", help="default 127.0.0.1; 0.0.0.0 in a pod")
    up.set_defaults(func=cmd_up)

    chat = sub.add_parser("chat", help="interactive chat against a running cluster")
    chat.add_argument("--target", default=DEFAULT_TARGET)
    chat.add_argument("--session", help="session id (default: a new one)")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)
    _client_flags(chat)
    chat.set_defaults(func=cmd_chat)

    st = sub.add_parser("status", help="pools and workers of a running cluster")
    st.add_argument("--target", default=DEFAULT_TARGET)
    st.add_argument("--json", action="store_true")
    _client_flags(st)
    st.set_defaults(func=cmd_status)
    launch.register(sub, _security_flags)
    _register_scale(sub)
    lifecycle.register(sub, _client_flags, DEFAULT_TARGET)
    _register_bench(sub)
    profiling.register(sub)


def _speculative_flags(up) -> None:
    up.add_argument("--speculative", choices=SPECULATIVE_METHODS,
                    help="speculative decoding on decode workers (speculative.method; default off)")
    up.add_argument("--num-speculative-tokens", type=int, metavar="K",
                    help="the most draft tokens per sequence per step (speculative.num_tokens)")


def _attach_flags(up) -> None:
    attach = up.add_mutually_exclusive_group()
    attach.add_argument("--detached", action="store_true", default=None,
                        help="the controller and its pools detached on RAY_ADDRESS's cluster, the router its own "
                             "process: a SIGKILL of this process loses nothing, a controller crash neither (the "
                             "restarted controller adopts the pools); `tandem down` stops the lot. The default "
                             "when RAY_ADDRESS is set")
    attach.add_argument("--attached", dest="detached", action="store_false",
                        help="everything owned by this process (the default without RAY_ADDRESS: a local Ray)")


def _security_flags(up) -> None:
    sec = up.add_argument_group("security (auth is on by default when --host is not loopback)")
    sec.add_argument("--auth-token-file", help="bearer tokens, one per line, or a mounted Secret directory; "
                                               "$TANDEM_AUTH_TOKEN also works")
    sec.add_argument("--admin-token-file", help="admin tokens (file or Secret directory; $TANDEM_ADMIN_TOKEN "
                                                "also works): the only tokens the Admin API takes")
    sec.add_argument("--metrics-auth", action="store_true", help="/metrics only with an admin token")
    sec.add_argument("--no-auth", action="store_true", help="no bearer-token check")
    sec.add_argument("--insecure-no-auth", action="store_true",
                     help="allow --no-auth on a non-loopback address")
    sec.add_argument("--tls-cert-file")
    sec.add_argument("--tls-key-file")
    sec.add_argument("--tls-client-ca-file", help="CA for client certificates (mutual TLS)")
    sec.add_argument("--tls-require-client-cert", action="store_true")


def _register_scale(sub) -> None:
    sc = sub.add_parser("scale", help="change a pool's bounds (and optionally pin its size) at run time")
    sc.add_argument("--target", default=DEFAULT_TARGET, help="router address")
    sc.add_argument("--pool", required=True, choices=["prefill", "decode"])
    sc.add_argument("--min", type=int, required=True)
    sc.add_argument("--max", type=int, required=True)
    sc.add_argument("--size", type=int, help="pin the pool at this size (the autoscaler leaves it alone)")
    _client_flags(sc)
    sc.set_defaults(func=cmd_scale)
    r = sub.add_parser("set-role", help="change what a worker serves (prefill, decode or mixed) in place")
    r.add_argument("--target", default=DEFAULT_TARGET, help="router address")
    r.add_argument("worker", help="worker id, as `tandem status` lists it")
    r.add_argument("role", choices=["prefill", "decode", "mixed"])
    r.add_argument("--reason", default="operator", help="recorded in the role-change log")
    _client_flags(r)
    r.set_defaults(func=cmd_set_role)


def _register_bench(sub) -> None:
    b = sub.add_parser(
        "bench", help="load-test a running cluster: TTFT/TPOT/E2E percentiles, goodput, cache and draft hits",
        formatter_class=argparse.RawDescriptionHelpFormatter, description=(
            "Open-loop load through the gRPC API (or the OpenAI HTTP edge: --api openai); prints a table\n"
            "per rate and writes bench-LABEL.json\n"
            "and PNG plots (latency CDFs; goodput vs rate for a sweep) under --out.\n\n"
            "--rate R means:\n"
            "  agent, agent-small          R new sessions per second, Poisson arrivals; within a\n"
            "                              session each turn is sent its think time after the\n"
            "                              previous answer ends, with that answer in its prompt\n"
            "  mooncake:PATH, azure:PATH   R requests per second on average: the trace's timestamps\n"
            "                              scaled to it (without --rate: the trace's own timing)\n"
            "Requests due past --duration are not sent; those in flight get --drain-timeout more seconds.\n"
            "Every request: prompt token ids, greedy, ignore_eos, max_tokens = the workload's output length."))
    b.add_argument("--target", default=DEFAULT_TARGET,
                   help="router address HOST:PORT (--api openai: the HTTP edge's HOST:PORT or URL)")
    b.add_argument("--api", choices=["grpc", "openai"], default="grpc",
                   help="grpc: tandem.v1.Generation; openai: POST /v1/completions, streamed (default grpc)")
    b.add_argument("--workload", required=True,
                   help="agent (contexts up to 32k: GPU), agent-small (CPU), mooncake:PATH.jsonl, azure:PATH.csv")
    rate = b.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, help="see above")
    rate.add_argument("--rates", help="a sweep, e.g. 0.5,1,2: one run per rate, in order")
    b.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate (default 60)")
    b.add_argument("--drain-timeout", type=float, default=120.0,
                   help="seconds past --duration that requests in flight may take (default 120)")
    b.add_argument("--sessions", type=int, help="at most this many sessions (trace: requests) per rate")
    b.add_argument("--retries", type=int, default=0, metavar="N",
                   help="send a turn refused before its first token (RESOURCE_EXHAUSTED, UNAVAILABLE) again "
                        "after the router's retry hint, up to N times, as agents do; its TTFT counts from "
                        "the first send (default 0: the session goes on to its next turn)")
    b.add_argument("--seed", type=int, default=0, help="workload and token ids (default 0)")
    b.add_argument("--ttft-slo-ms", type=float, default=1000.0, help="goodput's TTFT bound (default 1000)")
    b.add_argument("--tpot-slo-ms", type=float, default=40.0, help="goodput's TPOT bound (default 40)")
    b.add_argument("--max-context", type=int,
                   help="fit every request (prompt + output) in this many tokens (default: the model's context)")
    b.add_argument("--vocab-size", type=int, help="token ids are drawn below this (default: asked of the server)")
    b.add_argument("--out", default="bench-results", help="directory for the JSON and PNGs (default bench-results)")
    b.add_argument("--label", help="names the outputs bench-LABEL.* (default: workload and time)")
    b.add_argument("--no-progress", action="store_true", help="no progress line on stderr (off when not a tty)")
    b.add_argument("--watch-pools", type=float, default=0, metavar="S",
                   help="sample pool sizes and targets through the Admin API every S seconds during the "
                        "run (with --autoscale clusters): JSON pool_timeline and bench-LABEL-timeline.png")
    _client_flags(b)
    b.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    return loadgen_client.cmd_bench(args)


def cmd_set_role(args) -> int:
    stub = admin_pb2_grpc.AdminStub(_channel(args.target, args, admin=True))
    try:
        w = stub.SetWorkerRole(admin_pb2.SetWorkerRoleRequest(worker_id=args.worker, role=args.role,
                                                              reason=args.reason), timeout=15)
    except grpc.RpcError as e:
        print(f"tandem: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(f"{w.id} ({w.pool} pool): now {w.role}")
    return 0


def cmd_scale(args) -> int:
    stub = admin_pb2_grpc.AdminStub(_channel(args.target, args, admin=True))
    req = admin_pb2.SetPoolBoundsRequest(pool=args.pool, min=args.min, max=args.max)
    if args.size is not None:
        req.target = args.size
    try:
        p = stub.SetPoolBounds(req, timeout=10)
    except grpc.RpcError as e:
        print(f"tandem: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(f"{p.name}: size {p.size}, target {p.target}, bounds [{p.min}, {p.max}]"
          + (" (pinned)" if p.target_pinned else ""))
    return 0


def _client_flags(p) -> None:
    p.add_argument("--auth-token-file", help="bearer token file (default: $TANDEM_AUTH_TOKEN)")
    p.add_argument("--admin-token-file", help="admin token file, for status/scale/set-role "
                                              "(default: $TANDEM_ADMIN_TOKEN, else the client token)")
    p.add_argument("--tls-ca-file", help="CA that signed the router's certificate (turns TLS on)")
    p.add_argument("--tls-cert-file", help="client certificate (mutual TLS)")
    p.add_argument("--tls-key-file")
    p.add_argument("--tls-server-name", help="name to check in the router's certificate")


# ---- up -----------------------------------------------------------------------------------------
def cmd_up(args) -> int:
    from tandem.cluster.bootstrap import start_cluster  # noqa: PLC0415 - Ray only when a cluster starts
    overrides = {"model.name": args.model, "model.dtype": args.dtype, "model.device": args.device,
                 "model.tensor_parallel_size": args.tensor_parallel, "model.quantization": args.quantization,
                 "prefill.replicas": args.prefill, "decode.replicas": args.decode,
                 "router.host": args.host, "router.port": args.port, "router.http_port": args.http_port,
                 "router.redis_url": args.redis_url,
                 "decode.local_prefill_threshold": args.local_prefill_threshold, "cache.num_blocks": args.num_blocks,
                 "prefill.max_queued_tokens": args.prefill_queue_limit,
                 "router.metrics_port": args.metrics_port, "router.metrics_host": args.metrics_host,
                 "router.metrics_auth": True if args.metrics_auth else None,
                 "router.drain_timeout_s": args.drain_timeout,
                 "autoscaler.enabled": True if args.autoscale else None,
                 "speculative.method": args.speculative, "speculative.num_tokens": args.num_speculative_tokens}
    if args.layout == "adaptive":
        overrides = {**ADAPTIVE, **{k: v for k, v in overrides.items() if v is not None}}
    config = load_config(args.config, overrides)
    setup_logging(level=args.log_level)
    security = security_for(args, config.router.host)   # refuses an unsafe setup before starting anything
    if args.detached or (args.detached is None and os.environ.get("RAY_ADDRESS")):
        return launch.up_detached(args, config)
    print(f"tandem: starting {config.prefill.replicas} prefill + {config.decode.replicas} decode actors "
          f"serving {config.engine.model} ...", flush=True)
    # SIGTERM before the server is up must still shut the cluster down cleanly
    stopping = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stopping.__setitem__("flag", True))
    cluster = start_cluster(config)
    try:
        if not stopping["flag"]:
            asyncio.run(serve_until_stopped(cluster, config, security))
    except KeyboardInterrupt:
        pass
    finally:
        print("tandem: shutting down ...", flush=True)
        cluster.shutdown()
    print("tandem: stopped", flush=True)
    return 0


def security_for(args, host: str) -> dict:
    """The router's security from the flags (auth on by default off loopback): raises
    AuthConfigError for an unsafe setup."""
    auth = resolve_auth(host, token_file=args.auth_token_file, env_token=os.environ.get("TANDEM_AUTH_TOKEN"),
                        no_auth=args.no_auth, insecure_no_auth=args.insecure_no_auth)
    if auth.warning:
        logging.getLogger("tandem").warning(auth.warning)
    return _server_security(args, auth.enabled)


def _server_security(args, auth_enabled: bool) -> dict:
    """gRPC interceptors (bearer tokens) and credentials (TLS / mTLS) for the router."""
    out: dict = {"interceptors": (), "credentials": None, "token_store": None, "ssl_context": None}
    admin = TokenStore.admin_from_sources(getattr(args, "admin_token_file", None))
    if auth_enabled:
        out["token_store"] = TokenStore.from_sources(args.auth_token_file)   # gRPC and HTTP edges alike
        if admin is None:
            logging.getLogger("tandem").warning("auth is on and no admin token is configured: the Admin API "
                                                "refuses every call (--admin-token-file or $TANDEM_ADMIN_TOKEN)")
    if auth_enabled or admin is not None:
        out["interceptors"] = (BearerTokenInterceptor(out["token_store"], admin=admin),)
    out["admin_store"] = admin
    if args.tls_cert_file:
        tls = TLSConfig(cert_file=args.tls_cert_file, key_file=args.tls_key_file,
                        client_ca_file=args.tls_client_ca_file, require_client_cert=args.tls_require_client_cert)
        out["credentials"] = server_credentials(tls)
        out["ssl_context"] = server_ssl_context(tls)   # the HTTP edge: HTTPS with the same files
    return out


async def serve_until_stopped(cluster, config, security: dict | None = None) -> None:
    # the tokenizer's loader brings torch, the router Ray: only `tandem up` needs them
    from tandem.engine.weights import load_tokenizer  # noqa: PLC0415
    from tandem.router.drain import drain_and_stop  # noqa: PLC0415
    from tandem.router.server import serve  # noqa: PLC0415

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tokenizer, model_config = load_tokenizer(config.engine.model)
    security = dict(security or {})
    admin = security.pop("admin_store", None)
    rc = config.router
    if rc.metrics_auth and admin is None:
        raise SystemExit("tandem: router.metrics_auth needs an admin token (--admin-token-file or $TANDEM_ADMIN_TOKEN)")
    server, router, port = await serve(cluster.controller, config, cluster.namespace, tokenizer, model_config,
                                       **security)
    if rc.metrics_port is not None:
        mport = start_metrics_server(rc.metrics_port, rc.metrics_host, verify=admin.verify if rc.metrics_auth else None)
        print(f"tandem: metrics on http://{rc.metrics_host}:{mport}/metrics", flush=True)
    if router.http_port is not None:
        scheme = "https" if (security or {}).get("ssl_context") else "http"
        print(f"tandem: OpenAI API on {scheme}://{rc.host}:{router.http_port}/v1", flush=True)
    print(f"tandem: serving on {rc.host}:{port} (Ctrl-C to stop)", flush=True)
    after_startup()  # the router's start-up objects out of GC walks; long pauses are logged
    try:
        await stop.wait()
        print(f"tandem: draining (up to {rc.drain_timeout_s:g} s) ...", flush=True)
    finally:
        await drain_and_stop(server, router, rc.drain_timeout_s)   # health NOT_SERVING; streams finish


# ---- clients ------------------------------------------------------------------------------------
def _channel(target: str, args=None, admin: bool = False):
    """A channel to the router, with TLS and the bearer token when the flags or env ask for them
    (`admin`: the admin token, for the Admin API)."""
    admin_file = getattr(args, "admin_token_file", None)
    if admin and (admin_file or os.environ.get(ADMIN_TOKEN_ENV)):
        token = load_admin_token(admin_file)
    else:
        token = load_client_token(token_file=getattr(args, "auth_token_file", None))
    if getattr(args, "tls_ca_file", None):
        tls = ClientTLSConfig(ca_file=args.tls_ca_file, cert_file=args.tls_cert_file, key_file=args.tls_key_file,
                              server_name=args.tls_server_name)
        creds = channel_credentials(tls)
        if token:
            creds = grpc.composite_channel_credentials(creds, call_credentials(token))
        return grpc.secure_channel(target, creds, options=channel_options(tls))
    channel = grpc.insecure_channel(target)
    if token:
        channel = with_metadata(channel, auth_metadata(token))
    return channel


def stream_generate(stub, *, messages=None, prompt=None, session_id="", max_tokens=256, temperature=0.0,
                    on_text=None, timeout=None):
    """Send one Generate call; calls on_text(delta) as text streams; returns (text, token ids, last msg)."""
    req = pb.GenerateRequest(session_id=session_id,
                             sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=temperature))
    if messages is not None:
        req.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    else:
        req.prompt = prompt
    text, ids, last = "", [], None
    for resp in stub.Generate(req, timeout=timeout):
        text += resp.text
        ids.extend(resp.token_ids)
        if on_text and resp.text:
            on_text(resp.text)
        last = resp
    return text, ids, last


def cmd_chat(args) -> int:
    """An interactive session through tandem.client: each turn streams, the history stays in the
    session, and its KV on the workers that served the last turn. A turn the router sheds is sent
    again after its hint, twice at most, before the error is shown."""
    client = Client(channel=_channel(args.target, args), max_retries=2)
    session = client.session(args.session)
    print(f"session {session.session_id}; an empty line or Ctrl-D ends it", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if not line.strip():
            break
        sys.stdout.write("assistant> ")
        try:
            for chunk in session.stream(line, max_tokens=args.max_tokens, temperature=args.temperature):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        except TandemError as e:
            print(f"\ntandem: {e.code.name}: {e.details}", file=sys.stderr)
            continue
        u = chunk.usage
        print(f"\n[{u.prompt_tokens} prompt tokens, {u.cached_prompt_tokens} cached, {u.completion_tokens} generated]",
              file=sys.stderr)
    client.close()
    return 0


def cmd_status(args) -> int:
    stub = admin_pb2_grpc.AdminStub(_channel(args.target, args, admin=True))
    try:
        state = stub.GetClusterState(admin_pb2.GetClusterStateRequest(), timeout=10)
    except grpc.RpcError as e:
        print(f"tandem: cannot reach {args.target}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(MessageToDict(state, preserving_proto_field_name=True,
                                       always_print_fields_with_no_presence=True), indent=2))
        return 0
    print(f"{'pool':8} {'size':>4} {'target':>6} {'min':>4} {'max':>4} {'draining':>8}")
    for p in state.pools:
        print(f"{p.name:8} {p.size:>4} {p.target:>6} {p.min:>4} {p.max:>4} {p.draining:>8}")
    print()
    print(f"{'worker':12} {'pool':8} {'role':8} {'pid':>7} {'state':9} {'running':>7} {'waiting':>7} "
          f"{'KV blocks':>14}  node")
    for p in state.pools:
        for w in p.workers:
            st = admin_pb2.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower()
            print(f"{w.id:12} {w.pool:8} {w.role or w.pool:8} {w.pid:>7} {st:9} {w.running_requests:>7} "
                  f"{w.waiting_requests:>7} {w.kv_blocks_used:>6}/{w.kv_blocks_total:<7}  {w.node[:12]}")
    t = state.totals
    print(f"\ntotal: {t.workers} workers, {t.running_requests} running, {t.waiting_requests} waiting, "
          f"KV {t.kv_blocks_used}/{t.kv_blocks_total} blocks")
    if state.last_decision.reasons:
        print("last autoscaler decision:", *state.last_decision.reasons, sep="\n  ")
    if state.role_changes:
        print("role changes:", *(_role_change_line(c) for c in state.role_changes), sep="\n  ")
    return 0


def _role_change_line(c) -> str:
    at = time.strftime("%H:%M:%S", time.localtime(c.at_unix_s))
    return f"{at} {c.worker_id} ({c.pool} pool) {c.from_role} -> {c.to_role} in {1e3 * c.took_s:.0f} ms: {c.reason or '-'}"
