"""Stopping a router without cutting streams: health turns NOT_SERVING (load balancers and clients
move on), new calls are refused, the streams it has run to their end for up to `drain_timeout_s`
(router.drain_timeout_s; keep Kubernetes' terminationGracePeriodSeconds above it), then whatever
is left is cancelled, and the HTTP edge, the cluster view and the session store close.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger(__name__)


async def drain_and_stop(server, router, drain_timeout_s: float, poll_s: float = 0.1) -> bool:
    """-> True when every stream ended inside the deadline."""
    t0 = time.monotonic()
    running = router.limiter.running + router.limiter.waiting
    log.info("draining: %d request(s) in flight, up to %.0f s", running, drain_timeout_s)
    await router.health.enter_graceful_shutdown()
    # refuses new calls at once; its own grace is a backstop: the deadline is enforced below
    stopping = asyncio.ensure_future(server.stop(grace=drain_timeout_s + 5))
    deadline = t0 + drain_timeout_s
    # the router's own count: the HTTP edge's streams are not the gRPC server's
    while router.limiter.running + router.limiter.waiting > 0 and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
    left = router.limiter.running + router.limiter.waiting   # still running at the deadline
    if left:
        await server.stop(grace=0)     # cancels what is left now
    await stopping
    if left:
        log.warning("drain deadline (%.0f s) passed with %d request(s) in flight: cancelled", drain_timeout_s, left)
    else:
        log.info("drained in %.1f s", time.monotonic() - t0)
    if router.http is not None:
        await router.http.cleanup()
    if getattr(router, "health_server", None) is not None:   # (NOT_SERVING there too since the start)
        await router.health_server.stop(grace=0)
    await router.view.stop()
    await router.sessions.close()
    return not left
