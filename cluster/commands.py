"""Cluster subcommands of `tandem`: `up` (serve), `chat` (interactive client), `status` (Admin)."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import uuid

DEFAULT_TARGET = "127.0.0.1:50051"


def register(sub) -> None:
    up = sub.add_parser("up", help="start a cluster (local Ray, or the one RAY_ADDRESS names) and serve gRPC")
    up.add_argument("--config", help="cluster YAML (see cluster/config.py)")
    up.add_argument("--model")
    up.add_argument("--prefill", type=int, help="prefill actors")
    up.add_argument("--decode", type=int, help="decode actors")
    up.add_argument("--host")
    up.add_argument("--port", type=int)
    up.add_argument("--redis-url", help="share sessions between routers through Redis")
    up.add_argument("--local-prefill-threshold", type=float,
                    help="uncached prompt tokens up to which decode actors prefill locally (inf = colocated)")
    up.add_argument("--num-blocks", type=int, help="KV cache blocks per actor")
    up.add_argument("--log-level", default="WARNING")
    up.set_defaults(func=cmd_up)

    chat = sub.add_parser("chat", help="interactive chat against a running cluster")
    chat.add_argument("--target", default=DEFAULT_TARGET)
    chat.add_argument("--session", help="session id (default: a new one)")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.set_defaults(func=cmd_chat)

    st = sub.add_parser("status", help="pools and workers of a running cluster")
    st.add_argument("--target", default=DEFAULT_TARGET)
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)


# ---- up -----------------------------------------------------------------------------------------
def cmd_up(args) -> int:
    from cluster.bootstrap import start_cluster
    from cluster.config import load_config

    overrides = {"model.name": args.model, "prefill.replicas": args.prefill, "decode.replicas": args.decode,
                 "router.host": args.host, "router.port": args.port, "router.redis_url": args.redis_url,
                 "decode.local_prefill_threshold": args.local_prefill_threshold, "cache.num_blocks": args.num_blocks}
    config = load_config(args.config, overrides)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(f"tandem: starting {config.prefill.replicas} prefill + {config.decode.replicas} decode actors "
          f"serving {config.engine.model} ...", flush=True)
    # SIGTERM before the server is up must still shut the cluster down cleanly
    stopping = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stopping.__setitem__("flag", True))
    cluster = start_cluster(config)
    try:
        if not stopping["flag"]:
            asyncio.run(serve_until_stopped(cluster, config))
    except KeyboardInterrupt:
        pass
    finally:
        print("tandem: shutting down ...", flush=True)
        cluster.shutdown()
    print("tandem: stopped", flush=True)
    return 0


async def serve_until_stopped(cluster, config) -> None:
    from engine.weights import load_tokenizer
    from router.server import serve

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tokenizer, model_config = load_tokenizer(config.engine.model)
    server, router, port = await serve(cluster.controller, config, cluster.namespace, tokenizer, model_config)
    print(f"tandem: serving on {config.router.host}:{port} (Ctrl-C to stop)", flush=True)
    try:
        await stop.wait()
    finally:
        await router.health.enter_graceful_shutdown()  # health says NOT_SERVING; streams finish
        await server.stop(grace=10)
        await router.view.stop()
        await router.sessions.close()


# ---- clients ------------------------------------------------------------------------------------
def _channel(target: str):
    import grpc

    return grpc.insecure_channel(target)


def stream_generate(stub, *, messages=None, prompt=None, session_id="", max_tokens=256, temperature=0.0,
                    on_text=None, timeout=None):
    """Send one Generate call; calls on_text(delta) as text streams; returns (text, token ids, last msg)."""
    from protos.tandem.v1 import generation_pb2 as pb

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
    import grpc

    from protos.tandem.v1 import generation_pb2_grpc

    stub = generation_pb2_grpc.GenerationStub(_channel(args.target))
    session = args.session or uuid.uuid4().hex[:12]
    messages: list[dict[str, str]] = []
    print(f"session {session}; an empty line or Ctrl-D ends it", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        sys.stdout.write("assistant> ")
        try:
            text, _, last = stream_generate(stub, messages=messages, session_id=session, max_tokens=args.max_tokens,
                                            temperature=args.temperature,
                                            on_text=lambda t: (sys.stdout.write(t), sys.stdout.flush()))
        except grpc.RpcError as e:
            print(f"\ntandem: {e.code().name}: {e.details()}", file=sys.stderr)
            messages.pop()
            continue
        u = last.usage
        print(f"\n[{u.prompt_tokens} prompt tokens, {u.cached_prompt_tokens} cached, {u.completion_tokens} generated]",
              file=sys.stderr)
        messages.append({"role": "assistant", "content": text})
    return 0


def cmd_status(args) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from protos.tandem.v1 import admin_pb2, admin_pb2_grpc

    stub = admin_pb2_grpc.AdminStub(_channel(args.target))
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
    print(f"{'worker':12} {'pool':8} {'pid':>7} {'state':9} {'running':>7} {'waiting':>7} {'KV blocks':>14}  node")
    for p in state.pools:
        for w in p.workers:
            st = admin_pb2.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower()
            print(f"{w.id:12} {w.pool:8} {w.pid:>7} {st:9} {w.running_requests:>7} {w.waiting_requests:>7} "
                  f"{w.kv_blocks_used:>6}/{w.kv_blocks_total:<7}  {w.node[:12]}")
    t = state.totals
    print(f"\ntotal: {t.workers} workers, {t.running_requests} running, {t.waiting_requests} waiting, "
          f"KV {t.kv_blocks_used}/{t.kv_blocks_total} blocks")
    if state.last_decision.reasons:
        print("last autoscaler decision:", *state.last_decision.reasons, sep="\n  ")
    return 0
