"""Rank r > 0 of a tensor-parallel worker, as a KV transport end: its own sender and receiver on
its own cache (its KV heads) and its own connector (`rank_actor_id`), driven by rank 0
(`tp_ends.RankEnds`: each call is one of this class's methods, by name).

Rank 0 registers each rank-level transfer here before any data can come (`expect`, `begin`); a
send of layers a step writes is asked for at that step's first layer (`send_when_written`), and
each layer goes as this rank's step loop writes it (`layer_written`), the rest when the step
ends (`stepped`), so a layer is never read before it is written here. `settle` waits for transfers to end and says how; this rank owns no blocks, so a release
needs nothing here. Calls come from two threads (rank 0's calls, the step loop): one lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from tandem.kv_transfer.base import KVTransferError, TransferState
from tandem.kv_transfer.receiver import LayerStreamReceiver
from tandem.kv_transfer.sender import LayerStreamSender
from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.tp_ends import TPLayout

OPS = ("expect", "redirect", "begin", "send", "send_when_written", "abort", "settle")


class RankTransport:
    def __init__(self, cache, connector, config, layout: TPLayout):
        self.connector = connector
        self.sender = LayerStreamSender(cache, connector, config)
        self.receiver = LayerStreamReceiver(cache, connector, config)
        self.sender.peer_stores = layout.stores(cache, sending=True)
        self.receiver.peer_stores = layout.stores(cache, sending=False)
        self._lock = threading.RLock()          # settle aborts under it
        self.steps = 0                                   # steps this rank has run
        self._layers: dict[str, deque[int]] = {}         # transfers begun: their layers not sent yet
        self._due: dict[str, int] = {}                   # transfer -> the step that writes its layers

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
                self._layers[s.request_id] = deque(s.layers)

    def send(self, specs: list[TransferSpec], step: int) -> None:
        """All layers of `specs`, written by step `step` at the latest."""
        with self._lock:
            self.begin(specs)
            self.send_when_written([s.request_id for s in specs], step)

    def send_when_written(self, rids: list[str], step: int) -> None:
        """Send each layer of `rids` as step `step` writes it here (rank 0 asks at its first
        layer of that step), the rest once the step ran; at once when it ran already."""
        with self._lock:
            for rid in rids:
                if rid in self._layers:          # else aborted meanwhile (settle says so)
                    self._due[rid] = step
            self._send_due()

    def layer_written(self, layer: int) -> None:
        """The step loop's per-layer hook: `layer` of the step running now is written."""
        if self._due:
            with self._lock:
                self._send_due(layer)

    def stepped(self, steps: int) -> None:
        """The step loop ran step `steps`: what waited for it goes."""
        with self._lock:
            self.steps = steps
            self._send_due()

    def _send_due(self, written: int | None = None) -> None:
        for rid, step in list(self._due.items()):
            if self.steps >= step:
                self._send_next(rid, None)
                del self._due[rid]
            elif written is not None and step == self.steps + 1:
                self._send_next(rid, written)

    def _send_next(self, rid: str, upto: int | None) -> None:
        """The layers of `rid` not sent yet, in the spec's order, up to layer `upto` (None: all)."""
        layers = self._layers.get(rid)
        while layers and (upto is None or layers[0] <= upto):
            self.sender.send_layer(rid, layers.popleft())
        if not layers:
            self._layers.pop(rid, None)

    def abort(self, rids: list[str], sending: bool) -> None:
        with self._lock:
            end = self.sender if sending else self.receiver
            for rid in rids:
                if sending:
                    self._due.pop(rid, None)
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
