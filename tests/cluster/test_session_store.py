"""router.sessions against a real redis-server: encoding, TTL, sharing, surviving Redis outages."""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time

import msgpack
import redis

from tandem.router.sessions import (InMemorySessionStore, RedisSessionStore, SessionState,
                             make_session_store)

_prefixes = itertools.count()


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_state(turn: int = 1, **overrides) -> SessionState:
    fields = dict(decode_worker="decode-0", prefill_worker="prefill-1", num_tokens=1000 * turn,
                  token_ids_hash=bytes(range(8)), updated_at=1.7e9 + turn, turn=turn)
    fields.update(overrides)
    return SessionState(**fields)


def unique_prefix() -> str:
    return f"test:{next(_prefixes)}:session:"


def run(coro):
    return asyncio.run(coro)


# --- shared redis_server ----------------------------------------------------------------------

def test_round_trip(redis_server):
    async def main():
        store = RedisSessionStore(redis_server, ttl_s=60, prefix=unique_prefix())
        assert await store.get("s1") is None
        await store.put("s1", make_state(1))
        await store.put("s1", make_state(2))
        assert await store.get("s1") == make_state(2)
        assert store.redis_up
        await store.close()
    run(main())


def test_values_are_msgpack_with_a_ttl(redis_server):
    prefix = unique_prefix()

    async def main():
        store = RedisSessionStore(redis_server, ttl_s=120, prefix=prefix)
        await store.put("agent-7", make_state(3, prefill_worker=None))
        await store.close()
    run(main())

    raw_client = redis.Redis.from_url(redis_server)
    raw = raw_client.get(f"{prefix}agent-7")
    assert msgpack.unpackb(raw, raw=False) == {
        "v": 1, "decode_worker": "decode-0", "prefill_worker": None, "num_tokens": 3000,
        "token_ids_hash": bytes(range(8)), "updated_at": 1.7e9 + 3, "turn": 3}
    assert 110 < raw_client.ttl(f"{prefix}agent-7") <= 120
    raw_client.close()


def test_two_stores_share_state(redis_server):
    async def main():
        prefix = unique_prefix()
        a = RedisSessionStore(redis_server, ttl_s=60, prefix=prefix)
        b = RedisSessionStore(redis_server, ttl_s=60, prefix=prefix)
        await a.put("s", make_state(1))
        assert await b.get("s") == make_state(1)
        await b.put("s", make_state(2, decode_worker="decode-3"))
        assert (await a.get("s")).decode_worker == "decode-3"
        await a.close()
        await b.close()
    run(main())


def test_undecodable_value_is_a_miss(redis_server, caplog):
    prefix = unique_prefix()
    redis.Redis.from_url(redis_server).set(f"{prefix}bad", b"\xc1 not msgpack")

    async def main():
        store = RedisSessionStore(redis_server, ttl_s=60, prefix=prefix)
        assert await store.get("bad") is None
        await store.close()
    with caplog.at_level(logging.WARNING, logger="tandem.router.sessions"):
        run(main())
    assert "cannot decode" in caplog.text


def test_make_session_store(redis_server):
    assert isinstance(make_session_store(None), InMemorySessionStore)
    store = make_session_store(redis_server, ttl_s=5)
    assert isinstance(store, RedisSessionStore) and store.ttl_s == 5
    run(store.close())


# --- in memory ----------------------------------------------------------------------------------

def test_in_memory_lru_bound():
    store = InMemorySessionStore(max_sessions=2, ttl_s=60, clock=FakeClock())

    async def main():
        await store.put("a", make_state(1))
        await store.put("b", make_state(2))
        assert await store.get("a") == make_state(1)  # "a" is now the most recently used
        await store.put("c", make_state(3))
        assert await store.get("b") is None
        assert await store.get("a") == make_state(1) and await store.get("c") == make_state(3)
        assert len(store) == 2
    run(main())


def test_in_memory_ttl_counts_from_the_last_write():
    clock = FakeClock()
    store = InMemorySessionStore(ttl_s=10, clock=clock)

    async def main():
        await store.put("s", make_state(1))
        clock.advance(9)
        assert await store.get("s") is not None  # a read does not extend the TTL
        await store.put("s", make_state(2))
        clock.advance(9.9)
        assert await store.get("s") == make_state(2)
        clock.advance(0.1)
        assert await store.get("s") is None and len(store) == 0
    run(main())


def test_state_decoding_tolerates_added_and_missing_fields():
    raw = msgpack.packb({"v": 2, "decode_worker": "d", "prefill_worker": None, "num_tokens": 5,
                         "some_future_field": [1, 2]}, use_bin_type=True)
    assert SessionState.decode(raw) == SessionState("d", None, 5)


# --- Redis going away -----------------------------------------------------------------------------

def test_redis_outage_falls_back_then_resyncs(redis_server_factory, caplog):
    server = redis_server_factory()
    port, url = server.port, server.url
    clock = FakeClock()

    async def main():
        store = RedisSessionStore(url, ttl_s=3600, retry_interval_s=5, clock=clock)
        await store.put("kept", make_state(1))
        await store.put("changed", make_state(1))
        assert store.redis_up

        server.stop()
        # Nothing raises; reads and writes are served from the local copy.
        assert await store.get("kept") == make_state(1)
        assert not store.redis_up
        await store.put("changed", make_state(2))
        await store.put("new", make_state(1, decode_worker="decode-9"))
        assert await store.get("changed") == make_state(2)
        assert await store.get("new") == make_state(1, decode_worker="decode-9")
        assert await store.get("never-seen") is None

        restarted = redis_server_factory(port)  # same port, empty
        assert await store.get("new") is not None
        assert not store.redis_up  # not retried before retry_interval_s
        raw_client = redis.Redis.from_url(restarted.url)
        assert raw_client.dbsize() == 0

        # Another router writes a newer state for "new" while this one still thinks Redis is down.
        other = RedisSessionStore(url, ttl_s=3600)
        await other.put("new", make_state(5, decode_worker="decode-other"))

        clock.advance(5)
        assert await store.get("changed") == make_state(2)  # retries, writes back, then reads
        assert store.redis_up
        stored = {k.decode(): SessionState.decode(raw_client.get(k)) for k in raw_client.keys()}
        assert stored["tandem:session:changed"] == make_state(2)
        assert stored["tandem:session:new"].decode_worker == "decode-other"  # newer one kept
        assert "tandem:session:kept" not in stored  # unchanged during the outage: read back lazily
        assert await store.get("kept") == make_state(1)
        assert SessionState.decode(raw_client.get("tandem:session:kept")) == make_state(1)
        assert 3500 < raw_client.ttl("tandem:session:kept") <= 3600
        assert await store.get("new") == make_state(5, decode_worker="decode-other")

        raw_client.close()
        await other.close()
        await store.close()

    with caplog.at_level(logging.WARNING, logger="tandem.router.sessions"):
        run(main())
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("unreachable" in m for m in warnings) == 1, warnings  # logged once per outage
    assert any("is back" in m and "wrote back 1 session(s)" in m for m in warnings), warnings


def test_redis_never_reachable(caplog):
    async def main():
        store = RedisSessionStore(f"redis://127.0.0.1:{_closed_port()}/0", ttl_s=60,
                                  op_timeout_s=0.2)
        await store.put("s", make_state(1))
        assert await store.get("s") == make_state(1)
        assert not store.redis_up
        await store.close()
    run(main())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unresponsive_redis_times_out_quickly():
    """A Redis that accepts connections but never answers costs one op_timeout_s, then local."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]

    async def main():
        store = RedisSessionStore(f"redis://127.0.0.1:{port}/0", ttl_s=60, op_timeout_s=0.2,
                                  retry_interval_s=60)
        start = time.monotonic()
        await store.put("s", make_state(1))
        for _ in range(20):
            assert await store.get("s") == make_state(1)
        assert time.monotonic() - start < 1.5
        await store.close()
    try:
        run(main())
    finally:
        listener.close()
