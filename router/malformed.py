"""Requests that do not parse: a body that is not a valid protobuf of the method's type, or a string
field that is not UTF-8, gets INVALID_ARGUMENT with one line saying so, instead of gRPC's UNKNOWN
and a traceback in the log per request (a cheap log flood). The refusals are logged at most once
per `log_interval_s`, with how many there were since.

`MalformedRequestInterceptor` swaps the deserializer of every `tandem.v1` method for one that
hands the method a `Malformed` marker instead of raising, and refuses the marker before the
servicer sees it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import grpc

log = logging.getLogger(__name__)

GUARDED_PREFIX = "/tandem.v1."


@dataclass(frozen=True)
class Malformed:
    method: str
    why: str


class RateLimitedLog:
    """Log a line at most once per `interval_s`; the lines dropped in between are counted in it."""

    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self.clock = interval_s, clock
        self._next = float("-inf")
        self.suppressed = 0

    def warning(self, msg: str, *args) -> bool:
        now = self.clock()
        if now < self._next:
            self.suppressed += 1
            return False
        self._next = now + self.interval_s
        dropped, self.suppressed = self.suppressed, 0
        log.warning(msg + " (%d more like it not logged in the last %.0f s)", *args, dropped, self.interval_s)
        return True


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, log_interval_s: float = 60.0) -> None:
        self.log = RateLimitedLog(log_interval_s)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(GUARDED_PREFIX) or handler.request_streaming:
            return handler
        parse = _lenient(handler.request_deserializer, method)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(self._guard_stream(handler.unary_stream), parse,
                                                        handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(self._guard_unary(handler.unary_unary), parse,
                                                   handler.response_serializer)

    async def _refuse(self, context, bad: Malformed) -> None:
        self.log.warning("refused a malformed %s request from %s: %s", bad.method, context.peer(), bad.why)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the request is not a valid {bad.method.rsplit('/', 1)[-1]} message "
                            "(malformed protobuf, or a string field that is not UTF-8)")

    def _guard_unary(self, behavior):
        async def run(request, context):
            if isinstance(request, Malformed):
                await self._refuse(context, request)
            return await behavior(request, context)
        return run

    def _guard_stream(self, behavior):
        async def run(request, context):
            if isinstance(request, Malformed):
                await self._refuse(context, request)
            async for resp in behavior(request, context):
                yield resp
        return run


def _lenient(deserialize, method: str):
    def parse(data: bytes):
        try:
            return deserialize(data) if deserialize is not None else data
        except Exception as e:  # noqa: BLE001 - DecodeError, or UnicodeDecodeError by backend
            return Malformed(method, f"{type(e).__name__}: {str(e)[:120]}")
    return parse
