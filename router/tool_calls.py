"""Tool calls in a model's output text, in the formats the served families' chat templates teach:

- `hermes` (Qwen2.5/3, Hermes, and any template that writes `<tool_call>`): any number of
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks between ordinary text;
- `llama3_json` (Llama 3.x): the whole output is one call `{"name": ..., "parameters": {...}}`
  (or a list of them), after an optional `<|python_tag|>`.

`ToolCallStream` takes the output as it streams and says what can be shown at each point: text
that cannot be part of a call, and each call once it is complete. Text that looks like a call but
does not parse as one is given back as text, never dropped. Pure: no I/O.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str   # a JSON object, as text
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


def tool_format(chat_template: str | None) -> str | None:
    """The call format a chat template teaches; None when it does not render tools at all."""
    if not chat_template or "tools" not in chat_template:
        return None
    return "hermes" if HERMES_OPEN in chat_template else "llama3_json"


def call_from_json(text: str) -> ToolCall | None:
    """`{"name": ..., "arguments" | "parameters": {...}}` -> a ToolCall; None if it is not one."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    return _call(obj)


def _call(obj) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):      # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, fmt: str) -> tuple[str, list[ToolCall]]:
    """The whole output -> (its text outside calls, the calls)."""
    stream = ToolCallStream(fmt)
    content, calls = stream.feed(text)
    more, last = stream.finish()
    return content + more, calls + last


class ToolCallStream:
    def __init__(self, fmt: str):
        if fmt not in ("hermes", "llama3_json"):
            raise ValueError(f"unknown tool call format {fmt!r}")
        self.fmt = fmt
        self.buf = ""
        self.in_call = False        # hermes: inside <tool_call>...; llama3_json: holding a JSON output
        self.started = False        # llama3_json: the output's first non-space character was seen
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """More output text -> (text to show now, calls completed by it)."""
        self.buf += text
        return self._feed_hermes() if self.fmt == "hermes" else self._feed_llama()

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The output ended: whatever was held back, as calls or as text."""
        buf, self.buf = self.buf, ""
        if not self.in_call:
            return buf, []
        self.in_call = False
        if self.fmt == "hermes":     # an unclosed call (the model stopped at EOS right after it)
            call = call_from_json(buf.strip())
            return ("", self._count([call])) if call else (HERMES_OPEN + buf, [])
        calls = self._llama_calls(buf.strip().removeprefix(PYTHON_TAG))
        return ("", self._count(calls)) if calls else (buf, [])

    def _feed_hermes(self) -> tuple[str, list[ToolCall]]:
        out, calls = [], []
        while True:
            if not self.in_call:
                i = self.buf.find(HERMES_OPEN)
                if i < 0:
                    keep = _partial_suffix(self.buf, HERMES_OPEN)   # could be the start of a call
                    out.append(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                out.append(self.buf[:i])
                self.buf, self.in_call = self.buf[i + len(HERMES_OPEN):], True
            j = self.buf.find(HERMES_CLOSE)
            if j < 0:
                break
            body, self.buf, self.in_call = self.buf[:j], self.buf[j + len(HERMES_CLOSE):], False
            call = call_from_json(body.strip())
            if call is None:
                out.append(HERMES_OPEN + body + HERMES_CLOSE)
            else:
                calls.append(call)
        return "".join(out), self._count(calls)

    def _feed_llama(self) -> tuple[str, list[ToolCall]]:
        if self.in_call:
            return "", []
        if not self.started:
            head = self.buf.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return "", []             # nothing decisive yet
            self.started = True
            if head.startswith(("{", "[", PYTHON_TAG)):
                self.in_call = True
                return "", []
        buf, self.buf = self.buf, ""
        return buf, []

    @staticmethod
    def _llama_calls(text: str) -> list[ToolCall]:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return []
        objs = obj if isinstance(obj, list) else [obj]
        calls = [_call(o) for o in objs]
        return calls if calls and all(calls) else []

    def _count(self, calls: list[ToolCall]) -> list[ToolCall]:
        self.num_calls += len(calls)
        return calls


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
