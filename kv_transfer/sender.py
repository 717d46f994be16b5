"""The prefill end of a KV transfer, over any `Connector` (fake, gloo, NCCL).

The caller queues layers (`send_layer`) and returns at once; one background thread per receiving
peer (`send_worker.PeerSendWorker`) turns them into messages on one of two data paths, picked per
link by the receiver's answer to the link's first frame:

- **direct copy** (`direct_send`, `KVTransferConfig.direct_copy`): the receiver mapped this actor's
  cache (same host, CUDA IPC over NVLink) and copies the blocks itself; the link carries only
  "ready" frames naming the layers that are written, and a message is complete once the receiver
  acks its copy;
- **streamed** (`streamed_send`): the layers of one request that are queued together (up to
  `max_message_bytes`) are gathered into one contiguous tensor [k, *layer payload] and sent after a
  control frame announcing them. Up to `max_inflight_messages * max_message_bytes` bytes are on the
  wire at once (staged in one FIFO ring): the thread posts the next frame and sends while earlier
  data is still moving, and counts a layer as sent when its message completes.

So a prefill that queues layers as it computes them sends each as soon as it is ready (layer L
moves while L+1 computes), and a transfer whose layers are all ready goes as a few large messages.
The frames on the wire are the named types of `kv_transfer.frames`.

A receiver's abort comes back out of band (`Connector.abort_posted`), checked before each message.
Any error on a link (a message not taken within `timeout_s` among them) fails every unfinished
transfer to that peer and drops the link; a receiver that restarted or gave the pair up fails only
the transfers that used the old link.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch

from tandem.kv_transfer.base import BlockStore, KVSender, KVTransferAborted, KVTransferError, ReleaseCallback, TransferState
from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.link import Connector
from tandem.kv_transfer.records import TransferTable
from tandem.kv_transfer.send_queue import BeginItem, EndItem, LayerItem
from tandem.kv_transfer.send_worker import PeerSendWorker


def _ignore(_request_id: str) -> None:
    pass


class LayerStreamSender(KVSender):
    def __init__(self, store: BlockStore, connector: Connector,
                 config: KVTransferConfig = KVTransferConfig(),
                 on_release: ReleaseCallback = _ignore, clock: Callable[[], float] = time.monotonic,
                 on_transition: Callable[[], None] | None = None):
        """`on_transition`: called from the transport's thread when a transfer ends, so an owner
        idle between polls (the prefill loop waiting to hand over) can reap it at once; it must
        only signal."""
        self.store = store
        self.connector = connector
        # peer actor id -> the store its data comes from / lands in (kv_transfer.reshard: the
        # heads a rank of another tensor-parallel size gets); None: the whole cache
        self.peer_stores: Callable[[str], BlockStore] | None = None
        self.config = config
        self._table = TransferTable(on_release, releases_on=(TransferState.DONE, TransferState.FAILED,
                                                             TransferState.ABORTED), clock=clock,
                                    on_transition=on_transition)
        self._queued: dict[str, int] = {}             # owner thread only: layers queued so far
        self._workers: dict[str, PeerSendWorker] = {}
        self._lock = threading.Lock()
        self._closed = False
        # (time.time(), event, request id) of each message's steps while a list (benchmarks
        # diagnose a transfer with it); None: nothing is recorded
        self.trace: list[tuple[float, str, str]] | None = None

    def begin(self, spec: TransferSpec) -> None:
        self._register(spec)
        self._queued[spec.request_id] = 0
        # the worker checks the link and builds the block index now, while the prefill computes
        self._worker(spec.receiver_id).put(BeginItem(spec.request_id, False))
        self._table.run_releases()

    def _register(self, spec: TransferSpec) -> None:
        if spec.sender_id != self.connector.self_id:
            raise ValueError(f"spec {spec.request_id!r} is for sender {spec.sender_id!r}, "
                             f"this is {self.connector.self_id!r}")
        if max(spec.layers) >= self.store.num_layers:
            raise ValueError(f"spec {spec.request_id!r}: layer {max(spec.layers)} out of range")
        if len(spec.src_block_ids) != len(spec.dst_block_ids):
            raise ValueError(f"spec {spec.request_id!r}: the sender needs a source block per destination")
        if min(spec.src_block_ids) < 0 or max(spec.src_block_ids) >= self.store.num_blocks:
            raise ValueError(f"spec {spec.request_id!r}: source block ids outside 0..{self.store.num_blocks - 1}")
        if self._closed:
            raise KVTransferError("sender is closed")
        self._table.add(spec, peer=spec.receiver_id)

    def send_layer(self, request_id: str, layer: int, ready_event: Any = None) -> None:
        rec = self._table.get(request_id)
        if rec is None:
            raise KeyError(f"unknown transfer {request_id!r}: call begin(spec) first")
        if rec.state.terminal:         # aborted or failed: the prefill may still finish its layers
            self._queued.pop(request_id, None)
            self._table.run_releases()
            return
        idx = self._queued.get(request_id, rec.spec.num_layers)
        if idx >= rec.spec.num_layers or rec.spec.layers[idx] != layer:
            expected = rec.spec.layers[idx] if idx < rec.spec.num_layers else None
            raise ValueError(f"transfer {request_id!r}: got layer {layer}, expected {expected}")
        self._queued[request_id] = idx + 1
        if idx + 1 == rec.spec.num_layers:
            del self._queued[request_id]
        if ready_event is None and self.store.device.type == "cuda":
            ready_event = torch.cuda.Event()
            ready_event.record()
        self._worker(rec.peer).put(LayerItem(request_id, idx, ready_event, 1))
        self._table.run_releases()

    def send(self, spec: TransferSpec) -> None:
        """begin + every layer, all ready now (a prefix pull, a cache copy): one ready event for
        all of them and one pass, instead of an event and a table lookup per layer. On a direct
        link with nothing queued, and the layers already written, the frame leaves from this
        thread (`DirectSendPath.send_now`): no hand-over to the transport's thread."""
        self._register(spec)
        ready = None
        if self.store.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        worker = self._worker(spec.receiver_id)
        if not worker.direct.send_now(spec, ready):
            worker.put(BeginItem(spec.request_id, True))
            worker.put(LayerItem(spec.request_id, 0, ready, spec.num_layers))
        self._table.run_releases()

    def store_for(self, peer: str) -> BlockStore:
        return self.store if self.peer_stores is None else self.peer_stores(peer)

    def poll(self, request_id: str) -> TransferState:
        state = self._table.state(request_id)
        self._table.run_releases()
        return state

    def progress(self, request_id: str) -> tuple[int, int]:
        return self._table.progress(request_id)

    def wait(self, request_id: str, timeout: float) -> TransferState:
        return self._table.wait(request_id, timeout)

    def abort(self, request_id: str) -> None:
        rec = self._table.get(request_id)
        if rec is not None and self._table.finish(request_id, TransferState.ABORTED,
                                                  KVTransferAborted(f"transfer {request_id!r} "
                                                                    "aborted by the sender")):
            self._queued.pop(request_id, None)
            self._worker(rec.peer).put(EndItem(request_id, "aborted", "aborted by the sender"))
        self._table.run_releases()

    def reap(self) -> list[tuple[str, TransferState]]:
        finished = self._table.reap()
        for rid, _state in finished:
            self._queued.pop(rid, None)
        return finished

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
        for w in workers:
            w.stop()
            self._table.fail_peer(w.peer, KVTransferError("sender closed"))
        self._table.run_releases()

    def _worker(self, peer: str) -> PeerSendWorker:
        with self._lock:
            w = self._workers.get(peer)
            if w is None:
                w = self._workers[peer] = PeerSendWorker(self, peer)
            return w
