"""The streamed data path of a receive loop (the link's sender does not offer a direct copy, or this
end cannot map it): each "layers" frame announces messages that each carry one tensor of
consecutive layers; the frame reader posts their receives into staging (the window's bytes, a FIFO
ring) at once, and the loop accounts each and, on CUDA, queues its scatter into the spec's dst
blocks on its own stream right behind the receive. On CPU the data is scattered once it landed.
Layers must come in the spec's order; data for a transfer that is gone, or a message that does
not fit it, is received and dropped so the link stays in step.
"""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING

import torch

from tandem.kv_transfer.base import KVTransferError, StagingRing, device_index, layer_runs
from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.frames import LayersFrame
from tandem.kv_transfer.link import PeerLink
from tandem.kv_transfer.recv_items import Landing, PostedItem, PostedPart

if TYPE_CHECKING:
    from tandem.kv_transfer.recv_loop import PeerRecvLoop


class StreamedRecvPath:
    def __init__(self, loop: "PeerRecvLoop"):
        self.loop = loop
        self.staging = StagingRing(loop.receiver.config.window_bytes, loop.store.device)
        self._room = threading.Condition()   # the staging ring: the frame reader takes, the loop gives
        self.next_idx: dict[str, int] = {}   # rid -> index of the next layer expected

    # ---- the frame reader thread --------------------------------------------------------------
    def post_receives(self, link: PeerLink, frame: LayersFrame) -> PostedItem:
        """The receives of a "layers" frame's parts, in order, into staging (waiting while the
        ring has no room: the loop frees it as messages land)."""
        loop, rid, parts = self.loop, frame.rid, frame.parts
        loop.mark("recv.frame", rid)
        if sum(parts) != len(frame.layers) or min(parts) < 1:
            raise KVTransferError(f"corrupt control frame from {loop.peer!r}: parts {parts} "
                                  f"for {len(frame.layers)} layers")
        dtype = getattr(torch, frame.dtype)
        part_bytes = math.prod(frame.shape) * dtype.itemsize
        posts = []
        # Posted from a stream that holds only block-id copies: NCCL's stream waits for the
        # poster's stream, and on the scatter stream that would hold this receive until the
        # previous message's scatter is done (wire and scatter would take turns, not overlap).
        with self._room:
            while not self.staging.idle and not self.staging.fits([n * part_bytes for n in parts]):
                if loop.stopping or loop.broken:
                    raise KVTransferError(f"link to {loop.peer!r} closed")
                self._room.wait(0.01)              # bound the staging memory
            with loop.on_stream(loop.recv_stream):
                for n in parts:
                    buf, lease = self.staging.take((n, *frame.shape), dtype)
                    try:
                        posts.append(PostedPart(buf, lease, link.irecv_data(buf)))
                    except BaseException:
                        self.staging.give(lease)
                        raise
                    loop.mark(f"recv.post {n}", rid)
        loop.mark(f"recv.posted {parts}", rid)
        return PostedItem(frame, posts)

    def give(self, lease: StagingRing.Lease | None) -> None:
        with self._room:
            self.staging.give(lease)
            self._room.notify_all()

    # ---- the loop thread ----------------------------------------------------------------------
    def track_posted(self, item: PostedItem) -> None:
        frame, at = item.frame, 0
        for n, part in zip(frame.parts, item.posts):
            self._track(frame.rid, frame.idx + at, frame.layers[at:at + n], part)
            at += n

    def _track(self, rid: str, idx: int, layers: list[int], part: PostedPart) -> None:
        """Account one posted message (layers `idx`.. of the spec) to its transfer and queue its
        scatter behind the receive; or, for a transfer that is gone or a message that does not fit
        it, receive the data only to drop it."""
        loop = self.loop
        # CUDA queues the scatter now, behind the receive, so the blocks are claimed now; on CPU
        # the data lands in staging and is scattered once here, so the claim waits until then
        # (an abort meanwhile releases the blocks at once and nothing is written)
        ordered = loop.stream is not None
        rec = loop.claim(rid, idx + len(layers), start_work=ordered)
        expected = self.next_idx.get(rid, 0)
        problem = self._check(rec.spec, expected, idx, layers, part.buf) if rec is not None else ""
        if rec is None or problem:      # receive the data only to keep the link in step
            loop.landings.append(Landing(rid, None, [], part.op, part.buf, time.monotonic(), lease=part.lease))
            loop.watch(loop.landings[-1])
            if problem:                 # nothing will be written: give the blocks back first
                if ordered:
                    loop.table.end_work(rec, 0)
                loop.fail(rid, problem)
            loop.forget(rid)
            return
        landing = Landing(rid, rec, layers, part.op, part.buf, time.monotonic(), claimed=ordered,
                          lease=part.lease)
        loop.landings.append(landing)
        self.next_idx[rid] = expected + len(layers)
        if self.next_idx[rid] == rec.spec.num_layers:
            self.next_idx.pop(rid)
        if loop.stream is not None:
            with loop.on_stream():
                if part.op.order_current_stream():   # scatter right behind the receive, no host wait
                    try:
                        self.scatter(landing)
                    except BaseException:
                        landing.layers = []         # nothing to count or to scatter again
                        raise
                    landing.event = torch.cuda.Event()
                    landing.event.record(loop.stream)
        loop.watch(landing)

    def _check(self, spec: TransferSpec, done: int, idx: int, layers: list[int], buf: torch.Tensor) -> str:
        loop, store = self.loop, self.loop.store
        if spec.sender_id != loop.peer:
            return f"data came from {loop.peer!r}, expected {spec.sender_id!r}"
        want_layers = list(spec.layers[done:done + len(layers)])
        if idx != done or list(layers) != want_layers:
            return f"got layers {layers} (#{idx}), expected {want_layers} (#{done})"
        want = tuple(store.block_payload_shape(len(spec.dst_block_ids)))
        if tuple(buf.shape[1:]) != want or buf.dtype != store.dtype:
            return (f"layout mismatch: sender sent {tuple(buf.shape[1:])} {buf.dtype}, this cache "
                    f"takes {want} {store.dtype}")
        return ""

    def scatter(self, landing: Landing) -> None:
        loop, store = self.loop, self.loop.store
        index = loop.index.get(landing.rid)
        if index is None:     # on the idle receive-posting stream; the scatter stream waits for it
            index = loop.index[landing.rid] = device_index(store, landing.rec.spec.dst_block_ids,
                                                           loop.recv_stream, loop.stream, loop.pinned)
        for at, run in layer_runs(landing.layers):
            store.scatter_layers(run, index, landing.buf[at:at + len(run)])

    def forget(self, rid: str) -> None:
        self.next_idx.pop(rid, None)

    def link_ended(self) -> None:
        self.next_idx.clear()
