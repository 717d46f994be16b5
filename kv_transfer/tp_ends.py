"""A worker's KV sender and receiver when it or its peers are tensor-parallel: each worker-level
transfer (the router's spec, between two workers) becomes its rank-level transfers
(`reshard.rank_specs`), the ones of this worker's rank 0 on its own sender or receiver, the others
on its ranks 1..N-1 (`RankEnds`, over Ray: workers.tp_ranks). The owner sees one transfer: the
same API, ids, states and release callbacks as `LayerStreamSender` / `LayerStreamReceiver`.

A worker-level transfer ends when all of its rank-level ones have: DONE when all are, else the
first failure, and then the rest are aborted. Once its own parts ended, rank 0 asks its ranks how
theirs end (`settle`, answered in the background: the answer wakes the owner, whose next reap
gives the verdict), so the owner's loop never waits on them for that; registering a transfer
(`expect`, `begin`, `send`) waits for every rank's answer, one round trip for all. The blocks
are released (the callbacks) only once every rank lets go of them. Ranks 1..N-1 of a sending
worker send each layer as their own step writes it, as rank 0 does (`send_layer` of the first
layer asks them, not waiting for the answer; one that comes after the step sends them all at
once). On one thread: the owner's (the serving loop's), as the ends it wraps.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Protocol

from tandem.kv_transfer.base import KVTransferAborted, KVTransferError, TransferState
from tandem.kv_transfer.receiver import LayerStreamReceiver
from tandem.kv_transfer.reshard import HeadSliceStore, rank_specs, route_between, split_actor_id
from tandem.kv_transfer.sender import LayerStreamSender
from tandem.kv_transfer.spec import TransferSpec

log = logging.getLogger(__name__)

SETTLE_TIMEOUT_S = 60.0
_KEEP_ENDED = 4096


class RankEnds(Protocol):
    """Ranks 1..N-1 of this worker, each with its own sender and receiver (`RankTransport`)."""

    def call(self, rank: int, op: str, *args):
        """Rank `rank`'s answer to `op`, waited for."""

    def post(self, rank: int, op: str, *args) -> None:
        """`op` on rank `rank`, not waited for (inside a step: a failure shows at `settle`)."""

    def ask(self, rank: int, op: str, *args, then: Callable[[], None] | None = None) -> "Answer":
        """`op` on rank `rank`, answered later; `then` is called (from any thread) once it is."""


class Answer(Protocol):
    def ready(self) -> bool: ...

    def get(self): ...


@dataclass
class TPLayout:
    """Who this end is and how the model's KV heads are split, here and at each peer."""
    worker_id: str
    rank: int
    tp: int
    num_kv_heads: int
    peer_tp: Callable[[str], int]       # a peer worker's tensor_parallel_size

    def stores(self, cache, sending: bool) -> Callable[[str], object]:
        """peer rank's actor id -> this rank's cache, or the heads of it that peer sends or gets."""
        def store(peer_actor: str):
            worker, peer_rank = split_actor_id(peer_actor)
            peer_tp = self.peer_tp(worker)
            route = (route_between(self.num_kv_heads, self.tp, peer_tp, self.rank, peer_rank) if sending
                     else route_between(self.num_kv_heads, peer_tp, self.tp, peer_rank, self.rank))
            heads = None if route is None else (route.src_heads if sending else route.dst_heads)
            if heads is None or len(heads) == self.num_kv_heads // self.tp:
                return cache
            return HeadSliceStore(cache, heads)
        return store


@dataclass
class _Transfer:
    spec: TransferSpec
    local: list[str]                                   # rank 0's rank-level ids
    remote: dict[int, list[str]]                       # rank -> its rank-level ids
    ended: dict[str, TransferState] = field(default_factory=dict)
    quiet: set[str] = field(default_factory=set)       # local ids whose blocks are let go of
    state: TransferState | None = None                 # the verdict, once every rank has ended
    error: str = ""
    answers: dict[int, Answer] | None = None           # each rank's `settle`, once asked
    aborted: bool = False                              # every rank was told to stop
    released: bool = False


class _Fanout:
    """What the sender and the receiver share: the split, the bookkeeping, the verdict."""
    sending: bool

    def __init__(self, inner, layout: TPLayout, ranks: RankEnds | None, on_release: Callable[[str], None],
                 on_transition: Callable[[], None] | None = None):
        self.inner, self.layout, self.ranks, self._on_release = inner, layout, ranks, on_release
        self._wake = on_transition or (lambda: None)
        self.store, self.connector = inner.store, inner.connector
        inner.peer_stores = layout.stores(inner.store, self.sending)
        self._xfers: dict[str, _Transfer] = {}
        self._by_local: dict[str, str] = {}
        self._ended: OrderedDict[str, _Transfer] = OrderedDict()   # the latest verdicts, for poll/wait

    def _split(self, spec: TransferSpec) -> _Transfer:
        lay = self.layout
        peer = spec.receiver_id if self.sending else spec.sender_id
        src_tp, dst_tp = (lay.tp, lay.peer_tp(peer)) if self.sending else (lay.peer_tp(peer), lay.tp)
        local, remote = [], {}
        for route, sub in rank_specs(spec, lay.num_kv_heads, src_tp, dst_tp):
            rank = route.src_rank if self.sending else route.dst_rank
            if rank == 0:
                local.append(sub)
            else:
                remote.setdefault(rank, []).append(sub)
        if remote and self.ranks is None:
            raise KVTransferError(f"transfer {spec.request_id!r}: ranks {sorted(remote)} of {lay.worker_id} "
                                  "are not reachable from here")
        return local, remote

    def _on_ranks(self, op: str, remote: dict[int, list[TransferSpec]], *args) -> None:
        """`op` with each rank's rank-level transfers, on all ranks at once; waits for every answer
        (registrations must be in place before any data can come)."""
        answers = [self.ranks.ask(rank, op, subs, *args) for rank, subs in remote.items()]
        for a in answers:
            a.get()

    @staticmethod
    def _direct(spec: TransferSpec, local: list[TransferSpec], remote: dict) -> bool:
        """One rank-level transfer, the worker-level one itself (two single-rank workers, or a
        worker's rank 0 talking to its peer's rank 0 only): the ends it wraps take it as it is,
        with their own ids, callbacks and states."""
        return not remote and local == [spec]

    def _add(self, spec: TransferSpec, local: list[TransferSpec], remote: dict[int, list[TransferSpec]]) -> None:
        x = _Transfer(spec, [s.request_id for s in local], {r: [s.request_id for s in subs] for r, subs in remote.items()})
        self._xfers[spec.request_id] = x
        for rid in x.local:
            self._by_local[rid] = spec.request_id

    def _sub_released(self, rid: str) -> None:
        parent = self._by_local.get(rid)
        if parent is None:
            self._on_release(rid)          # a direct one
        elif parent in self._xfers:
            self._xfers[parent].quiet.add(rid)

    def _get(self, request_id: str) -> _Transfer | None:
        """The fanned-out transfer; None: a direct one (or unknown: the inner end says so)."""
        return self._xfers.get(request_id) or self._ended.get(request_id)

    def poll(self, request_id: str) -> TransferState:
        x = self._get(request_id)
        if x is None:
            return self.inner.poll(request_id)
        if x.state is not None:
            return x.state
        states = [self.inner.poll(rid) for rid in x.local]
        return TransferState.TRANSFERRING if any(s is not TransferState.WAITING for s in states) else TransferState.WAITING

    def progress(self, request_id: str) -> tuple[int, int]:
        x = self._get(request_id)
        if x is None:
            return self.inner.progress(request_id)
        return min(self.inner.progress(rid) for rid in x.local)

    def wait(self, request_id: str, timeout: float) -> TransferState:
        x = self._get(request_id)
        if x is None:
            return self.inner.wait(request_id, timeout)
        if x.state is None:
            for rid in x.local:
                try:
                    self.inner.wait(rid, timeout)
                except KVTransferError:
                    pass
            self._settle(x)
        if x.state is TransferState.DONE:
            return x.state
        raise (KVTransferAborted if x.state is TransferState.ABORTED else KVTransferError)(x.error)

    def abort(self, request_id: str) -> None:
        x = self._xfers.get(request_id)
        if x is None:
            self.inner.abort(request_id)
            return
        if x.state is not None or x.aborted:
            return
        x.aborted = True
        for rid in x.local:
            self.inner.abort(rid)
        for rank, rids in x.remote.items():
            try:
                self.ranks.call(rank, "abort", rids, self.sending)
            except Exception as e:  # noqa: BLE001 - a rank gone takes its worker with it (tp_ranks)
                log.warning("transfer %s: abort on rank %d: %s", request_id, rank, e)

    def reap(self) -> list[tuple[str, TransferState]]:
        out = []
        for rid, state in self.inner.reap():
            parent = self._by_local.get(rid)
            if parent is None:
                out.append((rid, state))       # a direct one
            else:
                x = self._xfers[parent]
                x.ended[rid] = state
                if state is not TransferState.DONE:
                    self.abort(parent)         # the others cannot make it whole any more
        for x in list(self._xfers.values()):
            if x.state is None and len(x.ended) == len(x.local) and self._ranks_answered(x):
                self._settle(x)
            if x.state is not None and not x.released and self._let_go(x):
                x.released = True
                for rid in x.local:
                    self._by_local.pop(rid, None)
                del self._xfers[x.spec.request_id]
                self._ended[x.spec.request_id] = x
                while len(self._ended) > _KEEP_ENDED:
                    self._ended.popitem(last=False)
                if self._owes_release(x.state):
                    self._on_release(x.spec.request_id)
                out.append((x.spec.request_id, x.state))
        return out

    def close(self) -> None:
        self.inner.close()

    # ---- the verdict ---------------------------------------------------------------------------
    def _ranks_answered(self, x: _Transfer) -> bool:
        """This rank's part of `x` ended: ask the others how theirs end (not waiting: their
        answers wake the owner, whose next reap settles it); -> whether all have answered."""
        if x.answers is None:
            x.answers = {rank: self.ranks.ask(rank, "settle", rids, self.sending, SETTLE_TIMEOUT_S, then=self._wake)
                         for rank, rids in x.remote.items()}
        return all(a.ready() for a in x.answers.values())

    def _settle(self, x: _Transfer) -> None:
        """Every rank's end of `x` (the others waited for), -> x.state and x.error."""
        states = {rid: (self.inner.poll(rid), "") for rid in x.local}
        for rank, rids in x.remote.items():
            try:
                got = (x.answers[rank].get() if x.answers is not None
                       else self.ranks.call(rank, "settle", rids, self.sending, SETTLE_TIMEOUT_S))
            except Exception as e:  # noqa: BLE001 - a rank that cannot answer fails the transfer
                got = {rid: ("failed", f"rank {rank}: {type(e).__name__}: {e}") for rid in rids}
            states.update({rid: (TransferState(s), why) for rid, (s, why) in got.items()})
        bad = [(rid, s, why) for rid, (s, why) in states.items() if s is not TransferState.DONE]
        if not bad:
            x.state = TransferState.DONE
            return
        x.state = TransferState.ABORTED if all(s is TransferState.ABORTED for _, s, _ in bad) else TransferState.FAILED
        rid, s, why = next((b for b in bad if b[1] is TransferState.FAILED), bad[0])
        if not why and rid in x.local:
            try:
                self.inner.wait(rid, 0)
            except KVTransferError as e:
                why = str(e)
        x.error = f"transfer {x.spec.request_id!r}: {rid} {s.value}" + (f": {why}" if why else "")

    def _let_go(self, x: _Transfer) -> bool:
        return all(rid in x.quiet or x.ended.get(rid) is TransferState.DONE and not self.sending
                   for rid in x.local)

    def _owes_release(self, state: TransferState) -> bool:
        return self.sending or state is not TransferState.DONE


class ReshardingSender(_Fanout):
    sending = True

    def __init__(self, store, connector, config, layout: TPLayout, ranks: RankEnds | None = None,
                 on_release: Callable[[str], None] = lambda _rid: None, on_transition=None,
                 step: Callable[[], int] = lambda: 0):
        """`step`: the number of the step rank 0 runs now (its ranks send once they ran it)."""
        inner = LayerStreamSender(store, connector, config, on_release=self._sub_released, on_transition=on_transition)
        super().__init__(inner, layout, ranks, on_release, on_transition)
        self.step = step

    def begin(self, spec: TransferSpec) -> None:
        local, remote = self._split(spec)
        if self._direct(spec, local, remote):
            return self.inner.begin(spec)
        self._on_ranks("begin", remote)
        self._add(spec, local, remote)
        for sub in local:
            self.inner.begin(sub)

    def send_layer(self, request_id: str, layer: int, ready_event=None) -> None:
        x = self._xfers.get(request_id)
        if x is None:
            return self.inner.send_layer(request_id, layer, ready_event)
        for rid in x.local:
            self.inner.send_layer(rid, layer, ready_event)
        if layer == x.spec.layers[0]:     # the step that writes them runs: its ranks send as they write
            for rank, rids in x.remote.items():
                self.ranks.post(rank, "send_when_written", rids, self.step())

    def send(self, spec: TransferSpec) -> None:
        local, remote = self._split(spec)
        if self._direct(spec, local, remote):
            return self.inner.send(spec)
        self._on_ranks("send", remote, self.step())
        self._add(spec, local, remote)
        for sub in local:
            self.inner.send(sub)


class ReshardingReceiver(_Fanout):
    sending = False

    def __init__(self, store, connector, config, layout: TPLayout, ranks: RankEnds | None = None,
                 on_release: Callable[[str], None] = lambda _rid: None, on_transition=None):
        inner = LayerStreamReceiver(store, connector, config, on_release=self._sub_released, on_transition=on_transition)
        super().__init__(inner, layout, ranks, on_release, on_transition)

    def expect(self, spec: TransferSpec) -> None:
        local, remote = self._split(spec)
        if self._direct(spec, local, remote):
            return self.inner.expect(spec)
        self._on_ranks("expect", remote)
        self._add(spec, local, remote)
        for sub in local:
            self.inner.expect(sub)

    def redirect(self, spec: TransferSpec) -> None:
        """Another sender, of the same tensor-parallel size (else refused: its rank-level
        transfers would not pair up with the ones registered)."""
        x = self._xfers.get(spec.request_id)
        local, remote = self._split(spec)
        if x is None and self._direct(spec, local, remote):
            return self.inner.redirect(spec)
        if x is None or [s.request_id for s in local] != x.local or \
                {r: [s.request_id for s in subs] for r, subs in remote.items()} != x.remote:
            raise KVTransferError(f"transfer {spec.request_id!r} cannot be redirected to {spec.sender_id!r} "
                                  "(unknown, or a sender of another tensor-parallel size)")
        self._on_ranks("redirect", remote)
        for sub in local:
            self.inner.redirect(sub)
        x.spec = spec


def make_ends(store, connector, config, *, on_sent_release, on_received_release, on_transition,
              layout: TPLayout | None = None, ranks: RankEnds | None = None, step: Callable[[], int] = lambda: 0):
    """A worker's sender and receiver: the plain ones, or with a `layout` the resharding ones
    (which hand a transfer between single-rank workers to the plain ones unchanged)."""
    if layout is None:
        return (LayerStreamSender(store, connector, config, on_release=on_sent_release, on_transition=on_transition),
                LayerStreamReceiver(store, connector, config, on_release=on_received_release,
                                    on_transition=on_transition))
    return (ReshardingSender(store, connector, config, layout, ranks, on_release=on_sent_release,
                             on_transition=on_transition, step=step),
            ReshardingReceiver(store, connector, config, layout, ranks, on_release=on_received_release,
                               on_transition=on_transition))
