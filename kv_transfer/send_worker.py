"""One receiving peer's send thread: it works through what the owner queued for that peer
(`send_queue`), in order, several messages deep (`send_window`), over one link at a time.

The thread owns the link: it connects, and on every new link the direct-copy path offers the
receiver this actor's cache (`DirectSendPath.negotiate`); the receiver's answer picks the link's
data path, the direct copy (`direct_send`) or the streamed path through the link (`streamed_send`).
Before a transfer's first layer it checks the link is still the receiver's and the receiver has
not aborted the transfer (at begin(), off the first layer's path, in one store lookup while the
receiver's epoch is unchanged). Any error fails every unfinished transfer to the peer and drops
the link; a receiver that restarted or gave the pair up fails only the transfers on the old link.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from tandem.kv_transfer.base import KVTransferAborted, KVTransferError, PinnedIndexRing, TransferState
from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.direct_send import DirectSendPath
from tandem.kv_transfer.frames import EndFrame
from tandem.kv_transfer.link import PeerLink
from tandem.kv_transfer.records import TransferRecord
from tandem.kv_transfer.send_queue import BeginItem, LayerItem, SendItem, SendQueue, VerifyItem
from tandem.kv_transfer.send_window import Message, SendWindow
from tandem.kv_transfer.streamed_send import StreamedSendPath

if TYPE_CHECKING:
    from tandem.kv_transfer.sender import LayerStreamSender

log = logging.getLogger(__name__)

_ABORT_CHECK_INTERVAL_S = 0.01   # at most one store lookup per transfer per 10 ms
POLL_MIN_S, POLL_MAX_S = 20e-6, 200e-6   # polling posted messages: backoff while nothing changes
_ACK_POLL_S = 1e-3         # direct copies: how often the acks are read while copies are out


class PeerSendWorker:
    """One thread, one link, one peer: works through the queue in order, several messages deep."""

    def __init__(self, sender: "LayerStreamSender", peer: str):
        self.sender = sender
        self.peer = peer
        self.table = sender._table
        self.store = sender.store_for(peer)   # a peer of another TP size: a head slice
        self.connector = sender.connector
        self.link: PeerLink | None = None
        self.queue = SendQueue()
        self.window = SendWindow()
        self.abort_checked: dict[str, float] = {}
        self.prepared: set[str] = set()            # rids whose link was checked at begin()
        self.partial: set[str] = set()             # rids with layers sent on this link, more to come
        self.epoch_seen: Any = None                # the peer's epoch at the last full check
        self.stream = self.index_stream = None     # CUDA: gathers and NCCL sends; block-id copies
        self.pinned: PinnedIndexRing | None = None
        self.messages_sent = 0
        self.streamed = StreamedSendPath(self)
        self.direct = DirectSendPath(self)
        # held while the thread works (never while it waits), so an owner's send_now can take
        # the thread's place for a moment
        self.lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"kv-send-{peer}", daemon=True)
        self._thread.start()

    @property
    def config(self) -> KVTransferConfig:
        return self.sender.config

    def put(self, item: SendItem) -> None:
        self.queue.put(item)

    def stop(self) -> None:
        self.queue.put(None)
        self.direct.stop()
        self._thread.join(timeout=5)
        if self.link is not None:
            self.link.close(broken=False)

    def mark(self, what: str, rid: str) -> None:
        trace = self.sender.trace
        if trace is not None:
            trace.append((time.time(), what, rid))

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        device = self.store.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
            self.stream = torch.cuda.Stream(device)         # gathers, then NCCL sends
            self.index_stream = torch.cuda.Stream(device)   # block-id copies only: kept idle
            self.pinned = PinnedIndexRing()
        stopping, idle_s = False, POLL_MIN_S
        while not (stopping and not self.queue.backlog and not self.window.messages):
            # Block only when there is nothing to send and nothing to watch.
            block = not self.queue.backlog and not self.window.messages and not stopping
            if block:
                with self.lock:
                    self._prune()
            stopping |= self.queue.take(block)
            with self.lock:
                progressed = self._step_guarded()
            if progressed:
                idle_s = POLL_MIN_S
            elif self.direct.active and not stopping:
                # direct copies: the next layer's readiness comes from the ready waiter and new
                # work through the queue, both waking this thread; acks (which only release the
                # source blocks) are read at a slow pace. No busy polling: every wake-up takes the
                # GIL from the owner (a prefill launching its layers) for a switch interval.
                stopping |= self.queue.wait(_ACK_POLL_S if self.window.messages else None)
            else:                     # data in flight, nothing new queued: poll with backoff
                time.sleep(idle_s)
                idle_s = min(idle_s * 2, POLL_MAX_S)

    def _step_guarded(self) -> bool:
        try:
            return self._step()
        except KVTransferError as err:
            self.break_link(err)
        except Exception as exc:  # noqa: BLE001 - a bug or a failed allocation: this peer's
            log.exception("KV sender to %s failed", self.peer)   # transfers fail, the thread lives
            self.break_link(KVTransferError(f"sender to {self.peer!r} failed: {type(exc).__name__}: {exc}"))
        return True

    def _step(self) -> bool:
        """Retire what completed, then send the head of the backlog on the link's data path (or
        act on a control item)."""
        progressed = self.retire(wait=False)
        head = self.queue.head()
        if isinstance(head, LayerItem):
            path = self.direct if self.direct.takes(head) else self.streamed
            return path.send_next(head) or progressed
        if head is None:
            return progressed
        item = self.queue.backlog.popleft()
        if isinstance(item, BeginItem):
            self._prepare(item.rid, all_ready=item.all_ready)
        elif isinstance(item, VerifyItem):
            self._verify()
        else:       # EndItem; frames are FIFO: the peer has seen every layer frame before it
            self.send_end(*item)
        return True

    def retire(self, wait: bool) -> bool:
        """Retire finished messages, oldest first (NCCL completes them in order); with `wait`,
        block for the oldest. A message past the transfer timeout breaks the link."""
        return self.window.retire(wait, self.config.timeout_s, self.peer, self._retired)

    def _retired(self, msg: Message) -> None:
        self.streamed.give(msg.lease)
        self.mark("send.done", msg.rec.request_id)
        self.table.end_work(msg.rec, msg.num_layers)
        self.direct.retired(msg)

    def send_end(self, rid: str, state: str, reason: str) -> None:
        if self.link is not None:   # no link: the peer never heard of the transfer from us
            self.link.send_frame(EndFrame(rid, state, reason[:200]).to_msg(), self.config.timeout_s)

    # ---- transfers ----------------------------------------------------------------------------
    def _prepare(self, rid: str, all_ready: bool = False) -> None:
        """At begin(): the store lookups (receiver aborted? link still current?) and the block
        index (direct link: the source ids into the arena), off the path of the first layer.
        `all_ready` (a queued `send`): no layer to overlap, the ids go in the frame."""
        rec = self.table.get(rid)
        if rec is None or rec.state.terminal:
            return
        self.mark("send.begin", rid)
        epoch = self.connector.peer_epoch(self.peer)
        self.mark("send.epoch", rid)
        if epoch is not None and self.link is not None and epoch == self.epoch_seen:
            # one lookup instead of three: the receiver has not restarted, broken the pair or
            # posted an abort since the last full check (an abort of this request posted before
            # that check is missed here; the receiver drops the data, as it does any late data)
            self.abort_checked[rid] = time.monotonic()
        else:
            if self._receiver_aborted(rec.spec, first=True):
                self.table.finish(rid, TransferState.ABORTED,
                                  KVTransferAborted(f"transfer {rid!r} aborted by the receiver"))
                return
            self.link_for(fresh=True)
            self.epoch_seen = epoch
        (self.direct if self.direct.active else self.streamed).prepare(rid, rec.spec, all_ready)
        self.prepared.add(rid)
        self.mark("send.prepared", rid)

    def _verify(self) -> None:
        """After a send_now: is the link still the receiver's? One lookup while its epoch has not
        moved; else the full check, which abandons a stale link (failing what used it, this
        transfer too)."""
        epoch = self.connector.peer_epoch(self.peer)
        if epoch is not None and epoch == self.epoch_seen:
            return
        if self.link is not None and not self.connector.is_current(self.link):
            self._abandon_link()
        else:
            self.epoch_seen = epoch

    def check_aborted(self, rid: str, fresh: bool) -> TransferRecord | None:
        """Before a message: has the receiver aborted the transfer (out of band)? Then it ends
        ABORTED here. Returns its record as it was looked up (None: unknown)."""
        known = self.table.get(rid)
        if known is not None and not known.state.terminal and self._receiver_aborted(known.spec, first=fresh):
            self.table.finish(rid, TransferState.ABORTED,
                              KVTransferAborted(f"transfer {rid!r} aborted by the receiver"))
        return known

    def _receiver_aborted(self, spec: TransferSpec, first: bool) -> bool:
        now = time.monotonic()
        last = self.abort_checked.get(spec.request_id)
        if not first and last is not None and now - last < _ABORT_CHECK_INTERVAL_S:
            return False
        self.abort_checked[spec.request_id] = now
        conn = self.connector
        if conn.abort_posted(spec.sender_id, spec.receiver_id, spec.request_id):
            conn.clear_abort(spec.sender_id, spec.receiver_id, spec.request_id)
            return True
        return False

    def sent(self, rid: str, last: bool) -> None:
        """Layers of `rid` went out: the last of them (forget it), or more to come."""
        if last:
            self.forget(rid)
        else:
            self.partial.add(rid)

    def forget(self, rid: str) -> None:
        self.partial.discard(rid)
        self.direct.forget(rid)
        self.streamed.forget(rid)
        self.abort_checked.pop(rid, None)
        self.prepared.discard(rid)

    def _prune(self) -> None:
        """Idle: drop what begin() prepared for transfers that ended without sending every layer
        (aborted, failed or timed out before the prefill got to them)."""
        for rid in [r for r in self.streamed.index if self._ended(r)]:
            self.forget(rid)
        for rid in [r for r in self.direct.arena if self._ended(r)]:
            self.direct.release_ids(rid)   # ended before its last copy (nothing in flight: idle)

    def _ended(self, rid: str) -> bool:
        rec = self.table.get(rid)
        return rec is None or rec.state.terminal

    # ---- the link -----------------------------------------------------------------------------
    def link_for(self, fresh: bool) -> PeerLink:
        """The link, made now if there is none; `fresh` (a transfer's first message): a link the
        receiver no longer uses is abandoned first."""
        if self.link is not None and fresh and not self.connector.is_current(self.link):
            self._abandon_link()              # the peer restarted or rebuilt the pair
        if self.link is None:
            link = self.connector.connect(self.peer, as_sender=True)
            try:
                self.direct.negotiate(link)
            except BaseException:
                link.close(broken=True)
                raise
            self.link = link
        return self.link

    def _abandon_link(self) -> None:
        """The receiver restarted or gave the pair up, so nothing posted on the link will ever be
        taken: fail the transfers that used it (data in flight, or layers still to come), close it
        (which aborts its communicator, ending the sends waiting on it). Transfers that have not
        sent anything yet go on over the next link."""
        err = KVTransferError(f"link to {self.peer!r}: the receiver restarted or rebuilt the pair")
        used = {m.rec.request_id for m in self.window.messages} | self.partial
        self._drop_link(broken=False)
        for rid in used:
            self.table.finish(rid, TransferState.FAILED, err)
            self.forget(rid)
        self.partial.clear()

    def _drop_link(self, broken: bool) -> None:
        """Close the link (aborting its communicator) and give back what its messages held."""
        if self.link is not None:
            self.link.close(broken=broken)
            self.link = None
        if self.stream is not None:          # no gather may still read blocks we hand back
            self.stream.synchronize()
        for msg in self.window.drain():
            self.table.end_work(msg.rec, 0)
            self.streamed.give(msg.lease)
        self.direct.link_dropped()

    def break_link(self, err: KVTransferError) -> None:
        self.table.fail_peer(self.peer, err)
        self._drop_link(broken=True)
        self.streamed.index.clear()
        self.abort_checked.clear()
        self.prepared.clear()
        self.partial.clear()
        self.epoch_seen = None
