"""One exception type per failure kind that crosses a process boundary. Workers raise them (Ray
re-raises them in the caller as subclasses of the same type); the router maps them to gRPC status
codes once, at its edge. Each takes one message argument, so it pickles across Ray unchanged."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent."""


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (bad parameter, too long, unknown role ...).

    Raised before any KV is allocated; the message says what is wrong and what is allowed.
    """


class WorkerUnavailable(RuntimeError):
    """This worker takes no new requests (draining or out of KV); the router tries another."""


class NoReservation(KeyError):
    """A call names a transfer this worker holds no reservation for: never made, aborted, or
    freed because it was not started in time. The router prefills locally instead."""

    def __str__(self) -> str:      # KeyError quotes its argument; this is a sentence
        return str(self.args[0]) if self.args else ""


class TransferFailed(RuntimeError):
    """A KV transfer ended without delivering the KV (it failed or was aborted), or a prefill's
    transfer ended before its first output token was sampled."""


class WorkerLost(RuntimeError):
    """A worker process died or stopped answering; its requests move to another worker."""


# ---- the router's own failures (router helper) ------------------------------------------------------
class NoWorkerReady(RuntimeError):
    """No worker of a pool is ready (all gone, starting or draining): UNAVAILABLE, retry later."""


WORKERS_RETRY_AFTER_S = 1.0   # the hint a WorkersOverloaded refusal carries (the simulator's too)


class WorkersOverloaded(RuntimeError):
    """Every ready worker of a pool is past its overload limits, or (`reason` "batch_guard") no
    decode batch has room for the request within the TPOT SLO: RESOURCE_EXHAUSTED, retry after
    `retry_after_s` (both edges send it as the hint)."""

    def __init__(self, message: str, reason: str = "worker_overload",
                 retry_after_s: float = WORKERS_RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class MigrationsExhausted(RuntimeError):
    """A request's decode actors failed it more times than the router moves a request: UNAVAILABLE."""


# ---- the controller's refusals (the Admin service) ---------------------------------------------
class UnknownWorker(KeyError):
    """An operator named a worker that is not a member of any pool (never was, or already left):
    NOT_FOUND."""

    def __str__(self) -> str:      # KeyError quotes its argument; this is a sentence
        return str(self.args[0]) if self.args else ""


class UnknownPool(ValueError):
    """An operator named a pool other than prefill and decode: INVALID_ARGUMENT."""


class InvalidPoolBounds(ValueError):
    """New pool bounds that do not satisfy 0 <= min <= max: INVALID_ARGUMENT."""


class InvalidRole(ValueError):
    """A worker role other than "prefill", "decode" and "mixed": INVALID_ARGUMENT."""
