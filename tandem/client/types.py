"""What the client sends and gets back, as dataclasses: `Chunk` (one streamed message),
`Completion` (a whole answer), `Usage`, `TokenLogprob`, the cluster's `ClusterState`; and the
one place requests are built (`build_request`) and responses read (`chunk_from`, `Accumulator`),
shared by the sync and asyncio clients."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Sequence

from tandem.protos.tandem.v1 import admin_pb2, generation_pb2 as pb


class FinishReason(enum.Enum):
    STOP = "stop"        # end-of-sequence token or a stop string
    LENGTH = "length"    # max_tokens, or the context is full
    ABORT = "abort"


_FINISH = {pb.STOP: FinishReason.STOP, pb.LENGTH: FinishReason.LENGTH, pb.ABORT: FinishReason.ABORT}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    draft_steps: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (token id, logprob), most likely first


@dataclass(frozen=True)
class Chunk:
    """One streamed message: the tokens and text new in it; `finish_reason` and `usage` on the last."""
    text: str
    token_ids: tuple[int, ...]
    request_id: str = ""      # on the first chunk
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    request_id: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


def build_request(*, prompt: str | None = None, messages: Sequence[dict] | None = None,
                  prompt_token_ids: Sequence[int] | None = None, session_id: str = "", request_id: str = "",
                  max_tokens: int | None = None, temperature: float = 0.0, top_p: float | None = None,
                  top_k: int = 0, seed: int | None = None, stop: Sequence[str] = (), ignore_eos: bool = False,
                  logprobs: int | None = None, tools: Sequence[dict] = (), presence_penalty: float = 0.0,
                  frequency_penalty: float = 0.0, repetition_penalty: float | None = None) -> pb.GenerateRequest:
    """A GenerateRequest from keyword arguments; exactly one of prompt, messages, prompt_token_ids.
    `messages`: {"role", "content"} dicts; `tools`: {"name", "description", "parameters" (JSON text)}."""
    sp = pb.SamplingParams(temperature=temperature, top_k=top_k, stop=list(stop), ignore_eos=ignore_eos,
                           presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)
    for name, value in (("max_tokens", max_tokens), ("top_p", top_p), ("seed", seed), ("logprobs", logprobs),
                        ("repetition_penalty", repetition_penalty)):
        if value is not None:
            setattr(sp, name, value)
    req = pb.GenerateRequest(request_id=request_id, session_id=session_id, sampling=sp,
                             tools=[pb.Tool(**t) for t in tools])
    if prompt is not None:
        req.prompt = prompt
    if prompt_token_ids is not None:
        req.prompt_token_ids.extend(prompt_token_ids)
    for m in messages or ():
        req.messages.append(pb.ChatMessage(role=m["role"], content=m.get("content") or "",
                                           tool_call_id=m.get("tool_call_id", ""), name=m.get("name", "")))
    return req


def chunk_from(resp: pb.GenerateResponse) -> Chunk:
    usage = Usage(**{f: getattr(resp.usage, f) for f in Usage.__dataclass_fields__}) if resp.finish_reason else None
    return Chunk(resp.text, tuple(resp.token_ids), resp.request_id, _FINISH.get(resp.finish_reason), usage,
                 tuple(TokenLogprob(t.token_id, t.logprob, tuple((a.token_id, a.logprob) for a in t.top))
                       for t in resp.logprobs))


class Accumulator:
    """Chunks -> one Completion."""

    def __init__(self):
        self.parts: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.request_id = ""
        self.last: Chunk | None = None

    def add(self, c: Chunk) -> Chunk:
        self.parts.append(c.text)
        self.ids.extend(c.token_ids)
        self.logprobs.extend(c.logprobs)
        self.request_id = self.request_id or c.request_id
        self.last = c
        return c

    def completion(self) -> Completion:
        last = self.last
        if last is None or last.finish_reason is None:
            raise RuntimeError("the stream ended without a finish reason")
        return Completion("".join(self.parts), self.ids, last.finish_reason, last.usage, self.request_id,
                          self.logprobs)


# ---- admin ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Worker:
    id: str
    pool: str
    state: str            # starting, ready, draining, dead
    running_requests: int
    waiting_requests: int
    kv_blocks_used: int
    kv_blocks_total: int
    node: str = ""
    pid: int = 0


@dataclass(frozen=True)
class Pool:
    name: str
    size: int
    target: int
    min: int
    max: int
    draining: int
    target_pinned: bool
    workers: list[Worker]


@dataclass(frozen=True)
class ClusterState:
    pools: list[Pool]
    last_decision_reasons: list[str]

    def pool(self, name: str) -> Pool:
        return next(p for p in self.pools if p.name == name)


def worker_from(w: Any) -> Worker:
    state = admin_pb2.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower()
    return Worker(w.id, w.pool, state, w.running_requests, w.waiting_requests, w.kv_blocks_used, w.kv_blocks_total,
                  w.node, w.pid)


def pool_from(p: Any) -> Pool:
    return Pool(p.name, p.size, p.target, p.min, p.max, p.draining, p.target_pinned, [worker_from(w) for w in p.workers])


def cluster_state_from(s: Any) -> ClusterState:
    return ClusterState([pool_from(p) for p in s.pools], list(s.last_decision.reasons))
