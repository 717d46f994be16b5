"""What a transport backend provides to the layer-streaming sender and receiver: an ordered,
reliable pipe to one peer (`PeerLink`) and a way to open pipes and pass out-of-band abort notices
(`Connector`); plus the control-frame encoding both backends share.

A link carries, sender to receiver only, a sequence of control frames (msgpack dicts: a fixed-size
head, then a tail only when the dict is longer; raw bytes on a Unix socket, a uint8 CPU tensor over
gloo) each optionally followed by one data tensor. Frames and data are two ordered streams (gloo
tags or a socket, and a gloo or an NCCL group): each is FIFO on its own, so a sender can post frame
2 while data 1 is still moving, and a receiver can keep the next frame's receive posted while data
is landing. Data operations can be posted (`isend_data`, `irecv_data`) and polled
(`Pending.done`), which is how both ends keep several messages in flight. A link that raised is
broken for good: its owner closes it (`close(broken=True)`) and connects again later.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgpack
import torch

FRAME_BYTES = 1024          # a control frame's head: 4-byte little-endian length, then msgpack
MAX_FRAME_BYTES = 1 << 20   # a longer frame continues in one tail message (block ids of a direct copy)
_LEN_BYTES = 4


def frame_bytes(msg: dict[str, Any]) -> bytearray:
    """The frame as bytes: FRAME_BYTES, or more when the dict needs it (the head is the first
    FRAME_BYTES). One buffer, no tensor ops: this is on every transfer's path."""
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES - _LEN_BYTES:
        raise ValueError(f"control frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES - _LEN_BYTES}")
    raw = bytearray(max(FRAME_BYTES, _LEN_BYTES + len(body)))
    raw[:_LEN_BYTES] = len(body).to_bytes(_LEN_BYTES, "little")
    raw[_LEN_BYTES:_LEN_BYTES + len(body)] = body
    return raw


def encode_frame(msg: dict[str, Any]) -> torch.Tensor:
    """`frame_bytes` as a uint8 CPU tensor (what a gloo send takes), sharing its memory."""
    return torch.frombuffer(frame_bytes(msg), dtype=torch.uint8)


def _raw(frame: "torch.Tensor | bytes | bytearray") -> "bytes | bytearray":
    return frame.numpy().tobytes() if isinstance(frame, torch.Tensor) else frame


def frame_tail_bytes(head: "torch.Tensor | bytes | bytearray") -> int:
    """How many bytes follow a received FRAME_BYTES head (0 for most frames)."""
    n = int.from_bytes(_raw(head[:_LEN_BYTES]), "little")
    if not 0 < n <= MAX_FRAME_BYTES - _LEN_BYTES:
        raise ValueError(f"corrupt control frame (length {n})")
    return max(0, _LEN_BYTES + n - FRAME_BYTES)


def decode_frame(frame: "torch.Tensor | bytes | bytearray") -> dict[str, Any]:
    raw = _raw(frame)
    n = int.from_bytes(raw[:_LEN_BYTES], "little")
    if not 0 < n <= len(raw) - _LEN_BYTES:
        raise ValueError(f"corrupt control frame (length {n})")
    msg = msgpack.unpackb(raw[_LEN_BYTES:_LEN_BYTES + n], raw=False)
    if not isinstance(msg, dict) or "op" not in msg:
        raise ValueError(f"corrupt control frame: {msg!r:.200}")
    return msg


class Pending(Protocol):
    """One posted operation on a link."""

    def done(self) -> bool:
        """Non-blocking: True once complete (on CUDA: its data is in place on the device); raises
        KVTransferError if it failed."""
        ...

    def wait(self, timeout: float | None) -> None:
        """Block until complete (None: until then or the link closes); KVTransferTimeout past it."""
        ...

    def order_current_stream(self) -> bool:
        """CUDA: make the caller's current stream wait for this operation, so work queued next on
        it may use the data before done() is True; returns True. Elsewhere False: use the data
        only once done()."""
        ...


class PeerLink(Protocol):
    """One direction between two actors. Every method raises KVTransferTimeout past its timeout
    and KVTransferError when the peer is gone; after that the link is unusable."""
    peer_id: str
    device: torch.device

    def send_frame(self, msg: dict[str, Any], timeout: float) -> None: ...

    def recv_frame(self, timeout: float | None) -> dict[str, Any]:
        """None: wait until a frame arrives or the link closes (an idle receiver posts this)."""
        ...

    def send_data(self, tensor: torch.Tensor, timeout: float) -> None:
        """On CUDA, ordered after the work already queued on the caller's current stream."""
        ...

    def recv_data(self, tensor: torch.Tensor, timeout: float) -> None:
        """Fill `tensor` in place; on CUDA, the data is complete when this returns."""
        ...

    def isend_data(self, tensor: torch.Tensor) -> Pending:
        """Post a send; `tensor` must stay alive and unchanged until it is done. On CUDA, ordered
        after the work queued on the caller's current stream."""
        ...

    def irecv_data(self, tensor: torch.Tensor) -> Pending:
        """Post a receive into `tensor` (complete once done(), or stream-ordered on CUDA through
        `Pending.order_current_stream`)."""
        ...

    def close(self, broken: bool) -> None:
        """Free the link; `broken`: it failed, so the pair must rendezvous afresh next time."""
        ...

    def send_verdict(self, direct: bool, why: str) -> None:
        """Receiver, once per link, answering the sender's "hello": can it copy straight out of the
        sender's cache (`kv_transfer.base` "direct copies")? The one message against the link's
        direction; it goes out of band (the rendezvous store), never per transfer."""
        ...

    def wait_verdict(self, timeout: float) -> tuple[bool, str]:
        """Sender: the receiver's `send_verdict`; KVTransferTimeout past `timeout`."""
        ...


class Connector(Protocol):
    """How one actor (`self_id`) reaches its peers."""
    self_id: str

    def connect(self, peer_id: str, as_sender: bool) -> PeerLink:
        """Open (or rendezvous) the link; blocks until the peer joins or the connect timeout."""
        ...

    def is_current(self, link: PeerLink) -> bool:
        """False when the peer restarted or either side rebuilt the pair since `link` was made."""
        ...

    def peer_epoch(self, peer_id: str) -> Any:
        """A value that changes whenever `peer_id` (a receiver) restarts, marks a link broken or
        posts an abort (one store round trip): while it is unchanged since a sender's full check
        (is_current, abort_posted), that check would answer the same. None when unknown."""
        ...

    def post_abort(self, sender_id: str, receiver_id: str, request_id: str) -> None: ...

    def abort_posted(self, sender_id: str, receiver_id: str, request_id: str) -> bool: ...

    def clear_abort(self, sender_id: str, receiver_id: str, request_id: str) -> None: ...
