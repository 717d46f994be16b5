"""What the owner queues for one receiving peer, and the order the peer's send thread works through
it: an inbox any thread may put to, and the backlog the send thread has taken out of it.

Items: `BeginItem` (a transfer was registered: check the link, prepare its block ids),
`LayerItem` (`count` consecutive layers of a transfer, from the `idx`-th of its spec, written once
`ready` completes), `EndItem` (tell the receiver the sender ended a transfer), `VerifyItem` (check
the link after a send from the owner's thread). `None` asks the thread to stop; a wake-up only
makes it look at its messages in flight.
"""

from __future__ import annotations

import queue
from collections import deque
from typing import Any, NamedTuple, Union


class BeginItem(NamedTuple):
    rid: str
    all_ready: bool           # a queued `send`: no layer to overlap an upload of the ids with


class LayerItem(NamedTuple):
    rid: str
    idx: int                  # index in the spec's layers of the first one
    ready: Any                # CUDA event recorded once the layers are written (None: they are)
    count: int


class EndItem(NamedTuple):
    rid: str
    state: str                # "aborted" or "failed"
    reason: str


class VerifyItem(NamedTuple):
    rid: str


SendItem = Union[BeginItem, LayerItem, EndItem, VerifyItem]
_WAKE = object()


class SendQueue:
    def __init__(self) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.backlog: deque[SendItem] = deque()    # taken off the inbox, not yet sent (send thread)

    def put(self, item: "SendItem | None") -> None:
        self.inbox.put(item)

    def wake(self) -> None:
        self.inbox.put(_WAKE)

    def idle(self) -> bool:
        return self.inbox.empty() and not self.backlog

    def head(self) -> "SendItem | None":
        return self.backlog[0] if self.backlog else None

    def take(self, block: bool) -> bool:
        """Move queued items to the backlog; True when stop was asked."""
        try:
            item = self.inbox.get() if block else self.inbox.get_nowait()
            while True:
                if item is None:
                    return True
                if item is not _WAKE:
                    self.backlog.append(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            return False

    def wait(self, timeout: float | None) -> bool:
        """Block until an item (or a wake-up) is queued, or `timeout`; True when stop was asked."""
        try:
            item = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return False
        if item is None:
            return True
        if item is not _WAKE:
            self.backlog.append(item)
        return self.take(False)

    def requeue(self, rid: str, idx: int, events: list[Any]) -> None:
        """Put layers idx.. (one ready event each) back at the front of the backlog, in order."""
        items: list[LayerItem] = []
        for ev in events:
            if items and items[-1].ready is ev:
                items[-1] = items[-1]._replace(count=items[-1].count + 1)
            else:
                items.append(LayerItem(rid, idx, ev, 1))
            idx += 1
        self.backlog.extendleft(reversed(items))

    def skip(self, rid: str) -> None:
        """Drop the transfer's queued layers (it ended)."""
        self.backlog = deque(item for item in self.backlog
                             if not (isinstance(item, LayerItem) and item.rid == rid))
