"""The control frames a link carries, sender to receiver, as named types. On the wire each is the
msgpack dict of `to_msg()` (`link.frame_bytes` encodes it); `parse_frame` reads one back.

    Hello        first on every link: handles of the sender's cache, ack cells and block-id arena,
                 offering a direct copy (cache None: it cannot be shared), the sender's ack cell and
                 machine
    LayersFrame  streamed: the next `layers` of `rid` follow as one data tensor per part,
                 [part, *shape] of `dtype`
    ReadyFrame   direct copy: those layers are written; copy them out of the n source blocks whose
                 ids are at `ids_at` of the arena (named in the transfer's first frame; or `src`,
                 the ids as int32 bytes: an all-ready send, or a full arena), and ack `seq`
    EndFrame     the sender ended the transfer: state "aborted" or "failed", and why
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union


@dataclass(frozen=True)
class Hello:
    cache: bytes | None
    acks: bytes | None
    ids: bytes | None
    cell: Any
    machine: Any

    def to_msg(self) -> dict[str, Any]:
        return {"op": "hello", "cache": self.cache, "acks": self.acks, "ids": self.ids,
                "cell": self.cell, "machine": self.machine}

    @classmethod
    def from_msg(cls, msg: dict[str, Any]) -> "Hello":
        # lenient: a bad field fails the offer (the receiver answers no), not the link
        return cls(msg.get("cache"), msg.get("acks"), msg.get("ids"), msg.get("cell"), msg.get("machine"))


@dataclass(frozen=True)
class LayersFrame:
    rid: str
    idx: int                  # index in the spec's layers of the first one
    layers: list[int]
    parts: list[int]          # layers per data message, in order
    shape: list[int]          # one layer's payload
    dtype: str                # a torch dtype's name, e.g. "bfloat16"

    def to_msg(self) -> dict[str, Any]:
        return {"op": "layers", "rid": self.rid, "idx": self.idx, "layers": self.layers,
                "parts": self.parts, "shape": self.shape, "dtype": self.dtype}

    @classmethod
    def from_msg(cls, msg: dict[str, Any]) -> "LayersFrame":
        layers = [int(x) for x in msg["layers"]]
        return cls(msg["rid"], msg["idx"], layers, [int(x) for x in msg.get("parts") or [len(layers)]],
                   msg["shape"], msg["dtype"])


@dataclass(frozen=True)
class ReadyFrame:
    rid: str
    idx: int
    layers: list[int]
    seq: int
    src: bytes | None = None      # the source block ids as int32 bytes
    ids_at: int | None = None     # or where they are in the sender's arena (in ids), and how many
    n: int | None = None

    def to_msg(self) -> dict[str, Any]:
        msg = {"op": "ready", "rid": self.rid, "idx": self.idx, "layers": self.layers, "seq": self.seq}
        if self.src is not None:
            msg["src"] = self.src
        if self.ids_at is not None:
            msg["ids_at"], msg["n"] = self.ids_at, self.n
        return msg

    @classmethod
    def from_msg(cls, msg: dict[str, Any]) -> "ReadyFrame":
        ids_at = msg.get("ids_at")
        return cls(msg["rid"], msg["idx"], [int(x) for x in msg["layers"]], msg["seq"], msg.get("src"),
                   None if ids_at is None else int(ids_at), None if ids_at is None else int(msg["n"]))


@dataclass(frozen=True)
class EndFrame:
    rid: str
    state: str | None         # "aborted" or "failed"
    reason: str

    def to_msg(self) -> dict[str, Any]:
        return {"op": "end", "rid": self.rid, "state": self.state, "reason": self.reason}

    @classmethod
    def from_msg(cls, msg: dict[str, Any]) -> "EndFrame":
        return cls(msg["rid"], msg.get("state"), msg.get("reason", "ended by the sender"))


Frame = Union[Hello, LayersFrame, ReadyFrame, EndFrame]
_BY_OP = {"hello": Hello, "layers": LayersFrame, "ready": ReadyFrame, "end": EndFrame}


def parse_frame(msg: dict[str, Any]) -> "Frame | dict[str, Any]":
    """The frame `msg` holds; an unknown op comes back as the dict (the receiver refuses it)."""
    kind = _BY_OP.get(msg.get("op"))
    return kind.from_msg(msg) if kind is not None else msg
