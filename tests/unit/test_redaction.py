"""Redis credentials never reach a log line (issue 27 item 6: the reconnect warnings printed
redis://:PASSWORD@host): the session store logs its URL redacted, and Tandem's log setup masks any
URL credentials or password parameters whoever logs them."""

from __future__ import annotations

import asyncio
import io
import logging
import socket

from tandem.router.sessions import RedisSessionStore, SessionState
from tandem.runtime.logging_setup import redact, setup_logging

SECRET = "S3cret-Pa55word"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_session_stores_reconnect_warnings_hide_the_password():
    out = io.StringIO()
    handler = setup_logging("DEBUG", "kv", stream=out)
    try:
        async def run():
            store = RedisSessionStore(f"redis://:{SECRET}@127.0.0.1:{_closed_port()}/0?password={SECRET}",
                                      op_timeout_s=0.2, retry_interval_s=0.0)
            await store.put("s", SessionState(decode_worker="d0", prefill_worker=None, num_tokens=3))
            assert (await store.get("s")).decode_worker == "d0"      # served from memory meanwhile
            await store.close()
        asyncio.run(run())
        logging.getLogger("elsewhere").warning("connecting to rediss://tandem:%s@redis:6380/0 failed", SECRET)
    finally:
        logging.getLogger().removeHandler(handler)
    text = out.getvalue()
    assert "unreachable" in text and "redis://:***@127.0.0.1" in text
    assert "rediss://tandem:***@redis:6380/0" in text
    assert SECRET not in text


def test_redact():
    assert redact("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact("redis://h:6379/0?ssl_ca_certs=/x&password=pw") == "redis://h:6379/0?ssl_ca_certs=/x&password=***"
    assert redact("a user@example.com wrote x=1") == "a user@example.com wrote x=1"
