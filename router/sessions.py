"""Where a session's KV lives: the decode and prefill worker that last served it, and how much.

`SessionStore` is async (the router is a grpc.aio server). Two implementations:
- `InMemorySessionStore`: one router; LRU-bounded, entries expire `ttl_s` after their last write.
- `RedisSessionStore`: several routers share state in Redis; values are msgpack maps written with
  `SET key value EX ttl`. Redis being unreachable never fails a request: the store logs once, serves
  from a local in-memory copy (every write also goes there), retries Redis every `retry_interval_s`,
  and when Redis answers again writes back the sessions changed meanwhile (unless Redis holds a
  newer state for them). A session Redis lost (e.g. it restarted empty) is read back from the
  local copy.
A session store is a hint: a wrong or missing entry only costs a prefix-cache miss.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Protocol

import msgpack
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from tandem.runtime.logging_setup import redact

log = logging.getLogger(__name__)

Clock = Callable[[], float]
# What an unreachable, restarting or overloaded Redis raises (TimeoutError is an OSError).
_REDIS_ERRORS = (RedisError, OSError)


@dataclass(frozen=True)
class SessionState:
    decode_worker: str | None
    prefill_worker: str | None
    num_tokens: int  # tokens of the session (last prompt + output) whose KV those workers hold
    token_ids_hash: bytes | None = None  # hash of the last full block of those tokens
    updated_at: float = 0.0  # wall-clock seconds of the write; the newer of two states wins
    turn: int = 0  # turns served so far

    def encode(self) -> bytes:
        return msgpack.packb({"v": 1, **asdict(self)}, use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> SessionState:
        data = msgpack.unpackb(raw, raw=False)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class SessionStore(Protocol):
    async def get(self, session_id: str) -> SessionState | None: ...

    async def put(self, session_id: str, state: SessionState) -> None: ...

    async def close(self) -> None: ...


class InMemorySessionStore:
    """Bounded LRU map session id -> state; an entry expires `ttl_s` after it was last written."""

    def __init__(self, max_sessions: int = 100_000, ttl_s: float = 3600.0,
                 clock: Clock = time.monotonic):
        if max_sessions < 1 or ttl_s <= 0:
            raise ValueError(f"need max_sessions >= 1 and ttl_s > 0, got {max_sessions}, {ttl_s}")
        self.max_sessions, self.ttl_s, self.clock = max_sessions, ttl_s, clock
        self._entries: OrderedDict[str, tuple[float, SessionState]] = OrderedDict()  # LRU first

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, session_id: str) -> SessionState | None:
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        expires_at, state = entry
        if self.clock() >= expires_at:
            del self._entries[session_id]
            return None
        self._entries.move_to_end(session_id)
        return state

    def store(self, session_id: str, state: SessionState) -> None:
        self._entries[session_id] = (self.clock() + self.ttl_s, state)
        self._entries.move_to_end(session_id)
        while len(self._entries) > self.max_sessions:
            self._entries.popitem(last=False)

    async def get(self, session_id: str) -> SessionState | None:
        return self.lookup(session_id)

    async def put(self, session_id: str, state: SessionState) -> None:
        self.store(session_id, state)

    async def close(self) -> None:
        self._entries.clear()


class RedisSessionStore:
    """Session state in Redis, shared by routers, with a local fallback (see module docstring)."""

    def __init__(self, url: str, ttl_s: float = 3600.0, prefix: str = "tandem:session:", *,
                 op_timeout_s: float = 0.5, retry_interval_s: float = 1.0,
                 max_local_sessions: int = 100_000, clock: Clock = time.monotonic):
        self.url, self.ttl_s, self.prefix = redact(url), ttl_s, prefix   # for logs: no password
        self.op_timeout_s, self.retry_interval_s, self.clock = op_timeout_s, retry_interval_s, clock
        # One immediate retry on a broken connection (a pooled connection to a Redis that since
        # restarted), none on timeouts: a failed call falls back at once, Redis is retried later.
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=op_timeout_s, socket_connect_timeout=op_timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        self.local = InMemorySessionStore(max_local_sessions, ttl_s, clock)
        self._dirty: set[str] = set()  # written while Redis was down, not yet written back
        self._down_since: float | None = None
        self._next_try = 0.0
        self._resync_lock = asyncio.Lock()

    @property
    def redis_up(self) -> bool:
        return self._down_since is None

    def key(self, session_id: str) -> str:
        return self.prefix + session_id

    async def get(self, session_id: str) -> SessionState | None:
        if await self._reachable():
            try:
                raw = await self._call(self._redis.get(self.key(session_id)))
            except _REDIS_ERRORS as e:
                self._mark_down(e)
            else:
                if raw is not None:
                    state = self._decode(session_id, raw)
                    if state is not None:
                        self.local.store(session_id, state)
                        return state
                state = self.local.lookup(session_id)
                if state is not None:  # Redis lost it (restart, eviction): put it back
                    await self._write(session_id, state, only_if_newer=True)
                return state
        return self.local.lookup(session_id)

    async def put(self, session_id: str, state: SessionState) -> None:
        self.local.store(session_id, state)
        if not await self._reachable() or not await self._write(session_id, state):
            self._dirty.add(session_id)

    async def close(self) -> None:
        close = getattr(self._redis, "aclose", None) or self._redis.close  # redis-py < 5.0.1
        await close()

    async def _reachable(self) -> bool:
        """True if Redis is up, or down but due for a retry that succeeded (after a resync)."""
        if self._down_since is None:
            return True
        if self.clock() < self._next_try:
            return False
        self._next_try = self.clock() + self.retry_interval_s
        async with self._resync_lock:
            if self._down_since is None:  # another task resynced while we waited
                return True
            try:
                await self._call(self._redis.ping())
                written = await self._write_back_dirty()
            except _REDIS_ERRORS as e:
                log.debug("session store: Redis at %s still unreachable: %s", self.url, e)
                return False
        log.warning("session store: Redis at %s is back after %.1f s; wrote back %d session(s) "
                    "changed meanwhile", self.url, self.clock() - self._down_since, written)
        self._down_since = None
        return True

    async def _write_back_dirty(self) -> int:
        written = 0
        while self._dirty:  # puts made while this runs are still "down" ones: they join the set
            session_id = self._dirty.pop()
            state = self.local.lookup(session_id)
            if state is None:  # expired locally
                continue
            try:
                written += await self._set_if_newer(session_id, state)
            except _REDIS_ERRORS:
                self._dirty.add(session_id)
                raise
        return written

    async def _write(self, session_id: str, state: SessionState, *,
                     only_if_newer: bool = False) -> bool:
        try:
            if only_if_newer:
                await self._set_if_newer(session_id, state)
            else:
                await self._call(self._redis.set(self.key(session_id), state.encode(), ex=self._ex))
            return True
        except _REDIS_ERRORS as e:
            self._mark_down(e)
            return False

    async def _set_if_newer(self, session_id: str, state: SessionState) -> bool:
        # Not atomic: two routers writing back the same session at once is harmless (both are
        # recent states of it, and the next turn overwrites either).
        raw = await self._call(self._redis.get(self.key(session_id)))
        current = self._decode(session_id, raw) if raw is not None else None
        if current is not None and current.updated_at >= state.updated_at:
            return False
        await self._call(self._redis.set(self.key(session_id), state.encode(), ex=self._ex))
        return True

    @property
    def _ex(self) -> int:
        return max(1, math.ceil(self.ttl_s))

    async def _call(self, coro):
        return await asyncio.wait_for(coro, self.op_timeout_s)

    def _mark_down(self, error: BaseException) -> None:
        if self._down_since is None:
            log.warning("session store: Redis at %s unreachable (%s: %s); serving sessions from "
                        "this router's memory and retrying every %.1f s", self.url,
                        type(error).__name__, error, self.retry_interval_s)
            self._down_since = self.clock()
        self._next_try = self.clock() + self.retry_interval_s

    def _decode(self, session_id: str, raw: bytes) -> SessionState | None:
        try:
            return SessionState.decode(raw)
        except Exception as e:  # noqa: BLE001 - a bad value is a miss, not a failed request
            log.warning("session store: cannot decode %s (%s); ignoring it",
                        self.key(session_id), e)
            return None


def make_session_store(redis_url: str | None, ttl_s: float = 3600.0) -> SessionStore:
    """RedisSessionStore when a URL is configured (several routers), else InMemorySessionStore."""
    if redis_url:
        return RedisSessionStore(redis_url, ttl_s)
    return InMemorySessionStore(ttl_s=ttl_s)
