"""router.validation: every bad input is rejected with a message naming the field and the rule."""

from __future__ import annotations

import math

import pytest

from tandem.protos.tandem.v1 import generation_pb2 as pb
from tandem.router.validation import (InvalidRequest, RequestLimits, check_prompt_length,
                               validate_request)
from tandem.wire.errors import InvalidRequestError

VOCAB = 1000
CONTEXT = 2048


def make_request(**overrides) -> pb.GenerateRequest:
    sampling = overrides.pop("sampling", {})
    has_input = {"prompt", "prompt_token_ids", "messages"} & set(overrides)
    fields = {**({} if has_input else {"prompt": "hello"}), **overrides}
    return pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), **fields)


def validate(req, limits: RequestLimits = RequestLimits()):
    return validate_request(req, vocab_size=VOCAB, max_context=CONTEXT, limits=limits)


def rejects(req, *fragments, limits: RequestLimits = RequestLimits()) -> str:
    with pytest.raises(InvalidRequest) as info:
        validate(req, limits)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


# --- valid requests ---------------------------------------------------------------------------

def test_prompt_with_defaults():
    v = validate(make_request(prompt="hi there"))
    assert (v.prompt, v.prompt_token_ids, v.messages) == ("hi there", None, None)
    assert (v.request_id, v.session_id) == (None, None)
    s = v.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop, s.ignore_eos) == (
        256, 0.0, 1.0, 0, None, (), False)
    assert s.greedy and not v.max_tokens_given


def test_token_ids_and_all_sampling_fields():
    v = validate(make_request(
        request_id="req-1", session_id="agent:42/main", prompt_token_ids=[0, 5, VOCAB - 1],
        sampling=dict(max_tokens=7, temperature=0.7, top_p=0.9, top_k=40, seed=123,
                      stop=["\n\n", "</s>"], ignore_eos=True)))
    assert v.prompt_token_ids == [0, 5, VOCAB - 1] and v.prompt is None
    assert (v.request_id, v.session_id) == ("req-1", "agent:42/main")
    s = v.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop, s.ignore_eos) == (
        7, 0.7, 0.9, 40, 123, ("\n\n", "</s>"), True)
    assert v.max_tokens_given


def test_penalties_pass_through_and_are_bounded():
    s = validate(make_request(prompt="x", sampling=dict(presence_penalty=1.0, frequency_penalty=-0.5,
                                                        repetition_penalty=1.1))).sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (1.0, -0.5, 1.1) and s.penalized
    assert not validate(make_request(prompt="x")).sampling.penalized
    rejects(make_request(prompt="x", sampling=dict(presence_penalty=2.5)), "sampling.presence_penalty must be in")
    rejects(make_request(prompt="x", sampling=dict(frequency_penalty=float("nan"))), "sampling.frequency_penalty")
    rejects(make_request(prompt="x", sampling=dict(repetition_penalty=0.0)), "sampling.repetition_penalty must be in")


def test_messages():
    msgs = [pb.ChatMessage(role=r, content=f"{r} text") for r in ("system", "user", "assistant",
                                                                  "tool")]
    msgs.append(pb.ChatMessage(role="assistant", content=""))  # empty turns are allowed
    v = validate(make_request(messages=msgs))
    assert v.messages[0] == {"role": "system", "content": "system text"}
    assert len(v.messages) == 5 and v.prompt is None


def test_seed_zero_is_a_seed_and_top_k_past_vocab_is_off():
    s = validate(make_request(sampling=dict(seed=0, top_k=VOCAB))).sampling
    assert s.seed == 0 and s.top_k == 0


def test_top_p_one_and_max_tokens_equal_to_context_are_allowed():
    s = validate(make_request(sampling=dict(top_p=1.0, max_tokens=CONTEXT))).sampling
    assert s.top_p == 1.0 and s.max_tokens == CONTEXT


def test_error_type_is_the_engines():
    assert InvalidRequest is InvalidRequestError


# --- input: exactly one of prompt / prompt_token_ids / messages -------------------------------

def test_no_input():
    rejects(pb.GenerateRequest(), "exactly one of prompt, prompt_token_ids or messages",
            "none was given")


def test_two_inputs():
    rejects(make_request(prompt="a", prompt_token_ids=[1]), "exactly one of",
            "got prompt and prompt_token_ids")


def test_three_inputs():
    rejects(make_request(prompt="a", prompt_token_ids=[1],
                         messages=[pb.ChatMessage(role="user", content="x")]),
            "got prompt and prompt_token_ids and messages")


def test_empty_prompt():
    rejects(make_request(prompt=""), "prompt is empty")


def test_empty_token_ids_and_messages_count_as_absent():
    rejects(make_request(prompt_token_ids=[], messages=[]), "none was given",
            "an empty list counts as not given")


def test_messages_all_empty():
    rejects(make_request(messages=[pb.ChatMessage(role="user", content="")]),
            "content is empty")


def test_token_id_out_of_vocab():
    rejects(make_request(prompt_token_ids=[1, 2, VOCAB, 3]),
            f"prompt_token_ids[2] is {VOCAB}", f"[0, {VOCAB})")


def test_token_ids_longer_than_context():
    rejects(make_request(prompt_token_ids=[1] * CONTEXT), f"the prompt is {CONTEXT} tokens",
            f"at most {CONTEXT - 1} tokens")


def test_token_ids_plus_explicit_max_tokens_over_context():
    rejects(make_request(prompt_token_ids=[1] * 2000, sampling=dict(max_tokens=100)),
            "sampling.max_tokens is 100", "at most 48")


def test_unknown_role():
    rejects(make_request(messages=[pb.ChatMessage(role="robot", content="x")]),
            "messages[0].role is 'robot'", "system, user, assistant, tool")


def test_too_many_messages():
    msgs = [pb.ChatMessage(role="user", content="x")] * 4
    rejects(make_request(messages=msgs), "messages has 4 entries; at most 3",
            limits=RequestLimits(max_messages=3))


def test_ten_megabyte_prompt():
    message = rejects(make_request(prompt="x" * (10 << 20)), f"prompt is {10 << 20} bytes",
                      f"at most {4 << 20} bytes (4 MiB)")
    assert len(message) < 200


def test_prompt_bytes_count_utf8():
    limits = RequestLimits(max_prompt_bytes=10)
    validate(make_request(prompt="x" * 10), limits)
    rejects(make_request(prompt="é" * 6), "prompt is 12 bytes", limits=limits)


def test_messages_bytes():
    limits = RequestLimits(max_prompt_bytes=10)
    msgs = [pb.ChatMessage(role="user", content="x" * 6)] * 2
    rejects(make_request(messages=msgs), "messages' content is 12 bytes", limits=limits)


def test_grpc_receive_limit_leaves_room_for_oversize_prompts():
    assert RequestLimits().grpc_max_receive_bytes >= 64 << 20 > 10 << 20


# --- sampling -------------------------------------------------------------------------------

@pytest.mark.parametrize("max_tokens", [0, -5])
def test_max_tokens_below_one(max_tokens):
    rejects(make_request(sampling=dict(max_tokens=max_tokens)),
            f"sampling.max_tokens must be at least 1, got {max_tokens}")


def test_max_tokens_over_context():
    rejects(make_request(sampling=dict(max_tokens=CONTEXT + 1)),
            f"sampling.max_tokens must be at most the model's context length {CONTEXT}, "
            f"got {CONTEXT + 1}")


@pytest.mark.parametrize("temperature", [-0.1, math.nan, math.inf])
def test_bad_temperature(temperature):
    rejects(make_request(sampling=dict(temperature=temperature)),
            "sampling.temperature must be a finite number >= 0 (0 = greedy)")


@pytest.mark.parametrize("top_p", [0.0, -0.5, 1.5, math.nan])
def test_bad_top_p(top_p):
    rejects(make_request(sampling=dict(top_p=top_p)), "sampling.top_p must be in (0, 1]",
            f"got {top_p}")


def test_top_p_message_exact():
    message = rejects(make_request(sampling=dict(top_p=1.5)))
    assert message == "sampling.top_p must be in (0, 1], got 1.5"


def test_negative_top_k():
    rejects(make_request(sampling=dict(top_k=-1)), "sampling.top_k must be >= 0 (0 = off), got -1")


def test_too_many_stop_strings():
    rejects(make_request(sampling=dict(stop=[str(i) for i in range(17)])),
            "sampling.stop has 17 strings; at most 16")


def test_stop_string_too_long():
    rejects(make_request(sampling=dict(stop=["ok", "x" * 257])),
            "sampling.stop[1] is 257 characters long; at most 256")


def test_empty_stop_string():
    rejects(make_request(sampling=dict(stop=[""])), "sampling.stop[0] is empty")


# --- ids ------------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["request_id", "session_id"])
def test_id_too_long(field):
    rejects(make_request(**{field: "a" * 129}), f"{field} is 129 characters long; at most 128")


@pytest.mark.parametrize("field", ["request_id", "session_id"])
@pytest.mark.parametrize("value", ["has space", "new\nline", "ünïcode", "semi;colon"])
def test_id_bad_characters(field, value):
    rejects(make_request(**{field: value}), f"{field} {value!r} has characters outside",
            "A-Za-z0-9")


def test_long_bad_id_is_not_echoed_whole():
    message = rejects(make_request(session_id=" " * 100), "characters outside")
    assert " " * 50 not in message


# --- check_prompt_length ----------------------------------------------------------------------

def test_default_max_tokens_is_capped_at_room_left():
    v = validate(make_request(prompt="x"))
    assert v.sampling_for_prompt(2000, CONTEXT).max_tokens == CONTEXT - 2000
    assert v.sampling_for_prompt(10, CONTEXT).max_tokens == 256
    assert check_prompt_length(2000, 256, CONTEXT, explicit=False) == 48


def test_explicit_max_tokens_must_fit():
    v = validate(make_request(prompt="x", sampling=dict(max_tokens=100)))
    assert v.sampling_for_prompt(1948, CONTEXT).max_tokens == 100
    with pytest.raises(InvalidRequest, match="sampling.max_tokens is 100 .* at most 99"):
        v.sampling_for_prompt(1949, CONTEXT)


def test_prompt_fills_the_context():
    with pytest.raises(InvalidRequest, match="prompt is 2048 tokens; the model's context is 2048"):
        check_prompt_length(CONTEXT, 1, CONTEXT)
    assert check_prompt_length(CONTEXT - 1, 1, CONTEXT) == 1


def test_prompt_empty_after_tokenization():
    with pytest.raises(InvalidRequest, match="empty after tokenization"):
        check_prompt_length(0, 1, CONTEXT)


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_stop_strings must be an integer >= 1"):
        RequestLimits(max_stop_strings=0)


def test_logprobs_and_tools_as_the_template_and_engine_take_them():
    v = validate(make_request(sampling={"logprobs": 3}))
    assert v.sampling.logprobs == 3 and validate(make_request()).sampling.logprobs is None
    rejects(make_request(sampling={"logprobs": 21}), "logprobs", "20")
    call = pb.ToolCall(id="c1", name="f", arguments='{"x": 1}')
    msgs = [pb.ChatMessage(role="user", content="hi"), pb.ChatMessage(role="assistant", tool_calls=[call]),
            pb.ChatMessage(role="tool", content="42", tool_call_id="c1", name="f")]
    v = validate(make_request(messages=msgs, tools=[pb.Tool(name="f", parameters='{"type": "object"}')]))
    assert v.tools == [{"type": "function", "function": {"name": "f", "description": "",
                                                          "parameters": {"type": "object"}}}]
    assert v.messages[1]["tool_calls"] == [{"id": "c1", "type": "function", "function": {"name": "f",
                                                                                        "arguments": {"x": 1}}}]
    assert v.messages[2] == {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"}
    rejects(make_request(tools=[pb.Tool(name="f")]), "only allowed with messages")
    rejects(make_request(messages=msgs[:1], tools=[pb.Tool(name="f", parameters="[1]")]), "tools[0].parameters")
    bad = [pb.ChatMessage(role="user", content="x", tool_calls=[call])]
    rejects(make_request(messages=bad), "only assistant messages")
    rejects(make_request(messages=[msgs[0], pb.ChatMessage(role="assistant", tool_calls=[
        pb.ToolCall(name="f", arguments="{oops")])]), "not valid JSON")


def test_num_speculative_tokens_per_request():
    v = validate(make_request(sampling={"num_speculative_tokens": 0}))
    assert v.sampling.num_speculative_tokens == 0  # speculation off for this request
    assert validate(make_request(sampling={"num_speculative_tokens": 12})).sampling.num_speculative_tokens == 12
    assert validate(make_request()).sampling.num_speculative_tokens is None  # the server's setting
    rejects(make_request(sampling={"num_speculative_tokens": 65}), "num_speculative_tokens", "64")
