"""The asyncio client: `AsyncClient`, the blocking `Client`'s twin over grpc.aio.

    async with AsyncClient("127.0.0.1:50051") as c:
        done = await c.generate(prompt="Hello", max_tokens=16)
        async for chunk in c.stream(messages=[{"role": "user", "content": "Hi"}]):
            ...

Closing a stream early (break, or the task cancelled) cancels the request and frees its KV.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from typing import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.client.channel import DEFAULT_TARGET, TLS, auth_metadata, make_channel
from tandem.client.errors import error_from_rpc, next_retry
from tandem.client.types import (Accumulator, Chunk, ClusterState, Completion, Pool, Worker, build_request,
                                 chunk_from, cluster_state_from, pool_from, worker_from)
from tandem.protos.tandem.v1 import admin_pb2, admin_pb2_grpc, generation_pb2_grpc


class AsyncClient:
    def __init__(self, target: str = DEFAULT_TARGET, *, token: str | None = None, admin_token: str | None = None,
                 tls: TLS | None = None,
                 channel: grpc.aio.Channel | None = None, timeout: float | None = None, max_retries: int = 0):
        """As `Client`'s (`max_retries` too)."""
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.channel = channel or make_channel(target, tls, aio=True)
        self.metadata = auth_metadata(token)
        # the Admin API takes only admin tokens (router --admin-token-file); without one, `token`
        self.admin_metadata = auth_metadata(admin_token or token)
        self.timeout = timeout
        self.max_retries = max_retries
        self._gen = generation_pb2_grpc.GenerationStub(self.channel)
        self._admin = admin_pb2_grpc.AdminStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    async def stream(self, **kw) -> AsyncIterator[Chunk]:
        request = build_request(**kw)
        for attempt in itertools.count():
            call = self._gen.Generate(request, timeout=self.timeout, metadata=self.metadata)
            started = False
            try:
                async for resp in call:
                    started = True
                    yield chunk_from(resp)
                return
            except grpc.RpcError as e:
                err = error_from_rpc(e)
                wait = next_retry(err, attempt, started, self.max_retries)
                if wait is None:
                    raise err from None
            finally:
                call.cancel()
            await asyncio.sleep(wait)

    async def generate(self, **kw) -> Completion:
        acc = Accumulator()
        async for c in self.stream(**kw):
            acc.add(c)
        return acc.completion()

    def session(self, session_id: str | None = None, system: str | None = None) -> AsyncSession:
        return AsyncSession(self, session_id or uuid.uuid4().hex[:16], system)

    async def health(self, service: str = "") -> str:
        try:
            r = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout or 10)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    async def cluster_state(self) -> ClusterState:
        return cluster_state_from(await self._call(self._admin.GetClusterState, admin_pb2.GetClusterStateRequest()))

    async def set_pool_bounds(self, pool: str, min: int, max: int, target: int | None = None) -> Pool:
        req = admin_pb2.SetPoolBoundsRequest(pool=pool, min=min, max=max)
        if target is not None:
            req.target = target
        return pool_from(await self._call(self._admin.SetPoolBounds, req))

    async def drain_worker(self, worker_id: str, finish_in_place: bool = False) -> Worker:
        return worker_from(await self._call(self._admin.DrainWorker, admin_pb2.DrainWorkerRequest(
            worker_id=worker_id, finish_in_place=finish_in_place)))

    async def move_sequences(self, worker_id: str, count: int = 0) -> int:
        return (await self._call(self._admin.MoveSequences, admin_pb2.MoveSequencesRequest(
            worker_id=worker_id, count=count))).paused

    async def _call(self, method, req):
        try:
            return await method(req, timeout=self.timeout or 30, metadata=self.admin_metadata)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class AsyncSession:
    """`Session` for the asyncio client: the history under one session id."""

    def __init__(self, client: AsyncClient, session_id: str, system: str | None = None):
        self.client, self.session_id = client, session_id
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []

    async def stream(self, text: str, **kw) -> AsyncIterator[Chunk]:
        self.messages.append({"role": "user", "content": text})
        acc = Accumulator()
        try:
            async for c in self.client.stream(messages=self.messages, session_id=self.session_id, **kw):
                yield acc.add(c)
        except BaseException:
            self.messages.pop()
            raise
        self.messages.append({"role": "assistant", "content": "".join(acc.parts)})

    async def send(self, text: str, **kw) -> Completion:
        acc = Accumulator()
        async for c in self.stream(text, **kw):
            acc.add(c)
        return acc.completion()
