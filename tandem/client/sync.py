"""The blocking client: `Client(target, token=..., tls=...)`.

    with Client("127.0.0.1:50051") as c:
        print(c.generate(prompt="Hello", max_tokens=16).text)
        for chunk in c.stream(messages=[{"role": "user", "content": "Hi"}]):
            print(chunk.text, end="")
        chat = c.session()                  # turns share a session id: their KV stays cached
        chat.send("Write a haiku.")

Generation keywords are `types.build_request`'s. Failures raise `tandem.client.errors` classes,
one per gRPC status. Leaving a stream early cancels the request, which frees its KV.
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.client.channel import DEFAULT_TARGET, TLS, auth_metadata, make_channel
from tandem.client.errors import error_from_rpc, next_retry
from tandem.client.types import (Accumulator, Chunk, ClusterState, Completion, Pool, Worker, build_request,
                                 chunk_from, cluster_state_from, pool_from, worker_from)
from tandem.protos.tandem.v1 import admin_pb2, admin_pb2_grpc, generation_pb2_grpc


class Client:
    def __init__(self, target: str = DEFAULT_TARGET, *, token: str | None = None, admin_token: str | None = None,
                 tls: TLS | None = None,
                 channel: grpc.Channel | None = None, timeout: float | None = None, max_retries: int = 0):
        """`channel`: use this one instead of making one; `timeout`: seconds per call (None: none);
        `max_retries`: how often a request refused before its first chunk is sent again
        (RESOURCE_EXHAUSTED after the router's retry hint, UNAVAILABLE after a backoff:
        errors.retry_delay), as the openai SDKs retry a 429; 0 (the default): the error is raised."""
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.channel = channel or make_channel(target, tls)
        self.metadata = auth_metadata(token)
        # the Admin API takes only admin tokens (router --admin-token-file); without one, `token`
        self.admin_metadata = auth_metadata(admin_token or token)
        self.timeout = timeout
        self.max_retries = max_retries
        self._gen = generation_pb2_grpc.GenerationStub(self.channel)
        self._admin = admin_pb2_grpc.AdminStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    # ---- generation -----------------------------------------------------------------------------
    def stream(self, **kw) -> Iterator[Chunk]:
        request = build_request(**kw)
        for attempt in itertools.count():   # sent again only when refused before its first chunk
            call = self._gen.Generate(request, timeout=self.timeout, metadata=self.metadata)
            started = False
            try:
                for resp in call:
                    started = True
                    yield chunk_from(resp)
                return
            except grpc.RpcError as e:
                err = error_from_rpc(e)
                wait = next_retry(err, attempt, started, self.max_retries)
                if wait is None:
                    raise err from None
            finally:
                call.cancel()   # a no-op once the stream ended; else the request is freed on every worker
            time.sleep(wait)

    def generate(self, **kw) -> Completion:
        acc = Accumulator()
        for c in self.stream(**kw):
            acc.add(c)
        return acc.completion()

    def session(self, session_id: str | None = None, system: str | None = None) -> Session:
        return Session(self, session_id or uuid.uuid4().hex[:16], system)

    # ---- health and admin ------------------------------------------------------------------------
    def health(self, service: str = "") -> str:
        """The router's health: "SERVING", or "NOT_SERVING" while it drains."""
        try:
            r = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout or 10)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    def cluster_state(self) -> ClusterState:
        return cluster_state_from(self._call(self._admin.GetClusterState, admin_pb2.GetClusterStateRequest()))

    def set_pool_bounds(self, pool: str, min: int, max: int, target: int | None = None) -> Pool:
        req = admin_pb2.SetPoolBoundsRequest(pool=pool, min=min, max=max)
        if target is not None:
            req.target = target
        return pool_from(self._call(self._admin.SetPoolBounds, req))

    def drain_worker(self, worker_id: str, finish_in_place: bool = False) -> Worker:
        """Drain a worker; its running sequences move elsewhere with their KV unless `finish_in_place`."""
        return worker_from(self._call(self._admin.DrainWorker, admin_pb2.DrainWorkerRequest(
            worker_id=worker_id, finish_in_place=finish_in_place)))

    def move_sequences(self, worker_id: str, count: int = 0) -> int:
        """Move up to `count` (0: all) of a worker's running sequences to others with their KV;
        -> how many it paused to move."""
        return self._call(self._admin.MoveSequences, admin_pb2.MoveSequencesRequest(worker_id=worker_id,
                                                                                   count=count)).paused

    def _call(self, method, req):
        try:
            return method(req, timeout=self.timeout or 30, metadata=self.admin_metadata)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Session:
    """A conversation: each turn sends the whole history under one session id, so the router sends
    it to the workers that hold its KV, and only the new turn is prefilled."""

    def __init__(self, client: Client, session_id: str, system: str | None = None):
        self.client, self.session_id = client, session_id
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []

    def stream(self, text: str, **kw) -> Iterator[Chunk]:
        """The answer to `text`, streamed; it joins the history once it is complete."""
        self.messages.append({"role": "user", "content": text})
        acc = Accumulator()
        try:
            for c in self.client.stream(messages=self.messages, session_id=self.session_id, **kw):
                yield acc.add(c)
        except BaseException:
            self.messages.pop()
            raise
        self.messages.append({"role": "assistant", "content": "".join(acc.parts)})

    def send(self, text: str, **kw) -> Completion:
        acc = Accumulator()
        for c in self.stream(text, **kw):
            acc.add(c)
        return acc.completion()
