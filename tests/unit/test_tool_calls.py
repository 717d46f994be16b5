"""Tool calls parsed out of output text (router/tool_calls.py), whole and streamed in every split,
and the OpenAI choice built around them and around logprobs (router/openai_choice.py)."""

from __future__ import annotations

import json

import pytest

from tandem.protos.tandem.v1 import generation_pb2 as pb
from tandem.router.openai_choice import NO_PROBABILITY, ChoiceBuilder
from tandem.router.tool_calls import ToolCallStream, parse_tool_calls, tool_format

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')


def _streamed(text: str, fmt: str, size: int):
    s = ToolCallStream(fmt)
    content, calls = "", []
    for i in range(0, len(text), size):
        c, k = s.feed(text[i:i + size])
        content, calls = content + c, calls + k
    c, k = s.finish()
    return content + c, calls + k


def test_hermes_calls_between_text():
    content, calls = parse_tool_calls(HERMES, "hermes")
    assert content == "Let me check.\n\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"tz": "CET"})]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id


@pytest.mark.parametrize("size", [1, 2, 3, 7, 11, 1000])
def test_streaming_in_any_split_gives_the_whole_text_result(size):
    whole = parse_tool_calls(HERMES, "hermes")
    content, calls = _streamed(HERMES, "hermes", size)
    assert content == whole[0] and [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole[1]]


def test_hermes_text_that_only_looks_like_a_call_is_kept():
    for text in ("a < b and <tool_ not a call", "<tool_call>{not json}</tool_call> after",
                 "x <tool_call>{\"no_name\": 1}</tool_call>"):
        for size in (1, 4, 100):
            content, calls = _streamed(text, "hermes", size)
            assert (content, calls) == (text, [])


def test_hermes_call_cut_by_eos_before_its_close_tag():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {}}\n', "hermes")
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", "{}")]


def test_held_back_text_is_only_a_possible_tag_start():
    s = ToolCallStream("hermes")
    assert s.feed("hello <tool") == ("hello ", [])
    assert s.feed("box>") == ("<toolbox>", [])


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '  {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}'])
def test_llama3_json_call(text):
    for size in (1, 5, 1000):
        content, calls = _streamed(text, "llama3_json", size)
        assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris"})]


def test_llama3_plain_text_and_json_that_is_not_a_call_stay_text():
    assert _streamed("Paris is sunny {today}", "llama3_json", 3) == ("Paris is sunny {today}", [])
    assert _streamed('{"answer": 42}', "llama3_json", 3) == ('{"answer": 42}', [])


def test_format_follows_the_template():
    assert tool_format("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert tool_format("{% if tools %}{{ tools | tojson }}{% endif %} parameters") == "llama3_json"
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert tool_format(None) is None


def _resp(text, finish=0, lps=()):
    return pb.GenerateResponse(text=text, finish_reason=finish, logprobs=[
        pb.TokenLogprob(token_id=t, logprob=lp, top=[pb.TopLogprob(token_id=a, logprob=v) for a, v in top])
        for t, lp, top in lps])


def test_chat_choice_with_tool_calls_streamed_and_whole():
    parts = [HERMES[:20], HERMES[20:60], HERMES[60:]]
    b = ChoiceBuilder(True, str, tool_format="hermes")
    deltas = [b.delta(_resp(p, pb.STOP if i == 2 else 0), i == 0) for i, p in enumerate(parts)]
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 1] and calls[0]["function"]["name"] == "get_weather"
    assert "".join(d["delta"]["content"] for d in deltas) == "Let me check.\n\n"
    assert deltas[-1]["finish_reason"] == "tool_calls"
    whole = ChoiceBuilder(True, str, tool_format="hermes")
    for i, p in enumerate(parts):
        whole.add(_resp(p, pb.STOP if i == 2 else 0))
    choice = whole.choice()
    assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 2
    assert choice["message"]["tool_calls"][1]["function"] == {"name": "get_time", "arguments": '{"tz": "CET"}'}


def test_logprobs_in_the_chat_and_completions_shapes():
    names = {1: "He", 2: "llo", 3: "é"}
    lps = [(1, -0.5, [(1, -0.5), (2, -1.5)]), (3, float("-inf"), [(1, -0.25), (2, -2.5)])]
    chat = ChoiceBuilder(True, names.__getitem__, logprobs=True).delta(_resp("Heé", pb.LENGTH, lps), True)
    content = chat["logprobs"]["content"]
    assert content[0] == {"token": "He", "logprob": -0.5, "bytes": [72, 101], "top_logprobs": [
        {"token": "He", "logprob": -0.5, "bytes": [72, 101]}, {"token": "llo", "logprob": -1.5, "bytes": [108, 108, 111]}]}
    assert content[1]["logprob"] == NO_PROBABILITY and content[1]["bytes"] == [0xC3, 0xA9]
    b = ChoiceBuilder(False, names.__getitem__, logprobs=True)
    b.add(_resp("He", 0, lps[:1]))
    b.add(_resp("é", pb.STOP, lps[1:]))
    lp = b.choice()["logprobs"]
    assert lp == {"tokens": ["He", "é"], "token_logprobs": [-0.5, NO_PROBABILITY],
                  "top_logprobs": [{"He": -0.5, "llo": -1.5}, {"He": -0.25, "llo": -2.5}], "text_offset": [0, 2]}
    assert ChoiceBuilder(False, str).delta(_resp("x"))["logprobs"] is None    # not asked: null
