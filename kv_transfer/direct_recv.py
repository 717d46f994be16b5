"""The direct-copy data path of a receive loop (see `kv_transfer.direct_send`): a link's first
frame, "hello", may offer the sender's cache; the frame reader maps it (CUDA IPC) and answers
through `PeerLink.send_verdict`, which picks the link's data path. On such a link a "ready" frame
carries no data: the reader queues one kernel per run of layers that copies the blocks out of the
sender's cache into the spec's dst blocks, then writes the frame's seq into the sender's ack cell,
both on the copy stream, and the loop accounts the message like any other landing. A copy seen
complete more than `timeout_s` after its frame is not counted (the sender may have given up on it
and reused its blocks).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from tandem.kv_transfer.base import KVTransferError, device_index, layer_runs, machine_id
from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.frames import Hello, ReadyFrame
from tandem.kv_transfer.link import PeerLink
from tandem.kv_transfer.recv_items import CopiedItem, Landing
from tandem.kv_transfer.records import TransferRecord

if TYPE_CHECKING:
    from tandem.kv_transfer.recv_loop import PeerRecvLoop


class PeerCache(NamedTuple):
    """What this end mapped of the sender's memory."""
    cache: torch.Tensor              # the sender's KV cache
    ack: torch.Tensor                # our ack cell in the sender's ack cells (a view, kept)
    arena: torch.Tensor | None       # the sender's id arena, as int64


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


class DirectRecvPath:
    def __init__(self, loop: "PeerRecvLoop"):
        self.loop = loop
        # frame reader thread only (but dropped by the loop when the link ends): what was mapped
        # of the sender (None: the link streams), the next layer index per transfer
        self.peer: PeerCache | None = None
        self.ready_next: dict[str, int] = {}
        # rid -> the sender's block index (or what is wrong with the ids the sender named)
        self.src_index: dict[str, "torch.Tensor | str"] = {}

    # ---- the frame reader thread --------------------------------------------------------------
    def open_peer(self, link: PeerLink, hello: Hello) -> None:
        """Map the sender's cache and ack cells for direct copies, if it offered them, and answer
        (the sender waits for the answer before its first transfer)."""
        self.peer = None
        if hello.cache is None:
            return
        store = self.loop.store
        try:
            if not self.loop.receiver.config.direct_copy:
                raise KVTransferError("direct copies are off here")
            if hello.machine != machine_id():    # a handle means nothing on another machine
                raise KVTransferError("the sender is on another machine")
            cache, acks = store.open_shared(hello.cache), store.open_shared(hello.acks)
            arena = store.open_shared(hello.ids).view(torch.long) if hello.ids else None
            own = store.tensor
            if (cache.dim() != own.dim() or cache.shape[:2] != own.shape[:2]
                    or cache.shape[3:] != own.shape[3:] or cache.dtype != own.dtype):
                raise KVTransferError(f"layout mismatch: the sender's cache is {tuple(cache.shape)} "
                                      f"{cache.dtype}, this one {tuple(own.shape)} {own.dtype}")
            peer = PeerCache(cache, acks[int(hello.cell)], arena)
        except Exception as exc:  # noqa: BLE001 - another host, no IPC: the data goes through the link
            link.send_verdict(False, f"{type(exc).__name__}: {str(exc)[:200]}")
            return
        link.send_verdict(True, "")
        self.peer = peer

    def launch_copy(self, frame: ReadyFrame) -> CopiedItem:
        """Claim the blocks and queue the copy of the frame's layers out of the sender's cache,
        then the ack, on the copy stream (on CPU both run now), right here (no hop to the loop
        thread); or, for a transfer that is gone or a frame that does not fit it, the ack alone.
        The loop accounts the returned item as it lands."""
        read_at = time.monotonic()           # the sender's clock for this copy started before
        peer, loop = self.peer, self.loop
        if peer is None:
            raise KVTransferError(f"{loop.peer!r} sent a direct copy on a link without one")
        rid, layers = frame.rid, frame.layers
        loop.mark("recv.ready", rid)
        self._note_src_ids(frame, peer)
        loop.mark("recv.src ids", rid)
        rec = loop.claim(rid, frame.idx + len(layers), start_work=True)
        expected = self.ready_next.get(rid, 0)
        problem = self._check_ready(rec.spec, expected, frame) if rec is not None else ""
        if problem:
            loop.table.end_work(rec, 0)
            loop.fail(rid, problem)
        copy = rec is not None and not problem
        loop.mark("recv.claimed", rid)
        event = None           # this thread's current stream is the copy stream (_read_frames)
        if copy:
            self._copy(rec, layers, peer.cache)
            loop.mark("recv.copy launched", rid)
        peer.ack.fill_(int(frame.seq))       # the sender may reuse its blocks from here on
        if loop.stream is not None:
            event = torch.cuda.Event()
            event.record(loop.stream)
        loop.mark("recv.acked", rid)
        if copy and expected + len(layers) < rec.spec.num_layers:
            self.ready_next[rid] = expected + len(layers)
        else:
            self.ready_next.pop(rid, None)
        return CopiedItem(rid, rec if copy else None, layers if copy else [], event, read_at)

    def _note_src_ids(self, frame: ReadyFrame, peer: PeerCache) -> None:
        """The transfer's source block index, when its first frame names the ids: a view of the
        sender's arena (no copy), or the ids the frame carries."""
        rid = frame.rid
        if frame.ids_at is not None and peer.arena is not None:
            at, n = frame.ids_at, frame.n
            self.src_index[rid] = (peer.arena[at:at + n] if 0 <= at and at + n <= peer.arena.shape[0]
                                   else f"source ids at {at}+{n} outside the sender's arena")
        elif frame.src is not None:
            self.src_index[rid] = self._frame_src_index(frame.src, peer.cache.shape[2])

    def _copy(self, rec: TransferRecord, layers: list[int], cache: torch.Tensor) -> None:
        loop, store, rid = self.loop, self.loop.store, rec.request_id
        dst = loop.index.get(rid)
        if dst is None:     # expect() just ran and the loop has not built it yet
            dst = device_index(store, rec.spec.dst_block_ids, loop.recv_stream, loop.stream,
                               loop.reader_pinned)
        src = self.src_index[rid]
        try:
            for _at, run in layer_runs(layers):
                store.copy_from_peer(cache, run, src, dst)
        except BaseException:
            loop.table.end_work(rec, 0)
            raise

    def _frame_src_index(self, raw: bytes, peer_blocks: int) -> "torch.Tensor | str":
        """The source block ids an all-ready send put in its frame, checked against the mapped
        cache's size, as an index on the device: copied from a pinned slot on this thread's
        stream, the copy's own, so the copy queued next is ordered after it without a wait. A
        string says what is wrong with them."""
        ids = np.frombuffer(raw, dtype=np.int32)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= peer_blocks):
            return f"source block ids outside the sender's 0..{peer_blocks - 1}"
        loop = self.loop
        pinned, store = loop.reader_pinned, loop.store
        host = pinned.take(ids, loop.stream) if pinned is not None else None
        if host is None:         # CPU, or more ids than a pinned slot holds
            return device_index(store, ids.tolist(), loop.recv_stream, loop.stream, None)
        index = store.block_index(host.to(store.device, non_blocking=True))
        pinned.copied(loop.stream)
        return index

    def _check_ready(self, spec: TransferSpec, done: int, frame: ReadyFrame) -> str:
        if spec.sender_id != self.loop.peer:
            return f"data came from {self.loop.peer!r}, expected {spec.sender_id!r}"
        want_layers = list(spec.layers[done:done + len(frame.layers)])
        if frame.idx != done or list(frame.layers) != want_layers:
            return f"got layers {frame.layers} (#{frame.idx}), expected {want_layers} (#{done})"
        src = self.src_index.get(spec.request_id)
        if isinstance(src, str):
            return src
        if src is None or src.shape[0] != len(spec.dst_block_ids):
            return (f"the sender named {None if src is None else src.shape[0]} source blocks for "
                    f"{len(spec.dst_block_ids)} destination blocks")
        return ""

    # ---- the loop thread ----------------------------------------------------------------------
    def track_copy(self, item: CopiedItem) -> None:
        """Account a direct copy the frame reader queued."""
        loop = self.loop
        landing = Landing(item.rid, item.rec, item.layers, _Copied(), None, item.read_at,
                          event=item.event, direct=True)
        loop.landings.append(landing)
        if item.rec is None or item.rec.state.terminal:
            loop.forget(item.rid)
        loop.watch(landing)

    def forget(self, rid: str) -> None:
        self.ready_next.pop(rid, None)

    def link_ended(self) -> None:
        self.src_index.clear()
        self.peer = None
