"""Tandem's Python client over gRPC (`tandem.v1`): `Client` (blocking) and `AsyncClient` (asyncio)
with generate, stream, sessions, health and admin; typed results (`Completion`, `Chunk`,
`ClusterState`) and one exception class per gRPC status (`tandem.client.errors`). It needs only
the generated stubs (`tandem.protos`), never the router, the engine or Ray."""

from tandem.client.aio import AsyncClient, AsyncSession
from tandem.client.channel import TLS
from tandem.client.errors import (Cancelled, DeadlineExceeded, InternalError, InvalidRequest, NotFound, Overloaded,
                                  PermissionDenied, TandemError, Unauthenticated, Unavailable)
from tandem.client.sync import Client, Session
from tandem.client.types import ClusterState, Completion, FinishReason, Pool, TokenLogprob, Usage, Worker

__all__ = ["AsyncClient", "AsyncSession", "Cancelled", "Client", "ClusterState", "Completion", "DeadlineExceeded",
           "FinishReason", "InternalError", "InvalidRequest", "NotFound", "Overloaded", "PermissionDenied", "Pool",
           "Session", "TLS", "TandemError", "TokenLogprob", "Unauthenticated", "Unavailable", "Usage", "Worker"]
