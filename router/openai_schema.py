"""OpenAI's HTTP API as data: a `/v1/chat/completions` or `/v1/completions` body becomes a
`tandem.v1.GenerateRequest` (the same message the gRPC edge serves, so validation, sessions and
sampling are router/generation.py's), and `GenerateResponse`s become OpenAI's responses and
stream chunks. Pure: no I/O, no event loop.

A field OpenAI defines that Tandem does not implement (`n` > 1, `tool_choice` "required" or a named
function, `logit_bias`) and any field OpenAI does not define is refused with `ApiError` naming it
(`param`), never ignored; fields that only label a request (`user`, `metadata`) are accepted.
`logprobs` set the gRPC `sampling.logprobs`; `tools` become `GenerateRequest.tools`, rendered by the
model's chat template (the router refuses them when the template has none). `presence_penalty` and
`frequency_penalty` set the gRPC sampling's. Three vLLM extensions are accepted: `ignore_eos`,
`repetition_penalty`, and `return_token_ids` (each choice carries its new `token_ids`).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

from tandem.protos.tandem.v1 import generation_pb2 as pb
from tandem.wire.messages import MAX_PENALTY, MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS

# Fields each endpoint acts on, and those it accepts without effect (labels and defaults).
_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop",
           "user", "prompt_cache_key", "n", "logprobs", "presence_penalty", "frequency_penalty",
           "logit_bias", "metadata", "safety_identifier", "store", "service_tier",
           "ignore_eos", "return_token_ids",    # vLLM's extensions: exact output lengths, token ids out,
           "repetition_penalty"}                # and transformers' repetition penalty
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls", "response_format"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
# field -> the values that mean "off", which are accepted; any other value is refused
_OFF: dict[str, tuple] = {"n": (None, 1),
                          "logit_bias": (None, {}),
                          "tool_choice": (None, "none", "auto"), "echo": (None, False),
                          "suffix": (None, ""), "best_of": (None, 1), "parallel_tool_calls": (None, True, False),
                          "response_format": (None, {"type": "text"}), "store": (None, False)}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_SESSION_ID = re.compile(r"[A-Za-z0-9._:/@+=-]{1,128}")
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
    logprobs: bool = False   # render each token's logprob (and sampling.logprobs alternatives)
    tools: bool = False      # parse tool calls out of the output
    token_ids: bool = False  # return_token_ids: each choice carries its new token ids


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
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise ApiError("logprobs must be a boolean", "logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        if not logprobs:
            raise ApiError("top_logprobs requires logprobs=true", "top_logprobs")
        _check_top(top, "top_logprobs")
    if logprobs:
        req.sampling.logprobs = top or 0
    tools = _tools(body)
    req.tools.extend(tools)
    return _parsed(req, body, tools=bool(tools))


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
    if body.get("logprobs") is not None:
        req.sampling.logprobs = _check_top(body["logprobs"], "logprobs")
    return _parsed(req, body)


def _check_top(value: Any, param: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ApiError(f"{param} must be an integer in [0, {MAX_TOP_LOGPROBS}]", param)
    return value


def _tools(body: dict) -> list[pb.Tool]:
    """`tools` as the gRPC request's; none when tool_choice is "none" (the model is not to call any)."""
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise ApiError("tools must be a list", "tools")
    if body.get("tool_choice") == "none":
        return []
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", f"tools[{i}]")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ApiError(f"tools[{i}].function.parameters must be a JSON Schema object", f"tools[{i}]")
        out.append(pb.Tool(name=fn["name"], description=str(fn.get("description") or ""),
                           parameters=json.dumps(params) if params is not None else ""))
    return out


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
        raise unknown_model(model, served_model)
    return body


def unknown_model(model: str, served_model: str) -> ApiError:
    return ApiError(f"the model {model!r} does not exist; this server serves {served_model!r}", "model",
                    status=404, code="model_not_found")


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
    for flag in ("ignore_eos", "return_token_ids"):
        if body.get(flag) is not None and not isinstance(body[flag], bool):
            raise ApiError(f"{flag} must be a boolean", flag)
    sp.ignore_eos = bool(body.get("ignore_eos"))
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name, 0.0)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise ApiError(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]", name)
        setattr(sp, name, value)
    if body.get("repetition_penalty") is not None:
        value = _number(body, "repetition_penalty", 1.0)
        if not 0 < value <= MAX_REPETITION_PENALTY:
            raise ApiError(f"repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}] (1 = off)",
                           "repetition_penalty")
        sp.repetition_penalty = value
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
    extra = set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"}
    if extra:
        raise ApiError(f"messages[{i}].{min(extra)} is not supported by this server", f"messages[{i}].{min(extra)}")
    calls = [_tool_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.get("tool_calls") or [])]
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
    name = m.get("name") if m["role"] == "tool" else None   # a user's or assistant's name only labels it
    return pb.ChatMessage(role=_ROLES[m["role"]], content=content, tool_calls=calls,
                          tool_call_id=str(m.get("tool_call_id") or ""), name=str(name or ""))


def _tool_call(c: Any, where: str) -> pb.ToolCall:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments", ""), str):
        raise ApiError(f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}", where)
    return pb.ToolCall(id=str(c.get("id") or ""), name=fn["name"], arguments=fn.get("arguments") or "{}")


def _parsed(req: pb.GenerateRequest, body: dict, tools: bool = False) -> ParsedRequest:
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError("stream_options may only hold include_usage", "stream_options")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise ApiError("stream must be a boolean", "stream")
    stream = bool(body.get("stream"))
    if options and not stream:
        raise ApiError("stream_options is only allowed with stream=true", "stream_options")
    return ParsedRequest(req, body["model"], stream, bool(options.get("include_usage")),
                         logprobs=req.sampling.HasField("logprobs"), tools=tools,
                         token_ids=bool(body.get("return_token_ids")))


# ---- responses -----------------------------------------------------------------------------------
def usage_dict(usage: pb.Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}


def response_id(chat: bool, request_id: str) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + request_id


def chunk(chat: bool, rid: str, created: int, model: str, choice: dict, *, include_usage: bool = False) -> dict:
    """One stream chunk holding `choice` (router/openai_choice.py's `delta`), with `usage: null`
    when the stream ends with a usage chunk, as OpenAI's do."""
    out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": created, "model": model, "choices": [choice]}
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(chat: bool, rid: str, created: int, model: str, usage: pb.Usage) -> dict:
    """The last chunk when stream_options.include_usage: no choices, the request's usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage_dict(usage)}


def full_response(chat: bool, rid: str, created: int, model: str, choice: dict, usage: pb.Usage) -> dict:
    """A non-streaming response: the whole `choice` (router/openai_choice.py's `choice`) and usage."""
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage_dict(usage)}


def model_card(model: str, created: int) -> dict:
    """`GET /v1/models/{model}`'s object, and each entry of the list."""
    return {"id": model, "object": "model", "created": created, "owned_by": "tandem"}


def models_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [model_card(model, created)]}
