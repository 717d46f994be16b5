"""Bounded admission at the router: how many requests run, how many wait, and who is told to back off.

`AdmissionLimiter` lets at most `max_in_flight` requests run and `max_queue` wait (FIFO); a request
past that, or one from a client that already has `max_streams_per_client` streams open, or one whose
expected wait is over `max_expected_wait_s`, is refused at once with `Overloaded`. The server maps
`Overloaded`, once, to RESOURCE_EXHAUSTED with trailing metadata `retry-after-ms` (from
`Overloaded.trailing_metadata()`). The hint comes from `ServiceRate`: how fast slots have freed
over the last `rate_window_s`. No gRPC here; time comes from the `clock` argument, so tests drive
it by hand. The limiter belongs to one event loop and is not thread-safe.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

RETRY_AFTER_KEY = "retry-after-ms"
Clock = Callable[[], float]


class Overloaded(Exception):
    """The router is shedding this request; the client should retry after `retry_after_s`."""

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(f"{reason}; retry after {retry_after_s:.2f} s")
        self.reason = reason
        self.retry_after_s = retry_after_s

    @property
    def retry_after_ms(self) -> int:
        return max(1, round(self.retry_after_s * 1000))

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((RETRY_AFTER_KEY, str(self.retry_after_ms)),)


@dataclass(frozen=True)
class AdmissionConfig:
    max_in_flight: int = 256  # requests running past admission (routed to workers)
    max_queue: int = 1024  # requests waiting for a running slot; 0: refuse instead of queueing
    max_streams_per_client: int = 0  # running + waiting per client identity; 0: no limit
    # Refuse at arrival when the queue ahead would take longer than this to clear at the recent
    # service rate. None: no such check (the client's deadline still bounds the wait).
    max_expected_wait_s: float | None = None
    rate_window_s: float = 30.0  # how far back the service rate looks
    default_retry_after_s: float = 1.0  # the hint before any request has finished
    min_retry_after_s: float = 0.05
    max_retry_after_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"admission: max_in_flight must be >= 1, got {self.max_in_flight}")
        for name in ("max_queue", "max_streams_per_client"):
            if getattr(self, name) < 0:
                raise ValueError(f"admission: {name} must be >= 0, got {getattr(self, name)}")
        if self.max_expected_wait_s is not None and self.max_expected_wait_s <= 0:
            raise ValueError("admission: max_expected_wait_s must be > 0 (or None for no limit)")
        if self.rate_window_s <= 0:
            raise ValueError(f"admission: rate_window_s must be > 0, got {self.rate_window_s}")
        if not 0 < self.min_retry_after_s <= self.max_retry_after_s:
            raise ValueError("admission: need 0 < min_retry_after_s <= max_retry_after_s")


class ServiceRate:
    """Slots freed per second over a sliding window, and the retry hints derived from it."""

    def __init__(self, config: AdmissionConfig, clock: Clock) -> None:
        self._config, self._clock = config, clock
        self._done: collections.deque[float] = collections.deque()  # release times, oldest first
        self._started = clock()

    def record_release(self) -> None:
        self._done.append(self._clock())
        self._trim()

    def per_second(self) -> float | None:
        """Releases per second over the window; None before the first one."""
        self._trim()
        if not self._done:
            return None
        now = self._clock()
        span = min(self._config.rate_window_s, max(now - self._started, 1e-3))
        return len(self._done) / span

    def wait_for(self, num_ahead: int) -> float | None:
        """Expected seconds until `num_ahead` more slots have freed; None when unknown."""
        rate = self.per_second()
        return None if rate is None else num_ahead / rate

    def retry_after(self, num_ahead: int) -> float:
        expected = self.wait_for(num_ahead)
        c = self._config
        hint = c.default_retry_after_s if expected is None else expected
        return min(c.max_retry_after_s, max(c.min_retry_after_s, hint))

    def _trim(self) -> None:
        horizon = self._clock() - self._config.rate_window_s
        while self._done and self._done[0] < horizon:
            self._done.popleft()


@dataclass
class Admission:
    """A request's running slot; give it back with `AdmissionLimiter.release` (once)."""

    client: str
    queued_s: float  # how long it waited (tandem:request_queue_time_seconds)
    released: bool = False


class AdmissionLimiter:
    def __init__(self, config: AdmissionConfig = AdmissionConfig(), clock: Clock = time.monotonic,
                 on_change: Callable[[int, int], None] | None = None) -> None:
        """`on_change(running, waiting)` is called whenever either changes (e.g. to set gauges)."""
        self.config = config
        self._clock = clock
        self.rate = ServiceRate(config, clock)
        self._on_change = on_change
        self._running = 0
        self._queue: collections.deque[asyncio.Future] = collections.deque()
        self._per_client: collections.Counter[str] = collections.Counter()

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def streams_of(self, client: str) -> int:
        return self._per_client[client]

    def check(self, client: str) -> None:
        """Raise Overloaded if a request from `client` would be refused now; changes nothing."""
        c = self.config
        if c.max_streams_per_client and self._per_client[client] >= c.max_streams_per_client:
            # Little's law: a running request takes about running / rate seconds.
            raise Overloaded(f"this client already has {self._per_client[client]} streams open, "
                             f"the limit is {c.max_streams_per_client}",
                             self.rate.retry_after(max(1, self._running)))
        if self._running < c.max_in_flight and not self._queue:
            return
        if len(self._queue) >= c.max_queue:
            raise Overloaded(f"server overloaded: {self._running} requests running and "
                             f"{len(self._queue)} queued (the queue limit)",
                             # by then half the queue has cleared: retries do not all collide
                             self.rate.retry_after(c.max_queue // 2 + 1))
        if c.max_expected_wait_s is not None:
            expected = self.rate.wait_for(len(self._queue) + 1)
            if expected is not None and expected > c.max_expected_wait_s:
                raise Overloaded(f"server overloaded: the queue would take about {expected:.1f} s, "
                                 f"over the {c.max_expected_wait_s:g} s limit",
                                 self.rate.retry_after(len(self._queue) + 1))

    async def acquire(self, client: str) -> Admission:
        """Wait for a running slot (FIFO) or raise Overloaded at once. Cancelling the waiting
        task (the client went away, its deadline passed) leaves the queue cleanly."""
        self.check(client)
        arrived = self._clock()
        self._per_client[client] += 1
        if self._running < self.config.max_in_flight and not self._queue:
            self._running += 1
            self._changed()
            return Admission(client, 0.0)
        slot: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue.append(slot)
        self._changed()
        try:
            await slot
        except BaseException:
            if slot.done() and not slot.cancelled():
                self._hand_over()  # the slot came just as we were cancelled: pass it on
            else:
                slot.cancel()
                with contextlib.suppress(ValueError):
                    self._queue.remove(slot)
            self._forget(client)
            self._changed()
            raise
        return Admission(client, self._clock() - arrived)

    def release(self, admission: Admission) -> None:
        if admission.released:
            return
        admission.released = True
        self._forget(admission.client)
        self.rate.record_release()
        self._hand_over()
        self._changed()

    @contextlib.asynccontextmanager
    async def admit(self, client: str) -> AsyncIterator[Admission]:
        """`async with limiter.admit(client) as a:` runs the block in a slot, released after."""
        admission = await self.acquire(client)
        try:
            yield admission
        finally:
            self.release(admission)

    def _hand_over(self) -> None:
        # The slot goes straight to the oldest waiter, so a newcomer cannot jump the queue.
        while self._queue:
            slot = self._queue.popleft()
            if not slot.done():
                slot.set_result(None)
                return
        self._running -= 1

    def _forget(self, client: str) -> None:
        self._per_client[client] -= 1
        if self._per_client[client] <= 0:
            del self._per_client[client]

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self._running, len(self._queue))


def token_fingerprint(token: str) -> str:
    """A short, stable, non-reversible name for a token (for limits and logs, never the token)."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def client_identity(peer: str, verified_token: str | None = None) -> str:
    """Who a request comes from, for per-client limits: the token's fingerprint when auth is on
    and the token was verified, else the peer's address without its port (gRPC's
    `context.peer()`: "ipv4:10.0.0.7:51234", "ipv6:[::1]:51234", "unix:/path")."""
    if verified_token:
        return "token:" + token_fingerprint(verified_token)
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host, sep, port = address.rpartition(":")
        address = host if sep and port.isdigit() else address
        address = address.strip("[]")
    return f"peer:{address or peer}"
