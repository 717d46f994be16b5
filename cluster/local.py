"""A whole Tandem cluster inside this process, for tests and benchmarks: the controller and pool
actors on the Ray this process is connected to, and one or more gRPC routers on 127.0.0.1 served
from a background event loop (each with its OpenAI HTTP edge on a free port). Tests talk gRPC to it and can also read the actors' counters."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import replace

import grpc
import ray

from tandem.cluster.bootstrap import start_cluster
from tandem.cluster.config import load_config
from tandem.engine.weights import load_tokenizer
from tandem.protos.tandem.v1 import admin_pb2, admin_pb2_grpc, generation_pb2 as pb, generation_pb2_grpc
from tandem.router.server import serve
from tandem.wire.stats import WorkerStats


class RunningCluster:
    def __init__(self, overrides: dict, redis_url: str | None = None):
        self.config = load_config(None, {"router.port": 0, "router.http_port": 0, "router.redis_url": redis_url, **overrides})
        self.cluster = start_cluster(self.config, namespace=f"test-{uuid.uuid4().hex[:6]}")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.routers = []
        self.target = self.add_router()
        self.channel = grpc.insecure_channel(self.target)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)

    def add_router(self, redis_url: str | None = None, tokenizer=None, **serve_kw) -> str:
        """Start another router on this cluster (optionally with its own Redis URL, or a tokenizer of
        the same vocabulary with another chat template; serve_kw: auth for router/server.py's
        `serve`); its target. Its HTTP port: `routers[-1][1].http_port`."""
        config = self.config
        if redis_url is not None:
            config = replace(config, router=replace(config.router, redis_url=redis_url))
        tok, model_cfg = load_tokenizer(config.engine.model)
        tok = tokenizer or tok
        fut = asyncio.run_coroutine_threadsafe(
            serve(self.cluster.controller, config, self.cluster.namespace, tok, model_cfg, **serve_kw), self.loop)
        server, router, port = fut.result(60)
        self.routers.append((server, router))
        return f"127.0.0.1:{port}"

    # ---- helpers ----------------------------------------------------------------------------
    def generate(self, stub=None, timeout=120, **kw):
        """-> (token ids, text, last response). kw: prompt | prompt_token_ids | messages, session_id,
        and sampling fields."""
        sampling = {k: kw.pop(k) for k in list(kw) if k in ("max_tokens", "temperature", "top_p", "top_k",
                                                           "seed", "stop", "ignore_eos", "presence_penalty",
                                                           "frequency_penalty", "repetition_penalty")}
        msgs = kw.pop("messages", None)
        req = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), **kw)
        if msgs:
            req.messages.extend(pb.ChatMessage(**m) for m in msgs)
        ids, text, last = [], "", None
        for r in (stub or self.stub).Generate(req, timeout=timeout):
            ids.extend(r.token_ids)
            text += r.text
            last = r
        return ids, text, last

    def worker_stats(self) -> dict[str, WorkerStats]:
        state = ray.get(self.cluster.controller.cluster_state.remote())
        handles = {w.worker_id: ray.get_actor(w.actor_name, namespace=self.cluster.namespace)
                   for w in state.workers if w.state == "ready"}
        out = {}
        for wid, h in handles.items():
            try:
                out[wid] = ray.get(h.stats.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # died since the controller last looked
        return out

    def admin_blocks_in_use(self) -> dict[str, int]:
        state = self.admin.GetClusterState(admin_pb2.GetClusterStateRequest(), timeout=10)
        return {w.id: w.kv_blocks_used for p in state.pools for w in p.workers}

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, int]:
        """Until Admin reports zero KV blocks held on every worker; returns the last reading."""
        deadline = time.monotonic() + timeout_s
        while True:
            used = self.admin_blocks_in_use()
            if used and all(v == 0 for v in used.values()):
                return used
            if time.monotonic() > deadline:
                return used
            time.sleep(0.3)

    def close(self) -> None:
        async def stop():
            for server, router in self.routers:
                await server.stop(grace=1)
                if router.http is not None:
                    await router.http.cleanup()
                await router.view.stop()
                await router.sessions.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.cluster.shutdown()
