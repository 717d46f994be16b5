"""Where a prefill's first output token meets the router asking for it: one future per transfer
id, made by whichever comes first, the router's `first_token` call (any thread) or the engine loop
resolving it. Resolved ones nobody asked for are dropped oldest first."""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future

from tandem.wire.errors import TransferFailed
from tandem.wire.messages import FirstTokenReady


class FirstTokenBoard:
    def __init__(self, keep: int = 4096, drop: int = 1024):
        self._ready: collections.OrderedDict[str, Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._keep, self._drop = keep, drop

    def wait(self, tid: str, timeout_s: float) -> FirstTokenReady:
        """Block until `tid`'s first token is resolved (or raise what ended it)."""
        fut = self._future(tid)
        try:
            return fut.result(timeout_s)
        finally:
            with self._lock:
                self._ready.pop(tid, None)

    def resolve(self, tid: str, first: FirstTokenReady | None, error: BaseException | None = None) -> None:
        """`first`, or the error that ended the transfer without one; the first answer wins."""
        fut = self._future(tid)
        if not fut.done():
            if first is not None:
                fut.set_result(first)
            else:
                fut.set_exception(error or TransferFailed(f"transfer {tid} ended without a first token"))

    def __len__(self) -> int:
        return len(self._ready)

    def _future(self, tid: str) -> Future:
        with self._lock:
            fut = self._ready.get(tid)
            if fut is None:
                fut = self._ready[tid] = Future()
                if len(self._ready) > self._keep:        # resolved long ago and never asked for
                    for old in [t for t, f in self._ready.items() if f.done()][:self._drop]:
                        del self._ready[old]
            return fut
