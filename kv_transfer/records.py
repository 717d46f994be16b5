"""The transfer table one end keeps: each request's state, per-layer progress and deadline, and the
release callbacks owed to the owner.

Promises: a transfer enters a terminal state once; `on_release` is owed at most once per transfer
and never while the transport is still touching its blocks (`busy`); callbacks run only inside
`run_releases()`, which the end's public methods call on the owner's thread, so the owner's block
allocator needs no lock. Background threads and the owner share the table under one lock.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from tandem.kv_transfer.base import KVTransferAborted, KVTransferError, KVTransferTimeout, ReleaseCallback, TransferState
from tandem.kv_transfer.spec import TransferSpec

log = logging.getLogger(__name__)


@dataclass
class TransferRecord:
    spec: TransferSpec
    peer: str
    deadline: float = math.inf       # FAILED with KVTransferTimeout once the clock passes it
    state: TransferState = TransferState.WAITING
    layers_done: int = 0
    error: KVTransferError | None = None
    busy: int = 0                    # messages of it the transport is reading/writing blocks for
    release_due: bool = False        # terminal; release waits for `busy` to clear

    @property
    def request_id(self) -> str:
        return self.spec.request_id


class TransferTable:
    def __init__(self, on_release: ReleaseCallback, releases_on: Iterable[TransferState],
                 clock: Callable[[], float] = time.monotonic, max_finished: int = 4096,
                 on_transition: Callable[[], None] | None = None):
        self._on_release = on_release
        # Called (under the table's lock, on whichever thread) when a transfer becomes terminal,
        # so an owner that sleeps between polls can wake for reap(); it must not call back in.
        self._on_transition = on_transition
        self._releases_on = frozenset(releases_on)
        self.clock = clock
        self._max_finished = max_finished
        self._cond = threading.Condition()
        self._records: dict[str, TransferRecord] = {}
        # the unfinished ones only: what expiry and per-peer lookups walk on every poll and reap
        # (the finished are kept up to max_finished, thousands on a busy actor)
        self._live: dict[str, TransferRecord] = {}
        self._finished: deque[str] = deque()             # terminal rids, oldest first, for pruning
        self._releases: deque[str] = deque()             # callbacks owed to the owner
        self._transitions: deque[tuple[str, TransferState]] = deque()

    # ---- owner side ---------------------------------------------------------------------------
    def add(self, spec: TransferSpec, peer: str, deadline: float = math.inf) -> TransferRecord:
        with self._cond:
            old = self._records.get(spec.request_id)
            if old is not None and not old.state.terminal:
                raise ValueError(f"transfer {spec.request_id!r} is already in progress")
            rec = TransferRecord(spec=spec, peer=peer, deadline=deadline)
            self._records[spec.request_id] = rec
            self._live[spec.request_id] = rec
            return rec

    def get(self, request_id: str) -> TransferRecord | None:
        with self._cond:
            return self._records.get(request_id)

    def state(self, request_id: str) -> TransferState:
        with self._cond:
            self._expire_locked(self.clock())
            return self._records[request_id].state

    def progress(self, request_id: str) -> tuple[int, int]:
        with self._cond:
            rec = self._records[request_id]
            return rec.layers_done, rec.spec.num_layers

    def wait(self, request_id: str, timeout: float) -> TransferState:
        end = self.clock() + timeout
        with self._cond:
            while True:
                rec = self._records[request_id]
                now = self.clock()
                self._expire_locked(now)
                if rec.state.terminal and not (rec.busy and rec.state in self._releases_on):
                    break              # terminal, and the blocks are ours again where they are owed
                if rec.state.terminal and now >= end:
                    break
                if now >= end:
                    self._finish_locked(rec, TransferState.FAILED, KVTransferTimeout(
                        f"transfer {request_id!r}: not done after waiting {timeout:.3g}s "
                        f"({rec.layers_done}/{rec.spec.num_layers} layers)"))
                    break
                self._cond.wait(max(1e-4, min(end, rec.deadline) - now))
        self.run_releases()
        return outcome(rec)

    def run_releases(self) -> None:
        while True:
            with self._cond:
                if not self._releases:
                    return
                rid = self._releases.popleft()
            self._on_release(rid)

    def reap(self) -> list[tuple[str, TransferState]]:
        with self._cond:
            self._expire_locked(self.clock())
            out = list(self._transitions)
            self._transitions.clear()
        self.run_releases()
        return out

    # ---- both sides ---------------------------------------------------------------------------
    def finish(self, request_id: str, state: TransferState, error: KVTransferError | None = None) -> bool:
        """Move to a terminal state; False when it already was terminal (first outcome wins)."""
        with self._cond:
            rec = self._records.get(request_id)
            return rec is not None and self._finish_locked(rec, state, error)

    def fail_peer(self, peer: str, error: KVTransferError) -> list[str]:
        """Fail every unfinished transfer with `peer` (its link broke)."""
        with self._cond:
            hit = [r for r in self._live.values() if r.peer == peer]
            for rec in hit:
                self._finish_locked(rec, TransferState.FAILED, error)
            return [r.request_id for r in hit]

    def active_with(self, peer: str) -> int:
        with self._cond:
            return sum(1 for r in self._live.values() if r.peer == peer)

    # ---- background side ----------------------------------------------------------------------
    def start_work(self, request_id: str, messages: int = 1) -> TransferRecord | None:
        """Claim the blocks of an unfinished transfer for `messages` messages (several may be in
        flight; each gives its claim back with end_work); None if it is finished."""
        with self._cond:
            rec = self._records.get(request_id)
            if rec is None or rec.state.terminal:
                return None
            rec.busy += messages
            return rec

    def reassign(self, rec: TransferRecord, spec: TransferSpec, peer: str) -> None:
        """A transfer that has not started gets another spec and peer (the receiver's redirect)."""
        with self._cond:
            rec.spec, rec.peer = spec, peer

    def live(self, request_id: str) -> TransferRecord | None:
        """The record of an unfinished transfer, without claiming its blocks; None if finished."""
        with self._cond:
            rec = self._records.get(request_id)
            return None if rec is None or rec.state.terminal else rec

    def end_work(self, rec: TransferRecord, advanced: int, next_deadline: float = math.inf) -> None:
        """Give back one message's claim on the blocks; `advanced`: layers it moved (0 if none).
        A release owed meanwhile is queued once the last claim is given back."""
        with self._cond:
            rec.busy -= 1
            if advanced and not rec.state.terminal:
                rec.layers_done += int(advanced)
                rec.deadline = next_deadline
                if rec.layers_done == rec.spec.num_layers:
                    self._finish_locked(rec, TransferState.DONE, None)
                else:
                    rec.state = TransferState.TRANSFERRING
            if rec.release_due and not rec.busy:
                rec.release_due = False
                self._releases.append(rec.request_id)
            self._cond.notify_all()

    # ---- internals ----------------------------------------------------------------------------
    def _finish_locked(self, rec: TransferRecord, state: TransferState,
                       error: KVTransferError | None) -> bool:
        if rec.state.terminal:
            return False
        rec.state, rec.error = state, error
        if self._live.get(rec.request_id) is rec:
            del self._live[rec.request_id]
        if state is TransferState.FAILED:  # aborts are asked for; a failure is news to an operator
            log.warning("KV transfer %s with %s failed after %d/%d layers: %s", rec.request_id, rec.peer,
                        rec.layers_done, rec.spec.num_layers, error)
        self._transitions.append((rec.request_id, state))
        if self._on_transition is not None:
            self._on_transition()
        if state in self._releases_on:
            if rec.busy:
                rec.release_due = True
            else:
                self._releases.append(rec.request_id)
        self._finished.append(rec.request_id)
        self._prune_locked()
        self._cond.notify_all()
        return True

    def _expire_locked(self, now: float) -> None:
        for rec in [r for r in self._live.values() if now > r.deadline]:
            if not rec.state.terminal:
                what = "first layer" if rec.layers_done == 0 else f"layer {rec.layers_done + 1}"
                self._finish_locked(rec, TransferState.FAILED, KVTransferTimeout(
                    f"transfer {rec.request_id!r}: {what} of {rec.spec.num_layers} did not arrive "
                    f"from {rec.peer!r} in time"))

    def _prune_locked(self) -> None:
        while len(self._finished) > self._max_finished:
            rid = self._finished.popleft()
            rec = self._records.get(rid)
            if rec is not None and rec.state.terminal and not rec.busy and not rec.release_due:
                del self._records[rid]


def outcome(rec: TransferRecord) -> TransferState:
    """DONE is returned; FAILED and ABORTED raise their typed error (a fresh instance per call)."""
    if rec.state is TransferState.DONE:
        return rec.state
    if rec.state is TransferState.ABORTED:
        raise KVTransferAborted(str(rec.error) if rec.error else f"transfer {rec.request_id!r} aborted")
    if rec.state is TransferState.FAILED:
        err = rec.error or KVTransferError(f"transfer {rec.request_id!r} failed")
        raise type(err)(str(err))
    raise AssertionError(f"outcome of an unfinished transfer ({rec.state})")
