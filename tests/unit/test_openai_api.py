"""router/openai_api.py's wiring without a cluster: an aiohttp test server around a fake Router,
for what a real cluster cannot show on demand (shedding, a failure after the stream began)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from aiohttp.test_utils import TestClient, TestServer

from tandem.protos.tandem.v1 import generation_pb2 as pb
from tandem.router.admission import Overloaded
from tandem.router.openai_api import make_app
from tandem.router.validation import RequestLimits
from tandem.wire.errors import NoWorkerReady

M = "smollm2-135m"
BODY = {"model": M, "messages": [{"role": "user", "content": "hi"}]}


class FakeRouter:
    """Answers admit_and_generate with `script`: responses, or an exception to raise."""

    def __init__(self, *script):
        self.script, self.limits, self.errors, self.closed = script, RequestLimits(), [], False

    async def admit_and_generate(self, request, client):
        try:
            for item in self.script:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.closed = True

    def record_error(self, e, code):
        self.errors.append(code)


def _post(router, path="/v1/chat/completions", body=BODY, tokens=None, headers=None):
    async def go():
        async with TestClient(TestServer(make_app(router, M, tokens))) as client:
            r = await client.post(path, json=body, headers=headers)
            return r.status, dict(r.headers), await r.text()
    return asyncio.run(go())


def test_shed_request_is_429_with_retry_after():
    router = FakeRouter(Overloaded("queue full", 2.2))
    status, headers, text = _post(router)
    assert status == 429 and headers["Retry-After"] == "3" and '"rate_limit_error"' in text
    assert headers["retry-after-ms"] == "2200"      # exact, and read first by the openai SDKs
    assert router.errors == ["RESOURCE_EXHAUSTED"]


def test_no_worker_is_503():
    status, _, text = _post(FakeRouter(NoWorkerReady("no decode worker is ready")))
    assert status == 503 and "no decode worker is ready" in text


def test_a_failure_after_the_stream_began_is_an_error_event_then_done():
    router = FakeRouter(pb.GenerateResponse(text="a", request_id="r1"), NoWorkerReady("gone"))
    status, _, text = _post(router, body={**BODY, "stream": True})
    events = [e for e in text.split("\n\n") if e]
    assert status == 200 and '"chatcmpl-r1"' in events[0] and '"error"' in events[1] and events[2] == "data: [DONE]"
    assert router.closed


def test_token_store_guards_the_api_but_not_health():
    store = SimpleNamespace(verify=lambda t: t == "good")
    assert _post(FakeRouter(), tokens=store)[0] == 401
    assert _post(FakeRouter(), tokens=store, headers={"Authorization": "Bearer bad"})[0] == 401
    done = pb.GenerateResponse(text="x", request_id="r", finish_reason=pb.STOP)
    assert _post(FakeRouter(done), tokens=store, headers={"Authorization": "Bearer good"})[0] == 200

    async def health():
        async with TestClient(TestServer(make_app(FakeRouter(), M, store))) as client:
            return (await client.get("/health")).status
    assert asyncio.run(health()) == 200


class ToolTokenizer:
    chat_template = "{% for t in tools %}{{ t | tojson }}{% endfor %} answer in <tool_call></tool_call>"

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i) for i in ids)


def _tool_router():
    parts = ['Sure.<tool', '_call>\n{"name": "get_weather", "arg', 'uments": {"city": "Paris"}}\n</tool_call>']
    router = FakeRouter(*[pb.GenerateResponse(text=t, token_ids=[i + 1], request_id="r1" if i == 0 else "",
                                              finish_reason=pb.STOP if i == 2 else 0,
                                              logprobs=[pb.TokenLogprob(token_id=i + 1, logprob=-0.5)])
                          for i, t in enumerate(parts)])
    router.tokenizer = ToolTokenizer()
    return router


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_tool_calls_reach_the_openai_client_streamed_and_whole():
    """The edge's wiring of router/tool_calls.py with the openai SDK as the client: the call comes
    back as tool_calls (whole) or as a tool_calls delta (streamed), with finish_reason tool_calls."""
    import openai

    async def go():
        async with TestServer(make_app(_tool_router(), M)) as server:
            client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0)
            whole = await client.chat.completions.create(model=M, messages=BODY["messages"], tools=TOOLS)
        async with TestServer(make_app(_tool_router(), M)) as server:
            client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0)
            stream = await client.chat.completions.create(model=M, messages=BODY["messages"], tools=TOOLS,
                                                          stream=True, logprobs=True)
            chunks = [c async for c in stream]
        return whole, chunks

    whole, chunks = asyncio.run(go())
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and msg.content == "Sure."
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Sure."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [lp.token for c in chunks for lp in c.choices[0].logprobs.content] == ["a", "b", "c"]


def _request(method, path, *, data=None, json=None, tokens=None, headers=None, limit=None):
    router = FakeRouter(pb.GenerateResponse(text="x", request_id="r", finish_reason=pb.STOP))
    if limit is not None:
        router.limits = SimpleNamespace(grpc_max_receive_bytes=limit)

    async def go():
        async with TestClient(TestServer(make_app(router, M, tokens))) as client:
            r = await client.request(method, path, data=data, json=json, headers=headers)
            return r.status, r.headers.get("Content-Type", ""), await r.text()
    return asyncio.run(go())


@pytest.mark.parametrize("method, path, status, words", [
    ("GET", "/v1/embeddings", 404, "no such endpoint: GET /v1/embeddings"),
    ("POST", "/v1/responses", 404, "no such endpoint: POST /v1/responses"),
    ("GET", "/v1/chat/completions", 405, "GET is not allowed on /v1/chat/completions"),
    ("DELETE", "/v1/models", 405, "DELETE is not allowed"),
])
def test_aiohttps_own_refusals_come_in_openais_shape(method, path, status, words):
    got, ctype, text = _request(method, path)
    body = json.loads(text)
    assert got == status and ctype.startswith("application/json")
    assert set(body["error"]) == {"message", "type", "param", "code"} and words in body["error"]["message"]


def test_a_body_over_the_limit_is_a_413_in_openais_shape():
    status, _, text = _request("POST", "/v1/chat/completions", data=b"x" * 5000, limit=4096,
                               headers={"Content-Type": "application/json"})
    assert status == 413 and "over this server's limit of 4096 bytes" in json.loads(text)["error"]["message"]


def test_retrieve_model_serves_the_one_model_and_404s_the_rest():
    status, _, text = _request("GET", f"/v1/models/{M}")
    assert status == 200 and json.loads(text) == {**json.loads(text), "id": M, "object": "model"}
    status, _, text = _request("GET", "/v1/models/org/other-model")
    err = json.loads(text)["error"]
    assert status == 404 and err["code"] == "model_not_found" and "'org/other-model'" in err["message"]
    store = SimpleNamespace(verify=lambda t: False)
    assert _request("GET", f"/v1/models/{M}", tokens=store)[0] == 401


@pytest.mark.parametrize("value", ["yes", 1, {"on": True}])
def test_stream_must_be_a_boolean(value):
    status, _, text = _request("POST", "/v1/chat/completions", json={**BODY, "stream": value})
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == "stream" and err["message"] == "stream must be a boolean"
