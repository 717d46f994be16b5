"""One record per decode request, keyed by its request id (and, while a KV transfer may still
write into its blocks, by its transfer id): the engine request, its router, its transfer, the
first token handed over before its KV, and when its first output went out (for TPOT).

A remotely prefilled request moves RESERVED -> RECEIVING -> (KV_READY ->) IN_ENGINE, and so does
a sequence moving in with its KV (its handoff token plays the first token's part); a locally
prefilled one is IN_ENGINE from its reserve. A sequence moved out with its KV goes IN_ENGINE ->
PAUSED -> SENDING -> GONE (or back IN_ENGINE when its router resumes it here). An aborted request whose blocks the receiver may still
write into waits as RELEASING until the receiver lets go. The transitions below only change the
record and say what the worker must do next; the worker does it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tandem.engine.request import Request
from tandem.wire.messages import FirstToken


class DecodeState(enum.Enum):
    RESERVED = "reserved"     # blocks held for a remote prefill; its receive not registered yet
    RECEIVING = "receiving"   # the receive is registered: the KV is on its way
    KV_READY = "kv_ready"     # the KV landed; the first token has not been handed over yet
    IN_ENGINE = "in_engine"   # in the engine's batch (local prefill, or remote with both halves)
    RELEASING = "releasing"   # aborted or failed; the receiver may still write into its blocks
    PAUSED = "paused"         # out of the batch with its KV, for its router to move it (or resume it)
    SENDING = "sending"       # its KV is on the way to the decode actor it moves to
    GONE = "gone"             # nothing held here any more


class AbortAction(enum.Enum):
    FREE_BLOCKS = "free_blocks"        # the worker frees the reserved blocks now
    ABORT_RECEIVE = "abort_receive"    # the receiver's release (or the reap of a landed one) frees them
    ABORT_IN_ENGINE = "abort_in_engine"  # the engine aborts it (and frees its blocks)
    DROP_PAUSED = "drop_paused"        # paused: the engine drops it (and frees its blocks) now
    ABORT_SEND = "abort_send"          # its KV is being sent: the sender's release frees them


class FirstTokenTaken(enum.Enum):
    ADMIT = "admit"       # the KV is here: join the batch now
    KEPT = "kept"         # the KV is still on its way: admitted when it lands
    REFUSED = "refused"   # the request is gone (aborted meanwhile)


@dataclass(eq=False)
class DecodeRequest:
    request: Request
    router_id: str | None            # who reads its outputs; None once told it ended
    transfer_id: str | None = None   # remote prefill only
    state: DecodeState = DecodeState.IN_ENGINE
    receiving: bool = False          # the receiver may write into its blocks (registered, not handed back)
    transfer_started_at: float | None = None   # perf_counter() when the receive was registered
    first: FirstToken | None = None            # handed over before the KV landed
    first_output_at: float | None = None       # the worker's clock at its first published output
    # a sequence moving in with its KV (decode_workers/moves_in.py): the positions reserved for it
    # (0: not a move), its pre-copy's record while that receive may land, and whether its tail
    # landed before the pre-copy did (it waits for it); on a pre-copy's record, the sequence's
    move_capacity: int = 0
    precopy: DecodeRequest | None = None
    tail_landed: bool = False
    precopy_of: DecodeRequest | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def awaiting_kv(self) -> bool:
        return self.state in (DecodeState.RESERVED, DecodeState.RECEIVING)

    @property
    def waiting(self) -> bool:
        """Holding blocks, not in the engine's batch yet."""
        return self.state in (DecodeState.RESERVED, DecodeState.RECEIVING, DecodeState.KV_READY)

    # ---- transitions -------------------------------------------------------------------------
    def registering(self) -> None:
        """About to register the receive: from now on the receiver may write (or release)."""
        self.receiving = True

    def registered(self, now: float) -> None:
        self.state, self.transfer_started_at = DecodeState.RECEIVING, now

    def registration_failed(self) -> None:
        self.receiving = False

    def released(self) -> bool:
        """The receiver lets go of a failed or aborted transfer's blocks: True when the worker
        frees them now (it held them)."""
        held, self.receiving = self.receiving, False
        if self.state is DecodeState.RELEASING:
            self.state = DecodeState.GONE
        return held

    def kv_arrived(self) -> FirstToken | None:
        """The whole prompt's KV landed: -> the first token to admit it with now, or None (it
        waits in KV_READY for the router's handover)."""
        if not self.awaiting_kv:
            raise ValueError(f"KV of {self.request_id} arrived in state {self.state.value}")
        self.receiving = False
        first, self.first = self.first, None
        self.state = DecodeState.IN_ENGINE if first is not None else DecodeState.KV_READY
        return first

    def transfer_failed(self) -> None:
        """The transfer failed: the request ends; its blocks come back with the receiver's release."""
        self.state = DecodeState.RELEASING if self.receiving else DecodeState.GONE

    def take_first(self, first: FirstToken) -> FirstTokenTaken:
        if self.state is DecodeState.KV_READY:
            self.state = DecodeState.IN_ENGINE
            return FirstTokenTaken.ADMIT
        if self.awaiting_kv:
            self.first = first
            return FirstTokenTaken.KEPT
        return FirstTokenTaken.REFUSED

    def abort(self) -> AbortAction:
        """Aborted by its router (or its router went silent)."""
        self.first = None
        if self.state is DecodeState.PAUSED:
            self.state = DecodeState.GONE
            return AbortAction.DROP_PAUSED
        if self.state is DecodeState.SENDING:
            self.state = DecodeState.RELEASING
            return AbortAction.ABORT_SEND
        if self.state is DecodeState.IN_ENGINE:
            self.state = DecodeState.GONE
            return AbortAction.ABORT_IN_ENGINE
        if self.awaiting_kv and self.receiving:
            self.state = DecodeState.RELEASING
            return AbortAction.ABORT_RECEIVE
        self.state = DecodeState.GONE
        return AbortAction.FREE_BLOCKS

    def landed_after_abort(self) -> bool:
        """A DONE transfer reaped after its request was aborted: True when the worker frees the
        blocks now (no release is owed for a DONE transfer)."""
        held, self.receiving = self.receiving, False
        self.state = DecodeState.GONE
        return held
