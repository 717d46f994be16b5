"""router/openai_schema.py: OpenAI bodies -> GenerateRequest, GenerateResponses -> OpenAI's shapes;
and the one table from error type to HTTP status (router/status_codes.py)."""

from __future__ import annotations

import pytest

from tandem.protos.tandem.v1 import generation_pb2 as pb
from tandem.router.admission import Overloaded
from tandem.router.openai_choice import ChoiceBuilder
from tandem.router.openai_schema import (ApiError, chunk, error_body, full_response, models_list, parse_chat,
                                         parse_completion, session_id_for, usage_chunk)
from tandem.router.status_codes import http_status
from tandem.wire.errors import InvalidRequestError, MigrationsExhausted, NoWorkerReady, WorkersOverloaded

M = "smollm2-135m"
CHAT = {"model": M, "messages": [{"role": "user", "content": "hi"}]}


def test_chat_body_becomes_a_generate_request():
    p = parse_chat({**CHAT, "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "\n",
                    "stream": True, "stream_options": {"include_usage": True}, "user": "u1"}, {}, M)
    assert p.stream and p.include_usage and p.model == M
    r = p.request
    assert [(m.role, m.content) for m in r.messages] == [("user", "hi")]
    assert r.sampling.max_tokens == 7 and r.sampling.temperature == 0 and r.sampling.top_p == 0.5
    assert r.sampling.seed == 3 and list(r.sampling.stop) == ["\n"] and r.session_id == "u1"


def test_defaults_follow_openai():
    r = parse_chat(CHAT, {}, M).request
    assert r.sampling.temperature == 1.0 and not r.sampling.HasField("max_tokens")
    assert not r.sampling.HasField("top_p") and not r.sampling.HasField("seed") and r.session_id == ""


def test_max_tokens_and_text_parts_and_developer_role():
    body = {"model": M, "max_tokens": 5, "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "assistant", "content": None}, {"role": "user", "content": "x"}]}
    r = parse_chat(body, {}, M).request
    assert [(m.role, m.content) for m in r.messages] == [("system", "be brief"), ("assistant", ""), ("user", "x")]
    assert r.sampling.max_tokens == 5


@pytest.mark.parametrize("extra, param", [
    ({"n": 2}, "n"), ({"logprobs": 1}, "logprobs"), ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"tools": [{"type": "function"}]}, "tools[0]"), ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]},
     "messages[0].tool_calls[0]"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": "lots"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": "hot"}, "temperature"), ({"seed": -1}, "seed"),
    ({"stop": [1]}, "stop"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"model": ""}, "model"),
])
def test_unsupported_or_bad_fields_are_refused_by_name(extra, param):
    with pytest.raises(ApiError) as e:
        parse_chat({**CHAT, **extra}, {}, M)
    assert e.value.param == param and e.value.status == 400


def test_off_values_of_unimplemented_fields_are_accepted():
    parse_chat({**CHAT, "n": 1, "logprobs": False, "tools": [], "presence_penalty": 0, "user": "x"}, {}, M)


def test_penalties_become_the_grpc_fields():
    sp = parse_chat({**CHAT, "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2},
                    {}, M).request.sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1.0, 1.2)
    sp = parse_completion({"model": M, "prompt": "x"}, {}, M).request.sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.HasField("repetition_penalty")) == (0.0, 0.0, False)


def test_logprobs_and_tools_become_the_grpc_fields():
    r = parse_chat({**CHAT, "logprobs": True, "top_logprobs": 3}, {}, M)
    assert r.logprobs and r.request.sampling.logprobs == 3
    r = parse_chat({**CHAT, "logprobs": True}, {}, M)
    assert r.logprobs and r.request.sampling.HasField("logprobs") and r.request.sampling.logprobs == 0
    r = parse_chat(CHAT, {}, M)
    assert not r.logprobs and not r.request.sampling.HasField("logprobs")
    assert parse_completion({"model": M, "prompt": "x", "logprobs": 2}, {}, M).request.sampling.logprobs == 2
    tool = {"type": "function", "function": {"name": "get_weather", "description": "d",
                                             "parameters": {"type": "object", "properties": {}}}}
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"c": 1}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"}]
    r = parse_chat({"model": M, "messages": msgs, "tools": [tool], "tool_choice": "auto"}, {}, M)
    assert r.tools and [t.name for t in r.request.tools] == ["get_weather"]
    assert r.request.tools[0].parameters == '{"type": "object", "properties": {}}'
    call = r.request.messages[1].tool_calls[0]
    assert (call.id, call.name, call.arguments) == ("call_1", "get_weather", '{"c": 1}')
    assert (r.request.messages[2].tool_call_id, r.request.messages[2].name) == ("call_1", "get_weather")
    none = parse_chat({"model": M, "messages": msgs, "tools": [tool], "tool_choice": "none"}, {}, M)
    assert not none.tools and not none.request.tools


def test_unknown_model_is_404():
    with pytest.raises(ApiError) as e:
        parse_chat({**CHAT, "model": "gpt-4o"}, {}, M)
    assert (e.value.status, e.value.param, e.value.code) == (404, "model", "model_not_found")


def test_completion_prompts():
    assert parse_completion({"model": M, "prompt": "abc"}, {}, M).request.prompt == "abc"
    assert parse_completion({"model": M, "prompt": ["abc"]}, {}, M).request.prompt == "abc"
    assert list(parse_completion({"model": M, "prompt": [1, 2]}, {}, M).request.prompt_token_ids) == [1, 2]
    assert list(parse_completion({"model": M, "prompt": [[3]]}, {}, M).request.prompt_token_ids) == [3]
    for bad, param in (({"prompt": ["a", "b"]}, "prompt"), ({"echo": True}, "echo"), ({"messages": []}, "messages")):
        with pytest.raises(ApiError) as e:
            parse_completion({"model": M, "prompt": "x", **bad}, {}, M)
        assert e.value.param == param


def test_session_id_from_cache_key_then_user_then_header():
    h = {"x-session-id": "hdr"}
    assert session_id_for({"prompt_cache_key": "k", "user": "u"}, h) == "k"
    assert session_id_for({"user": "u"}, h) == "u"
    assert session_id_for({}, h) == "hdr"
    odd = session_id_for({"user": "Jane Doe <jane@example.com>"}, {})
    assert odd.startswith("k-") and odd == session_id_for({"user": "Jane Doe <jane@example.com>"}, {})


def _last(text="!", finish=pb.STOP):
    return pb.GenerateResponse(text=text, finish_reason=finish, usage=pb.Usage(
        prompt_tokens=10, cached_prompt_tokens=8, completion_tokens=3))


def test_responses_in_openai_shape():
    usage = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
             "prompt_tokens_details": {"cached_tokens": 8}}
    b = ChoiceBuilder(True, str)
    b.add(pb.GenerateResponse(text="hey"))
    b.add(_last())
    full = full_response(True, "chatcmpl-x", 1, M, b.choice(), _last().usage)
    assert full["object"] == "chat.completion" and full["usage"] == usage
    assert full["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hey!"},
                                "logprobs": None, "finish_reason": "stop"}]
    b = ChoiceBuilder(False, str)
    b.add(_last("hey", finish=pb.LENGTH))
    text = full_response(False, "cmpl-x", 1, M, b.choice(), _last().usage)
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "hey"
    assert text["choices"][0]["finish_reason"] == "length"
    b = ChoiceBuilder(True, str)
    first = chunk(True, "c", 1, M, b.delta(pb.GenerateResponse(text="he"), first=True), include_usage=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "he"} and first["usage"] is None
    assert first["choices"][0]["finish_reason"] is None
    assert chunk(True, "c", 1, M, b.delta(_last()))["choices"][0]["delta"] == {"content": "!"}
    assert usage_chunk(True, "c", 1, M, _last().usage) == {
        "id": "c", "object": "chat.completion.chunk", "created": 1, "model": M, "choices": [], "usage": usage}
    assert models_list(M, 1)["data"][0]["id"] == M


def test_errors_map_through_the_grpc_table():
    assert http_status(InvalidRequestError("x")) == 400
    assert http_status(Overloaded("queue full", 0.5)) == 429
    assert http_status(WorkersOverloaded("x")) == 429
    assert http_status(NoWorkerReady("x")) == 503 and http_status(MigrationsExhausted("x")) == 503
    assert http_status(RuntimeError("x")) == 500
    assert error_body(429, "slow down") == {"error": {"message": "slow down", "type": "rate_limit_error",
                                                      "param": None, "code": None}}
