"""The prefill end of a KV transfer, over any `Connector` (fake, gloo, NCCL).

The caller queues layers (`send_layer`) and returns at once; one background thread per receiving
peer gathers each layer's blocks into one contiguous tensor and sends a control frame followed by
that tensor. Frames on the wire (sender -> receiver):

    {"op": "layer", "rid", "idx", "layer", "shape", "dtype"}  then the data tensor
    {"op": "end", "rid", "state": "aborted" | "failed", "reason"}

A receiver's abort comes back out of band (`Connector.abort_posted`), checked before each layer.
Any error on a link fails every unfinished transfer to that peer and drops the link.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import torch

from kv_transfer.base import (BlockStore, KVSender, KVTransferAborted, KVTransferConfig,
                              KVTransferError, ReleaseCallback, TransferSpec, TransferState)
from kv_transfer.link import Connector, PeerLink
from kv_transfer.records import TransferTable

_ABORT_CHECK_INTERVAL_S = 0.01   # at most one store lookup per transfer per 10 ms


def _ignore(_request_id: str) -> None:
    pass


class LayerStreamSender(KVSender):
    def __init__(self, store: BlockStore, connector: Connector,
                 config: KVTransferConfig = KVTransferConfig(),
                 on_release: ReleaseCallback = _ignore, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.connector = connector
        self.config = config
        self._table = TransferTable(on_release, releases_on=(TransferState.DONE, TransferState.FAILED,
                                                             TransferState.ABORTED), clock=clock)
        self._queued: dict[str, int] = {}             # owner thread only: layers queued so far
        self._workers: dict[str, _PeerSendWorker] = {}
        self._lock = threading.Lock()
        self._closed = False

    def begin(self, spec: TransferSpec) -> None:
        if spec.sender_id != self.connector.self_id:
            raise ValueError(f"spec {spec.request_id!r} is for sender {spec.sender_id!r}, "
                             f"this is {self.connector.self_id!r}")
        if max(spec.layers) >= self.store.num_layers:
            raise ValueError(f"spec {spec.request_id!r}: layer {max(spec.layers)} out of range")
        if self._closed:
            raise KVTransferError("sender is closed")
        self._table.add(spec, peer=spec.receiver_id)
        self._queued[spec.request_id] = 0
        self._worker(spec.receiver_id)
        self._table.run_releases()

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
        self._worker(rec.peer).put(("layer", request_id, idx, ready_event))
        self._table.run_releases()

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
            self._worker(rec.peer).put(("end", request_id, "aborted", "aborted by the sender"))
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

    def _worker(self, peer: str) -> "_PeerSendWorker":
        with self._lock:
            w = self._workers.get(peer)
            if w is None:
                w = self._workers[peer] = _PeerSendWorker(self, peer)
            return w


class _PeerSendWorker:
    """One thread, one link, one peer; works through the queue in order."""

    def __init__(self, sender: LayerStreamSender, peer: str):
        self.sender = sender
        self.peer = peer
        self.link: PeerLink | None = None
        self._queue: queue.Queue = queue.Queue()
        self._abort_checked: dict[str, float] = {}
        self._stream = None
        self._thread = threading.Thread(target=self._run, name=f"kv-send-{peer}", daemon=True)
        self._thread.start()

    def put(self, item: tuple) -> None:
        self._queue.put(item)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        if self.link is not None:
            self.link.close(broken=False)

    def _run(self) -> None:
        device = self.sender.store.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
            self._stream = torch.cuda.Stream(device)
        while (item := self._queue.get()) is not None:
            try:
                if item[0] == "layer":
                    self._send_layer(*item[1:])
                else:
                    self._send_end(*item[1:])
            except KVTransferError as err:
                self._break(err)

    def _send_layer(self, rid: str, idx: int, ready_event: Any) -> None:
        table, cfg = self.sender._table, self.sender.config
        rec = table.start_work(rid)
        if rec is None:                  # aborted or failed meanwhile: skip
            return
        spec, advanced = rec.spec, False
        try:
            if self._receiver_aborted(spec, first=idx == 0):
                table.finish(rid, TransferState.ABORTED,
                             KVTransferAborted(f"transfer {rid!r} aborted by the receiver"))
                return
            link = self._link(fresh=idx == 0)
            layer = spec.layers[idx]
            try:
                data = self._gather(layer, list(spec.src_block_ids), ready_event)
            except Exception as exc:     # bad block ids, OOM: this transfer only, tell the peer
                table.finish(rid, TransferState.FAILED, KVTransferError(
                    f"transfer {rid!r}: gather of layer {layer} failed: {exc}"))
                self._send_end(rid, "failed", f"sender could not read layer {layer}: {exc}")
                return
            link.send_frame({"op": "layer", "rid": rid, "idx": idx, "layer": layer,
                             "shape": list(data.shape), "dtype": str(data.dtype).removeprefix("torch.")},
                            cfg.timeout_s)
            self._send_data(link, data)
            advanced = True
        finally:
            table.end_work(rec, advanced)
            if idx + 1 == spec.num_layers or not advanced:
                self._abort_checked.pop(rid, None)

    def _send_end(self, rid: str, state: str, reason: str) -> None:
        if self.link is not None:        # no link: the peer never heard of the transfer from us
            self.link.send_frame({"op": "end", "rid": rid, "state": state, "reason": reason[:200]},
                                 self.sender.config.timeout_s)

    def _gather(self, layer: int, block_ids: list[int], ready_event: Any) -> torch.Tensor:
        if self._stream is None:
            return self.sender.store.gather_blocks(layer, block_ids)
        with torch.cuda.stream(self._stream):
            if ready_event is not None:
                self._stream.wait_event(ready_event)
            return self.sender.store.gather_blocks(layer, block_ids)

    def _send_data(self, link: PeerLink, data: torch.Tensor) -> None:
        if self._stream is None:
            link.send_data(data, self.sender.config.timeout_s)
        else:
            with torch.cuda.stream(self._stream):    # NCCL orders its send after the gather
                link.send_data(data, self.sender.config.timeout_s)

    def _receiver_aborted(self, spec: TransferSpec, first: bool) -> bool:
        now = time.monotonic()
        last = self._abort_checked.get(spec.request_id)
        if not first and last is not None and now - last < _ABORT_CHECK_INTERVAL_S:
            return False
        self._abort_checked[spec.request_id] = now
        conn = self.sender.connector
        if conn.abort_posted(spec.sender_id, spec.receiver_id, spec.request_id):
            conn.clear_abort(spec.sender_id, spec.receiver_id, spec.request_id)
            return True
        return False

    def _link(self, fresh: bool) -> PeerLink:
        conn = self.sender.connector
        if self.link is not None and fresh and not conn.is_current(self.link):
            self.link.close(broken=False)     # the peer restarted or rebuilt the pair
            self.link = None
        if self.link is None:
            self.link = conn.connect(self.peer, as_sender=True)
        return self.link

    def _break(self, err: KVTransferError) -> None:
        self.sender._table.fail_peer(self.peer, err)
        if self.link is not None:
            self.link.close(broken=True)
            self.link = None
