"""The OpenAI HTTP edge (router/openai_api.py) on a real cluster, with the official `openai` package
as the client: the same request path as gRPC, so its outputs, sessions and cancellation are the
gRPC path's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
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
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.response.json()["error"]["code"] == "model_not_found"
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


def test_the_readme_curl_examples_run(cluster):
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    commands = re.findall(r"```\n(curl [^`]*?)\n```", readme)
    assert len(commands) == 2
    port = cluster.routers[1][1].http_port   # the router with auth on, as off loopback
    bodies = []
    for command in commands:
        command = command.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, check=True,
                             env={**os.environ, "TANDEM_AUTH_TOKEN": TOKEN})
        bodies.append(json.loads(out.stdout))
    chat, completion = bodies
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] > 0, chat
    # the example samples (temperature 1, OpenAI's default): it may stop on EOS before its 4 tokens
    choice = completion["choices"][0]
    lp, n = choice["logprobs"], completion["usage"]["completion_tokens"]
    assert 1 <= n <= 4 and (n == 4 or choice["finish_reason"] == "stop"), completion
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == n and all(len(t) == 2 for t in lp["top_logprobs"])


# ---- logprobs -------------------------------------------------------------------------------------
def test_penalties_through_both_pools_give_the_engines_tokens(cluster):
    """presence and frequency penalties (OpenAI's fields) and vLLM's repetition_penalty (extra_body)
    reach the engines: the prefill actor samples the first token (the repetition penalty already
    applies to the prompt), the decode actor the rest; greedy, the text is the in-process engine's
    with the same penalties (tests/engine/test_penalties.py checks those against transformers),
    and differs from the unpenalized text. Out of range: a 400 naming the field."""
    from tandem.engine.config import CacheConfig, EngineConfig
    from tandem.engine.engine import LLMEngine

    client = _client(cluster)
    penalties = {"presence_penalty": 0.8, "frequency_penalty": 0.6, "repetition_penalty": 1.5}
    ref = LLMEngine(EngineConfig(model=MODEL, cache=CacheConfig(num_blocks=256))).generate(
        [{"messages": CHAT, "max_tokens": 24, **penalties}, {"messages": CHAT, "max_tokens": 24}])
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                       presence_penalty=0.8, frequency_penalty=0.6,
                                       extra_body={"repetition_penalty": 1.5})
    assert r.choices[0].message.content == ref[0]["text"] != ref[1]["text"]
    for bad in ({"presence_penalty": 3}, {"extra_body": {"repetition_penalty": -1}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, **bad)
        assert e.value.response.json()["error"]["param"] in ("presence_penalty", "repetition_penalty")


def test_logprobs_chat_streamed_and_not(cluster):
    client = _client(cluster)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 8 and "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:   # greedy: the chosen token is the most likely one
        assert c.logprob <= 0 and len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob) and bytes(c.bytes).decode() == c.token
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob >= c.top_logprobs[2].logprob
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [c for ch in chunks for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_logprobs_completions_shape(cluster):
    r = _client(cluster).completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                            temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(len(top) == 2 and max(top.values()) == pytest.approx(x) for top, x in zip(lp.top_logprobs,
                                                                                        lp.token_logprobs))


def test_the_prefill_actors_first_token_logprob_is_the_decode_actors(cluster):
    """The first token comes from the prefill actor (remote prefill: local_prefill_threshold 0), the
    later ones from the decode actor: token 2 of one request is token 1 of its extension."""
    client = _client(cluster)
    ids = cluster.generate(prompt="Once upon a time", max_tokens=1)[0]
    prompt = _prompt_ids(cluster, "Once upon a time")
    a = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=4)
    b = client.completions.create(model=MODEL, prompt=prompt + ids, max_tokens=2, temperature=0, logprobs=4)
    la, lb = a.choices[0].logprobs, b.choices[0].logprobs
    assert la.tokens[1] == lb.tokens[0]
    assert lb.token_logprobs[0] == pytest.approx(la.token_logprobs[1], abs=1e-3)
    assert list(lb.top_logprobs[0]) == list(la.top_logprobs[1])


def _prompt_ids(cluster, text: str) -> list[int]:
    return cluster.routers[0][1].tokenizer.encode(text)


# ---- tools ----------------------------------------------------------------------------------------
# Qwen2.5's chat template, shortened: the system prompt lists the tools, calls are <tool_call> JSON,
# tool results come back as <tool_response> in a user turn.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}"
    "{% else %}You are a helpful assistant.{% endif %}\n\n# Tools\n\n<tools>{% for tool in tools %}\n"
    "{{ tool | tojson }}{% endfor %}\n</tools>\n\nFor each function call, return a json object within "
    "<tool_call></tool_call> XML tags.<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'system' and tools %}{%- elif m.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ m.content }}{%- for tc in m.tool_calls or [] %}{% set f = tc.function %}"
    "\n<tool_call>\n{\"name\": \"{{ f.name }}\", \"arguments\": {{ f.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response><|im_end|>\n{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_TURNS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                  "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


@pytest.fixture(scope="module")
def tools_router(cluster, tmp_path_factory):
    """A router over the same workers whose tokenizer has a tools template (the same vocabulary)."""
    from tandem.engine.tokenizer import HFTokenizer
    from tandem.engine.weights import resolve_model_dir

    src = resolve_model_dir(MODEL)
    d = tmp_path_factory.mktemp("tools-model")
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (d / name).symlink_to(src / name)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": HERMES_TEMPLATE}))
    cluster.add_router(tokenizer=HFTokenizer.from_dir(d))
    return len(cluster.routers) - 1, d


def test_tool_call_round_trip_renders_like_transformers(cluster, tools_router):
    from transformers import PreTrainedTokenizerFast

    index, path = tools_router
    r = _client(cluster, index).chat.completions.create(model=MODEL, messages=TOOL_TURNS, tools=TOOLS,
                                                        tool_choice="auto", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), chat_template=HERMES_TEMPLATE)
    turns = [dict(TOOL_TURNS[1], tool_calls=[{**TOOL_TURNS[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]) if i == 1 else m for i, m in enumerate(TOOL_TURNS)]
    expected = hf.apply_chat_template(turns, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"name": "get_weather"' in expected and "<tool_response>\nsunny, 21 C" in expected
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in expected
    assert r.usage.prompt_tokens == len(hf.encode(expected, add_special_tokens=False))
    # tool_choice "none": the tools are not rendered, so the prompt is shorter
    r2 = _client(cluster, index).chat.completions.create(model=MODEL, messages=TOOL_TURNS, tools=TOOLS,
                                                         tool_choice="none", max_tokens=1)
    assert r2.usage.prompt_tokens < r.usage.prompt_tokens


def test_tools_with_a_template_that_has_none_is_a_400(cluster):
    with pytest.raises(openai.BadRequestError) as e:
        _client(cluster).chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=2)
    assert "does not support tools" in e.value.response.json()["error"]["message"]


# ---- overload and health --------------------------------------------------------------------------
def _http(method: str, url: str, body: dict | None = None) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of a plain HTTP call."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, method=method, data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def _one_slot_router_busy(cluster):
    """A new router of `cluster` that runs one request at a time, and an SDK stream holding that
    slot -> (router, the stream's client, the stream)."""
    from tandem.router.admission import AdmissionConfig, AdmissionLimiter

    cluster.add_router()
    router = cluster.routers[-1][1]
    router.limiter = AdmissionLimiter(AdmissionConfig(max_in_flight=1, max_queue=0))
    client = _client(cluster, len(cluster.routers) - 1)
    stream = client.completions.create(model=MODEL, prompt="count: 1 2 3", max_tokens=300, stream=True,
                                       temperature=0)
    next(iter(stream))     # the one running slot is taken
    return router, client, stream


def test_overload_is_a_429_with_retry_after(cluster):
    router, client, stream = _one_slot_router_busy(cluster)
    try:
        status, headers, body = _http("POST", f"http://127.0.0.1:{router.http_port}/v1/completions",
                                      {"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert int({k.lower(): v for k, v in headers.items()}["retry-after-ms"]) >= 1
        assert body["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    finally:
        stream.close()
    assert cluster.wait_idle()


def test_the_openai_sdk_retries_a_shed_request_after_the_routers_hint(cluster):
    """A client as agents run it (the openai SDK, retries on): the 429's retry hint brings its
    request back once the running slot is free, and it is answered; nothing is leaked."""
    router, _, stream = _one_slot_router_busy(cluster)
    timer = threading.Timer(0.3, stream.close)   # the slot freed before the hint (1 s: nothing finished yet) runs out
    timer.start()
    try:
        retrying = _client(cluster, len(cluster.routers) - 1).with_options(max_retries=2)
        raw = retrying.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
        out = raw.parse()
    finally:
        timer.cancel()
        stream.close()
    assert out.choices[0].text and out.usage.completion_tokens == 2
    assert raw.retries_taken >= 1      # refused first, then retried after the hint
    assert cluster.wait_idle() and router.limiter.running == 0 and router.limiter.waiting == 0


def test_health_follows_the_grpc_health(cluster):
    import asyncio

    from grpc_health.v1 import health_pb2

    router = cluster.routers[0][1]
    url = f"http://127.0.0.1:{router.http_port}/health"
    assert _http("GET", url)[0] == 200

    def set_status(status):
        asyncio.run_coroutine_threadsafe(router.health.set("", status), cluster.loop).result(10)

    set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        status, _, body = _http("GET", url)
        assert status == 503 and body == {"status": "not_serving"}
    finally:
        set_status(health_pb2.HealthCheckResponse.SERVING)
    assert _http("GET", url)[0] == 200
