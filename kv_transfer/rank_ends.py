"""Rank r > 0 of a tensor-parallel worker, as a KV transport end: its own sender and receiver on
its own cache (its KV heads) and its own connector (`rank_actor_id`), driven by rank 0
(`tp_ends.RankEnds`: each call is one of this class's methods, by name).

Rank 0 registers each rank-level transfer here before any data can come (`expect`, `begin`); a
send of layers a step writes is asked for while that step runs (`send_when_stepped`) and starts
once this rank has run it (`stepped`, from its step loop), so a layer is never read before it is
written. `settle` waits for transfers to end and says how; this rank owns no blocks, so a release
needs nothing here. Calls come from two threads (rank 0's calls, the step loop): one lock.
"""

from __future__ import annotations

import threading
import time

from tandem.kv_transfer.base import KVTransferError, TransferState
from tandem.kv_transfer.receiver import LayerStreamReceiver
from tandem.kv_transfer.sender import LayerStreamSender
from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.tp_ends import TPLayout

OPS = ("expect", "redirect", "begin", "send", "send_when_stepped", "abort", "settle")


class RankTransport:
    def __init__(self, cache, connector, config, layout: TPLayout):
        self.connector = connector
        self.sender = LayerStreamSender(cache, connector, config)
        self.receiver = LayerStreamReceiver(cache, connector, config)
        self.sender.peer_stores = layout.stores(cache, sending=True)
        self.receiver.peer_stores = layout.stores(cache, sending=False)
        self._lock = threading.RLock()          # settle aborts under it
        self.steps = 0                                   # steps this rank has run
        self._waiting: list[tuple[int, list[str]]] = []  # (step, transfer ids) to send once it ran
        self._layers: dict[str, tuple[int, ...]] = {}    # transfers begun and not yet sent: their layers

    def call(self, op: str, *args):
        if op not in OPS:
            raise ValueError(f"rank transport: unknown call {op!r}")
        return getattr(self, op)(*args)

    def expect(self, specs: list[TransferSpec]) -> None:
        with self._lock:
            for s in specs:
                self.receiver.expect(s)

    def redirect(self, specs: list[TransferSpec]) -> None:
        with self._lock:
            for s in specs:
                self.receiver.redirect(s)

    def begin(self, specs: list[TransferSpec]) -> None:
        with self._lock:
            for s in specs:
                self.sender.begin(s)
                self._layers[s.request_id] = s.layers

    def send(self, specs: list[TransferSpec], step: int) -> None:
        """All layers of `specs`, written by step `step` at the latest."""
        with self._lock:
            self.begin(specs)
            self.send_when_stepped([s.request_id for s in specs], step)

    def send_when_stepped(self, rids: list[str], step: int) -> None:
        with self._lock:
            if self.steps >= step:
                self._send_all(rids)
            else:
                self._waiting.append((step, rids))

    def stepped(self, steps: int) -> None:
        """The step loop ran step `steps`: the sends that waited for it start."""
        with self._lock:
            self.steps = steps
            due = [rids for step, rids in self._waiting if step <= steps]
            self._waiting = [(step, rids) for step, rids in self._waiting if step > steps]
            for rids in due:
                self._send_all(rids)

    def _send_all(self, rids: list[str]) -> None:
        for rid in rids:
            for layer in self._layers.pop(rid, ()):   # none: aborted meanwhile (settle says so)
                self.sender.send_layer(rid, layer)

    def abort(self, rids: list[str], sending: bool) -> None:
        with self._lock:
            end = self.sender if sending else self.receiver
            for rid in rids:
                self._waiting = [(s, [r for r in ids if r != rid]) for s, ids in self._waiting]
                if sending:
                    self._layers.pop(rid, None)
                end.abort(rid)

    def settle(self, rids: list[str], sending: bool, timeout: float) -> dict[str, tuple[str, str]]:
        """Wait (up to `timeout`, then abort) until `rids` ended -> rid -> (state, why)."""
        end = self.sender if sending else self.receiver
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                states = {rid: self._state(end, rid) for rid in rids}
                if all(s.terminal for s in states.values()) or time.monotonic() >= deadline:
                    break
            time.sleep(0.001)
        out = {}
        with self._lock:
            for rid in rids:
                if not states[rid].terminal:
                    self.abort([rid], sending)
                out[rid] = (self._state(end, rid).value, self._why(end, rid))
            end.reap()
        return out

    @staticmethod
    def _state(end, rid: str) -> TransferState:
        try:
            return end.poll(rid)
        except KeyError:
            return TransferState.FAILED

    @staticmethod
    def _why(end, rid: str) -> str:
        try:
            end.wait(rid, 0)
            return ""
        except KeyError:
            return "unknown transfer on this rank"
        except KVTransferError as e:
            return str(e)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
