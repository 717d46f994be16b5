"""An in-process transport for unit tests: queues stand in for the network, so the real sender and
receiver state machines run unchanged, in one process, with no torch.distributed.

Faults are injected per direction: `delay_s` (a slow peer: each layer leaves that much later),
`die_after_layers` (the sender dies after that many layers: both ends see the link break) and
`held_sends` (a send completes only once the receiver took its data, as a large NCCL send does), plus
`kill(actor_id)` for a peer that dies at an arbitrary moment and `replace_pipe` for a receiver that
restarted while sends were posted to it (they never complete, and never fail either).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from tandem.kv_transfer.base import BlockStore, KVTransferError, KVTransferTimeout, ReleaseCallback
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.link import decode_frame, encode_frame
from tandem.kv_transfer.receiver import LayerStreamReceiver
from tandem.kv_transfer.sender import LayerStreamSender

_CLOSED = object()


@dataclass
class LinkFaults:
    delay_s: float = 0.0                 # before each layer frame leaves the sender
    die_after_layers: int | None = None  # the pipe breaks once this many layers' data went out
    held_sends: bool = False             # a send completes when the receiver takes its data


class _Pipe:
    """One direction, sender -> receiver; both ends' links share it."""

    def __init__(self, sender_id: str, receiver_id: str, faults: LinkFaults):
        self.sender_id, self.receiver_id, self.faults = sender_id, receiver_id, faults
        self.frames: queue.Queue = queue.Queue()    # two FIFOs, as gloo tags / two groups are
        self.data: queue.Queue = queue.Queue()
        self.layers_sent = 0
        self.frames_sent = 0
        self.dead = False
        self.verdict: tuple[bool, str] | None = None   # the receiver's answer to "hello"
        self.answered = threading.Event()

    def kill(self) -> None:
        self.dead = True
        self.frames.put(_CLOSED)
        self.data.put(_CLOSED)


class FakeNetwork:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pipes: dict[tuple[str, str], _Pipe] = {}
        self._faults: dict[tuple[str, str], LinkFaults] = {}
        self._aborts: set[tuple[str, str, str]] = set()
        self.links_created = 0
        self.epoch = 0            # bumped by every abort notice and death (Connector.peer_epoch)

    def connector(self, actor_id: str) -> "FakeConnector":
        return FakeConnector(self, actor_id)

    def set_faults(self, sender_id: str, receiver_id: str, *, delay_s: float = 0.0,
                   die_after_layers: int | None = None, held_sends: bool = False) -> None:
        with self._lock:
            self._faults[(sender_id, receiver_id)] = LinkFaults(delay_s, die_after_layers, held_sends)
            pipe = self._pipes.get((sender_id, receiver_id))
            if pipe is not None:
                pipe.faults = self._faults[(sender_id, receiver_id)]

    def kill(self, actor_id: str) -> None:
        """The actor dies: every pipe it is on breaks."""
        with self._lock:
            self.epoch += 1
            for key, pipe in list(self._pipes.items()):
                if actor_id in key:
                    pipe.kill()
                    del self._pipes[key]

    def replace_pipe(self, sender_id: str, receiver_id: str) -> None:
        """The receiver restarted: the pair's next connect gets a new pipe. The old one stays open
        and nobody reads it, so what was posted on it neither completes nor fails."""
        with self._lock:
            self.epoch += 1
            self._pipes.pop((sender_id, receiver_id), None)

    def _pipe(self, sender_id: str, receiver_id: str) -> _Pipe:
        with self._lock:
            pipe = self._pipes.get((sender_id, receiver_id))
            if pipe is None or pipe.dead:
                faults = self._faults.get((sender_id, receiver_id), LinkFaults())
                pipe = self._pipes[(sender_id, receiver_id)] = _Pipe(sender_id, receiver_id, faults)
                self.links_created += 1
            return pipe

    def _is_current(self, pipe: _Pipe) -> bool:
        with self._lock:
            return not pipe.dead and self._pipes.get((pipe.sender_id, pipe.receiver_id)) is pipe


class FakeLink:
    def __init__(self, pipe: _Pipe, peer_id: str, device: torch.device):
        self.pipe, self.peer_id, self.device = pipe, peer_id, device

    def send_frame(self, msg: dict[str, Any], timeout: float) -> None:
        if msg["op"] in ("layers", "ready") and self.pipe.faults.delay_s:
            time.sleep(self.pipe.faults.delay_s)
        die = self.pipe.faults.die_after_layers
        if msg["op"] == "ready" and die is not None and self.pipe.layers_sent + len(msg["layers"]) > die:
            self.pipe.kill()      # the sender dies before a frame past its last layer leaves
        self._put(self.pipe.frames, encode_frame(msg))
        self.pipe.frames_sent += msg["op"] != "hello"      # transfers' frames, not the link's
        if msg["op"] == "ready":          # a direct copy: the frame is all that goes out
            self.pipe.layers_sent += len(msg["layers"])
            die = self.pipe.faults.die_after_layers
            if die is not None and self.pipe.layers_sent >= die:
                self.pipe.kill()

    def isend_data(self, tensor: torch.Tensor) -> "_FakeOp":
        taken = threading.Event() if self.pipe.faults.held_sends else None
        self._queue_data(tensor, taken)
        return _FakeOp(self, None, None, taken)

    def send_data(self, tensor: torch.Tensor, timeout: float) -> None:
        self._queue_data(tensor, None)

    def _queue_data(self, tensor: torch.Tensor, taken: threading.Event | None) -> None:
        n = tensor.shape[0] if tensor.dim() else 1
        die = self.pipe.faults.die_after_layers
        if die is not None and self.pipe.layers_sent + n > die:
            self.pipe.kill()      # layers batched past the last one never leave
        self._put(self.pipe.data, (tensor.detach().clone(), taken))
        self.pipe.layers_sent += n
        if die is not None and self.pipe.layers_sent >= die:
            self.pipe.kill()

    def recv_frame(self, timeout: float | None) -> dict[str, Any]:
        op = _FakeOp(self, self.pipe.frames, None)
        op.wait(timeout)
        return decode_frame(op.item)

    def irecv_data(self, tensor: torch.Tensor) -> "_FakeOp":
        return _FakeOp(self, self.pipe.data, tensor)

    def recv_data(self, tensor: torch.Tensor, timeout: float) -> None:
        self.irecv_data(tensor).wait(timeout)

    def close(self, broken: bool) -> None:
        self.pipe.kill()

    def send_verdict(self, direct: bool, why: str) -> None:
        self.pipe.verdict = (direct, why)
        self.pipe.answered.set()

    def wait_verdict(self, timeout: float) -> tuple[bool, str]:
        if not self.pipe.answered.wait(timeout):
            raise KVTransferTimeout(f"fake link to {self.peer_id!r}: no answer to hello in {timeout}s")
        return self.pipe.verdict

    def _put(self, q: queue.Queue, item: torch.Tensor) -> None:
        if self.pipe.dead:
            raise KVTransferError(f"fake link to {self.peer_id!r}: peer is gone")
        q.put(item)

    def _take(self, q: queue.Queue, timeout: float | None, block: bool) -> torch.Tensor | None:
        if self.pipe.dead and q.empty():
            raise KVTransferError(f"fake link to {self.peer_id!r}: peer is gone")
        try:
            item = q.get(timeout=timeout) if block else q.get_nowait()
        except queue.Empty:
            if not block:
                return None
            raise KVTransferTimeout(f"fake link to {self.peer_id!r}: nothing in {timeout}s") from None
        if item is _CLOSED:
            q.put(_CLOSED)       # stays closed for every later reader
            raise KVTransferError(f"fake link to {self.peer_id!r}: peer is gone")
        return item


class _FakeOp:
    """A posted fake operation: sends complete at once; a receive completes when its item is
    taken off the pipe (in posting order per stream, as gloo tags and NCCL keep order)."""

    def __init__(self, link: FakeLink, source: queue.Queue | None, into: torch.Tensor | None,
                 taken: threading.Event | None = None):
        self.link, self.source, self.into, self.taken = link, source, into, taken
        self.item: torch.Tensor | None = None
        self._complete = source is None and taken is None

    def done(self) -> bool:
        if not self._complete and self.taken is not None:    # a held send
            if self.link.pipe.dead and not self.taken.is_set():
                raise KVTransferError(f"fake link to {self.link.peer_id!r}: peer is gone")
            self._complete = self.taken.is_set()
        elif not self._complete:
            self._land(self.link._take(self.source, None, block=False))
        return self._complete

    def wait(self, timeout: float | None) -> None:
        if not self._complete and self.taken is not None:
            if not self.taken.wait(timeout):
                raise KVTransferTimeout(f"fake link to {self.link.peer_id!r}: send not taken in {timeout}s")
            self._complete = True
        elif not self._complete:
            self._land(self.link._take(self.source, timeout, block=True))

    def order_current_stream(self) -> bool:
        return False

    def _land(self, item: "torch.Tensor | tuple | None") -> None:
        if item is None:
            return
        if isinstance(item, tuple):         # data: (tensor, the sender's event or None)
            item, taken = item
            if taken is not None:
                taken.set()
        if self.into is not None:
            if item.shape != self.into.shape or item.dtype != self.into.dtype:
                raise KVTransferError(f"fake link: got {tuple(item.shape)} {item.dtype}, "
                                      f"posted {tuple(self.into.shape)} {self.into.dtype}")
            self.into.copy_(item)
        self.item, self._complete = item, True


class FakeConnector:
    def __init__(self, network: FakeNetwork, actor_id: str, device: torch.device | str = "cpu"):
        self.network, self.self_id, self.device = network, actor_id, torch.device(device)

    def connect(self, peer_id: str, as_sender: bool) -> FakeLink:
        key = (self.self_id, peer_id) if as_sender else (peer_id, self.self_id)
        return FakeLink(self.network._pipe(*key), peer_id, self.device)

    def is_current(self, link: FakeLink) -> bool:
        return self.network._is_current(link.pipe)

    def peer_epoch(self, peer_id: str) -> tuple:
        """Changes whenever an abort is posted, an actor dies, or this pair's pipe is replaced or
        broken (coarser than the real connector's, never finer)."""
        with self.network._lock:
            pipe = self.network._pipes.get((self.self_id, peer_id))
            return (self.network.epoch, id(pipe) if pipe is not None else None,
                    pipe.dead if pipe is not None else None)

    def post_abort(self, sender_id: str, receiver_id: str, request_id: str) -> None:
        with self.network._lock:
            self.network.epoch += 1
        self.network._aborts.add((sender_id, receiver_id, request_id))

    def abort_posted(self, sender_id: str, receiver_id: str, request_id: str) -> bool:
        return (sender_id, receiver_id, request_id) in self.network._aborts

    def clear_abort(self, sender_id: str, receiver_id: str, request_id: str) -> None:
        self.network._aborts.discard((sender_id, receiver_id, request_id))


def make_fake_pair(sender_store: BlockStore, receiver_store: BlockStore, *,
                   network: FakeNetwork | None = None, sender_id: str = "prefill-0",
                   receiver_id: str = "decode-0", config: KVTransferConfig = KVTransferConfig(),
                   on_sender_release: ReleaseCallback | None = None,
                   on_receiver_release: ReleaseCallback | None = None,
                   ) -> tuple[LayerStreamSender, LayerStreamReceiver, FakeNetwork]:
    """A sender and a receiver joined by a FakeNetwork (a new one unless given)."""
    network = network or FakeNetwork()
    sender = LayerStreamSender(sender_store, network.connector(sender_id), config,
                               on_release=on_sender_release or (lambda _rid: None))
    receiver = LayerStreamReceiver(receiver_store, network.connector(receiver_id), config,
                                   on_release=on_receiver_release or (lambda _rid: None))
    return sender, receiver, network
