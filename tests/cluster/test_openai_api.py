"""The OpenAI HTTP edge (router/openai_api.py) on a real cluster, with the official `openai` package
as the client: the same request path as gRPC, so its outputs, sessions and cancellation are the
gRPC path's."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import openai
import pytest

from tandem.router.auth import BearerTokenInterceptor, TokenStore

MODEL = "smollm2-135m"
CHAT = [{"role": "user", "content": "Write a haiku about unit tests."}]
TOKEN = "openai-edge-test-token-0123456789"


@pytest.fixture(scope="module")
def cluster(ray_session):
    from tandem.cluster.local import RunningCluster

    c = RunningCluster({"model.name": MODEL, "cache.num_blocks": 512, "decode.local_prefill_threshold": 0,
                        "prefill.replicas": 1, "decode.replicas": 1})
    store = TokenStore(None, TOKEN)
    c.add_router(interceptors=(BearerTokenInterceptor(store),), token_store=store)
    yield c
    c.close()


def _client(cluster, router: int = 0, api_key: str = "unused") -> openai.OpenAI:
    port = cluster.routers[router][1].http_port
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0, timeout=120)


def test_models_and_chat_match_the_grpc_path(cluster):
    client = _client(cluster)
    assert [m.id for m in client.models.list()] == [MODEL]
    ids, text, last = cluster.generate(messages=CHAT, max_tokens=12, temperature=0)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == last.usage.prompt_tokens and r.usage.completion_tokens == len(ids) == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-2].choices[0].finish_reason == "length"


def test_completions_streamed_and_not(cluster):
    client = _client(cluster)
    prompt = "The three laws of thermodynamics are"
    _, text, _ = cluster.generate(prompt=prompt, max_tokens=10, temperature=0)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == text and r.usage.completion_tokens == 10
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text


def test_second_turn_of_a_prompt_cache_key_shows_cached_tokens(cluster):
    client = _client(cluster)
    first = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                           prompt_cache_key="agent-7")
    turn2 = CHAT + [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "Another one."}]
    second = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=8, temperature=0,
                                            prompt_cache_key="agent-7")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached >= first.usage.prompt_tokens - 16   # whole blocks of the first turn


def test_bad_parameters_and_unknown_model_get_openai_errors(cluster):
    client = _client(cluster)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, n=2)
    assert e.value.status_code == 400
    err = e.value.response.json()["error"]
    assert err["param"] == "n" and err["type"] == "invalid_request_error" and set(err) == {
        "message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError):   # the router's own validation, as for gRPC
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10**9)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert e.value.response.json()["error"]["code"] == "model_not_found"


def test_auth_like_grpc(cluster):
    with pytest.raises(openai.AuthenticationError) as e:
        _client(cluster, 1, api_key="wrong-token-wrong-token").chat.completions.create(model=MODEL, messages=CHAT)
    assert e.value.status_code == 401 and e.value.response.json()["error"]["code"] == "invalid_api_key"
    r = _client(cluster, 1, api_key=TOKEN).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_disconnect_mid_stream_frees_every_block(cluster):
    client = _client(cluster)
    router = cluster.routers[0][1]
    cancelled = router.counters["cancelled"]
    stream = client.completions.create(model=MODEL, prompt="def merge_sorted(a, b):\n" * 20, max_tokens=400,
                                       temperature=0, stream=True)
    got = 0
    for c in stream:
        got += 1
        if got >= 5:
            stream.close()
            break
    assert got >= 5
    used = cluster.wait_idle()
    assert used and all(v == 0 for v in used.values()), used
    assert router.counters["cancelled"] == cancelled + 1   # cancelled by the disconnect, not finished


def test_the_readme_curl_example_runs(cluster):
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    command = re.search(r"```\n(curl [^`]*?)\n```", readme).group(1)
    port = cluster.routers[1][1].http_port   # the router with auth on, as off loopback
    command = command.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "TANDEM_AUTH_TOKEN": TOKEN})
    body = json.loads(out.stdout)
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] > 0, body
