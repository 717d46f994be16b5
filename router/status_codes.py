"""The router's one table from error type to gRPC status code, used at its edge by both services
(router/server.py's Generation, router/admin.py's Admin): each failure kind leaves as one code. The
OpenAI HTTP edge (router/openai_api.py) maps that code on to an HTTP status by `HTTP_STATUS`."""

from __future__ import annotations

import grpc
import ray

from tandem.router.admission import Overloaded
from tandem.router.request_ids import DuplicateRequest
from tandem.wire.errors import (InvalidPoolBounds, InvalidRequestError, InvalidRole, MigrationsExhausted,
                                NoWorkerReady, UnknownPool, UnknownWorker, WorkersOverloaded, WorkerUnavailable)

# Error type -> status code, first match wins; anything else is INTERNAL.
STATUS_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (DuplicateRequest, grpc.StatusCode.ALREADY_EXISTS),           # the caller's own live request id
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),          # admission: with retry-after-ms
    (WorkersOverloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoWorkerReady, grpc.StatusCode.UNAVAILABLE),
    (MigrationsExhausted, grpc.StatusCode.UNAVAILABLE),
    (WorkerUnavailable, grpc.StatusCode.UNAVAILABLE),
    (UnknownWorker, grpc.StatusCode.NOT_FOUND),                  # Admin: the controller's refusals
    (UnknownPool, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidPoolBounds, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRole, grpc.StatusCode.INVALID_ARGUMENT),
    (ray.exceptions.RayActorError, grpc.StatusCode.UNAVAILABLE),
)


def status_code(e: BaseException) -> grpc.StatusCode:
    return next((code for kind, code in STATUS_CODES if isinstance(e, kind)), grpc.StatusCode.INTERNAL)

# gRPC status -> HTTP status, for the OpenAI HTTP edge (router/openai_api.py): the same error types
# through the table above, then this one; anything else is 500.
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def http_status(e: BaseException) -> int:
    return HTTP_STATUS.get(status_code(e), 500)
