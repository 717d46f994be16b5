"""One exception class per gRPC status the router answers with (docs/api.md lists when each
happens), all under `TandemError`; `error_from_rpc` maps a `grpc.RpcError` to its class once."""

from __future__ import annotations

import random

import grpc

RETRY_AFTER_KEY = "retry-after-ms"   # router/admission.py's trailing metadata on RESOURCE_EXHAUSTED


class TandemError(Exception):
    """A call the router refused or that failed; `code` is the gRPC status, `details` its message."""
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, code: grpc.StatusCode | None = None):
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code


class InvalidRequest(TandemError):
    """INVALID_ARGUMENT: the request is wrong (the message says what is allowed); do not retry."""
    code = grpc.StatusCode.INVALID_ARGUMENT


class Unauthenticated(TandemError):
    """UNAUTHENTICATED: no bearer token, or not one the router accepts."""
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(TandemError):
    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(TandemError):
    """NOT_FOUND: an unknown worker or pool (Admin)."""
    code = grpc.StatusCode.NOT_FOUND


class Overloaded(TandemError):
    """RESOURCE_EXHAUSTED: the router is shedding load; retry after `retry_after_s`."""
    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, details: str, retry_after_s: float | None = None):
        super().__init__(details)
        self.retry_after_s = retry_after_s


class Unavailable(TandemError):
    """UNAVAILABLE: no worker can take the request now, or the router cannot be reached; retry."""
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(TandemError):
    """DEADLINE_EXCEEDED: the call's timeout passed; the request was freed on every worker."""
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(TandemError):
    code = grpc.StatusCode.CANCELLED


class InternalError(TandemError):
    """INTERNAL / UNKNOWN: a failure in the cluster; the message names it."""
    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[TandemError]] = {
    c.code: c for c in (InvalidRequest, Unauthenticated, PermissionDenied, NotFound, Overloaded, Unavailable,
                        DeadlineExceeded, Cancelled, InternalError)}


def error_from_rpc(e: grpc.RpcError) -> TandemError:
    """The TandemError for a failed call (sync or asyncio)."""
    code, details = e.code(), e.details() or ""
    cls = _BY_CODE.get(code, InternalError)
    if cls is Overloaded:
        return Overloaded(details, retry_hint_s(dict(e.trailing_metadata() or ()).get(RETRY_AFTER_KEY)))
    return cls(details, code)


def retry_hint_s(ms: str | None) -> float | None:
    """A `retry-after-ms` value (gRPC trailing metadata or HTTP header) in seconds; None where
    absent or not an integer."""
    try:
        return int(ms) / 1000 if ms else None
    except ValueError:
        return None


MAX_RETRY_WAIT_S = 60.0     # a hint longer than this is not waited for: the error is raised


def retry_delay(e: TandemError, attempt: int, rng: random.Random | None = None) -> float | None:
    """Seconds to wait before retry `attempt` (0 for the first) of a request that failed with `e`
    before its first chunk, or None where a retry would not help (`backoff_s`, each backoff drawn
    from 75-100% so clients shed together do not return together)."""
    hint = e.retry_after_s if isinstance(e, Overloaded) else None
    return backoff_s(e.code.name, hint, attempt, (rng or random).uniform(0.75, 1.0))


def backoff_s(status: str, hint_s: float | None, attempt: int, jitter: float = 1.0) -> float | None:
    """The retry policy, pure (the client's, `tandem bench --retries`' and the simulator's): a
    request refused with gRPC status `status` (its name) before its first chunk waits this long
    before retry `attempt`, or None where a retry would not help. RESOURCE_EXHAUSTED waits the
    router's hint; without one, and on UNAVAILABLE, 0.5 s doubling per attempt up to 8 s, times
    `jitter`. A hint past MAX_RETRY_WAIT_S: None (the cluster is saying it is full for a long while)."""
    if status not in ("RESOURCE_EXHAUSTED", "UNAVAILABLE"):
        return None
    if status == "RESOURCE_EXHAUSTED" and hint_s is not None:
        return hint_s if 0 <= hint_s <= MAX_RETRY_WAIT_S else None
    return min(0.5 * 2 ** attempt, 8.0) * jitter


def next_retry(e: TandemError, attempt: int, started: bool, max_retries: int) -> float | None:
    """Seconds to wait before sending a failed request again, or None to raise `e`: only a request
    refused before its first chunk, at most `max_retries` times, as `retry_delay` says."""
    return None if started or attempt >= max_retries else retry_delay(e, attempt)
