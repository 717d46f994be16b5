"""The router's one table from error type to gRPC status code, used at its edge by both services
(router/server.py's Generation, router/admin.py's Admin): each failure kind leaves as one code. The
OpenAI HTTP edge (router/openai_api.py) maps that code on to an HTTP status by `HTTP_STATUS`.
`client_message` is what a client reads: one line, without tracebacks, file paths, pids, addresses,
actor ids or terminal colours; the detail goes to the log, under the request's id."""

from __future__ import annotations

import re

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


# A failure of these kinds is the router's (or the controller's) own refusal, with a message meant
# for the client; anything else failed inside the cluster and is named only by its type.
OWN_MESSAGES: tuple[type[BaseException], ...] = (
    InvalidRequestError, DuplicateRequest, Overloaded, WorkersOverloaded, NoWorkerReady, MigrationsExhausted,
    UnknownWorker, UnknownPool, InvalidPoolBounds, InvalidRole)
_SCRUB = (
    (re.compile(r"\x1b\[[0-9;?]*[A-Za-z]"), ""),                                   # ANSI colours
    (re.compile(r"(?:[A-Za-z]:)?(?:/[\w.@+-]+){2,}/?"), "<path>"),                  # file paths
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"), "<address>"),            # IPv4[:port]
    (re.compile(r"\[[0-9a-f.]*:[0-9a-f:.]*\](?::\d+)?|\b(?:[0-9a-f]{1,4}:){7}[0-9a-f]{1,4}\b|"
                r"(?<![\w:])(?:[0-9a-f]{1,4}(?::[0-9a-f]{1,4})*)?::(?:[0-9a-f]{1,4}(?::[0-9a-f]{1,4})*)?(?![\w:])",
                re.I), "<address>"),                                                    # IPv6
    (re.compile(r"\b(pid|PID)[=: ]+\d+"), r"\1=<pid>"),
    (re.compile(r"\b[0-9a-f]{24,}\b"), "<id>"),                                    # Ray actor/task/node ids
)


def one_line(text: str, limit: int = 300) -> str:
    """`text` as one scrubbed line for a client: its first non-empty line, internals masked."""
    for pattern, repl in _SCRUB[:1]:
        text = pattern.sub(repl, text)
    text = text.split("Traceback (most recent call last)")[0]
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "").rstrip(" :")
    for pattern, repl in _SCRUB[1:]:
        line = pattern.sub(repl, line)
    return line[:limit]


def client_message(e: BaseException, request_id: str | None = None) -> str:
    """What the client reads about `e`: the refusal's own message (scrubbed, one line) for the
    router's and controller's errors, else only the failure's kind; with the request id to quote."""
    cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None else e
    ref = f" (request {request_id})" if request_id else ""
    if isinstance(cause, OWN_MESSAGES):
        return one_line(str(cause)) + ref
    kind = "the worker was lost" if isinstance(cause, ray.exceptions.RayActorError) else type(cause).__name__
    return f"request failed in the cluster ({kind}){ref}; it is safe to retry"
