"""The decode end of a KV transfer, over any `Connector` (fake, gloo, NCCL).

`expect(spec)` registers a transfer into blocks the owner reserved (and has the peer's loop copy
its block ids to the device). Per sending peer, a receive loop (`recv_loop.PeerRecvLoop`) reads
the link on background threads, on one of two data paths picked per link by the sender's first
frame and this end's answer: the direct copy (`direct_recv`: this end maps the sender's cache and
copies the blocks out of it) or the streamed path (`streamed_recv`: the data comes through the
link into staging and is scattered into the spec's dst blocks). Layers must come in the spec's
order. The owner's decode loop never blocks on any of it; it learns of finished transfers from
`reap()`.

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
from typing import Callable

from tandem.kv_transfer.base import BlockStore, KVReceiver, KVTransferAborted, KVTransferError, KVTransferTimeout, ReleaseCallback, TransferState
from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.link import Connector
from tandem.kv_transfer.recv_loop import PeerRecvLoop
from tandem.kv_transfer.records import TransferTable

_MAX_EARLY = 4096


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
        # peer actor id -> the store its data comes from / lands in (kv_transfer.reshard: the
        # heads a rank of another tensor-parallel size gets); None: the whole cache
        self.peer_stores: Callable[[str], BlockStore] | None = None
        self.config = config
        self._on_release = on_release
        self._table = TransferTable(self._release, releases_on=(TransferState.FAILED,
                                                                TransferState.ABORTED), clock=clock,
                                    on_transition=on_transition)
        self._lock = threading.Lock()          # loops and early arrivals
        self._loops: dict[str, PeerRecvLoop] = {}
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
                    loop = self._loops[spec.sender_id] = PeerRecvLoop(self, spec.sender_id)
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
                self._loops[spec.sender_id] = PeerRecvLoop(self, spec.sender_id)
            if spec.sender_id in self._loops:
                self._loops[spec.sender_id].prepare(spec)

    def store_for(self, peer: str) -> BlockStore:
        return self.store if self.peer_stores is None else self.peer_stores(peer)

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

    def _loop_ended(self, loop: PeerRecvLoop, err: KVTransferError) -> None:
        with self._lock:
            if self._loops.get(loop.peer) is loop:
                del self._loops[loop.peer]
            if not self._closed:
                self._table.fail_peer(loop.peer, err)
