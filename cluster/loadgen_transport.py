"""How `tandem bench` sends one request: over gRPC (`tandem.v1.Generation`) or over the OpenAI HTTP
edge (`POST /v1/completions`, streamed, prompt as token ids). Both yield the same `Update`s, so
the driver (cluster/loadgen_client.py) records a run the same way whichever API it drives; a failed
call raises `SendFailed` with a gRPC status name (HTTP statuses are mapped back to them).

The HTTP requests use two vLLM-compatible extensions the edge accepts: `ignore_eos` (the
workload's output lengths are exact) and `return_token_ids` (each chunk's token ids: the bench
times tokens, not text, and a session's next prompt holds the last answer's ids).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

import aiohttp
import grpc

from tandem.client.errors import RETRY_AFTER_KEY, retry_hint_s
from tandem.protos.tandem.v1 import generation_pb2 as pb

# the OpenAI edge's HTTP statuses as the gRPC codes the report counts
HTTP_TO_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
                  429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}
_FINISH = {"stop": "STOP", "length": "LENGTH", "abort": "ABORT", "tool_calls": "STOP"}


@dataclass(frozen=True)
class Update:
    """New tokens of one streamed message; its finish reason (a tandem.v1 FinishReason name) on the
    last one; the request's usage on the last (gRPC) or on an Update of its own after it (HTTP)."""
    token_ids: list[int]
    finish_reason: str | None = None
    usage: pb.Usage | None = None


class SendFailed(Exception):
    """A call that failed: its gRPC status name, message, and the router's retry hint (seconds; the
    `retry-after-ms` of a RESOURCE_EXHAUSTED, else None)."""

    def __init__(self, status: str, details: str, retry_after_s: float | None = None):
        super().__init__(f"{status}: {details}")
        self.status, self.details, self.retry_after_s = status, details, retry_after_s


class Transport(Protocol):
    def stream(self, request_id: str, session_id: str, prompt: list[int], max_tokens: int,
               timeout: float) -> AsyncIterator[Update]: ...

    async def rejection(self, prompt: list[int], max_tokens: int) -> str | None:
        """The INVALID_ARGUMENT message for a request the router must refuse (None if accepted)."""


class GrpcTransport:
    def __init__(self, stub, metadata=()):
        self.stub, self.metadata = stub, metadata

    async def stream(self, request_id, session_id, prompt, max_tokens, timeout):
        req = pb.GenerateRequest(request_id=request_id, session_id=session_id, prompt_token_ids=prompt,
                                 sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        try:
            async for resp in self.stub.Generate(req, timeout=timeout, metadata=self.metadata):
                finish = pb.FinishReason.Name(resp.finish_reason) if resp.finish_reason else None
                yield Update(list(resp.token_ids), finish, resp.usage if finish else None)
        except grpc.aio.AioRpcError as e:
            raise SendFailed(e.code().name, e.details() or "",
                             retry_hint_s(dict(e.trailing_metadata() or ()).get(RETRY_AFTER_KEY))) from None

    async def rejection(self, prompt, max_tokens):
        try:
            async for _ in self.stream("", "", prompt, max_tokens, 30):
                pass
        except SendFailed as e:
            if e.status != "INVALID_ARGUMENT":
                raise
            return e.details
        return None


class OpenAITransport:
    """`POST {base}/v1/completions` with `stream: true`; `base` like http://127.0.0.1:8000."""

    def __init__(self, session: aiohttp.ClientSession, base: str, model: str, token: str | None = None):
        self.http, self.base, self.model = session, base.rstrip("/"), model
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    @classmethod
    async def connect(cls, session: aiohttp.ClientSession, base: str, token: str | None = None) -> OpenAITransport:
        """The transport for the model the endpoint serves (`GET /v1/models`)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with session.get(f"{base.rstrip('/')}/v1/models", headers=headers) as r:
            if r.status != 200:
                raise SendFailed(HTTP_TO_STATUS.get(r.status, f"HTTP_{r.status}"), await r.text())
            model = (await r.json())["data"][0]["id"]
        return cls(session, base, model, token)

    def _body(self, session_id: str, prompt: list[int], max_tokens: int) -> dict:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True, "return_token_ids": True,
                **({"prompt_cache_key": session_id} if session_id else {})}

    async def stream(self, request_id, session_id, prompt, max_tokens, timeout):
        body = self._body(session_id, prompt, max_tokens)
        try:
            async with self.http.post(f"{self.base}/v1/completions", json=body, headers=self.headers,
                                      timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                if r.status != 200:
                    raise SendFailed(HTTP_TO_STATUS.get(r.status, f"HTTP_{r.status}"), _message(await r.text()),
                                     retry_hint_s(r.headers.get(RETRY_AFTER_KEY)))
                async for update in _events(r):
                    yield update
        except TimeoutError:
            raise SendFailed("DEADLINE_EXCEEDED", f"no answer within {timeout:.1f} s") from None
        except aiohttp.ClientError as e:
            raise SendFailed("UNAVAILABLE", repr(e)) from None

    async def rejection(self, prompt, max_tokens):
        async with self.http.post(f"{self.base}/v1/completions", headers=self.headers,
                                  json={"model": self.model, "prompt": prompt, "max_tokens": max_tokens}) as r:
            return _message(await r.text()) if r.status == 400 else None


async def _events(r: aiohttp.ClientResponse) -> AsyncIterator[Update]:
    """The SSE stream's chunks as Updates, each as it arrives: tokens (and the finish reason on the
    last), then the usage chunk as an Update of its own."""
    async for line in r.content:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        data = json.loads(line[6:])
        if "error" in data:
            raise SendFailed("INTERNAL", data["error"].get("message", ""))
        if data.get("usage"):
            u = data["usage"]
            yield Update([], None, pb.Usage(prompt_tokens=u["prompt_tokens"], completion_tokens=u["completion_tokens"],
                                            cached_prompt_tokens=(u.get("prompt_tokens_details") or {}).get(
                                                "cached_tokens", 0)))
        elif data["choices"]:
            choice = data["choices"][0]
            yield Update(choice.get("token_ids") or [], _FINISH.get(choice.get("finish_reason")))


def _message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:200]
