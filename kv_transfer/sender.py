"""The prefill end of a KV transfer, over any `Connector` (fake, gloo, NCCL).

The caller queues layers (`send_layer`) and returns at once; one background thread per receiving
peer turns them into messages: the layers of one request that are queued together (up to
`max_message_bytes`) are gathered into one contiguous tensor [k, *layer payload] and sent after a
control frame announcing them. Up to `max_inflight_messages` messages are on the wire at once: the
thread posts the next message's frame and send while earlier data is still moving, and counts a
layer as sent when its message completes. So a prefill that queues layers as it computes them
sends each as soon as it is ready (layer L moves while L+1 computes), and a transfer whose layers
are all ready goes as a few large messages. Frames on the wire (sender -> receiver):

    {"op": "layers", "rid", "idx", "layers", "shape", "dtype"}  then one tensor [len(layers), *shape]
    {"op": "end", "rid", "state": "aborted" | "failed", "reason"}

On CUDA the gather runs on the thread's own stream after the layer's ready event (recorded by the
prefill after it wrote the layer's KV), and NCCL's send is ordered after the gather on that stream:
the prefill's compute stream never waits for the transfer.

A receiver's abort comes back out of band (`Connector.abort_posted`), checked before each message.
Any error on a link fails every unfinished transfer to that peer and drops the link.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from kv_transfer.base import (BlockStore, KVSender, KVTransferAborted, KVTransferConfig,
                              KVTransferError, ReleaseCallback, TransferSpec, TransferState,
                              StagingSlots, device_index, layer_runs)
from kv_transfer.link import Connector, PeerLink, Pending
from kv_transfer.records import TransferRecord, TransferTable

log = logging.getLogger(__name__)

_ABORT_CHECK_INTERVAL_S = 0.01   # at most one store lookup per transfer per 10 ms
_POLL_MIN_S, _POLL_MAX_S = 20e-6, 200e-6   # polling posted messages: backoff while nothing changes


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
        self.config = config
        self._table = TransferTable(on_release, releases_on=(TransferState.DONE, TransferState.FAILED,
                                                             TransferState.ABORTED), clock=clock,
                                    on_transition=on_transition)
        self._queued: dict[str, int] = {}             # owner thread only: layers queued so far
        self._workers: dict[str, _PeerSendWorker] = {}
        self._lock = threading.Lock()
        self._closed = False
        # (time.time(), event, request id) of each message's steps while a list (benchmarks
        # diagnose a transfer with it); None: nothing is recorded
        self.trace: list[tuple[float, str, str]] | None = None

    def begin(self, spec: TransferSpec) -> None:
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
        self._queued[spec.request_id] = 0
        # the worker checks the link and builds the block index now, while the prefill computes
        self._worker(spec.receiver_id).put(("begin", spec.request_id))
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

    def send(self, spec: TransferSpec) -> None:
        """begin + every layer, all ready now (a prefix pull, a cache copy): one ready event for
        all of them and one pass, instead of an event and a table lookup per layer."""
        self.begin(spec)
        rec = self._table.get(spec.request_id)
        if rec is None or rec.state.terminal:
            self._queued.pop(spec.request_id, None)
            self._table.run_releases()
            return
        ready = None
        if self.store.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        del self._queued[spec.request_id]
        worker = self._worker(rec.peer)
        for idx in range(spec.num_layers):
            worker.put(("layer", spec.request_id, idx, ready))
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


def _split(n: int, per_msg: int) -> list[int]:
    """n layers in as few messages of at most per_msg layers as possible, sizes within one."""
    k = -(-n // per_msg)
    return [n // k + (i < n % k) for i in range(k)]


@dataclass
class _Message:
    rec: TransferRecord
    num_layers: int
    op: Pending
    data: torch.Tensor      # kept alive until the send completes
    slot: int | None = None  # its staging slot, free again once the send completes


class _PeerSendWorker:
    """One thread, one link, one peer: works through the queue in order, several messages deep."""

    def __init__(self, sender: LayerStreamSender, peer: str):
        self.sender = sender
        self.peer = peer
        self.link: PeerLink | None = None
        self._queue: queue.Queue = queue.Queue()
        self._backlog: deque[tuple] = deque()       # taken off the queue, not yet sent
        self._inflight: deque[_Message] = deque()
        self._index: dict[str, torch.Tensor] = {}   # rid -> src block index on the device
        self._abort_checked: dict[str, float] = {}
        self._prepared: set[str] = set()            # rids whose link was checked at begin()
        self._epoch_seen: Any = None                # the peer's epoch at the last full check
        self._stream = self._index_stream = None
        self._staging: StagingSlots | None = None
        self.messages_sent = 0
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
            self._stream = torch.cuda.Stream(device)           # gathers, then NCCL sends
            self._index_stream = torch.cuda.Stream(device)     # block-id copies only: kept idle
        stopping, idle_s = False, _POLL_MIN_S
        while not (stopping and not self._backlog and not self._inflight):
            # Block only when there is nothing to send and nothing to watch.
            block = not self._backlog and not self._inflight and not stopping
            if block:
                self._prune()
            stopping |= self._take(block)
            try:
                progressed = self._complete(wait=False)
                if self._backlog and len(self._inflight) < self.sender.config.max_inflight_messages:
                    item = self._backlog.popleft()
                    if item[0] == "layer":
                        self._send_layers(item)
                    elif item[0] == "begin":
                        self._prepare(item[1])
                    else:        # frames are FIFO: the peer has seen every layer frame before it
                        self._send_end(*item[1:])
                    progressed = True
                elif self._backlog:
                    self._complete(wait=True)    # window full: wait for the oldest message
                    progressed = True
            except KVTransferError as err:
                self._break(err)
                progressed = True
            except Exception as exc:  # noqa: BLE001 - a bug or a failed allocation: this peer's
                log.exception("KV sender to %s failed", self.peer)     # transfers fail, the thread lives
                self._break(KVTransferError(f"sender to {self.peer!r} failed: {type(exc).__name__}: {exc}"))
                progressed = True
            if progressed:
                idle_s = _POLL_MIN_S
            else:                    # data in flight, nothing new queued: poll with backoff
                time.sleep(idle_s)
                idle_s = min(idle_s * 2, _POLL_MAX_S)

    def _take(self, block: bool) -> bool:
        """Move queued items to the backlog; True when stop() was asked."""
        try:
            item = self._queue.get() if block else self._queue.get_nowait()
            while True:
                if item is None:
                    return True
                self._backlog.append(item)
                item = self._queue.get_nowait()
        except queue.Empty:
            return False

    def _mark(self, what: str, rid: str) -> None:
        trace = self.sender.trace
        if trace is not None:
            trace.append((time.time(), what, rid))

    def _prepare(self, rid: str) -> None:
        """At begin(): the store lookups (receiver aborted? link still current?) and the block
        index, off the path of the first layer."""
        rec = self.sender._table.get(rid)
        if rec is None or rec.state.terminal:
            return
        epoch = self.sender.connector.peer_epoch(self.peer)
        if epoch is not None and self.link is not None and epoch == self._epoch_seen:
            # one lookup instead of three: the receiver has not restarted, broken the pair or
            # posted an abort since the last full check (an abort of this request posted before
            # that check is missed here; the receiver drops the data, as it does any late data)
            self._abort_checked[rid] = time.monotonic()
        else:
            if self._receiver_aborted(rec.spec, first=True):
                self.sender._table.finish(rid, TransferState.ABORTED,
                                          KVTransferAborted(f"transfer {rid!r} aborted by the receiver"))
                return
            self._link(fresh=True)
            self._epoch_seen = epoch
        self._block_index(rid, rec.spec)
        self._prepared.add(rid)
        self._mark("send.prepared", rid)

    def _send_layers(self, first: tuple) -> None:
        """Send the request's layers that are ready now, from `first` on: as many messages of up
        to max_message_bytes as the window has room for, announced by one control frame, so the
        receiver posts every receive at once and the wire never waits for a frame in between."""
        _, rid, idx, event = first
        self._mark("send.pick", rid)
        table, cfg = self.sender._table, self.sender.config
        fresh = idx == 0 and rid not in self._prepared
        known = table.get(rid)
        if known is not None and not known.state.terminal and self._receiver_aborted(known.spec, first=fresh):
            table.finish(rid, TransferState.ABORTED,
                         KVTransferAborted(f"transfer {rid!r} aborted by the receiver"))
        shape = tuple(self.sender.store.block_payload_shape(len(known.spec.src_block_ids))) if known else ()
        per_msg = max(1, cfg.max_message_bytes // (math.prod(shape) * self.sender.store.dtype.itemsize or 1))
        room = per_msg * (cfg.max_inflight_messages - len(self._inflight))
        events = [event]                 # more ready layers of the same request join
        while (len(events) < room and self._backlog and self._backlog[0][0] == "layer"
               and self._backlog[0][1] == rid):
            events.append(self._backlog.popleft()[3])
        parts = _split(len(events), per_msg)
        rec = table.start_work(rid, len(parts))
        if rec is None:                  # aborted or failed meanwhile: skip its queued layers
            self._skip_queued(rid)
            self._forget(rid)
            return
        spec, claims = rec.spec, len(parts)
        staging, bufs = self._staging_for(cfg), []
        try:
            link = self._link(fresh=fresh)
            layers = list(spec.layers[idx:idx + len(events)])
            try:                         # staging first: an OOM fails this transfer only
                for n in parts:
                    bufs.append(staging.take((n, *shape), self.sender.store.dtype))
            except Exception as exc:
                table.finish(rid, TransferState.FAILED, KVTransferError(
                    f"transfer {rid!r}: no staging memory for layers {layers}: {exc}"))
                self._skip_queued(rid)
                self._forget(rid)
                self._send_end(rid, "failed", f"sender could not stage layers {layers}: {exc}")
                return
            link.send_frame({"op": "layers", "rid": rid, "idx": idx, "layers": layers, "parts": parts,
                             "shape": list(shape), "dtype": str(bufs[0][0].dtype).removeprefix("torch.")},
                            cfg.timeout_s)
            at = 0
            for n, (buf, slot) in zip(parts, list(bufs)):   # each send is ordered after its gather
                self._gather(rid, spec, layers[at:at + n], events[at:at + n], buf)
                posted = self._post(link, buf)
                claims -= 1
                bufs.pop(0)
                self._mark(f"send.posted {n}", rid)
                self._inflight.append(_Message(rec, n, posted, buf, slot))
                self.messages_sent += 1
                at += n
            if idx + len(layers) == spec.num_layers:
                self._forget(rid)
        finally:
            for _ in range(claims):       # parts never posted (the link broke): give them back
                table.end_work(rec, 0)
            if bufs and self._stream is not None:
                self._stream.synchronize()    # a gather queued into them may still run
            for _buf, slot in bufs:
                staging.give(slot)

    def _complete(self, wait: bool) -> bool:
        """Retire finished messages, oldest first (NCCL completes them in order); with `wait`,
        block for the oldest. A message past the transfer timeout breaks the link."""
        cfg, table = self.sender.config, self.sender._table
        progressed = False
        while self._inflight:
            msg = self._inflight[0]
            if wait and not progressed:
                msg.op.wait(cfg.timeout_s)
            elif not msg.op.done():
                return progressed
            self._inflight.popleft()
            self._staging.give(msg.slot)
            self._mark("send.done", msg.rec.request_id)
            table.end_work(msg.rec, msg.num_layers)
            progressed = True
        return progressed

    def _drain(self) -> None:
        while self._inflight:
            self._complete(wait=True)

    def _send_end(self, rid: str, state: str, reason: str) -> None:
        if self.link is not None:        # no link: the peer never heard of the transfer from us
            self.link.send_frame({"op": "end", "rid": rid, "state": state, "reason": reason[:200]},
                                 self.sender.config.timeout_s)

    def _gather(self, rid: str, spec: TransferSpec, layers: list[int], events: list[Any],
                out: torch.Tensor) -> None:
        store = self.sender.store
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        index = self._block_index(rid, spec)
        with ctx:
            for event in dict.fromkeys(events):      # layers queued together share one event
                if event is not None and self._stream is not None:
                    self._stream.wait_event(event)
            for at, run in layer_runs(layers):
                store.gather_layers(run, index, out=out[at:at + len(run)])

    def _staging_for(self, cfg: KVTransferConfig) -> StagingSlots:
        """The message buffers; made again (once idle) when the message size was changed."""
        st = self._staging
        if st is None or (st.slot_bytes != cfg.max_message_bytes and st.free == st.slots):
            st = self._staging = StagingSlots(cfg.max_inflight_messages, cfg.max_message_bytes,
                                              self.sender.store.device)
        return st

    def _block_index(self, rid: str, spec: TransferSpec) -> torch.Tensor:
        index = self._index.get(rid)
        if index is None:                    # gathers run on self._stream, after the copy
            index = self._index[rid] = device_index(self.sender.store, spec.src_block_ids,
                                                    self._index_stream, self._stream)
        return index

    def _post(self, link: PeerLink, data: torch.Tensor) -> Pending:
        if self._stream is None:
            return link.isend_data(data)
        with torch.cuda.stream(self._stream):    # NCCL orders its send after the gather
            return link.isend_data(data)

    def _skip_queued(self, rid: str) -> None:
        self._backlog = deque(item for item in self._backlog if not (item[0] == "layer" and item[1] == rid))

    def _prune(self) -> None:
        """Idle: drop what begin() prepared for transfers that ended without sending every layer
        (aborted, failed or timed out before the prefill got to them)."""
        table = self.sender._table
        for rid in [r for r in self._index if (rec := table.get(r)) is None or rec.state.terminal]:
            self._forget(rid)

    def _forget(self, rid: str) -> None:
        self._index.pop(rid, None)
        self._abort_checked.pop(rid, None)
        self._prepared.discard(rid)

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
            self._drain()                     # what is posted on the old link finishes there
            self.link.close(broken=False)     # the peer restarted or rebuilt the pair
            self.link = None
        if self.link is None:
            self.link = conn.connect(self.peer, as_sender=True)
        return self.link

    def _break(self, err: KVTransferError) -> None:
        table = self.sender._table
        table.fail_peer(self.peer, err)
        if self.link is not None:
            self.link.close(broken=True)
            self.link = None
        if self._stream is not None:          # no gather may still read blocks we hand back
            self._stream.synchronize()
        while self._inflight:
            msg = self._inflight.popleft()
            table.end_work(msg.rec, 0)
            self._staging.give(msg.slot)
        self._index.clear()
        self._abort_checked.clear()
        self._prepared.clear()
        self._epoch_seen = None
