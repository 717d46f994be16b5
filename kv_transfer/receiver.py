"""The decode end of a KV transfer, over any `Connector` (fake, gloo, NCCL).

`expect(spec)` registers a transfer into blocks the owner reserved. One background thread per
sending peer keeps a control-frame receive posted on that peer's link; each layer frame is
followed by the data, received into a staging tensor and scattered into the spec's dst blocks.
Layers must come in the spec's order.

Ordering contract: call `expect(spec)` before the sender's first layer can leave (the decode actor
does it inside its reserve call, before the router hands the spec to the prefill actor). Data for a
request the receiver does not know yet is discarded, and a later `expect` of it fails at once.

Late data for a transfer that already failed or was aborted here is received and dropped, so the
link stays in step; the blocks were already released and are never written.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Callable

import torch

from kv_transfer.base import (BlockStore, KVReceiver, KVTransferAborted, KVTransferConfig,
                              KVTransferError, KVTransferTimeout, ReleaseCallback, TransferSpec,
                              TransferState)
from kv_transfer.link import Connector, PeerLink
from kv_transfer.records import TransferTable

_MAX_EARLY = 4096


def _ignore(_request_id: str) -> None:
    pass


class LayerStreamReceiver(KVReceiver):
    def __init__(self, store: BlockStore, connector: Connector,
                 config: KVTransferConfig = KVTransferConfig(),
                 on_release: ReleaseCallback = _ignore, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.connector = connector
        self.config = config
        self._on_release = on_release
        self._table = TransferTable(self._release, releases_on=(TransferState.FAILED,
                                                                TransferState.ABORTED), clock=clock)
        self._lock = threading.Lock()          # loops and early arrivals
        self._loops: dict[str, _PeerRecvLoop] = {}
        self._early: OrderedDict[str, str] = OrderedDict()    # rid -> what came before expect()
        self._closed = False

    def expect(self, spec: TransferSpec) -> None:
        if spec.receiver_id != self.connector.self_id:
            raise ValueError(f"spec {spec.request_id!r} is for receiver {spec.receiver_id!r}, "
                             f"this is {self.connector.self_id!r}")
        if max(spec.layers) >= self.store.num_layers:
            raise ValueError(f"spec {spec.request_id!r}: layer {max(spec.layers)} out of range")
        if self._closed:
            raise KVTransferError("receiver is closed")
        deadline = self._table.clock() + self.config.start_timeout_s
        with self._lock:
            self._table.add(spec, peer=spec.sender_id, deadline=deadline)
            early = self._early.pop(spec.request_id, None)
            if early is not None:
                self._table.finish(spec.request_id, TransferState.FAILED, KVTransferError(
                    f"transfer {spec.request_id!r}: {early} from {spec.sender_id!r} before expect()"))
            elif spec.sender_id not in self._loops:
                self._loops[spec.sender_id] = _PeerRecvLoop(self, spec.sender_id)
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
        if self._table.finish(request_id, TransferState.ABORTED,
                              KVTransferAborted(f"transfer {request_id!r} aborted by the receiver")):
            self._tell_sender_to_stop(request_id)
        self._table.run_releases()

    def reap(self) -> list[tuple[str, TransferState]]:
        return self._table.reap()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            loops, self._loops = list(self._loops.values()), {}
        for loop in loops:
            self._table.fail_peer(loop.peer, KVTransferError("receiver closed"))
            loop.stop()
        self._table.run_releases()

    def _release(self, request_id: str) -> None:
        """Owner thread. A transfer that timed out here may still be running on the sender."""
        rec = self._table.get(request_id)
        if rec is not None and isinstance(rec.error, KVTransferTimeout):
            self._tell_sender_to_stop(request_id)
        self._on_release(request_id)

    def _tell_sender_to_stop(self, request_id: str) -> None:
        rec = self._table.get(request_id)
        try:
            self.connector.post_abort(rec.spec.sender_id, rec.spec.receiver_id, request_id)
        except Exception:   # an optimisation only: late data is dropped anyway
            pass

    def _note_early(self, rid: str, what: str) -> None:
        """Background thread, under self._lock."""
        self._early[rid] = what
        while len(self._early) > _MAX_EARLY:
            self._early.popitem(last=False)

    def _loop_ended(self, loop: "_PeerRecvLoop", err: KVTransferError) -> None:
        with self._lock:
            if self._loops.get(loop.peer) is loop:
                del self._loops[loop.peer]
            if not self._closed:
                self._table.fail_peer(loop.peer, err)


class _PeerRecvLoop:
    """One thread reading one peer's link until it breaks or the receiver closes."""

    def __init__(self, receiver: LayerStreamReceiver, peer: str):
        self.receiver = receiver
        self.peer = peer
        self.link: PeerLink | None = None
        self._stopping = False
        self._stream = None
        self._thread = threading.Thread(target=self._run, name=f"kv-recv-{peer}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Does not wait: a gloo receive posted while idle only returns when the peer closes or
        the process exits (the thread is a daemon); the fake link wakes it at once."""
        self._stopping = True
        if self.link is not None:
            self.link.close(broken=False)
        self._thread.join(timeout=0.1)

    def _run(self) -> None:
        store = self.receiver.store
        if store.device.type == "cuda":
            torch.cuda.set_device(store.device)
            self._stream = torch.cuda.Stream(store.device)
        try:
            self.link = self.receiver.connector.connect(self.peer, as_sender=False)
            while not self._stopping:
                self._handle(self.link.recv_frame(None))
        except KVTransferError as err:
            if self.link is not None:
                self.link.close(broken=not self._stopping)
            self.receiver._loop_ended(self, err)

    def _handle(self, frame: dict[str, Any]) -> None:
        op, rid = frame["op"], frame["rid"]
        table = self.receiver._table
        if op == "end":
            reason = f"transfer {rid!r}: {frame.get('reason', 'ended by the sender')}"
            with self.receiver._lock:
                rec = table.get(rid)
                if rec is None:
                    self.receiver._note_early(rid, f"the sender ended it ({reason})")
                elif rec.peer == self.peer and frame.get("state") == "aborted":
                    table.finish(rid, TransferState.ABORTED, KVTransferAborted(reason))
                elif rec.peer == self.peer:
                    table.finish(rid, TransferState.FAILED, KVTransferError(reason))
            return
        if op != "layer":
            raise KVTransferError(f"unknown control frame {op!r} from {self.peer!r}")
        buf = torch.empty(frame["shape"], dtype=getattr(torch, frame["dtype"]),
                          device=self.receiver.store.device)
        self._recv_data(buf)
        with self.receiver._lock:
            rec = table.start_work(rid)
            if rec is None:
                known = table.get(rid)
                if known is None:
                    self.receiver._note_early(rid, "its KV arrived")
                elif frame["idx"] + 1 == known.spec.num_layers:    # the sender is done with it
                    self._clear_abort(known.spec)
                return
        advanced = False
        try:
            problem = self._check(rec.spec, rec.layers_done, frame, buf)
            if problem:
                table.finish(rid, TransferState.FAILED, KVTransferError(f"transfer {rid!r}: {problem}"))
                return
            self._scatter(frame["layer"], list(rec.spec.dst_block_ids), buf)
            advanced = True
        finally:
            table.end_work(rec, advanced, table.clock() + self.receiver.config.timeout_s)

    def _check(self, spec: TransferSpec, done: int, frame: dict[str, Any], buf: torch.Tensor) -> str:
        if spec.sender_id != self.peer:
            return f"data came from {self.peer!r}, expected {spec.sender_id!r}"
        if frame["idx"] != done or frame["layer"] != spec.layers[done]:
            return f"got layer {frame['layer']} (#{frame['idx']}), expected {spec.layers[done]} (#{done})"
        want = tuple(self.receiver.store.block_payload_shape(len(spec.dst_block_ids)))
        if tuple(buf.shape) != want or buf.dtype != self.receiver.store.dtype:
            return (f"layout mismatch: sender sent {tuple(buf.shape)} {buf.dtype}, this cache "
                    f"takes {want} {self.receiver.store.dtype}")
        return ""

    def _recv_data(self, buf: torch.Tensor) -> None:
        timeout = self.receiver.config.timeout_s
        if self._stream is None:
            self.link.recv_data(buf, timeout)
        else:
            with torch.cuda.stream(self._stream):
                self.link.recv_data(buf, timeout)

    def _scatter(self, layer: int, block_ids: list[int], buf: torch.Tensor) -> None:
        if self._stream is None:
            self.receiver.store.scatter_blocks(layer, block_ids, buf)
            return
        with torch.cuda.stream(self._stream):
            self.receiver.store.scatter_blocks(layer, block_ids, buf)
        self._stream.synchronize()      # DONE must mean the blocks hold the data

    def _clear_abort(self, spec: TransferSpec) -> None:
        try:
            self.receiver.connector.clear_abort(spec.sender_id, spec.receiver_id, spec.request_id)
        except Exception:
            pass
