"""The prefill end of a KV transfer, over any `Connector` (fake, gloo, NCCL).

The caller queues layers (`send_layer`) and returns at once; one background thread per receiving
peer turns them into messages: the layers of one request that are queued together (up to
`max_message_bytes`) are gathered into one contiguous tensor [k, *layer payload] and sent after a
control frame announcing them. Up to `max_inflight_messages * max_message_bytes` bytes are on the
wire at once (staged in one FIFO ring): the thread posts the next frame and sends while earlier
data is still moving, and counts a layer as sent when its message completes. So a prefill that
queues layers as it computes them sends each as soon as it is ready (layer L moves while L+1
computes), and a transfer whose layers are all ready goes as a few large messages. Frames on the
wire (sender -> receiver):

    {"op": "hello", "cache", "acks", "ids", "cell"}  first on every link: handles of this actor's
        cache, ack cells and block-id arena, offering a direct copy (None: it cannot be shared)
    {"op": "layers", "rid", "idx", "layers", "parts", "shape", "dtype"}  then, per part, one tensor
        [part, *shape] of the next `part` layers
    {"op": "ready", "rid", "idx", "layers", "seq", "ids_at", "n"}  (direct copy) those layers are
        written: copy them out of the n source blocks whose ids are at `ids_at` of the arena (named
        in the transfer's first frame; or "src", the ids as int32 bytes: an all-ready send, or a
        full arena),
        and ack `seq`
    {"op": "end", "rid", "state": "aborted" | "failed", "reason"}

**Direct copy** (`KVTransferConfig.direct_copy`): when the receiver could map this actor's cache
(same host, CUDA IPC over NVLink), no data goes through the link at all. A "ready" frame tells the
receiver which layers are written; it copies them block to block, out of this cache into its own,
with one kernel that reads the source block ids from this actor's id arena (a streamed transfer's,
uploaded at begin() while the prefill computes) or from its own device (an all-ready send's, which
ride in the frame: uploading them first would delay the frame by a copy and a wait), then writes
the frame's `seq` into this actor's ack cell (device memory it mapped, one cell per link),
stream-ordered behind the copy. A message is complete once its `seq` is acked: only then does this
side stop holding the source blocks. The receiver only ever reads this
cache and writes its own, so a late or aborted copy can never touch memory either side has reused.

On CUDA the gather runs on the thread's own stream after the layer's ready event (recorded by the
prefill after it wrote the layer's KV), and NCCL's send is ordered after the gather on that stream:
the prefill's compute stream never waits for the transfer.

A receiver's abort comes back out of band (`Connector.abort_posted`), checked before each message.
Any error on a link (a message not taken within `timeout_s` among them) fails every unfinished
transfer to that peer and drops the link; a receiver that restarted or gave the pair up fails only
the transfers that used the old link.
"""

from __future__ import annotations

import contextlib
from array import array
import logging
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from tandem.kv_transfer.base import (BlockStore, KVSender, KVTransferAborted, KVTransferConfig,
                              KVTransferError, KVTransferTimeout, ReleaseCallback, StagingRing,
                              PinnedIndexRing, TransferSpec, TransferState, device_index, layer_runs,
                              machine_id, plan_messages)
from tandem.kv_transfer.link import Connector, PeerLink, Pending
from tandem.kv_transfer.records import TransferRecord, TransferTable

log = logging.getLogger(__name__)

_ABORT_CHECK_INTERVAL_S = 0.01   # at most one store lookup per transfer per 10 ms
_POLL_MIN_S, _POLL_MAX_S = 20e-6, 200e-6   # polling posted messages: backoff while nothing changes
_ACK_POLL_S = 1e-3         # direct copies: how often the acks are read while copies are out


def _ignore(_request_id: str) -> None:
    pass


def _event_done(event: Any) -> bool:
    return event is None or event.query()


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
        self._register(spec)
        self._queued[spec.request_id] = 0
        # the worker checks the link and builds the block index now, while the prefill computes
        self._worker(spec.receiver_id).put(("begin", spec.request_id, False))
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
        self._worker(rec.peer).put(("layer", request_id, idx, ready_event, 1))
        self._table.run_releases()

    def send(self, spec: TransferSpec) -> None:
        """begin + every layer, all ready now (a prefix pull, a cache copy): one ready event for
        all of them and one pass, instead of an event and a table lookup per layer. On a direct
        link with nothing queued, and the layers already written, the frame leaves from this
        thread (`_PeerSendWorker.send_now`): no hand-over to the transport's thread."""
        self._register(spec)
        ready = None
        if self.store.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        worker = self._worker(spec.receiver_id)
        if not worker.send_now(spec, ready):
            worker.put(("begin", spec.request_id, True))
            worker.put(("layer", spec.request_id, 0, ready, spec.num_layers))
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


@dataclass
class _Message:
    rec: TransferRecord
    num_layers: int
    op: Pending
    data: torch.Tensor | None   # kept alive until the send completes (None: a direct copy)
    lease: StagingRing.Lease | None = None   # its staging, free again once the send completes
    posted_at: float = 0.0
    nbytes: int = 0             # counted against the window (a direct copy holds no staging)
    last: bool = False          # carries the transfer's last layer


_WAKE = ("wake",)   # queued by send_now: look at the messages in flight
_ACK_CELLS = 64     # one per link in turn: a receiver still acking on an old link writes its own
_ID_ARENA_BYTES = 4 << 20   # source block ids of the transfers in flight (512 K ids)


class _AckOp:
    """A direct copy's completion: the receiver wrote `seq` (or a later one) into the link's ack
    cell, which this side reads from a stream it keeps idle (a few microseconds)."""

    def __init__(self, worker: "_PeerSendWorker", cell: int, seq: int):
        self.worker, self.cell, self.seq = worker, cell, seq

    def done(self) -> bool:
        return self.worker._acked(self.cell) >= self.seq

    def wait(self, timeout: float | None) -> None:
        deadline = time.monotonic() + (timeout if timeout is not None else 7 * 24 * 3600.0)
        idle_s = _POLL_MIN_S
        while not self.done():
            if time.monotonic() > deadline:
                raise KVTransferTimeout(f"link to {self.worker.peer!r}: copy #{self.seq} not acked "
                                        f"in {timeout:.3g}s")
            time.sleep(idle_s)
            idle_s = min(idle_s * 2, _POLL_MAX_S)

    def order_current_stream(self) -> bool:
        return False


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
        self._partial: set[str] = set()             # rids with layers sent on this link, more to come
        self._epoch_seen: Any = None                # the peer's epoch at the last full check
        self._stream = self._index_stream = None
        self._pinned: PinnedIndexRing | None = None
        self._staging: StagingRing | None = None
        self._inflight_bytes = 0
        self.messages_sent = 0
        self.ids_in_frames = 0       # direct copies whose source ids went in the frame (all ready, or arena full)
        # direct copies: whether this link's receiver copies out of our cache, the ack cells (kept
        # for the worker's life: a receiver may write one after we dropped its link), the link's
        # cell, the last seq sent and the last ack read
        self._direct = False
        self._acks: torch.Tensor | None = None
        self._acks_handle: bytes | None = None
        self._cache_handle: bytes | None = None
        self._id_ring: StagingRing | None = None
        self._ready_waiter: threading.Thread | None = None     # direct copies: blocks on layer events
        self._ready_events: queue.SimpleQueue | None = None
        self._waiting_on: Any = None
        self._ids_handle: bytes | None = None
        # rid -> (offset in the arena in ids, count, lease, upload event), or None: ids go in the frame
        self._src_ids: dict[str, tuple | None] = {}
        self._ack_cell = -1
        self._seq = 0
        self._ack_seen = 0
        self._links_made = 0
        self._src_sent: set[str] = set()            # rids whose source block ids this link's receiver has
        # held while the thread works (never while it waits), so an owner's send_now can take
        # the thread's place for a moment
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"kv-send-{peer}", daemon=True)
        self._thread.start()

    def put(self, item: tuple) -> None:
        self._queue.put(item)

    def send_now(self, spec: TransferSpec, ready: Any) -> bool:
        """Owner's thread, all layers of a registered transfer ready: announce them on this
        direct link right here (one frame, the source ids in it), instead of handing them to the
        transport's thread, whose wake-up and every GIL hand-over on the way (each up to a switch
        interval behind a busy owner) come before the copy can start; the link is verified after
        (`_verify`, on the thread). False, having done nothing, unless the link is up and direct,
        nothing is queued or being worked on for this peer, and the layers are written; the
        caller then queues the transfer."""
        if not (self._direct and self._queue.empty() and not self._backlog and _event_done(ready)):
            return False
        if not self._lock.acquire(timeout=0.001):
            return False
        try:
            on_cuda = self.sender.store.device.type == "cuda"
            if not self._direct or self.link is None or (on_cuda and self._pinned is None):
                return False
            if self._backlog or not self._queue.empty():
                return False
            rid = spec.request_id
            self._mark("send.now", rid)
            self._abort_checked[rid] = time.monotonic()
            self._prepared.add(rid)
            self._backlog.append(("layer", rid, 0, None, spec.num_layers))
            try:
                self._send_ready()
            except KVTransferError as err:   # as on the thread: the peer's transfers fail
                self._break(err)
            except Exception as exc:  # noqa: BLE001
                log.exception("KV sender to %s failed", self.peer)
                self._break(KVTransferError(f"sender to {self.peer!r} failed: {type(exc).__name__}: {exc}"))
            # the epoch check (a store round trip) comes after the frame, on the thread: a receiver
            # restarted meanwhile fails this transfer with the old link, instead of delaying all
            self._queue.put(("verify", rid))
            return True
        finally:
            self._lock.release()
            self._queue.put(_WAKE)           # the thread watches the copy's ack

    def stop(self) -> None:
        self._queue.put(None)
        if self._ready_events is not None:
            self._ready_events.put(None)
        self._thread.join(timeout=5)
        if self.link is not None:
            self.link.close(broken=False)

    def _run(self) -> None:
        device = self.sender.store.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
            self._stream = torch.cuda.Stream(device)           # gathers, then NCCL sends
            self._index_stream = torch.cuda.Stream(device)     # block-id copies only: kept idle
            self._pinned = PinnedIndexRing()
        stopping, idle_s = False, _POLL_MIN_S
        while not (stopping and not self._backlog and not self._inflight):
            # Block only when there is nothing to send and nothing to watch.
            block = not self._backlog and not self._inflight and not stopping
            if block:
                with self._lock:
                    self._prune()
            stopping |= self._take(block)
            self._lock.acquire()
            try:
                progressed = self._complete(wait=False)
                head = self._backlog[0] if self._backlog else None
                if (head is not None and self._direct and head[0] == "layer"
                        and (head[1] not in self._partial or head[1] in self._src_sent)):
                    progressed = self._send_ready() or progressed
                elif self._backlog and (self._backlog[0][0] != "layer" or not self._window_full()):
                    item = self._backlog.popleft()
                    if item[0] == "layer":
                        self._send_layers(item)
                    elif item[0] == "begin":
                        self._prepare(item[1], all_ready=item[2])
                    elif item[0] == "verify":
                        self._verify()
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
            finally:
                self._lock.release()
            if progressed:
                idle_s = _POLL_MIN_S
            elif self._direct and not stopping:
                # direct copies: the next layer's readiness comes from the ready waiter and new
                # work through the queue, both waking this thread; acks (which only release the
                # source blocks) are read at a slow pace. No busy polling: every wake-up takes the
                # GIL from the owner (a prefill launching its layers) for a switch interval.
                stopping |= self._wait_queue(_ACK_POLL_S if self._inflight else None)
            else:                    # data in flight, nothing new queued: poll with backoff
                time.sleep(idle_s)
                idle_s = min(idle_s * 2, _POLL_MAX_S)

    def _wait_queue(self, timeout: float | None) -> bool:
        """Block until an item (or a wake-up) is queued, or `timeout`; True when stop() was asked."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return False
        if item is None:
            return True
        if item is not _WAKE:
            self._backlog.append(item)
        return self._take(False)

    def _wait_ready(self, event: Any) -> None:
        """Have the ready waiter block on `event` (a layer still being computed) and wake this
        thread when it completes."""
        if self._waiting_on is event:
            return
        self._waiting_on = event
        if self._ready_waiter is None:
            self._ready_events = queue.SimpleQueue()
            self._ready_waiter = threading.Thread(target=self._wait_events, args=(self._ready_events,),
                                                  name=f"kv-ready-{self.peer}", daemon=True)
            self._ready_waiter.start()
        self._ready_events.put(event)

    def _wait_events(self, events: queue.SimpleQueue) -> None:
        while True:
            event = events.get()
            if event is None:
                return
            try:
                event.synchronize()          # without the GIL
            except Exception:  # noqa: BLE001 - the loop sees the error when it queries it
                pass
            self._queue.put(_WAKE)

    def _take(self, block: bool) -> bool:
        """Move queued items to the backlog; True when stop() was asked."""
        try:
            item = self._queue.get() if block else self._queue.get_nowait()
            while True:
                if item is None:
                    return True
                if item is not _WAKE:
                    self._backlog.append(item)
                item = self._queue.get_nowait()
        except queue.Empty:
            return False

    def _mark(self, what: str, rid: str) -> None:
        trace = self.sender.trace
        if trace is not None:
            trace.append((time.time(), what, rid))

    def _prepare(self, rid: str, all_ready: bool = False) -> None:
        """At begin(): the store lookups (receiver aborted? link still current?) and the block
        index (direct link: the source ids into the arena), off the path of the first layer.
        `all_ready` (a queued `send`): no layer to overlap, the ids go in the frame."""
        rec = self.sender._table.get(rid)
        if rec is None or rec.state.terminal:
            return
        self._mark("send.begin", rid)
        epoch = self.sender.connector.peer_epoch(self.peer)
        self._mark("send.epoch", rid)
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
        if self._direct:                   # the receiver reads them from the arena
            if not all_ready:
                self._upload_ids(rid, rec.spec)
        else:
            self._block_index(rid, rec.spec)
        self._prepared.add(rid)
        self._mark("send.prepared", rid)

    def _verify(self) -> None:
        """After a send_now: is the link still the receiver's? One lookup while its epoch has not
        moved; else the full check, which abandons a stale link (failing what used it, this
        transfer too)."""
        conn = self.sender.connector
        epoch = conn.peer_epoch(self.peer)
        if epoch is not None and epoch == self._epoch_seen:
            return
        if self.link is not None and not conn.is_current(self.link):
            self._abandon_link()
        else:
            self._epoch_seen = epoch

    def _window_full(self) -> bool:
        """Bytes in flight fill the window (a message larger than it still goes alone)."""
        return bool(self._inflight) and self._inflight_bytes >= self.sender.config.window_bytes

    def _send_layers(self, first: tuple) -> None:
        """Send the request's layers that are ready now, from `first` on: as many as the window
        has room for, in messages of up to max_message_bytes (`plan_messages`), announced by one
        control frame, so the receiver posts
        every receive at once and the wire never waits for a frame in between. A queued item
        carries `count` consecutive layers behind one ready event (an all-ready send is one item)."""
        rid, idx = first[1], first[2]
        self._mark("send.pick", rid)
        table, cfg = self.sender._table, self.sender.config
        fresh = idx == 0 and rid not in self._prepared
        known = table.get(rid)
        if known is not None and not known.state.terminal and self._receiver_aborted(known.spec, first=fresh):
            table.finish(rid, TransferState.ABORTED,
                         KVTransferAborted(f"transfer {rid!r} aborted by the receiver"))
        shape = tuple(self.sender.store.block_payload_shape(len(known.spec.src_block_ids))) if known else ()
        layer_bytes = math.prod(shape) * self.sender.store.dtype.itemsize or 1
        per_msg = max(1, cfg.max_message_bytes // layer_bytes)
        room = (cfg.window_bytes - self._inflight_bytes) // layer_bytes if self._inflight else max(
            1, cfg.window_bytes // layer_bytes)
        events: list[Any] = []           # one per layer; more ready layers of the same request join
        item = first
        while room:
            at, ev, n = item[2], item[3], item[4]
            take = min(n, room - len(events))
            events += [ev] * take
            if take < n:                 # the rest waits for room
                self._backlog.appendleft(("layer", rid, at + take, ev, n - take))
                break
            if not (len(events) < room and self._backlog and self._backlog[0][0] == "layer"
                    and self._backlog[0][1] == rid):
                break
            item = self._backlog.popleft()
        staging = self._staging_for(cfg)
        while events:
            parts = plan_messages(len(events), per_msg)
            if not self._inflight or staging.fits([n * layer_bytes for n in parts]):
                break
            keep = len(events) // 2      # the ring's free space is split: send fewer now
            self._requeue(rid, idx + keep, events[keep:])
            del events[keep:]
        if not events:                   # no room until the oldest message is done
            if not room:
                self._backlog.appendleft(first)
            self._complete(wait=True)
            return
        rec = table.start_work(rid, len(parts))
        if rec is None:                  # aborted or failed meanwhile: skip its queued layers
            self._skip_queued(rid)
            self._forget(rid)
            return
        spec, claims, bufs = rec.spec, len(parts), []
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
            self._mark("send.frame", rid)
            at = 0
            for n, (buf, lease) in zip(parts, list(bufs)):   # each send is ordered after its gather
                self._gather(rid, spec, layers[at:at + n], events[at:at + n], buf)
                self._mark(f"send.gathered {n}", rid)
                posted = self._post(link, buf)
                claims -= 1
                bufs.pop(0)
                self._mark(f"send.posted {n}", rid)
                self._inflight.append(_Message(rec, n, posted, buf, lease, time.monotonic(), n * layer_bytes))
                self._inflight_bytes += n * layer_bytes
                self.messages_sent += 1
                at += n
            if idx + len(layers) == spec.num_layers:
                self._forget(rid)
            else:
                self._partial.add(rid)
        finally:
            for _ in range(claims):       # parts never posted (the link broke): give them back
                table.end_work(rec, 0)
            if bufs and self._stream is not None:
                self._stream.synchronize()    # a gather queued into them may still run
            for _buf, lease in reversed(bufs):
                staging.give(lease)

    def _complete(self, wait: bool) -> bool:
        """Retire finished messages, oldest first (NCCL completes them in order); with `wait`,
        block for the oldest. A message past the transfer timeout breaks the link."""
        cfg, table = self.sender.config, self.sender._table
        progressed = False
        while self._inflight:
            msg = self._inflight[0]
            if wait and not progressed:
                msg.op.wait(max(0.0, msg.posted_at + cfg.timeout_s - time.monotonic()))
            elif not msg.op.done():
                if time.monotonic() - msg.posted_at > cfg.timeout_s:
                    raise KVTransferTimeout(f"link to {self.peer!r}: a message of {msg.rec.request_id!r} "
                                            f"was not taken in {cfg.timeout_s:.3g}s")
                return progressed
            self._inflight.popleft()
            self._inflight_bytes -= msg.nbytes
            if self._staging is not None:
                self._staging.give(msg.lease)
            self._mark("send.done", msg.rec.request_id)
            table.end_work(msg.rec, msg.num_layers)
            if msg.last:
                self._release_ids(msg.rec.request_id)
            progressed = True
        return progressed

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

    def _staging_for(self, cfg: KVTransferConfig) -> StagingRing:
        """The message buffers; made again (once idle) when the window was resized."""
        st = self._staging
        if st is None or (st.capacity != cfg.window_bytes and st.idle):
            st = self._staging = StagingRing(cfg.window_bytes, self.sender.store.device)
        return st

    def _block_index(self, rid: str, spec: TransferSpec) -> torch.Tensor:
        index = self._index.get(rid)
        if index is None:                    # gathers run on self._stream, after the copy
            index = self._index[rid] = device_index(self.sender.store, spec.src_block_ids,
                                                    self._index_stream, self._stream, self._pinned)
        return index

    def _post(self, link: PeerLink, data: torch.Tensor) -> Pending:
        if self._stream is None:
            return link.isend_data(data)
        with torch.cuda.stream(self._stream):    # NCCL orders its send after the gather
            return link.isend_data(data)

    def _requeue(self, rid: str, idx: int, events: list[Any]) -> None:
        """Put layers idx.. (one ready event each) back at the front of the backlog, in order."""
        items: list[tuple] = []
        for ev in events:
            if items and items[-1][3] is ev:
                items[-1] = (*items[-1][:4], items[-1][4] + 1)
            else:
                items.append(("layer", rid, idx, ev, 1))
            idx += 1
        self._backlog.extendleft(reversed(items))

    def _skip_queued(self, rid: str) -> None:
        self._backlog = deque(item for item in self._backlog if not (item[0] == "layer" and item[1] == rid))

    def _prune(self) -> None:
        """Idle: drop what begin() prepared for transfers that ended without sending every layer
        (aborted, failed or timed out before the prefill got to them)."""
        table = self.sender._table
        for rid in [r for r in self._index if (rec := table.get(r)) is None or rec.state.terminal]:
            self._forget(rid)
        for rid in [r for r in self._src_ids if (rec := table.get(r)) is None or rec.state.terminal]:
            self._release_ids(rid)        # ended before its last copy (nothing in flight: idle)

    def _forget(self, rid: str) -> None:
        self._partial.discard(rid)
        self._src_sent.discard(rid)
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
            self._abandon_link()              # the peer restarted or rebuilt the pair
        if self.link is None:
            link = conn.connect(self.peer, as_sender=True)
            try:
                self._hello(link)
            except BaseException:
                link.close(broken=True)
                raise
            self.link = link
        return self.link

    def _hello(self, link: PeerLink) -> None:
        """First frame on a new link: offer the receiver a direct copy out of this cache, and
        wait for its answer (once per link; a receiver on another host, or a CPU cache, says no
        and the data goes through the link)."""
        cfg, store = self.sender.config, self.sender.store
        self._direct = False
        share = getattr(store, "share", None)
        if cfg.direct_copy and share is not None and self._acks_handle is None:
            self._cache_handle = share()          # once: every link offers the same mapping
            if self._cache_handle is not None:
                self._acks = torch.zeros(_ACK_CELLS, dtype=torch.long, device=store.device)
                self._acks_handle = share(self._acks)
                self._id_ring = StagingRing(_ID_ARENA_BYTES, store.device)
                self._ids_handle = share(self._id_ring.memory())
        handle = self._cache_handle if cfg.direct_copy else None
        self._links_made += 1
        self._ack_cell = self._links_made % _ACK_CELLS
        self._ack_seen = 0
        link.send_frame({"op": "hello", "cache": handle, "acks": self._acks_handle if handle else None,
                         "ids": self._ids_handle if handle else None, "cell": self._ack_cell,
                         "machine": machine_id()}, cfg.timeout_s)
        if handle is None:
            return
        self._direct, why = link.wait_verdict(cfg.connect_timeout_s)
        if not self._direct:
            log.info("KV sender to %s: no direct copy (%s); the data goes through the link", self.peer, why)

    def _upload_ids(self, rid: str, spec: TransferSpec) -> None:
        """A streamed direct copy's source block ids into the shared arena (at begin(), once per
        transfer), queued on the idle index stream: `_src_ids[rid]` = (offset in ids, count,
        lease, event), or None when the arena is full or the ids overflow a pinned slot (they
        travel in the frame instead)."""
        if rid in self._src_ids:
            return
        ids, ring, entry = spec.src_block_ids, self._id_ring, None
        if ring is not None and ring.fits([8 * len(ids)]):
            buf, lease = ring.take((len(ids),), torch.long)
            self._mark("send.ids slot", rid)
            if self._index_stream is None:
                buf.copy_(torch.as_tensor(ids, dtype=torch.long))
                entry = (lease.start // 8, len(ids), lease, None)
            else:
                with torch.cuda.stream(self._index_stream):
                    host = self._pinned.take(ids, self._index_stream)
                    self._mark("send.ids pinned", rid)
                    if host is not None:
                        buf.copy_(host, non_blocking=True)
                        self._pinned.copied(self._index_stream)
                        event = torch.cuda.Event()
                        event.record(self._index_stream)
                        entry = (lease.start // 8, len(ids), lease, event)
                        self._mark("send.ids queued", rid)
                if entry is None:
                    ring.give(lease)
        self._src_ids[rid] = entry

    def _release_ids(self, rid: str) -> None:
        """The transfer's last copy was acked (or it ended): its arena slot is free again."""
        entry = self._src_ids.pop(rid, None)
        if entry is not None and self._id_ring is not None:
            self._id_ring.give(entry[2])

    def _acked(self, cell: int) -> int:
        """The last seq the receiver acked in `cell` (read only while short of what is asked)."""
        if cell != self._ack_cell or self._acks is None:
            return self._ack_seen
        if self._index_stream is not None:      # idle: the read waits for nothing else
            with torch.cuda.stream(self._index_stream):
                value = int(self._acks[cell].item())
        else:
            value = int(self._acks[cell])
        self._ack_seen = max(self._ack_seen, value)
        return self._ack_seen

    def _send_ready(self) -> bool:
        """Direct copy: announce the head request's layers whose KV is written (their ready
        events complete), as one "ready" frame; the receiver copies them. False while the first
        one is still being computed (the loop polls again)."""
        first = self._backlog[0]
        rid, idx = first[1], first[2]
        if not _event_done(first[3]):
            self._wait_ready(first[3])
            return False
        table, cfg = self.sender._table, self.sender.config
        fresh = idx == 0 and rid not in self._prepared
        link = self._link(fresh=fresh)
        if not self._direct:             # rebuilt, and the new receiver copies through the link
            return True
        self._mark("send.pick", rid)
        known = table.get(rid)
        if known is not None and not known.state.terminal and self._receiver_aborted(known.spec, first=fresh):
            table.finish(rid, TransferState.ABORTED,
                         KVTransferAborted(f"transfer {rid!r} aborted by the receiver"))
        n = self._backlog.popleft()[4]
        while (self._backlog and self._backlog[0][0] == "layer" and self._backlog[0][1] == rid
               and _event_done(self._backlog[0][3])):
            n += self._backlog.popleft()[4]
        rec = table.start_work(rid, 1)
        if rec is None:                  # aborted or failed meanwhile: skip its queued layers
            self._skip_queued(rid)
            self._forget(rid)
            return True
        spec = rec.spec
        layers = list(spec.layers[idx:idx + n])
        frame = {"op": "ready", "rid": rid, "idx": idx, "layers": layers, "seq": self._seq + 1}
        if rid not in self._src_sent:
            # in the arena when begin() put them there while the layers were computed; an
            # all-ready send (send_now) has had no such moment: its ids ride in the frame (2 KiB
            # at 8k tokens), where an upload here would cost a pinned copy, a host-to-device copy
            # and a wait for it before the frame could leave (~0.25 ms, measured)
            ids = self._src_ids.get(rid)
            if ids is None:
                frame["src"] = array("i", spec.src_block_ids).tobytes()
                self.ids_in_frames += 1
            else:
                if ids[3] is not None:
                    ids[3].synchronize()     # in the arena before the receiver reads it
                    self._mark("send.ids there", rid)
                frame["ids_at"], frame["n"] = ids[0], ids[1]
        self._mark("send.frame built", rid)
        try:
            link.send_frame(frame, cfg.timeout_s)
        except BaseException:
            table.end_work(rec, 0)
            raise
        self._seq += 1
        self._src_sent.add(rid)
        self._mark(f"send.ready {n}", rid)
        self._inflight.append(_Message(rec, n, _AckOp(self, self._ack_cell, self._seq), None,
                                       posted_at=time.monotonic(), last=idx + n == spec.num_layers))
        self.messages_sent += 1
        if idx + n == spec.num_layers:
            self._forget(rid)
        else:
            self._partial.add(rid)
        return True

    def _abandon_link(self) -> None:
        """The receiver restarted or gave the pair up, so nothing posted on the link will ever be
        taken: fail the transfers that used it (data in flight, or layers still to come), close it
        (which aborts its communicator, ending the sends waiting on it). Transfers that have not
        sent anything yet go on over the next link."""
        table = self.sender._table
        err = KVTransferError(f"link to {self.peer!r}: the receiver restarted or rebuilt the pair")
        used = {m.rec.request_id for m in self._inflight} | self._partial
        self._drop_link(broken=False)
        for rid in used:
            table.finish(rid, TransferState.FAILED, err)
            self._forget(rid)
        self._partial.clear()

    def _drop_link(self, broken: bool) -> None:
        """Close the link (aborting its communicator) and give back what its messages held."""
        if self.link is not None:
            self.link.close(broken=broken)
            self.link = None
        if self._stream is not None:          # no gather may still read blocks we hand back
            self._stream.synchronize()
        while self._inflight:
            msg = self._inflight.popleft()
            self.sender._table.end_work(msg.rec, 0)
            if self._staging is not None:
                self._staging.give(msg.lease)
        self._inflight_bytes = 0
        self._direct = False
        self._src_sent.clear()
        for rid in list(self._src_ids):   # a receiver still reading the arena reads valid ids
            self._release_ids(rid)

    def _break(self, err: KVTransferError) -> None:
        self.sender._table.fail_peer(self.peer, err)
        self._drop_link(broken=True)
        self._index.clear()
        self._abort_checked.clear()
        self._prepared.clear()
        self._partial.clear()
        self._epoch_seen = None
