"""The direct-copy data path of a send thread (`KVTransferConfig.direct_copy`): when the receiver
could map this actor's cache (same host, CUDA IPC over NVLink), no data goes through the link.

On every new link `negotiate` sends the "hello" (handles of this actor's cache, ack cells and
block-id arena; None where the cache cannot be shared) and waits for the receiver's verdict, which
picks the link's data path. On a direct link a "ready" frame tells the receiver which layers are
written; it copies them block to block, out of this cache into its own, with one kernel that
reads the source block ids from this actor's id arena (a streamed transfer's, uploaded at begin()
while the prefill computes) or from its own device (an all-ready send's, which ride in the frame:
uploading them first would delay the frame by a copy and a wait), then writes the frame's `seq`
into this actor's ack cell (device memory it mapped, one cell per link), stream-ordered behind the
copy. A message is complete once its `seq` is acked: only then does this side stop holding the
source blocks. The receiver only ever reads this cache and writes its own, so a late or aborted
copy can never touch memory either side has reused.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from array import array
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from tandem.kv_transfer.base import KVTransferError, KVTransferTimeout, StagingRing, machine_id
from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.frames import Hello, ReadyFrame
from tandem.kv_transfer.link import PeerLink
from tandem.kv_transfer.send_queue import LayerItem, VerifyItem
from tandem.kv_transfer.send_window import Message

if TYPE_CHECKING:
    from tandem.kv_transfer.send_worker import PeerSendWorker

log = logging.getLogger(__name__)

_ACK_CELLS = 64     # one per link in turn: a receiver still acking on an old link writes its own
_ID_ARENA_BYTES = 4 << 20   # source block ids of the transfers in flight (512 K ids)
_POLL_MIN_S, _POLL_MAX_S = 20e-6, 200e-6   # waiting for an ack: backoff while nothing changes


def event_done(event: Any) -> bool:
    return event is None or event.query()


class ArenaEntry(NamedTuple):
    """A streamed transfer's source block ids in the shared arena."""
    offset: int                   # in ids (int64)
    count: int
    lease: StagingRing.Lease
    uploaded: Any                 # CUDA event recorded after the upload (None: on CPU, done)


class AckOp:
    """A direct copy's completion: the receiver wrote `seq` (or a later one) into the link's ack
    cell, which this side reads from a stream it keeps idle (a few microseconds)."""

    def __init__(self, path: "DirectSendPath", cell: int, seq: int):
        self.path, self.cell, self.seq = path, cell, seq

    def done(self) -> bool:
        return self.path.acked(self.cell) >= self.seq

    def wait(self, timeout: float | None) -> None:
        deadline = time.monotonic() + (timeout if timeout is not None else 7 * 24 * 3600.0)
        idle_s = _POLL_MIN_S
        while not self.done():
            if time.monotonic() > deadline:
                raise KVTransferTimeout(f"link to {self.path.worker.peer!r}: copy #{self.seq} not acked "
                                        f"in {timeout:.3g}s")
            time.sleep(idle_s)
            idle_s = min(idle_s * 2, _POLL_MAX_S)

    def order_current_stream(self) -> bool:
        return False


class DirectSendPath:
    def __init__(self, worker: "PeerSendWorker"):
        self.worker = worker
        self.active = False            # this link's receiver copies out of our cache
        # the ack cells (kept for the worker's life: a receiver may write one after we dropped
        # its link), the link's cell, the last seq sent and the last ack read
        self.acks: torch.Tensor | None = None
        self.acks_handle: bytes | None = None
        self.cache_handle: bytes | None = None
        self.id_ring: StagingRing | None = None
        self.ids_handle: bytes | None = None
        self.arena: dict[str, ArenaEntry | None] = {}   # None: the ids go in the frame
        self.ack_cell = -1
        self.seq = 0
        self.ack_seen = 0
        self.links_made = 0
        self.src_sent: set[str] = set()    # rids whose source block ids this link's receiver has
        self.ids_in_frames = 0   # copies whose source ids went in the frame (all ready, or arena full)
        self._ready_waiter: threading.Thread | None = None   # blocks on layer events
        self._ready_events: queue.SimpleQueue | None = None
        self._waiting_on: Any = None

    def takes(self, head: LayerItem) -> bool:
        """Is the next layer item this path's? (A transfer that started streaming on this link
        goes on streaming.)"""
        return self.active and (head.rid not in self.worker.partial or head.rid in self.src_sent)

    def negotiate(self, link: PeerLink) -> None:
        """First frame on a new link: offer the receiver a direct copy out of this cache, and
        wait for its answer (once per link; a receiver on another host, or a CPU cache, says no
        and the data goes through the link)."""
        cfg, store = self.worker.config, self.worker.store
        self.active = False
        if cfg.direct_copy and self.acks_handle is None:
            self.cache_handle = store.share()          # once: every link offers the same mapping
            if self.cache_handle is not None:
                self.acks = torch.zeros(_ACK_CELLS, dtype=torch.long, device=store.device)
                self.acks_handle = store.share(self.acks)
                self.id_ring = StagingRing(_ID_ARENA_BYTES, store.device)
                self.ids_handle = store.share(self.id_ring.memory())
        handle = self.cache_handle if cfg.direct_copy else None
        self.links_made += 1
        self.ack_cell = self.links_made % _ACK_CELLS
        self.ack_seen = 0
        link.send_frame(Hello(handle, self.acks_handle if handle else None, self.ids_handle if handle else None,
                              self.ack_cell, machine_id()).to_msg(), cfg.timeout_s)
        if handle is None:
            return
        self.active, why = link.wait_verdict(cfg.connect_timeout_s)
        if not self.active:
            log.info("KV sender to %s: no direct copy (%s); the data goes through the link",
                     self.worker.peer, why)

    def prepare(self, rid: str, spec: TransferSpec, all_ready: bool) -> None:
        if not all_ready:                # the receiver reads them from the arena
            self.upload_ids(rid, spec)

    def upload_ids(self, rid: str, spec: TransferSpec) -> None:
        """A streamed direct copy's source block ids into the shared arena (at begin(), once per
        transfer), queued on the idle index stream: `arena[rid]`, or None when the arena is full
        or the ids overflow a pinned slot (they travel in the frame instead)."""
        if rid in self.arena:
            return
        w = self.worker
        ids, ring, entry = spec.src_block_ids, self.id_ring, None
        if ring is not None and ring.fits([8 * len(ids)]):
            buf, lease = ring.take((len(ids),), torch.long)
            w.mark("send.ids slot", rid)
            if w.index_stream is None:
                buf.copy_(torch.as_tensor(ids, dtype=torch.long))
                entry = ArenaEntry(lease.start // 8, len(ids), lease, None)
            else:
                with torch.cuda.stream(w.index_stream):
                    host = w.pinned.take(ids, w.index_stream)
                    w.mark("send.ids pinned", rid)
                    if host is not None:
                        buf.copy_(host, non_blocking=True)
                        w.pinned.copied(w.index_stream)
                        event = torch.cuda.Event()
                        event.record(w.index_stream)
                        entry = ArenaEntry(lease.start // 8, len(ids), lease, event)
                        w.mark("send.ids queued", rid)
                if entry is None:
                    ring.give(lease)
        self.arena[rid] = entry

    def release_ids(self, rid: str) -> None:
        """The transfer's last copy was acked (or it ended): its arena slot is free again."""
        entry = self.arena.pop(rid, None)
        if entry is not None and self.id_ring is not None:
            self.id_ring.give(entry.lease)

    def retired(self, msg: Message) -> None:
        if msg.last:
            self.release_ids(msg.rec.request_id)

    def acked(self, cell: int) -> int:
        """The last seq the receiver acked in `cell` (read only while short of what is asked)."""
        if cell != self.ack_cell or self.acks is None:
            return self.ack_seen
        index_stream = self.worker.index_stream
        if index_stream is not None:       # idle: the read waits for nothing else
            with torch.cuda.stream(index_stream):
                value = int(self.acks[cell].item())
        else:
            value = int(self.acks[cell])
        self.ack_seen = max(self.ack_seen, value)
        return self.ack_seen

    def send_next(self, head: LayerItem) -> bool:
        """Announce the head request's layers whose KV is written (their ready events complete),
        as one "ready" frame; the receiver copies them. False while the first one is still being
        computed (the loop polls again)."""
        w = self.worker
        rid, idx = head.rid, head.idx
        if not event_done(head.ready):
            self._wait_ready(head.ready)
            return False
        fresh = idx == 0 and rid not in w.prepared
        link = w.link_for(fresh=fresh)
        if not self.active:              # rebuilt, and the new receiver copies through the link
            return True
        w.mark("send.pick", rid)
        w.check_aborted(rid, fresh)
        n = self._take_ready(rid)
        rec = w.table.start_work(rid, 1)
        if rec is None:                  # aborted or failed meanwhile: skip its queued layers
            w.queue.skip(rid)
            w.forget(rid)
            return True
        spec = rec.spec
        frame = self._ready_frame(spec, idx, n)
        w.mark("send.frame built", rid)
        try:
            link.send_frame(frame.to_msg(), w.config.timeout_s)
        except BaseException:
            w.table.end_work(rec, 0)
            raise
        self.seq += 1
        self.src_sent.add(rid)
        w.mark(f"send.ready {n}", rid)
        last = idx + n == spec.num_layers
        w.window.add(Message(rec, n, AckOp(self, self.ack_cell, self.seq), None,
                             posted_at=time.monotonic(), last=last))
        w.messages_sent += 1
        w.sent(rid, last=last)
        return True

    def _take_ready(self, rid: str) -> int:
        """Take the head item and the queued items of the same request already written off the
        backlog: how many layers they hold."""
        backlog = self.worker.queue.backlog
        n = backlog.popleft().count
        while (backlog and isinstance(backlog[0], LayerItem) and backlog[0].rid == rid
               and event_done(backlog[0].ready)):
            n += backlog.popleft().count
        return n

    def _ready_frame(self, spec: TransferSpec, idx: int, n: int) -> ReadyFrame:
        rid = spec.request_id
        layers = list(spec.layers[idx:idx + n])
        if rid in self.src_sent:
            return ReadyFrame(rid, idx, layers, self.seq + 1)
        # in the arena when begin() put them there while the layers were computed; an all-ready
        # send (send_now) has had no such moment: its ids ride in the frame (2 KiB at 8k tokens),
        # where an upload here would cost a pinned copy, a host-to-device copy and a wait for it
        # before the frame could leave (~0.25 ms, measured)
        entry = self.arena.get(rid)
        if entry is None:
            self.ids_in_frames += 1
            return ReadyFrame(rid, idx, layers, self.seq + 1, src=array("i", spec.src_block_ids).tobytes())
        if entry.uploaded is not None:
            entry.uploaded.synchronize()     # in the arena before the receiver reads it
            self.worker.mark("send.ids there", rid)
        return ReadyFrame(rid, idx, layers, self.seq + 1, ids_at=entry.offset, n=entry.count)

    def send_now(self, spec: TransferSpec, ready: Any) -> bool:
        """Owner's thread, all layers of a registered transfer ready: announce them on this
        direct link right here (one frame, the source ids in it), instead of handing them to the
        transport's thread, whose wake-up and every GIL hand-over on the way (each up to a switch
        interval behind a busy owner) come before the copy can start; the link is verified after
        (a VerifyItem, on the thread). False, having done nothing, unless the link is up and
        direct, nothing is queued or being worked on for this peer, and the layers are written;
        the caller then queues the transfer."""
        w = self.worker
        if not (self.active and w.queue.idle() and event_done(ready)):
            return False
        if not w.lock.acquire(timeout=0.001):
            return False
        try:
            on_cuda = w.store.device.type == "cuda"
            if not self.active or w.link is None or (on_cuda and w.pinned is None):
                return False
            if not w.queue.idle():
                return False
            rid = spec.request_id
            w.mark("send.now", rid)
            w.abort_checked[rid] = time.monotonic()
            w.prepared.add(rid)
            w.queue.backlog.append(LayerItem(rid, 0, None, spec.num_layers))
            try:
                self.send_next(w.queue.backlog[0])
            except KVTransferError as err:   # as on the thread: the peer's transfers fail
                w.break_link(err)
            except Exception as exc:  # noqa: BLE001
                log.exception("KV sender to %s failed", w.peer)
                w.break_link(KVTransferError(f"sender to {w.peer!r} failed: {type(exc).__name__}: {exc}"))
            # the epoch check (a store round trip) comes after the frame, on the thread: a receiver
            # restarted meanwhile fails this transfer with the old link, instead of delaying all
            w.queue.put(VerifyItem(rid))
            return True
        finally:
            w.lock.release()
            w.queue.wake()               # the thread watches the copy's ack

    def _wait_ready(self, event: Any) -> None:
        """Have the ready waiter block on `event` (a layer still being computed) and wake the
        send thread when it completes."""
        if self._waiting_on is event:
            return
        self._waiting_on = event
        if self._ready_waiter is None:
            self._ready_events = queue.SimpleQueue()
            self._ready_waiter = threading.Thread(target=self._wait_events, args=(self._ready_events,),
                                                  name=f"kv-ready-{self.worker.peer}", daemon=True)
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
            self.worker.queue.wake()

    def link_dropped(self) -> None:
        self.active = False
        self.src_sent.clear()
        for rid in list(self.arena):   # a receiver still reading the arena reads valid ids
            self.release_ids(rid)

    def forget(self, rid: str) -> None:
        self.src_sent.discard(rid)

    def stop(self) -> None:
        if self._ready_events is not None:
            self._ready_events.put(None)
