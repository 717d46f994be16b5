"""Bounded admission at the router: how many requests run, how many wait, and who is told to back off.

`AdmissionLimiter` lets at most `max_in_flight` requests run and `max_queue` wait (FIFO); a request
past that, or one from a client that already has `max_streams_per_client` streams open, or one whose
predicted wait is over `max_expected_wait_s` (on by default), is refused at once with `Overloaded`.
The server maps `Overloaded`, once, to RESOURCE_EXHAUSTED with trailing metadata `retry-after-ms`
(from `Overloaded.trailing_metadata()`).

The predicted wait is the time until the requests ahead of a newcomer have started (their first
token out), at the rate requests have started while some were waiting (`StartRate`: starts per
second of backlogged time, so an idle spell does not read as a slow cluster). The requests ahead
are every admitted or queued request without its first token; a request whose cluster is past
capacity piles them up, however large `max_in_flight` is. Queue-limit hints come from
`ServiceRate`: how fast slots have freed over the last `rate_window_s`. No gRPC here; time comes
from the `clock` argument, so tests drive it by hand. One event loop; not thread-safe.
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

    def __init__(self, reason: str, retry_after_s: float, *, router_wide: bool = False) -> None:
        super().__init__(f"{reason}; retry after {retry_after_s:.2f} s")
        self.reason = reason
        self.retry_after_s = retry_after_s
        # the whole router is full (not one client's limit): AdmissionLimiter spaces such hints
        self.router_wide = router_wide

    @property
    def retry_after_ms(self) -> int:
        return hint_ms(self.retry_after_s)

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return retry_hint(self)


def hint_ms(seconds: float) -> int:
    """A retry hint in whole milliseconds, at least 1 (the `retry-after-ms` value)."""
    return max(1, round(seconds * 1000))


def retry_hint(e: Exception) -> tuple[tuple[str, str], ...]:
    """The `retry-after-ms` trailing metadata of a refusal that carries `retry_after_s` (the
    limiter's, the workers' overload), else none."""
    s = getattr(e, "retry_after_s", None)
    return () if s is None else ((RETRY_AFTER_KEY, str(hint_ms(s))),)


# the admission limits a router config carries under these names (AdmissionConfig.of)
ROUTER_FIELDS = ("max_in_flight", "max_queue", "max_streams_per_client", "max_expected_wait_s")


@dataclass(frozen=True)
class AdmissionConfig:
    max_in_flight: int = 256  # requests running past admission (routed to workers)
    max_queue: int = 1024  # requests waiting for a running slot; 0: refuse instead of queueing
    max_streams_per_client: int = 0  # running + waiting per client identity; 0: no limit
    # Refuse at arrival when the requests ahead (without their first token yet) would take longer
    # than this to start at the rate requests have started lately (`StartRate`). None: no such
    # check (the client's deadline still bounds the wait).
    max_expected_wait_s: float | None = 15.0
    min_start_samples: int = 8  # starts seen (in the window) before the rate is trusted
    rate_window_s: float = 30.0  # how far back the service rate looks
    default_retry_after_s: float = 1.0  # the hint before any request has finished
    min_retry_after_s: float = 0.05
    max_retry_after_s: float = 30.0

    @classmethod
    def of(cls, router) -> "AdmissionConfig":
        """The admission limits a router config sets (cluster.config.RouterConfig's fields named in
        ROUTER_FIELDS): what the router enforces and the simulator replays."""
        return cls(**{name: getattr(router, name) for name in ROUTER_FIELDS})

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


class StartRate:
    """Requests started per second of backlogged time (some request waiting for its first token),
    over the last `rate_window_s`; None until `min_start_samples` starts were seen."""

    def __init__(self, config: AdmissionConfig, clock: Clock) -> None:
        self._config, self._clock = config, clock
        self._starts: collections.deque[tuple[float, float]] = collections.deque()  # (when, busy gap)

    def record(self, busy_gap_s: float) -> None:
        self._starts.append((self._clock(), max(0.0, busy_gap_s)))
        self._trim()

    def per_second(self) -> float | None:
        self._trim()
        busy = sum(gap for _, gap in self._starts)
        if len(self._starts) < self._config.min_start_samples or busy <= 0:
            return None
        return len(self._starts) / busy

    def wait_for(self, num_ahead: int) -> float | None:
        rate = self.per_second()
        return None if rate is None else num_ahead / rate

    def _trim(self) -> None:
        horizon = self._clock() - self._config.rate_window_s
        while self._starts and self._starts[0][0] < horizon:
            self._starts.popleft()


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
    started: bool = False  # its first token is out (`AdmissionLimiter.started`)


class AdmissionLimiter:
    def __init__(self, config: AdmissionConfig = AdmissionConfig(), clock: Clock = time.monotonic,
                 on_change: Callable[[int, int], None] | None = None) -> None:
        """`on_change(running, waiting)` is called whenever either changes (e.g. to set gauges)."""
        self.config = config
        self._clock = clock
        self.rate = ServiceRate(config, clock)
        self.served = ServiceRate(config, clock)   # only the releases of requests that started: room freed
        self.starts = StartRate(config, clock)
        self._unstarted = 0          # admitted or queued, no first token yet: the requests ahead
        self._busy_since: float | None = None   # since when some request has waited to start
        self._last_start = 0.0
        self._promised_s = 0.0       # the latest return time a router-wide refusal's hint gave
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
        self._check_predicted_wait()
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
                             self.rate.retry_after(c.max_queue // 2 + 1), router_wide=True)

    def _check_predicted_wait(self) -> None:
        limit = self.config.max_expected_wait_s
        expected = None if limit is None else self.starts.wait_for(self._unstarted)
        if expected is not None and expected > limit:
            c = self.config
            raise Overloaded(f"server overloaded: {self._unstarted} requests are waiting for their first token, "
                             f"about {expected:.1f} s of work at the recent rate, over the {limit:g} s limit",
                             # by then the backlog is back under the limit
                             min(c.max_retry_after_s, max(c.min_retry_after_s, expected - limit)), router_wide=True)

    def spaced(self, hint_s: float, workers: bool = False) -> float:
        """A router-wide refusal's hint, past the return times handed out before it by one start at
        the recent rate each: clients shed together come back one after another, not all at once
        into the same full router (the openai SDKs wait a hint exactly, without jitter). `workers`:
        the workers' own refusal (every decode worker overloaded or full, router/generation.py),
        whose room comes back as served requests end, so the rate is theirs."""
        now, c = self._clock(), self.config
        rate = self.served.per_second() if workers else self.starts.per_second() or self.rate.per_second()
        if rate and self._promised_s > now:
            hint_s = max(hint_s, self._promised_s - now + 1.0 / rate)
        hint_s = min(c.max_retry_after_s, max(c.min_retry_after_s, hint_s))
        self._promised_s = max(self._promised_s, now + hint_s)
        return hint_s

    def started(self, admission: Admission) -> None:
        """`admission`'s request has its first token out: one fewer ahead, one start at the rate."""
        if admission.started:
            return
        admission.started = True
        now = self._clock()
        self.starts.record(now - max(self._last_start, self._busy_since if self._busy_since is not None else now))
        self._last_start = now
        self._not_waiting()

    def _not_waiting(self) -> None:
        self._unstarted -= 1
        if self._unstarted <= 0:
            self._unstarted, self._busy_since = 0, None

    def _count_in(self, client: str) -> float:
        """Refuse (Overloaded) or count the request in among those ahead of later ones; -> now."""
        try:
            self.check(client)
        except Overloaded as e:
            if not e.router_wide:
                raise
            raise Overloaded(e.reason, self.spaced(e.retry_after_s), router_wide=True) from None
        arrived = self._clock()
        self._per_client[client] += 1
        self._unstarted += 1
        if self._busy_since is None:
            self._busy_since = arrived
        return arrived

    def admit_now(self, client: str) -> Admission:
        """`acquire` for a caller without an event loop whose requests wait elsewhere (the
        simulator, whose workers queue them): the same refusals (Overloaded), the request counted
        among those ahead of later ones until `started` or `release`, and a running slot taken at
        once, past `max_in_flight` too, where `acquire` would queue it (such a caller's requests
        queue on its workers; with `max_queue` 0 it is refused, as `acquire` refuses it)."""
        self._count_in(client)
        self._running += 1
        self._changed()
        return Admission(client, 0.0)

    async def acquire(self, client: str) -> Admission:
        """Wait for a running slot (FIFO) or raise Overloaded at once. Cancelling the waiting
        task (the client went away, its deadline passed) leaves the queue cleanly."""
        arrived = self._count_in(client)
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
            self._not_waiting()
            self._changed()
            raise
        return Admission(client, self._clock() - arrived)

    def release(self, admission: Admission) -> None:
        if admission.released:
            return
        admission.released = True
        if not admission.started:   # failed or cancelled before its first token
            admission.started = True
            self._not_waiting()
        else:
            self.served.record_release()
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
