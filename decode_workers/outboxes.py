"""What a decode actor has produced for each router, until that router's next `get_outputs`:
one queue per router, holding one list of outputs per step. A router that stops polling is
noticed here (`silent`), and its queue cut down to the error messages only (`keep_errors_only`)."""

from __future__ import annotations

import queue
import threading
from typing import Callable

from tandem.wire.messages import Output, OutputError


class Outboxes:
    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self._boxes: dict[str, queue.SimpleQueue] = {}
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}   # router id -> the clock at its last poll (or reserve)
        self._expired: set[str] = set()     # handled already; a poll or reserve revives one
        self._put: dict[str, int] = {}      # router id -> lists put for it so far
        self._taken: dict[str, int] = {}    # ... of which its polls took this many

    def put(self, router_id: str, outputs: list[Output]) -> int:
        """-> a ticket: `delivered(router_id, ticket)` once the router's poll took these outputs."""
        box = self._box(router_id)
        with self._lock:
            n = self._put[router_id] = self._put.get(router_id, 0) + 1
            box.put(outputs)
        return n

    def delivered(self, router_id: str, ticket: int) -> bool:
        """The router took the outputs `put` gave this ticket for (or it stopped polling)."""
        return self._taken.get(router_id, 0) >= ticket or router_id in self._expired

    def seen(self, router_id: str) -> None:
        """The router is alive (it polled, or reserved a request)."""
        self._seen[router_id] = self.clock()
        self._expired.discard(router_id)

    def take(self, router_id: str, timeout_s: float) -> list[Output]:
        """Everything queued for `router_id`, waiting up to `timeout_s` for the first step's."""
        self.seen(router_id)
        box = self._box(router_id)
        with self._lock:     # every list put so far is in the box now: this call takes them all
            upto = self._put.get(router_id, 0)
        out: list[Output] = []
        try:
            out.extend(box.get(timeout=timeout_s))
        except queue.Empty:
            self._taken[router_id] = max(self._taken.get(router_id, 0), upto)
            return out
        while True:
            try:
                out.extend(box.get_nowait())
            except queue.Empty:
                self._taken[router_id] = max(self._taken.get(router_id, 0), upto)
                return out

    def silent(self, timeout_s: float) -> set[str]:
        """Routers that have not polled for `timeout_s`, not reported before; reported once."""
        now = self.clock()
        gone = {r for r, t in list(self._seen.items()) if now - t > timeout_s and r not in self._expired}
        self._expired |= gone
        return gone

    def keep_errors_only(self, router_id: str) -> None:
        """Drop a silent router's token stream, keeping the error messages for when it comes back."""
        with self._lock:
            box = self._boxes.get(router_id)
            self._taken[router_id] = self._put.get(router_id, 0)   # what it drops is never delivered
            if box is None:
                return
            kept: list[Output] = []
            while True:
                try:
                    kept.extend(m for m in box.get_nowait() if isinstance(m, OutputError))
                except queue.Empty:
                    break
            if kept:
                box.put(kept)
            else:
                del self._boxes[router_id]

    def _box(self, router_id: str) -> queue.SimpleQueue:
        with self._lock:
            box = self._boxes.get(router_id)
            if box is None:
                box = self._boxes[router_id] = queue.SimpleQueue()
            return box
