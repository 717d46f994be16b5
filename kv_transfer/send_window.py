"""The messages one send thread has posted to its peer and not yet seen complete, oldest first, and
the bytes of staging they hold: the window (`KVTransferConfig.window_bytes`) the streamed path
fills, and the acks a direct copy waits for. Messages complete in the order they were posted (NCCL
and the fake network keep order; a direct copy's acks only grow)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from tandem.kv_transfer.base import KVTransferTimeout, StagingRing
from tandem.kv_transfer.link import Pending
from tandem.kv_transfer.records import TransferRecord


@dataclass
class Message:
    rec: TransferRecord
    num_layers: int
    op: Pending
    data: torch.Tensor | None   # kept alive until the send completes (None: a direct copy)
    lease: StagingRing.Lease | None = None   # its staging, free again once the send completes
    posted_at: float = 0.0
    nbytes: int = 0             # counted against the window (a direct copy holds no staging)
    last: bool = False          # carries the transfer's last layer


class SendWindow:
    def __init__(self) -> None:
        self.messages: deque[Message] = deque()
        self.bytes = 0

    def add(self, msg: Message) -> None:
        self.messages.append(msg)
        self.bytes += msg.nbytes

    def full(self, window_bytes: int) -> bool:
        """Bytes in flight fill the window (a message larger than it still goes alone)."""
        return bool(self.messages) and self.bytes >= window_bytes

    def room(self, window_bytes: int, layer_bytes: int) -> int:
        """Layers of `layer_bytes` that fit in the window now (one at least when it is empty)."""
        if self.messages:
            return (window_bytes - self.bytes) // layer_bytes
        return max(1, window_bytes // layer_bytes)

    def retire(self, wait: bool, timeout_s: float, peer: str, on_done: Callable[[Message], None]) -> bool:
        """Hand finished messages to `on_done`, oldest first; with `wait`, block for the oldest.
        A message older than `timeout_s` that is not complete raises KVTransferTimeout."""
        progressed = False
        while self.messages:
            msg = self.messages[0]
            if wait and not progressed:
                msg.op.wait(max(0.0, msg.posted_at + timeout_s - time.monotonic()))
            elif not msg.op.done():
                if time.monotonic() - msg.posted_at > timeout_s:
                    raise KVTransferTimeout(f"link to {peer!r}: a message of {msg.rec.request_id!r} "
                                            f"was not taken in {timeout_s:.3g}s")
                return progressed
            self.messages.popleft()
            self.bytes -= msg.nbytes
            on_done(msg)
            progressed = True
        return progressed

    def drain(self) -> Iterator[Message]:
        """Every message, oldest first, dropped from the window (the link closed under them)."""
        while self.messages:
            yield self.messages.popleft()
        self.bytes = 0
