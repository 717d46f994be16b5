"""The decode end of a KV transfer, over any `Connector` (fake, gloo, NCCL).

`expect(spec)` registers a transfer into blocks the owner reserved (and has the peer's thread copy
its block ids to the device). Per sending peer, a frame reader thread keeps a control-frame receive
posted; each "layers" frame announces messages that each carry one tensor of consecutive layers,
and the reader posts their receives into staging (the window's bytes, a FIFO ring) at once. The
peer's loop thread then accounts them and, on CUDA, queues each message's scatter into the spec's
dst blocks on its own stream right behind the receive; a waiter thread blocks on the scatter's
event and wakes the loop, so a message is done when that event completes. Layers must come in the
spec's order. The owner's decode loop never blocks on any of it; it learns of finished transfers
from `reap()`.

Ordering contract: call `expect(spec)` before the sender's first layer can leave (the decode actor
does it inside its reserve call, before the router hands the spec to the prefill actor). Data for a
request the receiver does not know yet is discarded, and a later `expect` of it fails at once.

Late data for a transfer that already failed or was aborted here is received and dropped, so the
link stays in step; the blocks were already released and are never written.

Direct copy (see `kv_transfer.sender`): a link's first frame, "hello", may offer the sender's cache;
the frame reader maps it (CUDA IPC) and answers through `PeerLink.send_verdict`. On such a link a
"ready" frame carries no data: the loop queues one kernel per run of layers that copies the blocks
out of the sender's cache into the spec's dst blocks, then writes the frame's seq into the sender's
ack cell, both on the copy stream, and the message lands like any other. A copy seen complete more
than `timeout_s` after its frame is not counted (the sender may have given up on it and reused
its blocks).
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from tandem.kv_transfer.base import (BlockStore, KVReceiver, KVTransferAborted, KVTransferConfig,
                              KVTransferError, KVTransferTimeout, ReleaseCallback, TransferSpec,
                              PinnedIndexRing, StagingRing, TransferState, device_index, layer_runs,
                              machine_id)
from tandem.kv_transfer.link import Connector, PeerLink, Pending
from tandem.kv_transfer.records import TransferRecord, TransferTable

log = logging.getLogger(__name__)

_MAX_EARLY = 4096
_POLL_MIN_S, _POLL_MAX_S = 20e-6, 200e-6   # polling landing messages: backoff while nothing changes
_WATCHED_S = 0.01          # while every landing has a waiter: wake only to check for a timeout
_LANDED = object()         # the landing waiter's wake-up


def _ignore(_request_id: str) -> None:
    pass


class LayerStreamReceiver(KVReceiver):
    def __init__(self, store: BlockStore, connector: Connector,
                 config: KVTransferConfig = KVTransferConfig(),
                 on_release: ReleaseCallback = _ignore, clock: Callable[[], float] = time.monotonic,
                 on_transition: Callable[[], None] | None = None):
        """`on_transition`: called from the transport's thread when a transfer ends, so the decode
        loop, idle between polls, can wake and admit it at once (it must only signal)."""
        self.store = store
        self.connector = connector
        self.config = config
        self._on_release = on_release
        self._table = TransferTable(self._release, releases_on=(TransferState.FAILED,
                                                                TransferState.ABORTED), clock=clock,
                                    on_transition=on_transition)
        self._lock = threading.Lock()          # loops and early arrivals
        self._loops: dict[str, _PeerRecvLoop] = {}
        self._early: OrderedDict[str, str] = OrderedDict()    # rid -> what came before expect()
        self._closed = False
        self.trace: list[tuple[float, str, str]] | None = None   # as LayerStreamSender.trace

    def expect(self, spec: TransferSpec) -> None:
        if spec.receiver_id != self.connector.self_id:
            raise ValueError(f"spec {spec.request_id!r} is for receiver {spec.receiver_id!r}, "
                             f"this is {self.connector.self_id!r}")
        if max(spec.layers) >= self.store.num_layers:
            raise ValueError(f"spec {spec.request_id!r}: layer {max(spec.layers)} out of range")
        if min(spec.dst_block_ids) < 0 or max(spec.dst_block_ids) >= self.store.num_blocks:
            raise ValueError(f"spec {spec.request_id!r}: destination block ids outside "
                             f"0..{self.store.num_blocks - 1}")
        if self._closed:
            raise KVTransferError("receiver is closed")
        deadline = self._table.clock() + self.config.start_timeout_s
        with self._lock:
            self._table.add(spec, peer=spec.sender_id, deadline=deadline)
            early = self._early.pop(spec.request_id, None)
            if early is not None:
                self._table.finish(spec.request_id, TransferState.FAILED, KVTransferError(
                    f"transfer {spec.request_id!r}: {early} from {spec.sender_id!r} before expect()"))
            else:
                loop = self._loops.get(spec.sender_id)
                if loop is None:
                    loop = self._loops[spec.sender_id] = _PeerRecvLoop(self, spec.sender_id)
                loop.prepare(spec)
        self._table.run_releases()

    def redirect(self, spec: TransferSpec) -> None:
        """Point a registered transfer at another sender (`spec.sender_id`), as long as nothing of
        it has arrived: the decode actor registers the receive when it reserves, naming the prefill
        actor the router asked first; if that one could not take the request, the router uses
        another. Same request id, layers and destination blocks."""
        with self._lock:
            rec = self._table.get(spec.request_id)
            if rec is None or rec.state is not TransferState.WAITING or rec.busy or rec.layers_done:
                raise KVTransferError(f"transfer {spec.request_id!r} cannot be redirected: "
                                      f"{'unknown' if rec is None else rec.state.value}")
            if (rec.spec.layers, rec.spec.dst_block_ids, rec.spec.receiver_id) != \
                    (spec.layers, spec.dst_block_ids, spec.receiver_id):
                raise ValueError(f"transfer {spec.request_id!r}: a redirect keeps its layers and blocks")
            self._table.reassign(rec, spec, peer=spec.sender_id)
            if spec.sender_id not in self._loops and not self._closed:
                self._loops[spec.sender_id] = _PeerRecvLoop(self, spec.sender_id)
            if spec.sender_id in self._loops:
                self._loops[spec.sender_id].prepare(spec)

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


class _Copied:
    """The `Pending` of a direct copy: nothing was posted, the copy is stream-ordered."""

    @staticmethod
    def done() -> bool:
        return True

    @staticmethod
    def wait(timeout: float | None) -> None:
        return None

    @staticmethod
    def order_current_stream() -> bool:
        return True


@dataclass
class _Landing:
    """One posted message: its receive, then (once the data is there) its scatter."""
    rid: str
    rec: TransferRecord | None       # None: the data is received only to keep the link in step
    layers: list[int]                # to scatter and count; empty when the data is dropped
    op: Pending
    buf: torch.Tensor
    posted_at: float
    event: Any = None                # CUDA: recorded after the stream-ordered scatter
    claimed: bool = True             # holds a claim on the blocks (CPU: taken only to scatter)
    watched: bool = False            # the landing waiter thread wakes the loop when it is done
    lease: StagingRing.Lease | None = None   # its staging, free again once retired
    direct: bool = False             # copied straight out of the sender's cache (no scatter)


class _PeerRecvLoop:
    """One thread reading one peer's link until it breaks or the receiver closes."""

    def __init__(self, receiver: LayerStreamReceiver, peer: str):
        self.receiver = receiver
        self.peer = peer
        self.link: PeerLink | None = None
        self._stopping = False
        self._stream = self._recv_stream = None
        self._pinned: PinnedIndexRing | None = None
        self._landings: deque[_Landing] = deque()
        cfg = receiver.config
        self._staging = StagingRing(cfg.window_bytes, receiver.store.device)
        self._next_idx: dict[str, int] = {}          # rid -> index of the next layer expected
        self._index: dict[str, torch.Tensor] = {}    # rid -> dst block index on the device
        self._src_index: dict[str, torch.Tensor] = {}   # direct copy: rid -> the sender's block index
        # direct copy, frame reader thread only (but dropped by the loop when the link ends): the
        # sender's cache, ack cells, our cell and its id arena; the next layer index per transfer
        self._peer: tuple | None = None
        self._ready_next: dict[str, int] = {}
        self._reader_pinned: PinnedIndexRing | None = None
        # frames from the reader thread, link errors, and ("prepare", spec) from expect()
        self._frames: queue.SimpleQueue = queue.SimpleQueue()
        self._watch: queue.SimpleQueue | None = None   # CUDA: events for the landing waiter
        self._room = threading.Condition()             # the staging ring: the frame reader takes,
        self._broken = False                           # the loop gives back
        self._thread = threading.Thread(target=self._run, name=f"kv-recv-{peer}", daemon=True)
        self._thread.start()

    def prepare(self, spec: TransferSpec) -> None:
        """expect() was called: copy the destination block ids to the device while this thread is
        idle, not when the first message's scatter is queued."""
        self._frames.put(("prepare", spec))

    def stop(self) -> None:
        """Does not wait: a gloo receive posted while idle only returns when the peer closes or
        the process exits (the thread is a daemon); the fake link wakes it at once."""
        self._stopping = True
        if self._watch is not None:
            self._watch.put(None)
        if self.link is not None:
            self.link.close(broken=False)
        self._thread.join(timeout=0.1)

    def _run(self) -> None:
        store = self.receiver.store
        if store.device.type == "cuda":
            torch.cuda.set_device(store.device)
            self._stream = torch.cuda.Stream(store.device)         # scatters
            self._recv_stream = torch.cuda.Stream(store.device)    # posts receives; block-id copies only
            self._pinned = PinnedIndexRing()
            self._reader_pinned = PinnedIndexRing()
            self._watch = queue.SimpleQueue()
            threading.Thread(target=self._wait_landings, args=(self._watch,), daemon=True,
                             name=f"kv-landing-{self.peer}").start()
        try:
            self.link = self.receiver.connector.connect(self.peer, as_sender=False)
            frames = self._frames
            threading.Thread(target=self._read_frames, args=(self.link, frames), daemon=True,
                             name=f"kv-frames-{self.peer}").start()
            idle_s = _POLL_MIN_S
            while not self._stopping:
                # A frame wakes this thread at once; while data is landing it also wakes to poll.
                if not self._landings:
                    self._prune()
                if not self._landings:
                    timeout = None
                elif all(landing.watched for landing in self._landings):
                    timeout = _WATCHED_S
                else:
                    timeout = idle_s
                try:
                    item = frames.get(timeout=timeout)
                except queue.Empty:
                    item = None
                if isinstance(item, KVTransferError):
                    raise item
                if isinstance(item, tuple) and item[0] == "prepare":
                    self._prepare(item[1])
                elif item is _LANDED:
                    item = None
                elif item is not None:
                    self._handle(item)
                if self._land(wait=False) or item is not None:
                    idle_s = _POLL_MIN_S
                else:
                    idle_s = min(idle_s * 2, _POLL_MAX_S)
        except Exception as exc:  # noqa: BLE001 - the link, or a bug / failed allocation here
            self._broken = True
            self._take_queued_copies()
            err = exc if isinstance(exc, KVTransferError) else KVTransferError(
                f"receiver from {self.peer!r} failed: {type(exc).__name__}: {exc}")
            if not isinstance(exc, KVTransferError):
                log.exception("KV receiver from %s failed", self.peer)
            if self.link is not None:
                self.link.close(broken=not self._stopping)
            self._abandon_landings()
            self.receiver._loop_ended(self, err)

    def _take_queued_copies(self) -> None:
        """The link ended: account the direct copies the frame reader queued that the loop has
        not seen, so their claims on the blocks are handed back with the rest."""
        while True:
            try:
                item = self._frames.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple) and item[0] == "copied":
                self._track_copy(item)

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
            self._frames.put(_LANDED)

    def _watch_landing(self, landing: "_Landing") -> None:
        event = landing.event if landing.event is not None else getattr(landing.op, "end", None)
        if self._watch is not None and event is not None:
            landing.watched = True
            self._watch.put(event)

    def _prepare(self, spec: TransferSpec) -> None:
        rec = self.receiver._table.get(spec.request_id)
        if rec is not None and not rec.state.terminal and spec.request_id not in self._index:
            self._index[spec.request_id] = device_index(self.receiver.store, spec.dst_block_ids,
                                                        self._recv_stream, self._stream, self._pinned)

    def _prune(self) -> None:
        """Idle: drop block indexes of transfers that ended before their data came."""
        table = self.receiver._table
        for rid in [r for r in {**self._index, **self._src_index}
                    if (rec := table.get(r)) is None or rec.state.terminal]:
            self._forget(rid)

    def _read_frames(self, link: PeerLink, frames: queue.SimpleQueue) -> None:
        """Keeps a control-frame receive posted and, for a "layers" frame, posts every part's
        receive right here, so the wire never waits for the loop thread (busy queueing scatters,
        or waiting for the GIL behind the engine); the loop then accounts the posted parts."""
        if self._stream is not None:     # direct copies and their acks: queued from this thread
            torch.cuda.set_device(self.receiver.store.device)
            torch.cuda.set_stream(self._stream)
        try:
            while not self._stopping:
                frame = link.recv_frame(None)
                if frame.get("op") == "layers":
                    frames.put(("posted", frame, *self._post_receives(link, frame)))
                elif frame.get("op") == "hello":
                    self._peer = self._open_peer(link, frame)     # (re)mapped, or None
                elif frame.get("op") == "ready":
                    frames.put(self._launch_copy(frame))
                else:
                    self._mark(f"recv.frame {frame.get('op')}", frame.get("rid", ""))
                    frames.put(frame)
        except KVTransferError as err:
            frames.put(err)
        except Exception as exc:  # noqa: BLE001 - a bug or a failed allocation: the link fails
            log.exception("KV receiver from %s failed posting receives", self.peer)
            frames.put(KVTransferError(f"receiver from {self.peer!r} failed: {type(exc).__name__}: {exc}"))

    def _open_peer(self, link: PeerLink, frame: dict[str, Any]) -> tuple | None:
        """Frame reader thread: map the sender's cache and ack cells for direct copies, if it
        offered them, and answer (the sender waits for the answer before its first transfer)."""
        if frame.get("cache") is None:
            return None
        store = self.receiver.store
        try:
            if not self.receiver.config.direct_copy:
                raise KVTransferError("direct copies are off here")
            if frame.get("machine") != machine_id():    # a handle means nothing on another machine
                raise KVTransferError("the sender is on another machine")
            open_shared = getattr(store, "open_shared", None)
            if open_shared is None:
                raise KVTransferError(f"{type(store).__name__} cannot map a peer's cache")
            cache, acks = open_shared(frame["cache"]), open_shared(frame["acks"])
            arena = open_shared(frame["ids"]).view(torch.long) if frame.get("ids") else None
            own = store.tensor
            if (cache.dim() != own.dim() or cache.shape[:2] != own.shape[:2]
                    or cache.shape[3:] != own.shape[3:] or cache.dtype != own.dtype):
                raise KVTransferError(f"layout mismatch: the sender's cache is {tuple(cache.shape)} "
                                      f"{cache.dtype}, this one {tuple(own.shape)} {own.dtype}")
            peer = (cache, acks[int(frame["cell"])], arena)      # our ack cell: a view, kept
        except Exception as exc:  # noqa: BLE001 - another host, no IPC: the data goes through the link
            link.send_verdict(False, f"{type(exc).__name__}: {str(exc)[:200]}")
            return None
        link.send_verdict(True, "")
        return peer

    def _post_receives(self, link: PeerLink, frame: dict[str, Any]) -> tuple[list[int], list]:
        """Frame reader thread: the receives of a "layers" frame's parts, in order, into staging
        (waiting while the ring has no room: the loop frees it as messages land)."""
        rid = frame["rid"]
        self._mark("recv.frame", rid)
        layers = [int(x) for x in frame["layers"]]
        parts = [int(x) for x in frame.get("parts") or [len(layers)]]
        if sum(parts) != len(layers) or min(parts) < 1:
            raise KVTransferError(f"corrupt control frame from {self.peer!r}: parts {parts} "
                                  f"for {len(layers)} layers")
        dtype = getattr(torch, frame["dtype"])
        part_bytes = math.prod(frame["shape"]) * dtype.itemsize
        posts = []
        # Posted from a stream that holds only block-id copies: NCCL's stream waits for the
        # poster's stream, and on the scatter stream that would hold this receive until the
        # previous message's scatter is done (wire and scatter would take turns, not overlap).
        with self._room:
            while not self._staging.idle and not self._staging.fits([n * part_bytes for n in parts]):
                if self._stopping or self._broken:
                    raise KVTransferError(f"link to {self.peer!r} closed")
                self._room.wait(0.01)              # bound the staging memory
            with self._on_stream(self._recv_stream):
                for n in parts:
                    buf, lease = self._staging.take((n, *frame["shape"]), dtype)
                    try:
                        posts.append((buf, lease, link.irecv_data(buf)))
                    except BaseException:
                        self._staging.give(lease)
                        raise
                    self._mark(f"recv.post {n}", rid)
        self._mark(f"recv.posted {parts}", rid)
        return parts, posts

    def _give(self, lease: StagingRing.Lease | None) -> None:
        with self._room:
            self._staging.give(lease)
            self._room.notify_all()

    def _handle(self, frame: "dict[str, Any] | tuple") -> None:
        if isinstance(frame, tuple) and frame[0] == "copied":
            self._track_copy(frame)
            return
        if isinstance(frame, tuple):       # ("posted", a "layers" frame, its parts, their receives)
            _, frame, parts, posts = frame
            layers, at = [int(x) for x in frame["layers"]], 0
            for n, (buf, lease, posted) in zip(parts, posts):
                self._track(frame["rid"], {**frame, "idx": frame["idx"] + at, "layers": layers[at:at + n]},
                            buf, lease, posted)
                at += n
            return
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
            self._forget(rid)
            return
        raise KVTransferError(f"unknown control frame {op!r} from {self.peer!r}")

    def _track(self, rid: str, part: dict[str, Any], buf: torch.Tensor,
               lease: StagingRing.Lease | None, posted: Pending) -> None:
        """Account one posted message (`part`: its idx and layers) to its transfer and queue its
        scatter behind the receive; or, for a transfer that is gone or a message that does not fit
        it, receive the data only to drop it."""
        table, layers = self.receiver._table, part["layers"]
        # CUDA queues the scatter now, behind the receive, so the blocks are claimed now; on CPU
        # the data lands in staging and is scattered once here, so the claim waits until then
        # (an abort meanwhile releases the blocks at once and nothing is written)
        ordered = self._stream is not None
        with self.receiver._lock:
            rec = table.start_work(rid) if ordered else table.live(rid)
            if rec is None:
                known = table.get(rid)
                if known is None:
                    self.receiver._note_early(rid, "its KV arrived")
                elif part["idx"] + len(layers) == known.spec.num_layers:   # the sender is done with it
                    self._clear_abort(known.spec)
        expected = self._next_idx.get(rid, 0)
        problem = self._check(rec.spec, expected, part, buf) if rec is not None else ""
        if rec is None or problem:      # receive the data only to keep the link in step
            self._landings.append(_Landing(rid, None, [], posted, buf, time.monotonic(), lease=lease))
            self._watch_landing(self._landings[-1])
            if problem:                 # nothing will be written: give the blocks back first
                if ordered:
                    table.end_work(rec, 0)
                table.finish(rid, TransferState.FAILED, KVTransferError(f"transfer {rid!r}: {problem}"))
            self._forget(rid)
            return
        landing = _Landing(rid, rec, layers, posted, buf, time.monotonic(), claimed=ordered, lease=lease)
        self._landings.append(landing)
        self._next_idx[rid] = expected + len(layers)
        if self._next_idx[rid] == rec.spec.num_layers:
            self._next_idx.pop(rid)
        if self._stream is not None:
            with self._on_stream():
                if posted.order_current_stream():   # scatter right behind the receive, no host wait
                    try:
                        self._scatter(landing)
                    except BaseException:
                        landing.layers = []         # nothing to count or to scatter again
                        raise
                    landing.event = torch.cuda.Event()
                    landing.event.record(self._stream)
        self._watch_landing(landing)

    def _launch_copy(self, frame: dict[str, Any]) -> tuple:
        """Frame reader thread, direct copy: claim the blocks and queue the copy of the frame's
        layers out of the sender's cache, then the ack, on the copy stream (on CPU both run now),
        right here (no hop to the loop thread); or, for a transfer that is gone or a frame that
        does not fit it, the ack alone. -> ("copied", rid, record or None, layers, event, read at)
        for the loop, which accounts it as it lands."""
        read_at = time.monotonic()           # the sender's clock for this copy started before
        peer = self._peer
        if peer is None:
            raise KVTransferError(f"{self.peer!r} sent a direct copy on a link without one")
        cache, ack, arena = peer
        rid, layers, store = frame["rid"], [int(x) for x in frame["layers"]], self.receiver.store
        self._mark("recv.ready", rid)
        if "ids_at" in frame and arena is not None:        # a view of the sender's arena: no copy
            at, n = int(frame["ids_at"]), int(frame["n"])
            self._src_index[rid] = (arena[at:at + n] if 0 <= at and at + n <= arena.shape[0]
                                    else f"source ids at {at}+{n} outside the sender's arena")
        elif frame.get("src") is not None:
            self._src_index[rid] = self._frame_src_index(frame["src"], cache.shape[2])
        self._mark("recv.src ids", rid)
        table = self.receiver._table
        with self.receiver._lock:
            rec = table.start_work(rid)
            if rec is None:
                known = table.get(rid)
                if known is None:
                    self.receiver._note_early(rid, "its KV arrived")
                elif frame["idx"] + len(layers) == known.spec.num_layers:
                    self._clear_abort(known.spec)
        expected = self._ready_next.get(rid, 0)
        problem = self._check_ready(rec.spec, expected, frame) if rec is not None else ""
        if problem:
            table.end_work(rec, 0)
            table.finish(rid, TransferState.FAILED, KVTransferError(f"transfer {rid!r}: {problem}"))
        copy = rec is not None and not problem
        self._mark("recv.claimed", rid)
        event = None           # this thread's current stream is the copy stream (_read_frames)
        if copy:
            dst = self._index.get(rid)
            if dst is None:     # expect() just ran and the loop has not built it yet
                dst = device_index(store, rec.spec.dst_block_ids, self._recv_stream, self._stream,
                                   self._reader_pinned)
            src = self._src_index[rid]
            try:
                for _at, run in layer_runs(layers):
                    store.copy_from_peer(cache, run, src, dst)
            except BaseException:
                table.end_work(rec, 0)
                raise
            self._mark("recv.copy launched", rid)
        ack.fill_(int(frame["seq"]))         # the sender may reuse its blocks from here on
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record(self._stream)
        self._mark("recv.acked", rid)
        if copy and expected + len(layers) < rec.spec.num_layers:
            self._ready_next[rid] = expected + len(layers)
        else:
            self._ready_next.pop(rid, None)
        return ("copied", rid, rec if copy else None, layers if copy else [], event, read_at)

    def _track_copy(self, item: tuple) -> None:
        """Loop thread: account a direct copy the frame reader queued."""
        _, rid, rec, layers, event, read_at = item
        landing = _Landing(rid, rec, layers, _Copied(), None, read_at, event=event, direct=True)
        self._landings.append(landing)
        if rec is None or rec.state.terminal:
            self._forget(rid)
        self._watch_landing(landing)

    def _frame_src_index(self, raw: bytes, peer_blocks: int) -> "torch.Tensor | str":
        """Frame reader thread: the source block ids an all-ready send put in its frame, checked
        against the mapped cache's size, as an index on the device: copied from a pinned slot on
        this thread's stream, the copy's own, so the copy queued next is ordered after it without
        a wait. A string says what is wrong with them."""
        ids = np.frombuffer(raw, dtype=np.int32)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= peer_blocks):
            return f"source block ids outside the sender's 0..{peer_blocks - 1}"
        pinned, store = self._reader_pinned, self.receiver.store
        host = pinned.take(ids, self._stream) if pinned is not None else None
        if host is None:         # CPU, or more ids than a pinned slot holds
            return device_index(store, ids.tolist(), self._recv_stream, self._stream, None)
        index = store.block_index(host.to(store.device, non_blocking=True))
        pinned.copied(self._stream)
        return index

    def _check_ready(self, spec: TransferSpec, done: int, frame: dict[str, Any]) -> str:
        if spec.sender_id != self.peer:
            return f"data came from {self.peer!r}, expected {spec.sender_id!r}"
        want_layers = list(spec.layers[done:done + len(frame["layers"])])
        if frame["idx"] != done or list(frame["layers"]) != want_layers:
            return f"got layers {frame['layers']} (#{frame['idx']}), expected {want_layers} (#{done})"
        src = self._src_index.get(spec.request_id)
        if isinstance(src, str):
            return src
        if src is None or src.shape[0] != len(spec.dst_block_ids):
            return (f"the sender named {None if src is None else src.shape[0]} source blocks for "
                    f"{len(spec.dst_block_ids)} destination blocks")
        return ""

    def _land(self, wait: bool) -> bool:
        """Retire landed messages, oldest first; with `wait`, block for the oldest. Past the
        transfer timeout, a message that has not landed breaks the link."""
        cfg = self.receiver.config
        progressed = False
        while self._landings:
            landing = self._landings[0]
            if wait and not progressed:
                landing.op.wait(cfg.timeout_s)
                if landing.event is not None:
                    landing.event.synchronize()
            elif not self._landed(landing):
                if time.monotonic() - landing.posted_at > cfg.timeout_s:
                    raise KVTransferTimeout(f"link to {self.peer!r}: a message of {landing.rid!r} "
                                            f"did not land in {cfg.timeout_s:.3g}s")
                return progressed
            self._retire(self._landings.popleft())
            progressed = True
        return progressed

    @staticmethod
    def _landed(landing: _Landing) -> bool:
        return landing.op.done() and (landing.event is None or landing.event.query())

    def _retire(self, landing: _Landing) -> None:
        """Count the landed message's layers and give back its claim on the blocks (also when
        the scatter raises: the claim must not outlive the message)."""
        try:
            self._retire_landed(landing)
        finally:                             # landed and scattered: its buffer is free again
            self._give(landing.lease)

    def _retire_landed(self, landing: _Landing) -> None:
        moved, rec, table = 0, landing.rec, self.receiver._table
        self._mark("recv.landed", landing.rid)
        if rec is not None and not landing.claimed:      # CPU: claim the blocks to scatter
            rec = table.start_work(landing.rid)
            if rec is not landing.rec:   # it ended meanwhile: the blocks are not ours to write
                if rec is not None:
                    table.end_work(rec, 0)
                self._forget(landing.rid)
                return
        try:
            if landing.direct and rec is not None and \
                    time.monotonic() - landing.posted_at > self.receiver.config.timeout_s:
                table.finish(landing.rid, TransferState.FAILED, KVTransferTimeout(
                    f"transfer {landing.rid!r}: the copy out of {self.peer!r} completed after "
                    f"{self.receiver.config.timeout_s:.3g}s, when the sender may have reused its blocks"))
            elif landing.layers and landing.event is None and not landing.direct:   # CPU: scatter now
                self._scatter(landing)
                moved = len(landing.layers)
            else:
                moved = len(landing.layers)
        finally:
            if rec is not None:
                table.end_work(rec, moved, table.clock() + self.receiver.config.timeout_s)
                if rec.state.terminal:
                    self._forget(landing.rid)

    def _abandon_landings(self) -> None:
        """The link broke: keep what had fully arrived before it did, then hand the rest of the
        blocks back once no scatter can still write them."""
        try:
            while self._landings and self._landed(self._landings[0]):
                self._retire(self._landings.popleft())
        except Exception:  # noqa: BLE001 - what is left is handed back below
            pass
        if self._stream is not None:
            try:
                self._stream.synchronize()
            except Exception:
                pass
        table = self.receiver._table
        while self._landings:
            landing = self._landings.popleft()
            self._give(landing.lease)
            if landing.rec is not None and landing.claimed:
                table.end_work(landing.rec, 0)
        self._next_idx.clear()
        self._index.clear()
        self._src_index.clear()
        self._peer = None            # unmapped: a dead sender's memory can be freed

    def _check(self, spec: TransferSpec, done: int, frame: dict[str, Any], buf: torch.Tensor) -> str:
        if spec.sender_id != self.peer:
            return f"data came from {self.peer!r}, expected {spec.sender_id!r}"
        want_layers = list(spec.layers[done:done + len(frame["layers"])])
        if frame["idx"] != done or list(frame["layers"]) != want_layers:
            return f"got layers {frame['layers']} (#{frame['idx']}), expected {want_layers} (#{done})"
        want = tuple(self.receiver.store.block_payload_shape(len(spec.dst_block_ids)))
        if tuple(buf.shape[1:]) != want or buf.dtype != self.receiver.store.dtype:
            return (f"layout mismatch: sender sent {tuple(buf.shape[1:])} {buf.dtype}, this cache "
                    f"takes {want} {self.receiver.store.dtype}")
        return ""

    def _scatter(self, landing: _Landing) -> None:
        store = self.receiver.store
        index = self._index.get(landing.rid)
        if index is None:     # on the idle receive-posting stream; the scatter stream waits for it
            index = self._index[landing.rid] = device_index(store, landing.rec.spec.dst_block_ids,
                                                            self._recv_stream, self._stream, self._pinned)
        for at, run in layer_runs(landing.layers):
            store.scatter_layers(run, index, landing.buf[at:at + len(run)])

    def _mark(self, what: str, rid: str) -> None:
        trace = self.receiver.trace
        if trace is not None:
            trace.append((time.time(), what, rid))

    def _on_stream(self, stream=None):
        stream = stream or self._stream
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _forget(self, rid: str) -> None:
        self._next_idx.pop(rid, None)
        self._ready_next.pop(rid, None)
        if not any(landing.rid == rid for landing in self._landings):
            self._index.pop(rid, None)
            self._src_index.pop(rid, None)

    def _clear_abort(self, spec: TransferSpec) -> None:
        try:
            self.receiver.connector.clear_abort(spec.sender_id, spec.receiver_id, spec.request_id)
        except Exception:
            pass
