"""One sending peer's receive threads: a frame reader that keeps a control-frame receive posted and
acts on each frame at once, and a loop thread that accounts what the reader started and retires
messages as they land, oldest first.

The reader hands each frame to the link's data path: a "hello" to the direct-copy path, which maps
the sender's cache if it can and answers (`direct_recv`); a "layers" frame to the streamed path,
which posts its receives into staging (`streamed_recv`); a "ready" frame to the direct-copy path,
which queues the copy and the ack. The loop then accounts them as `Landing`s (on CUDA a scatter or
copy is stream-ordered, and a waiter thread blocks on its event and wakes the loop), counts the
layers of each landed message, and gives back its staging and its claim on the blocks.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from tandem.kv_transfer.base import KVTransferAborted, KVTransferError, KVTransferTimeout, PinnedIndexRing, TransferState, device_index
from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.direct_recv import DirectRecvPath
from tandem.kv_transfer.frames import EndFrame, Hello, LayersFrame, ReadyFrame, parse_frame
from tandem.kv_transfer.link import PeerLink
from tandem.kv_transfer.recv_items import CopiedItem, Landing, PostedItem, PrepareItem
from tandem.kv_transfer.records import TransferRecord
from tandem.kv_transfer.streamed_recv import StreamedRecvPath

if TYPE_CHECKING:
    from tandem.kv_transfer.receiver import LayerStreamReceiver

log = logging.getLogger(__name__)

_POLL_MIN_S, _POLL_MAX_S = 20e-6, 200e-6   # polling landing messages: backoff while nothing changes
_WATCHED_S = 0.01          # while every landing has a waiter: wake only to check for a timeout
_LANDED = object()         # the landing waiter's wake-up


class PeerRecvLoop:
    """One thread reading one peer's link until it breaks or the receiver closes."""

    def __init__(self, receiver: "LayerStreamReceiver", peer: str):
        self.receiver = receiver
        self.peer = peer
        self.table = receiver._table
        self.store = receiver.store_for(peer)   # a peer of another TP size: a head slice
        self.link: PeerLink | None = None
        self.stopping = False
        self.broken = False
        self.stream = self.recv_stream = None      # CUDA: scatters and copies; receive posts
        self.pinned: PinnedIndexRing | None = None
        self.reader_pinned: PinnedIndexRing | None = None   # the frame reader's
        self.landings: deque[Landing] = deque()
        self.index: dict[str, torch.Tensor] = {}    # rid -> dst block index on the device
        self.streamed = StreamedRecvPath(self)
        self.direct = DirectRecvPath(self)
        # items from the reader thread (posted messages, queued copies, frames), link errors,
        # PrepareItems from expect()
        self.frames: queue.SimpleQueue = queue.SimpleQueue()
        self._watch: queue.SimpleQueue | None = None   # CUDA: events for the landing waiter
        self._thread = threading.Thread(target=self._run, name=f"kv-recv-{peer}", daemon=True)
        self._thread.start()

    def prepare(self, spec: TransferSpec) -> None:
        """expect() was called: copy the destination block ids to the device while this thread is
        idle, not when the first message's scatter is queued."""
        self.frames.put(PrepareItem(spec))

    def stop(self) -> None:
        """Does not wait: a gloo receive posted while idle only returns when the peer closes or
        the process exits (the thread is a daemon); the fake link wakes it at once."""
        self.stopping = True
        if self._watch is not None:
            self._watch.put(None)
        if self.link is not None:
            self.link.close(broken=False)
        self._thread.join(timeout=0.1)

    def mark(self, what: str, rid: str) -> None:
        trace = self.receiver.trace
        if trace is not None:
            trace.append((time.time(), what, rid))

    def on_stream(self, stream=None):
        stream = stream or self.stream
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    # ---- the loop thread ----------------------------------------------------------------------
    def _run(self) -> None:
        if self.store.device.type == "cuda":
            torch.cuda.set_device(self.store.device)
            self.stream = torch.cuda.Stream(self.store.device)         # scatters
            self.recv_stream = torch.cuda.Stream(self.store.device)    # posts receives; block-id copies only
            self.pinned = PinnedIndexRing()
            self.reader_pinned = PinnedIndexRing()
            self._watch = queue.SimpleQueue()
            threading.Thread(target=self._wait_landings, args=(self._watch,), daemon=True,
                             name=f"kv-landing-{self.peer}").start()
        try:
            self.link = self.receiver.connector.connect(self.peer, as_sender=False)
            threading.Thread(target=self._read_frames, args=(self.link, self.frames), daemon=True,
                             name=f"kv-frames-{self.peer}").start()
            self._serve()
        except Exception as exc:  # noqa: BLE001 - the link, or a bug / failed allocation here
            self.broken = True
            self._take_queued_copies()
            err = exc if isinstance(exc, KVTransferError) else KVTransferError(
                f"receiver from {self.peer!r} failed: {type(exc).__name__}: {exc}")
            if not isinstance(exc, KVTransferError):
                log.exception("KV receiver from %s failed", self.peer)
            if self.link is not None:
                self.link.close(broken=not self.stopping)
            self._abandon_landings()
            self.receiver._loop_ended(self, err)

    def _serve(self) -> None:
        idle_s = _POLL_MIN_S
        while not self.stopping:
            # A frame wakes this thread at once; while data is landing it also wakes to poll.
            if not self.landings:
                self._prune()
            if not self.landings:
                timeout = None
            elif all(landing.watched for landing in self.landings):
                timeout = _WATCHED_S
            else:
                timeout = idle_s
            try:
                item = self.frames.get(timeout=timeout)
            except queue.Empty:
                item = None
            if isinstance(item, KVTransferError):
                raise item
            if isinstance(item, PrepareItem):
                self._prepare(item.spec)
            elif item is _LANDED:
                item = None
            elif item is not None:
                self._handle(item)
            if self._land(wait=False) or item is not None:
                idle_s = _POLL_MIN_S
            else:
                idle_s = min(idle_s * 2, _POLL_MAX_S)

    def _handle(self, item: Any) -> None:
        if isinstance(item, CopiedItem):
            self.direct.track_copy(item)
        elif isinstance(item, PostedItem):
            self.streamed.track_posted(item)
        elif isinstance(item, EndFrame):
            self._end(item)
        else:
            raise KVTransferError(f"unknown control frame {item.get('op')!r} from {self.peer!r}")

    def _end(self, frame: EndFrame) -> None:
        rid, table = frame.rid, self.table
        reason = f"transfer {rid!r}: {frame.reason}"
        with self.receiver._lock:
            rec = table.get(rid)
            if rec is None:
                self.receiver._note_early(rid, f"the sender ended it ({reason})")
            elif rec.peer == self.peer and frame.state == "aborted":
                table.finish(rid, TransferState.ABORTED, KVTransferAborted(reason))
            elif rec.peer == self.peer:
                table.finish(rid, TransferState.FAILED, KVTransferError(reason))
        self.forget(rid)

    def _take_queued_copies(self) -> None:
        """The link ended: account the direct copies the frame reader queued that the loop has
        not seen, so their claims on the blocks are handed back with the rest."""
        while True:
            try:
                item = self.frames.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, CopiedItem):
                self.direct.track_copy(item)

    def _wait_landings(self, events: queue.SimpleQueue) -> None:
        """CUDA: block (without the GIL) on each landing's last event in turn and wake the loop as
        it completes, so a landing is seen at once instead of at the next poll."""
        while True:
            event = events.get()
            if event is None:
                return
            try:
                event.synchronize()
            except Exception:  # noqa: BLE001 - the loop sees the error when it polls the landing
                pass
            self.frames.put(_LANDED)

    def watch(self, landing: Landing) -> None:
        """Have the landing waiter wake the loop once `landing`'s scatter or copy completes."""
        if self._watch is not None and landing.event is not None:
            landing.watched = True
            self._watch.put(landing.event)

    def _prepare(self, spec: TransferSpec) -> None:
        rec = self.table.get(spec.request_id)
        if rec is not None and not rec.state.terminal and spec.request_id not in self.index:
            self.index[spec.request_id] = device_index(self.store, spec.dst_block_ids,
                                                       self.recv_stream, self.stream, self.pinned)

    def _prune(self) -> None:
        """Idle: drop block indexes of transfers that ended before their data came."""
        for rid in [r for r in {**self.index, **self.direct.src_index}
                    if (rec := self.table.get(r)) is None or rec.state.terminal]:
            self.forget(rid)

    def claim(self, rid: str, end: int, start_work: bool) -> TransferRecord | None:
        """The transfer a message of layers ..`end` belongs to, with a claim on its blocks when
        `start_work` (else only if it is live); None for one that is gone (or not known yet)."""
        table = self.table
        with self.receiver._lock:
            rec = table.start_work(rid) if start_work else table.live(rid)
            if rec is None:
                known = table.get(rid)
                if known is None:
                    self.receiver._note_early(rid, "its KV arrived")
                elif end == known.spec.num_layers:   # the sender is done with it
                    self.clear_abort(known.spec)
        return rec

    def fail(self, rid: str, problem: str) -> None:
        self.table.finish(rid, TransferState.FAILED, KVTransferError(f"transfer {rid!r}: {problem}"))

    # ---- the frame reader thread --------------------------------------------------------------
    def _read_frames(self, link: PeerLink, frames: queue.SimpleQueue) -> None:
        """Keeps a control-frame receive posted and, for a "layers" frame, posts every part's
        receive right here, so the wire never waits for the loop thread (busy queueing scatters,
        or waiting for the GIL behind the engine); the loop then accounts the posted parts."""
        if self.stream is not None:     # direct copies and their acks: queued from this thread
            torch.cuda.set_device(self.store.device)
            torch.cuda.set_stream(self.stream)
        try:
            while not self.stopping:
                frame = parse_frame(link.recv_frame(None))
                if isinstance(frame, LayersFrame):
                    frames.put(self.streamed.post_receives(link, frame))
                elif isinstance(frame, Hello):
                    self.direct.open_peer(link, frame)      # (re)mapped, or not
                elif isinstance(frame, ReadyFrame):
                    frames.put(self.direct.launch_copy(frame))
                else:
                    if isinstance(frame, EndFrame):
                        self.mark("recv.frame end", frame.rid)
                    else:
                        self.mark(f"recv.frame {frame.get('op')}", frame.get("rid", ""))
                    frames.put(frame)
        except KVTransferError as err:
            frames.put(err)
        except Exception as exc:  # noqa: BLE001 - a bug or a failed allocation: the link fails
            log.exception("KV receiver from %s failed posting receives", self.peer)
            frames.put(KVTransferError(f"receiver from {self.peer!r} failed: {type(exc).__name__}: {exc}"))

    # ---- landings -----------------------------------------------------------------------------
    def _land(self, wait: bool) -> bool:
        """Retire landed messages, oldest first; with `wait`, block for the oldest. Past the
        transfer timeout, a message that has not landed breaks the link."""
        cfg = self.receiver.config
        progressed = False
        while self.landings:
            landing = self.landings[0]
            if wait and not progressed:
                landing.op.wait(cfg.timeout_s)
                if landing.event is not None:
                    landing.event.synchronize()
            elif not self._landed(landing):
                if time.monotonic() - landing.posted_at > cfg.timeout_s:
                    raise KVTransferTimeout(f"link to {self.peer!r}: a message of {landing.rid!r} "
                                            f"did not land in {cfg.timeout_s:.3g}s")
                return progressed
            self._retire(self.landings.popleft())
            progressed = True
        return progressed

    @staticmethod
    def _landed(landing: Landing) -> bool:
        return landing.op.done() and (landing.event is None or landing.event.query())

    def _retire(self, landing: Landing) -> None:
        """Count the landed message's layers and give back its claim on the blocks (also when
        the scatter raises: the claim must not outlive the message)."""
        try:
            self._retire_landed(landing)
        finally:                             # landed and scattered: its buffer is free again
            self.streamed.give(landing.lease)

    def _retire_landed(self, landing: Landing) -> None:
        moved, rec, table, timeout_s = 0, landing.rec, self.table, self.receiver.config.timeout_s
        self.mark("recv.landed", landing.rid)
        if rec is not None and not landing.claimed:      # CPU: claim the blocks to scatter
            rec = table.start_work(landing.rid)
            if rec is not landing.rec:   # it ended meanwhile: the blocks are not ours to write
                if rec is not None:
                    table.end_work(rec, 0)
                self.forget(landing.rid)
                return
        try:
            if landing.direct and rec is not None and time.monotonic() - landing.posted_at > timeout_s:
                table.finish(landing.rid, TransferState.FAILED, KVTransferTimeout(
                    f"transfer {landing.rid!r}: the copy out of {self.peer!r} completed after "
                    f"{timeout_s:.3g}s, when the sender may have reused its blocks"))
            elif landing.layers and landing.event is None and not landing.direct:   # CPU: scatter now
                self.streamed.scatter(landing)
                moved = len(landing.layers)
            else:
                moved = len(landing.layers)
        finally:
            if rec is not None:
                table.end_work(rec, moved, table.clock() + timeout_s)
                if rec.state.terminal:
                    self.forget(landing.rid)

    def _abandon_landings(self) -> None:
        """The link broke: keep what had fully arrived before it did, then hand the rest of the
        blocks back once no scatter can still write them."""
        try:
            while self.landings and self._landed(self.landings[0]):
                self._retire(self.landings.popleft())
        except Exception:  # noqa: BLE001 - what is left is handed back below
            pass
        if self.stream is not None:
            try:
                self.stream.synchronize()
            except Exception:
                pass
        while self.landings:
            landing = self.landings.popleft()
            self.streamed.give(landing.lease)
            if landing.rec is not None and landing.claimed:
                self.table.end_work(landing.rec, 0)
        self.streamed.link_ended()
        self.index.clear()
        self.direct.link_ended()     # unmapped: a dead sender's memory can be freed

    def forget(self, rid: str) -> None:
        self.streamed.forget(rid)
        self.direct.forget(rid)
        if not any(landing.rid == rid for landing in self.landings):
            self.index.pop(rid, None)
            self.direct.src_index.pop(rid, None)

    def clear_abort(self, spec: TransferSpec) -> None:
        try:
            self.receiver.connector.clear_abort(spec.sender_id, spec.receiver_id, spec.request_id)
        except Exception:
            pass
