"""The OpenAI-compatible HTTP edge, served with aiohttp in the router's event loop beside gRPC:
`POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /v1/models/{model}`,
`GET /health`.

Each request is parsed by router/openai_schema.py into the gRPC `GenerateRequest` and served by
`Router.admit_and_generate`, the gRPC edge's own path (admission, validation, sessions,
cancellation). Errors leave through router/status_codes.py's table, then `HTTP_STATUS`, in OpenAI's
JSON shape, and so do aiohttp's own refusals (an unknown path, a wrong method, a body over the
size limit: `_openai_errors`). A client that goes away mid-request cancels it: aiohttp cancels the handler, and the
closed generator frees what the request holds on its actors.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import time

from aiohttp import web
from grpc_health.v1 import health_pb2

from tandem.router.admission import RETRY_AFTER_KEY, client_identity, hint_ms
from tandem.router.auth import bearer_token
from tandem.router.generation import Router
from tandem.router.openai_choice import ChoiceBuilder
from tandem.router.openai_schema import (ApiError, ParsedRequest, chunk, error_body, full_response, model_card,
                                         models_list, parse_chat, parse_completion, response_id, unknown_model,
                                         usage_chunk)
from tandem.router.status_codes import client_message, http_status, status_code
from tandem.router.tool_calls import tool_format

log = logging.getLogger(__name__)

ROUTER_KEY = web.AppKey("router", Router)
MODEL_KEY = web.AppKey("model", str)
TOKENS_KEY = web.AppKey("tokens", object)     # a router/auth.py TokenStore, or None: auth off
TOKEN_TEXT_KEY = web.AppKey("token_text", object)   # token id -> its text (logprobs), cached
MAX_BODY_KEY = web.AppKey("max_body", int)          # bytes a request body may have
CREATED = int(time.time())   # /v1/models' `created`: when this router started


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   retry_after_s: float | None = None) -> web.Response:
    """An OpenAI-shaped error. With `retry_after_s`, two hints: `Retry-After` in whole seconds (the
    HTTP standard's), and `retry-after-ms` exact (the gRPC edge's trailing key), which the openai
    SDKs read first, so a client that retries waits the router's hint, not a rounded-up second."""
    headers = None
    if retry_after_s is not None:
        headers = {"Retry-After": str(max(1, math.ceil(retry_after_s))),
                   RETRY_AFTER_KEY: str(hint_ms(retry_after_s))}
    return web.json_response(error_body(status, message, param, code), status=status, headers=headers)


def _api_error(e: ApiError) -> web.Response:
    return error_response(e.status, str(e), e.param, e.code)


def _from_exception(router: Router, e: Exception) -> web.Response:
    """The HTTP response for a failure of the request path, by the gRPC edge's one table."""
    code = status_code(e)
    router.record_error(e, code.name)
    status = http_status(e)
    if status >= 500 and status != 503:
        log.exception("request failed in the cluster")
    retry = getattr(e, "retry_after_s", 1.0) if status == 429 else None   # the workers' overload: 1 s
    return error_response(status, client_message(e, getattr(e, "tandem_request_id", None)), retry_after_s=retry)


def _client(request: web.Request) -> str | None:
    """The client's identity for admission; None when auth is on and the token is missing or wrong."""
    token = bearer_token(request.headers.items())
    tokens = request.app[TOKENS_KEY]
    if tokens is not None and (token is None or not tokens.verify(token)):
        return None
    return client_identity(f"http:{request.remote}", token if tokens is not None else None)


_UNAUTHORIZED = "missing or invalid credentials: send 'Authorization: Bearer <token>'"


@web.middleware
async def _openai_errors(request: web.Request, handler):
    """aiohttp's own refusals (404 for a path it does not serve, 405, 413 for a body over
    `client_max_size`) in OpenAI's error shape, as the SDKs expect of every error."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = {404: f"no such endpoint: {request.method} {request.path}; this server serves "
                        "/v1/chat/completions, /v1/completions, /v1/models and /health",
                   405: f"{request.method} is not allowed on {request.path}",
                   413: f"the request body is over this server's limit of {request.app[MAX_BODY_KEY]} bytes"}.get(e.status, e.reason)
        return error_response(e.status, message)


async def _parse(request: web.Request, parse) -> ParsedRequest | web.Response:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return error_response(400, "the request body is not valid JSON")
    try:
        return parse(body, request.headers, request.app[MODEL_KEY])
    except ApiError as e:
        return _api_error(e)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion, chat=False)


async def _generate(request: web.Request, parse, *, chat: bool) -> web.StreamResponse:
    client = _client(request)
    if client is None:
        return error_response(401, _UNAUTHORIZED, code="invalid_api_key")
    parsed = await _parse(request, parse)
    if isinstance(parsed, web.Response):
        return parsed
    router = request.app[ROUTER_KEY]
    async with contextlib.aclosing(router.admit_and_generate(parsed.request, client)) as gen:
        try:
            first = await anext(gen)   # errors before the first token still get their HTTP status
        except Exception as e:  # noqa: BLE001 - every failure leaves as a status
            return _from_exception(router, e)
        rid = response_id(chat, first.request_id)
        fmt = tool_format(getattr(router.tokenizer, "chat_template", None)) if parsed.tools else None
        builder = ChoiceBuilder(chat, request.app[TOKEN_TEXT_KEY], logprobs=parsed.logprobs, tool_format=fmt,
                                token_ids=parsed.token_ids)
        if parsed.stream:
            return await _stream(request, gen, first, parsed, rid, builder)
        last = first
        try:
            builder.add(first)
            async for last in gen:
                builder.add(last)
        except Exception as e:  # noqa: BLE001
            return _from_exception(router, e)
        return web.json_response(full_response(chat, rid, int(time.time()), parsed.model, builder.choice(),
                                               last.usage))


async def _stream(request: web.Request, gen, first, parsed: ParsedRequest, rid: str, builder: ChoiceBuilder):
    """Server-sent events: one chunk per message, the usage chunk if asked, then [DONE]. A client
    that disconnects ends the handler (aiohttp cancels it, or the write fails), which closes `gen`."""
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await out.prepare(request)
    created, resp, is_first, chat = int(time.time()), first, True, builder.chat
    try:
        while True:
            data = chunk(chat, rid, created, parsed.model, builder.delta(resp, is_first),
                         include_usage=parsed.include_usage)
            await out.write(b"data: " + json.dumps(data).encode() + b"\n\n")
            if resp.finish_reason:
                break
            resp, is_first = await anext(gen), False
        if parsed.include_usage:
            data = usage_chunk(chat, rid, created, parsed.model, resp.usage)
            await out.write(b"data: " + json.dumps(data).encode() + b"\n\n")
    except ConnectionResetError:    # the client went away: nothing more to write
        return out
    except StopAsyncIteration:      # ended without a finish reason (not expected): still [DONE]
        pass
    except Exception as e:  # noqa: BLE001 - the status is sent: the error goes as an event
        request.app[ROUTER_KEY].record_error(e, status_code(e).name)
        log.warning("stream %s failed after it began: %s", rid, e)
        await out.write(b"data: " + json.dumps(error_body(http_status(e), client_message(e, rid))).encode() + b"\n\n")
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


async def list_models(request: web.Request) -> web.Response:
    if _client(request) is None:
        return error_response(401, _UNAUTHORIZED, code="invalid_api_key")
    return web.json_response(models_list(request.app[MODEL_KEY], CREATED))


async def retrieve_model(request: web.Request) -> web.Response:
    if _client(request) is None:
        return error_response(401, _UNAUTHORIZED, code="invalid_api_key")
    name, served = request.match_info["model"], request.app[MODEL_KEY]
    if name != served:
        return _api_error(unknown_model(name, served))
    return web.json_response(model_card(served, CREATED))


async def health(request: web.Request) -> web.Response:
    """The router's gRPC health ("" service): 200 while SERVING, else 503 (draining: `tandem down`
    entered graceful shutdown), so one probe serves both edges."""
    servicer = getattr(request.app[ROUTER_KEY], "health", None)   # set by router/server.py's serve
    if servicer is not None:
        status = (await servicer.Check(health_pb2.HealthCheckRequest(service=""), None)).status
        if status != health_pb2.HealthCheckResponse.SERVING:
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(status).lower()
            return web.json_response({"status": name}, status=503)
    return web.json_response({"status": "ok"})


def make_app(router: Router, model: str, tokens=None) -> web.Application:
    limit = router.limits.grpc_max_receive_bytes
    app = web.Application(client_max_size=limit, middlewares=[_openai_errors])
    app[ROUTER_KEY], app[MODEL_KEY], app[TOKENS_KEY], app[MAX_BODY_KEY] = router, model, tokens, limit
    app[TOKEN_TEXT_KEY] = functools.lru_cache(maxsize=1 << 16)(
        lambda token_id: router.tokenizer.decode([token_id], skip_special_tokens=False))
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)   # ids may hold a '/' (org/name)
    app.router.add_get("/health", health)
    return app


async def serve_http(router: Router, model: str, host: str, port: int, tokens=None,
                     ssl_context=None) -> tuple[web.AppRunner, int]:
    """Start the HTTP edge in the running event loop (HTTPS with `ssl_context`, router/tls.py's
    `server_ssl_context`); returns (runner: `await runner.cleanup()` to stop it, bound port)."""
    runner = web.AppRunner(make_app(router, model, tokens), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    return runner, runner.addresses[0][1]   # port 0: the one the OS picked
