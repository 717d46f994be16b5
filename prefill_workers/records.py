"""One record per prefill request, keyed by its transfer id: the engine request (its blocks), its
prefix pulls, its timings, its first token and the caller waiting for the transfer's end.

A record moves RESERVED -> (PULLING ->) SENDING -> ended, and an ended one whose blocks a prefix
pull may still write into waits as PARKED until the pull lets go. The transitions below only change
the record and say what the worker must do next (schedule it, abort its transfer, free its
blocks); the worker does it. They never touch the engine or the transport.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field

from tandem.engine.request import Request
from tandem.wire.messages import FirstToken


class PrefillState(enum.Enum):
    RESERVED = "reserved"   # blocks held; the router has not called `start` yet
    PULLING = "pulling"     # started; waiting for a prefix pull before it is scheduled
    SENDING = "sending"     # scheduled: computing, each layer of the final step sent as it ends
    PARKED = "parked"       # ended; its blocks wait for a prefix pull that may still write them
    ENDED = "ended"         # ended; its blocks are free (or the engine frees them)


@dataclass(eq=False)
class PrefillJob:
    transfer_id: str
    request: Request
    reserved_at: float                   # the worker's clock: expiry, and reserve -> KV latency
    state: PrefillState = PrefillState.RESERVED
    pulls: dict[str, int] = field(default_factory=dict)   # pending pull id -> tokens it covers
    holds: set[str] = field(default_factory=set)          # pull ids that may still write its blocks
    started_at: float | None = None      # perf_counter() at `start`
    scheduled_at: float | None = None    # perf_counter() when queued for compute (prefix pulled)
    first: FirstToken | None = None
    done: Future | None = None           # `start`'s caller: the transfer's end

    @property
    def started(self) -> bool:
        return self.state in (PrefillState.PULLING, PrefillState.SENDING)

    @property
    def live(self) -> bool:
        """Reserved or started: it may still compute and send."""
        return self.state in (PrefillState.RESERVED, PrefillState.PULLING, PrefillState.SENDING)

    def expired(self, now: float, timeout_s: float) -> bool:
        return self.state is PrefillState.RESERVED and now - self.reserved_at > timeout_s

    # ---- transitions -------------------------------------------------------------------------
    def add_pull(self, pull_id: str, covers: int) -> None:
        """A prefix pull will land in its blocks (registered before `start`)."""
        if self.state is not PrefillState.RESERVED:
            raise ValueError(f"a pull for {self.transfer_id} in state {self.state.value}")
        self.pulls[pull_id] = covers
        self.holds.add(pull_id)

    def drop_pull(self, pull_id: str) -> None:
        """The pull was never registered with the receiver."""
        self.pulls.pop(pull_id, None)
        self.holds.discard(pull_id)

    def start(self, now: float, done: Future) -> bool:
        """RESERVED -> PULLING or SENDING; True: schedule it now (no pull pending)."""
        if self.state is not PrefillState.RESERVED:
            raise ValueError(f"start of {self.transfer_id} in state {self.state.value}")
        self.started_at, self.done = now, done
        self.state = PrefillState.PULLING if self.pulls else PrefillState.SENDING
        return self.state is PrefillState.SENDING

    def scheduled(self, now: float) -> None:
        self.scheduled_at = now

    def pull_landed(self, pull_id: str) -> tuple[int, bool] | None:
        """A pending pull's KV is in: -> (tokens it covers, schedule it now), or None when the pull
        no longer matters (the request ended meanwhile)."""
        covers = self.pulls.pop(pull_id, None)
        if covers is None or not self.live:
            return None
        schedule = self.state is PrefillState.PULLING
        if schedule:
            self.state = PrefillState.SENDING
        return covers, schedule

    def pull_failed(self, pull_id: str) -> bool:
        """A pending pull failed: True when its transfer must be aborted (started already; before
        `start` the request just computes its prefix itself)."""
        return self.pulls.pop(pull_id, None) is not None and self.started

    def let_go(self, pull_id: str) -> bool:
        """Pull `pull_id` writes no more into the blocks: True when they are to be freed now."""
        self.holds.discard(pull_id)
        if self.state is PrefillState.PARKED and not self.holds:
            self.state = PrefillState.ENDED
            return True
        return False

    def end(self) -> list[str]:
        """Ended (done, failed, aborted, expired): -> the pending pulls to abort. Call `settle`
        once they are aborted."""
        pending, self.pulls = list(self.pulls), {}
        return pending

    def settle(self) -> bool:
        """After `end`'s pulls were aborted: True when the blocks are to be freed now (no pull
        holds them), else they stay PARKED until `let_go`."""
        self.state = PrefillState.PARKED if self.holds else PrefillState.ENDED
        return self.state is PrefillState.ENDED
