"""Checks a `tandem.v1.GenerateRequest` before any work is done for it. Pure: no gRPC, Ray or torch.

`validate_request` turns a request message into a `ValidatedRequest` (defaults applied) or raises
`InvalidRequest`, whose message says what is wrong and what is allowed; the server maps it, once, to
INVALID_ARGUMENT. Checks that need the token count (prompt too long for the context) are in
`check_prompt_length`, which the server calls after rendering and tokenizing.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace

from tandem.wire.errors import InvalidRequestError
from tandem.wire.messages import (MAX_PENALTY, MAX_REPETITION_PENALTY, MAX_SPECULATIVE_TOKENS, MAX_TOP_LOGPROBS,
                                  SamplingParams)

# One error type for bad input, shared with the engine (which raises it for the same reasons).
InvalidRequest = InvalidRequestError

CHAT_ROLES = ("system", "user", "assistant", "tool")
_INPUTS = ("prompt", "prompt_token_ids", "messages")
_ID_CHARS = "A-Za-z0-9._:/@+=-"
_ID_PATTERN = re.compile(f"[{_ID_CHARS}]+")


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds the router enforces; the model's vocab and context come separately."""

    max_prompt_bytes: int = 4 << 20  # UTF-8 bytes of `prompt`, or of all message contents
    max_messages: int = 10_000
    max_stop_strings: int = 16
    max_stop_chars: int = 256  # characters per stop string
    max_id_chars: int = 128  # request_id and session_id
    default_max_tokens: int = 256  # when sampling.max_tokens is unset (then capped at the context)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"request limits: {name} must be an integer >= 1, got {value!r}")

    @property
    def grpc_max_receive_bytes(self) -> int:
        """What the server should set as `grpc.max_receive_message_length`.

        gRPC's default (4 MiB) would reject an oversize prompt with a bare RESOURCE_EXHAUSTED before
        this validator could name the limit; this leaves room for prompts well past the limit.
        """
        return max(64 << 20, 4 * self.max_prompt_bytes)


@dataclass(frozen=True)
class ValidatedRequest:
    """A validated request: exactly one of prompt, prompt_token_ids and messages is set."""

    request_id: str | None  # None: the router assigns one
    session_id: str | None  # None: no session affinity
    prompt: str | None
    prompt_token_ids: list[int] | None
    messages: list[dict] | None  # [{"role": ..., "content": ...}] (+ tool_calls, tool_call_id, name)
    # max_tokens is the client's value, or limits.default_max_tokens when max_tokens_given is False;
    # `sampling_for_prompt` fits it to the context once the prompt's token count is known.
    sampling: SamplingParams
    max_tokens_given: bool
    tools: list[dict] | None = None  # as chat templates take them: [{"type": "function", "function": {...}}]

    def sampling_for_prompt(self, num_prompt_tokens: int, max_context: int) -> SamplingParams:
        """The sampling parameters to run with; raises InvalidRequest if the prompt does not fit."""
        max_tokens = check_prompt_length(num_prompt_tokens, self.sampling.max_tokens, max_context,
                                         explicit=self.max_tokens_given)
        return replace(self.sampling, max_tokens=max_tokens)


def validate_request(req, *, vocab_size: int, max_context: int,
                     limits: RequestLimits = RequestLimits()) -> ValidatedRequest:
    """Check a GenerateRequest; returns it as a ValidatedRequest or raises InvalidRequest."""
    request_id = _check_id("request_id", req.request_id, limits)
    session_id = _check_id("session_id", req.session_id, limits)
    given = [name for name, present in zip(_INPUTS, (
        req.HasField("prompt"), len(req.prompt_token_ids) > 0, len(req.messages) > 0)) if present]
    if len(given) != 1:
        got = "none was given (an empty list counts as not given)" if not given else \
            f"got {' and '.join(given)}"
        raise InvalidRequest(
            f"exactly one of prompt, prompt_token_ids or messages is required; {got}")

    prompt = token_ids = messages = None
    if given[0] == "prompt":
        prompt = _check_prompt(req.prompt, limits)
    elif given[0] == "prompt_token_ids":
        token_ids = _check_token_ids(req.prompt_token_ids, vocab_size, max_context)
    else:
        messages = _check_messages(req.messages, limits)

    sampling, max_tokens_given = _check_sampling(req.sampling, vocab_size, max_context, limits)
    tools = _check_tools(req.tools, limits) if len(req.tools) else None
    if tools is not None and messages is None:
        raise InvalidRequest("tools are only allowed with messages (the chat template renders them)")
    if token_ids is not None:
        check_prompt_length(len(token_ids), sampling.max_tokens, max_context,
                            explicit=max_tokens_given)
    return ValidatedRequest(request_id=request_id, session_id=session_id, prompt=prompt,
                            prompt_token_ids=token_ids, messages=messages, sampling=sampling,
                            max_tokens_given=max_tokens_given, tools=tools)


def check_prompt_length(num_prompt_tokens: int, max_tokens: int, max_context: int, *,
                        explicit: bool = True) -> int:
    """Check that the prompt leaves room for output; returns the max_tokens to run with.

    An explicit max_tokens must fit next to the prompt; a default one is capped at the room left.
    """
    if num_prompt_tokens < 1:
        raise InvalidRequest("the prompt is empty after tokenization; at least 1 token is required")
    room = max_context - num_prompt_tokens
    if room < 1:
        raise InvalidRequest(
            f"the prompt is {num_prompt_tokens} tokens; the model's context is {max_context} "
            f"tokens, so a prompt may have at most {max_context - 1} tokens (leaving room for 1 "
            f"output token)")
    if not explicit:
        return min(max_tokens, room)
    if max_tokens > room:
        raise InvalidRequest(
            f"sampling.max_tokens is {max_tokens} but the prompt is {num_prompt_tokens} tokens and "
            f"the model's context is {max_context} tokens: max_tokens may be at most {room} "
            f"(or leave it unset to get the default capped at the room left)")
    return max_tokens


def _check_id(name: str, value: str, limits: RequestLimits) -> str | None:
    if not value:
        return None
    if len(value) > limits.max_id_chars:
        raise InvalidRequest(
            f"{name} is {len(value)} characters long; at most {limits.max_id_chars} are allowed")
    if not _ID_PATTERN.fullmatch(value):
        raise InvalidRequest(
            f"{name} {_preview(value)} has characters outside the allowed set [{_ID_CHARS}]")
    return value


def _check_prompt(prompt: str, limits: RequestLimits) -> str:
    if not prompt:
        raise InvalidRequest(
            "prompt is empty; give a non-empty prompt, prompt_token_ids or messages")
    _check_bytes("prompt", len(prompt.encode("utf-8")), limits)
    return prompt


def _check_token_ids(ids, vocab_size: int, max_context: int) -> list[int]:
    if len(ids) >= max_context:  # before the O(n) scan below; same message as check_prompt_length
        check_prompt_length(len(ids), 1, max_context)
    token_ids = list(ids)
    if max(token_ids) >= vocab_size:
        i, bad = next((i, t) for i, t in enumerate(token_ids) if t >= vocab_size)
        raise InvalidRequest(f"prompt_token_ids[{i}] is {bad}; token ids must be in "
                             f"[0, {vocab_size}) for this model's vocabulary of {vocab_size}")
    return token_ids


def _check_messages(messages, limits: RequestLimits) -> list[dict[str, str]]:
    if len(messages) > limits.max_messages:
        raise InvalidRequest(
            f"messages has {len(messages)} entries; at most {limits.max_messages} are allowed")
    out = []
    num_bytes = 0
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role is {_preview(m.role)}; allowed roles are "
                                 f"{', '.join(CHAT_ROLES)}")
        num_bytes += len(m.content.encode("utf-8")) + sum(len(c.arguments.encode("utf-8")) for c in m.tool_calls)
        out.append(_message_dict(m, i))
    if all(not m["content"] and not m.get("tool_calls") for m in out):
        raise InvalidRequest("every message's content is empty; at least one must have text")
    _check_bytes("messages' content", num_bytes, limits)
    return out


def _message_dict(m, i: int) -> dict:
    """A chat message as chat templates read it (transformers' convention: a tool call's arguments
    as an object, so a template's `tojson` writes them once)."""
    d: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        if m.role != "assistant":
            raise InvalidRequest(f"messages[{i}].tool_calls: only assistant messages make tool calls")
        d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": _json_object(c.arguments or "{}", f"messages[{i}].tool_calls[{j}].arguments")}}
            for j, c in enumerate(m.tool_calls)]
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    if m.name:
        d["name"] = m.name
    return d


def _check_tools(tools, limits: RequestLimits) -> list[dict]:
    _check_bytes("tools", sum(len(t.parameters.encode("utf-8")) + len(t.description.encode("utf-8"))
                              for t in tools), limits)
    out = []
    for i, t in enumerate(tools):
        if not t.name:
            raise InvalidRequest(f"tools[{i}].name must not be empty")
        fn: dict = {"name": t.name, "description": t.description}
        if t.parameters:
            fn["parameters"] = _json_object(t.parameters, f"tools[{i}].parameters")
        out.append({"type": "function", "function": fn})
    return out


def _json_object(text: str, what: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{what} must be a JSON object")
    return value


def _check_bytes(what: str, num_bytes: int, limits: RequestLimits) -> None:
    if num_bytes > limits.max_prompt_bytes:
        raise InvalidRequest(f"{what} is {num_bytes} bytes; at most {limits.max_prompt_bytes} "
                             f"bytes ({_mib(limits.max_prompt_bytes)}) are allowed per request")


def _check_sampling(s, vocab_size: int, max_context: int,
                    limits: RequestLimits) -> tuple[SamplingParams, bool]:
    max_tokens_given = s.HasField("max_tokens")
    max_tokens = s.max_tokens if max_tokens_given else limits.default_max_tokens
    if max_tokens < 1:
        raise InvalidRequest(f"sampling.max_tokens must be at least 1, got {max_tokens} (leave it "
                             f"unset for the default, {limits.default_max_tokens})")
    if max_tokens > max_context:
        raise InvalidRequest(f"sampling.max_tokens must be at most the model's context length "
                             f"{max_context}, got {max_tokens}")
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise InvalidRequest(
            f"sampling.temperature must be a finite number >= 0 (0 = greedy), got {s.temperature}")
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not 0 < top_p <= 1:  # NaN fails too
        raise InvalidRequest(f"sampling.top_p must be in (0, 1], got {top_p}")
    if s.top_k < 0:
        raise InvalidRequest(f"sampling.top_k must be >= 0 (0 = off), got {s.top_k}")
    stop = tuple(s.stop)
    if len(stop) > limits.max_stop_strings:
        raise InvalidRequest(f"sampling.stop has {len(stop)} strings; at most "
                             f"{limits.max_stop_strings} are allowed")
    for i, text in enumerate(stop):
        if not text:
            raise InvalidRequest(f"sampling.stop[{i}] is empty; stop strings must be non-empty")
        if len(text) > limits.max_stop_chars:
            raise InvalidRequest(f"sampling.stop[{i}] is {len(text)} characters long; at most "
                                 f"{limits.max_stop_chars} are allowed")
    logprobs = s.logprobs if s.HasField("logprobs") else None
    if logprobs is not None and logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"sampling.logprobs must be at most {MAX_TOP_LOGPROBS}, got {logprobs}")
    spec_k = s.num_speculative_tokens if s.HasField("num_speculative_tokens") else None
    if spec_k is not None and spec_k > MAX_SPECULATIVE_TOKENS:
        raise InvalidRequest(f"sampling.num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS} "
                             f"(0 = off for this request), got {spec_k}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN fails too
            raise InvalidRequest(f"sampling.{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off), "
                                 f"got {value}")
    repetition = s.repetition_penalty if s.HasField("repetition_penalty") else 1.0
    if not 0 < repetition <= MAX_REPETITION_PENALTY:
        raise InvalidRequest(f"sampling.repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] "
                             f"(1 = off), got {repetition}")
    sampling = SamplingParams(
        max_tokens=max_tokens, temperature=s.temperature, top_p=top_p,
        top_k=0 if s.top_k >= vocab_size else s.top_k,  # k >= vocab keeps every token: off
        seed=s.seed if s.HasField("seed") else None, stop=stop, ignore_eos=s.ignore_eos, logprobs=logprobs,
        num_speculative_tokens=spec_k, presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=repetition)
    return sampling, max_tokens_given


def _preview(value: str, limit: int = 40) -> str:
    return repr(value if len(value) <= limit else value[:limit] + "...")


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):g} MiB"
