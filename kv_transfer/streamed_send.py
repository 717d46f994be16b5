"""The streamed data path of a send thread (a link whose receiver does not copy directly: another
host, a CPU cache, `direct_copy` off): the layers of one request that are ready together (up to
`max_message_bytes` a message, as many as the window has room for) are gathered into staging and
sent after one "layers" frame announcing them all, so the receiver posts every receive at once.

On CUDA the gather runs on the thread's own stream after the layer's ready event (recorded by the
prefill after it wrote the layer's KV), and NCCL's send is ordered after the gather on that stream:
the prefill's compute stream never waits for the transfer.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Any

import torch

from tandem.kv_transfer.base import KVTransferError, StagingRing, TransferState, device_index, layer_runs, plan_messages
from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.frames import LayersFrame
from tandem.kv_transfer.link import PeerLink, Pending
from tandem.kv_transfer.records import TransferRecord
from tandem.kv_transfer.send_queue import LayerItem
from tandem.kv_transfer.send_window import Message

if TYPE_CHECKING:
    from tandem.kv_transfer.send_worker import PeerSendWorker


class StreamedSendPath:
    def __init__(self, worker: "PeerSendWorker"):
        self.worker = worker
        self.index: dict[str, torch.Tensor] = {}   # rid -> src block index on the device
        self.staging: StagingRing | None = None

    def prepare(self, rid: str, spec: TransferSpec, all_ready: bool) -> None:
        self.block_index(rid, spec)

    def send_next(self, head: LayerItem) -> bool:
        w = self.worker
        if w.window.full(w.config.window_bytes):
            w.retire(wait=True)            # window full: wait for the oldest message
        else:
            self.send_layers(w.queue.backlog.popleft())
        return True

    def send_layers(self, first: LayerItem) -> None:
        """Send the request's layers that are ready now, from `first` on: as many as the window
        has room for, in messages of up to max_message_bytes (`plan_messages`), announced by one
        control frame, so the receiver posts every receive at once and the wire never waits for
        a frame in between. A queued item carries `count` consecutive layers behind one ready
        event (an all-ready send is one item)."""
        w = self.worker
        rid, idx = first.rid, first.idx
        w.mark("send.pick", rid)
        cfg, store = w.config, w.store
        fresh = idx == 0 and rid not in w.prepared
        known = w.check_aborted(rid, fresh)
        shape = tuple(store.block_payload_shape(len(known.spec.src_block_ids))) if known else ()
        layer_bytes = math.prod(shape) * store.dtype.itemsize or 1
        room = w.window.room(cfg.window_bytes, layer_bytes)
        events = self._take_ready(first, room)     # one per layer
        staging = self._staging_for(cfg)
        parts = self._fit(rid, idx, events, max(1, cfg.max_message_bytes // layer_bytes), layer_bytes, staging)
        if not events:                   # no room until the oldest message is done
            if not room:
                w.queue.backlog.appendleft(first)
            w.retire(wait=True)
            return
        rec = w.table.start_work(rid, len(parts))
        if rec is None:                  # aborted or failed meanwhile: skip its queued layers
            w.queue.skip(rid)
            w.forget(rid)
            return
        self._post_messages(rec, fresh, idx, events, parts, shape, layer_bytes, staging)

    def _take_ready(self, first: LayerItem, room: int) -> list[Any]:
        """The ready events of up to `room` layers of first's request, from `first` on (more of
        its queued items join; what does not fit goes back to the front of the backlog)."""
        backlog, rid = self.worker.queue.backlog, first.rid
        events: list[Any] = []
        item = first
        while room:
            take = min(item.count, room - len(events))
            events += [item.ready] * take
            if take < item.count:            # the rest waits for room
                backlog.appendleft(LayerItem(rid, item.idx + take, item.ready, item.count - take))
                break
            if not (len(events) < room and backlog and isinstance(backlog[0], LayerItem)
                    and backlog[0].rid == rid):
                break
            item = backlog.popleft()
        return events

    def _fit(self, rid: str, idx: int, events: list[Any], per_msg: int, layer_bytes: int,
             staging: StagingRing) -> list[int]:
        """The messages' layer counts for `events`, cut (in place) to what the staging ring has
        room for while earlier messages hold some of it; the rest is queued again."""
        parts: list[int] = []
        while events:
            parts = plan_messages(len(events), per_msg)
            if not self.worker.window.messages or staging.fits([n * layer_bytes for n in parts]):
                break
            keep = len(events) // 2          # the ring's free space is split: send fewer now
            self.worker.queue.requeue(rid, idx + keep, events[keep:])
            del events[keep:]
        return parts

    def _post_messages(self, rec: TransferRecord, fresh: bool, idx: int, events: list[Any],
                       parts: list[int], shape: tuple[int, ...], layer_bytes: int,
                       staging: StagingRing) -> None:
        """Stage, announce, gather and post the messages of one claimed batch (`rec` holds a
        claim per part; those never posted are given back, as is their staging)."""
        w, rid, dtype = self.worker, rec.request_id, self.worker.store.dtype
        spec, claims, bufs = rec.spec, len(parts), []
        try:
            link = w.link_for(fresh=fresh)
            layers = list(spec.layers[idx:idx + len(events)])
            try:                        # staging first: an OOM fails this transfer only
                for n in parts:
                    bufs.append(staging.take((n, *shape), dtype))
            except Exception as exc:
                self._no_staging(rid, layers, exc)
                return
            link.send_frame(LayersFrame(rid, idx, layers, parts, list(shape),
                                        str(bufs[0][0].dtype).removeprefix("torch.")).to_msg(),
                            w.config.timeout_s)
            w.mark("send.frame", rid)
            at = 0
            for n, (buf, lease) in zip(parts, list(bufs)):   # each send is ordered after its gather
                self._gather(rid, spec, layers[at:at + n], events[at:at + n], buf)
                w.mark(f"send.gathered {n}", rid)
                posted = self._post(link, buf)
                claims -= 1
                bufs.pop(0)
                w.mark(f"send.posted {n}", rid)
                w.window.add(Message(rec, n, posted, buf, lease, time.monotonic(), n * layer_bytes))
                w.messages_sent += 1
                at += n
            w.sent(rid, last=idx + len(layers) == spec.num_layers)
        finally:
            for _ in range(claims):     # parts never posted (the link broke): give them back
                w.table.end_work(rec, 0)
            if bufs and w.stream is not None:
                w.stream.synchronize()  # a gather queued into them may still run
            for _buf, lease in reversed(bufs):
                staging.give(lease)

    def _no_staging(self, rid: str, layers: list[int], exc: Exception) -> None:
        w = self.worker
        w.table.finish(rid, TransferState.FAILED, KVTransferError(
            f"transfer {rid!r}: no staging memory for layers {layers}: {exc}"))
        w.queue.skip(rid)
        w.forget(rid)
        w.send_end(rid, "failed", f"sender could not stage layers {layers}: {exc}")

    def _gather(self, rid: str, spec: TransferSpec, layers: list[int], events: list[Any],
                out: torch.Tensor) -> None:
        w = self.worker
        ctx = torch.cuda.stream(w.stream) if w.stream is not None else contextlib.nullcontext()
        index = self.block_index(rid, spec)
        with ctx:
            for event in dict.fromkeys(events):      # layers queued together share one event
                if event is not None and w.stream is not None:
                    w.stream.wait_event(event)
            for at, run in layer_runs(layers):
                w.store.gather_layers(run, index, out=out[at:at + len(run)])

    def _staging_for(self, cfg: KVTransferConfig) -> StagingRing:
        """The message buffers; made again (once idle) when the window was resized."""
        st = self.staging
        if st is None or (st.capacity != cfg.window_bytes and st.idle):
            st = self.staging = StagingRing(cfg.window_bytes, self.worker.store.device)
        return st

    def block_index(self, rid: str, spec: TransferSpec) -> torch.Tensor:
        index = self.index.get(rid)
        if index is None:                    # gathers run on the worker's stream, after the copy
            w = self.worker
            index = self.index[rid] = device_index(w.store, spec.src_block_ids, w.index_stream,
                                                   w.stream, w.pinned)
        return index

    def _post(self, link: PeerLink, data: torch.Tensor) -> Pending:
        stream = self.worker.stream
        if stream is None:
            return link.isend_data(data)
        with torch.cuda.stream(stream):      # NCCL orders its send after the gather
            return link.isend_data(data)

    def give(self, lease: StagingRing.Lease | None) -> None:
        """A message's staging is free again (it completed, or its link closed)."""
        if self.staging is not None:
            self.staging.give(lease)

    def forget(self, rid: str) -> None:
        self.index.pop(rid, None)
