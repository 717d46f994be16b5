"""OpenAI's HTTP API as data: a `/v1/chat/completions` or `/v1/completions` body becomes a
`tandem.v1.GenerateRequest` (the same message the gRPC edge serves, so validation, sessions and
sampling are router/generation.py's), and `GenerateResponse`s become OpenAI's responses and
stream chunks. Pure: no I/O, no event loop.

A field OpenAI defines that Tandem does not implement (`n` > 1, `logprobs`, `tools`, penalties)
and any field OpenAI does not define is refused with `ApiError` naming it (`param`), never ignored;
fields that only label a request (`user`, `metadata`) are accepted.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Mapping

from tandem.protos.tandem.v1 import generation_pb2 as pb

# Fields each endpoint acts on, and those it accepts without effect (labels and defaults).
_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop",
           "user", "prompt_cache_key", "n", "logprobs", "presence_penalty", "frequency_penalty",
           "logit_bias", "metadata", "safety_identifier", "store", "service_tier"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls", "response_format"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
# field -> the values that mean "off", which are accepted; any other value is refused
_OFF: dict[str, tuple] = {"n": (None, 1), "logprobs": (None, False), "top_logprobs": (None, 0),
                          "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
                          "tools": (None, []), "tool_choice": (None, "none", "auto"), "echo": (None, False),
                          "suffix": (None, ""), "best_of": (None, 1), "parallel_tool_calls": (None, True, False),
                          "response_format": (None, {"type": "text"}), "store": (None, False)}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_SESSION_ID = re.compile(r"[A-Za-z0-9._:/@+=-]{1,128}")
FINISH_REASONS = {pb.STOP: "stop", pb.LENGTH: "length", pb.ABORT: "abort"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable_error"}


class ApiError(Exception):
    """A request the HTTP edge refuses itself; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


@dataclass(frozen=True)
class ParsedRequest:
    request: pb.GenerateRequest
    model: str
    stream: bool
    include_usage: bool


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "internal_error"), "param": param,
                      "code": code}}


def session_id_for(body: Mapping[str, Any], headers: Mapping[str, str]) -> str:
    """The gRPC session id: `prompt_cache_key`, else `user`, else the `x-session-id` header. A key
    the gRPC id rules would refuse (other characters, too long) is replaced by a digest of it."""
    key = body.get("prompt_cache_key") or body.get("user") or headers.get("x-session-id") or ""
    if not isinstance(key, str):
        raise ApiError("prompt_cache_key and user must be strings", "prompt_cache_key")
    if not key or _SESSION_ID.fullmatch(key):
        return key
    return "k-" + hashlib.sha256(key.encode()).hexdigest()[:40]


def parse_chat(body: Any, headers: Mapping[str, str], served_model: str) -> ParsedRequest:
    """A /v1/chat/completions body -> the GenerateRequest to serve; raises ApiError."""
    body = _check_fields(body, CHAT_FIELDS, served_model)
    req = pb.GenerateRequest(session_id=session_id_for(body, headers), sampling=_sampling(body))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", "messages")
    req.messages.extend(_message(m, i) for i, m in enumerate(messages))
    return _parsed(req, body)


def parse_completion(body: Any, headers: Mapping[str, str], served_model: str) -> ParsedRequest:
    """A /v1/completions body -> the GenerateRequest to serve; raises ApiError."""
    body = _check_fields(body, COMPLETION_FIELDS, served_model)
    req = pb.GenerateRequest(session_id=session_id_for(body, headers), sampling=_sampling(body))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]      # a batch of one
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
        req.prompt_token_ids.extend(prompt)
    else:
        raise ApiError("prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    return _parsed(req, body)


def _check_fields(body: Any, known: set[str], served_model: str) -> dict:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    for name in sorted(body):
        if name not in known:
            raise ApiError(f"unrecognized request argument supplied: {name}", name)
        if name in _OFF and body[name] not in _OFF[name]:
            raise ApiError(f"{name}={body[name]!r} is not supported by this server", name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError("you must provide a model parameter", "model")
    if model != served_model:
        raise ApiError(f"the model {model!r} does not exist; this server serves {served_model!r}", "model",
                       status=404, code="model_not_found")
    return body


def _sampling(body: dict) -> pb.SamplingParams:
    sp = pb.SamplingParams(temperature=_number(body, "temperature", 1.0))   # OpenAI's default is 1
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
            raise ApiError(f"{param} must be an integer >= 1", param)
        sp.max_tokens = max_tokens
    if body.get("top_p") is not None:
        sp.top_p = _number(body, "top_p", 1.0)
    seed = body.get("seed")
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
            raise ApiError("seed must be an integer in [0, 2**64)", "seed")
        sp.seed = seed
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError("stop must be a string or a list of strings", "stop")
    sp.stop.extend(stops)
    return sp


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ApiError(f"{name} must be a number", name)
    return float(value)


def _message(m: Any, i: int) -> pb.ChatMessage:
    if not isinstance(m, dict) or m.get("role") not in _ROLES:
        raise ApiError(f"messages[{i}] must be an object with a role in {sorted(_ROLES)}", f"messages[{i}].role")
    extra = set(m) - {"role", "content", "name"}
    if extra:
        raise ApiError(f"messages[{i}].{min(extra)} is not supported by this server", f"messages[{i}].{min(extra)}")
    content = m.get("content")
    if isinstance(content, list):       # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ApiError(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
        content = "".join(p["text"] for p in content)
    if content is None and m["role"] == "assistant":
        content = ""
    if not isinstance(content, str):
        raise ApiError(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")
    return pb.ChatMessage(role=_ROLES[m["role"]], content=content)


def _parsed(req: pb.GenerateRequest, body: dict) -> ParsedRequest:
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError("stream_options may only hold include_usage", "stream_options")
    stream = bool(body.get("stream"))
    if options and not stream:
        raise ApiError("stream_options is only allowed with stream=true", "stream_options")
    return ParsedRequest(req, body["model"], stream, bool(options.get("include_usage")))


# ---- responses -----------------------------------------------------------------------------------
def usage_dict(usage: pb.Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}


def response_id(chat: bool, request_id: str) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + request_id


def chunk(chat: bool, rid: str, created: int, model: str, resp: pb.GenerateResponse, *,
          first: bool = False, include_usage: bool = False) -> dict:
    """One stream chunk for `resp`'s new text (with `usage: null` when the stream ends with a usage
    chunk, as OpenAI's do)."""
    finish = FINISH_REASONS.get(resp.finish_reason)
    if chat:
        delta = {"role": "assistant", "content": resp.text} if first else {"content": resp.text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": resp.text, "logprobs": None, "finish_reason": finish}
    out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": created, "model": model, "choices": [choice]}
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(chat: bool, rid: str, created: int, model: str, usage: pb.Usage) -> dict:
    """The last chunk when stream_options.include_usage: no choices, the request's usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage_dict(usage)}


def full_response(chat: bool, rid: str, created: int, model: str, text: str, last: pb.GenerateResponse) -> dict:
    """A non-streaming response from the whole text and the last message (finish reason, usage)."""
    finish = FINISH_REASONS.get(last.finish_reason)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage_dict(last.usage)}


def models_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "tandem"}]}
