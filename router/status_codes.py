"""The router's one table from error type to gRPC status code, used at its edge by both services
(router/server.py's Generation, router/admin.py's Admin): each failure kind leaves as one code."""

from __future__ import annotations

import grpc
import ray

from tandem.router.admission import Overloaded
from tandem.wire.errors import (InvalidPoolBounds, InvalidRequestError, MigrationsExhausted, NoWorkerReady,
                                UnknownPool, UnknownWorker, WorkersOverloaded, WorkerUnavailable)

# Error type -> status code, first match wins; anything else is INTERNAL.
STATUS_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),          # admission: with retry-after-ms
    (WorkersOverloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoWorkerReady, grpc.StatusCode.UNAVAILABLE),
    (MigrationsExhausted, grpc.StatusCode.UNAVAILABLE),
    (WorkerUnavailable, grpc.StatusCode.UNAVAILABLE),
    (UnknownWorker, grpc.StatusCode.NOT_FOUND),                  # Admin: the controller's refusals
    (UnknownPool, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidPoolBounds, grpc.StatusCode.INVALID_ARGUMENT),
    (ray.exceptions.RayActorError, grpc.StatusCode.UNAVAILABLE),
)


def status_code(e: BaseException) -> grpc.StatusCode:
    return next((code for kind, code in STATUS_CODES if isinstance(e, kind)), grpc.StatusCode.INTERNAL)
