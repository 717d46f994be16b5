"""One request's OpenAI `choices[0]`, built from the `GenerateResponse`s the router streams: its
text, its tool calls (router/tool_calls.py, when the request sent tools) and its log-probabilities,
in the chat shape (`logprobs.content[]`) or the completions shape (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`). `delta` gives a stream chunk's choice, `add` + `choice` the
non-streaming one. Pure: no I/O; `token_text` turns a token id into its text.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from tandem.protos.tandem.v1 import generation_pb2 as pb
from tandem.router.tool_calls import ToolCall, ToolCallStream

FINISH_REASONS = {pb.STOP: "stop", pb.LENGTH: "length", pb.ABORT: "abort"}
NO_PROBABILITY = -9999.0   # OpenAI's logprob for a token the distribution excludes (JSON has no -inf)


class ChoiceBuilder:
    def __init__(self, chat: bool, token_text: Callable[[int], str], *, logprobs: bool = False,
                 tool_format: str | None = None, token_ids: bool = False):
        self.chat = chat
        self.token_ids: list[int] | None = [] if token_ids else None   # return_token_ids
        self.token_text = token_text
        self.logprobs = logprobs
        self.tools = ToolCallStream(tool_format) if tool_format else None
        self.text_offset = 0     # completions: where the next token's text starts
        self.parts: list[str] = []
        self.calls: list[ToolCall] = []
        self.lp: dict[str, list] = {}
        self.finish: str | None = None

    # ---- streaming ------------------------------------------------------------------------------
    def delta(self, resp: pb.GenerateResponse, first: bool = False) -> dict[str, Any]:
        text, calls = self._text_and_calls(resp)
        lp = self._logprobs(resp) if self.logprobs else None
        ids = {"token_ids": list(resp.token_ids)} if self.token_ids is not None else {}
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": lp, "finish_reason": self.finish, **ids}
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        if calls:
            base = len(self.calls) - len(calls)
            delta["tool_calls"] = [{"index": base + i, **_call_dict(c)} for i, c in enumerate(calls)]
        return {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": self.finish, **ids}

    # ---- whole response -------------------------------------------------------------------------
    def add(self, resp: pb.GenerateResponse) -> None:
        text, _ = self._text_and_calls(resp)
        self.parts.append(text)
        if self.token_ids is not None:
            self.token_ids.extend(resp.token_ids)
        if self.logprobs:
            for key, values in self._logprobs(resp).items():
                if isinstance(values, list):      # not chat's "refusal": None
                    self.lp.setdefault(key, []).extend(values)

    def choice(self) -> dict[str, Any]:
        text = "".join(self.parts)
        lp = {**_empty_logprobs(self.chat), **self.lp} if self.logprobs else None
        ids = {"token_ids": self.token_ids} if self.token_ids is not None else {}
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": lp, "finish_reason": self.finish, **ids}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.calls:
            message = {"role": "assistant", "content": text or None, "tool_calls": [_call_dict(c) for c in self.calls]}
        return {"index": 0, "message": message, "logprobs": lp, "finish_reason": self.finish, **ids}

    # ---- parts ----------------------------------------------------------------------------------
    def _text_and_calls(self, resp: pb.GenerateResponse) -> tuple[str, list[ToolCall]]:
        text, calls = resp.text, []
        if self.tools is not None:
            text, calls = self.tools.feed(text)
            if resp.finish_reason:
                more, last = self.tools.finish()
                text, calls = text + more, calls + last
        self.calls.extend(calls)
        if resp.finish_reason:
            self.finish = FINISH_REASONS.get(resp.finish_reason)
            if self.calls and self.finish == "stop":
                self.finish = "tool_calls"
        return text, calls

    def _logprobs(self, resp: pb.GenerateResponse) -> dict[str, list]:
        if self.chat:
            return {"content": [dict(self._entry(t.token_id, t.logprob), top_logprobs=[
                self._entry(a.token_id, a.logprob) for a in t.top]) for t in resp.logprobs], "refusal": None}
        tokens = [self.token_text(t.token_id) for t in resp.logprobs]
        offsets = []
        for s in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": [_finite(t.logprob) for t in resp.logprobs],
                "top_logprobs": [{self.token_text(a.token_id): _finite(a.logprob) for a in t.top}
                                 for t in resp.logprobs], "text_offset": offsets}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def _call_dict(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else NO_PROBABILITY


def _empty_logprobs(chat: bool) -> dict[str, list | None]:
    if chat:
        return {"content": [], "refusal": None}
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
