"""A pool worker that prefills for other workers, decodes, or both, over one engine: one serving
loop, one KV cache and prefix cache, one sender and one receiver on one connector
(`kv_transfer.shared`). It hosts the two parts the single-role workers are, `PrefillWorker` and
`DecodeWorker`, and fans the loop's hooks out to both; each part handles only its own requests
(a prefill's engine id is its transfer id, a decode request's its attempt id).

Its role says which part takes new work: "prefill" (reserves for remote prefills), "decode"
(reserves for decoding, with local prefill of short prompts) or "mixed" (both). `set_role` takes
effect at once and moves nothing: the part whose role is dropped refuses new reservations, as a
draining worker does, while its requests in flight (reserved, prefilling, sending, receiving,
decoding) finish; weights and KV cache stay. The actor's own `draining` stops both parts.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from tandem.decode_workers.worker import DecodeWorker
from tandem.engine.engine import LLMEngine
from tandem.engine.serving_loop import EngineLoop
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.link import Connector
from tandem.kv_transfer.shared import SharedEngine
from tandem.kv_transfer.tp_ends import RankEnds, TPLayout, make_ends
from tandem.prefill_workers.worker import PrefillWorker
from tandem.runtime.latency import DEFAULT_WINDOW_S
from tandem.wire.errors import InvalidRole
from tandem.wire.messages import DecodeReserve, PrefillReserve
from tandem.wire.stats import WorkerStats
from tandem.workers.stats import merge_stats

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "mixed")


class PoolWorker:
    def __init__(self, worker_id: str, pool: str, engine: LLMEngine, connector: Connector, role: str | None = None,
                 local_prefill_threshold: float = 256, transfer_config: KVTransferConfig | None = None,
                 reservation_timeout_s: float = 120.0, router_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, warmup: dict[str, Any] | None = None,
                 tp_layout: TPLayout | None = None, tp_ranks: RankEnds | None = None, latency_window_s: float = DEFAULT_WINDOW_S):
        """`pool`: where it started ("prefill" | "decode"), its role unless `role` is given.
        `tp_layout`: its transfers reshard KV by head for peers of other tensor-parallel sizes,
        `tp_ranks` its own ranks 1..N-1 (kv_transfer.tp_ends). The rest as `PrefillWorker` and
        `DecodeWorker` take them."""
        self.worker_id, self.pool, self.engine = worker_id, pool, engine
        self.role = _checked(role or pool)
        self._draining = False
        tcfg = transfer_config or KVTransferConfig(start_timeout_s=600.0)
        self.loop = EngineLoop(engine, on_step=self._on_step, before_step=self._before_step,
                               on_step_error=self._fail_step, name=f"{worker_id}-loop")
        shards = getattr(engine, "shards", None)   # tensor parallel: its step count
        self.sender, self.receiver = make_ends(
            engine.kv_cache, connector, tcfg, on_sent_release=self._sent_released,
            on_received_release=self._received_released, on_transition=self.loop.wake, layout=tp_layout,
            ranks=tp_ranks, step=(lambda: shards.steps) if shards is not None else (lambda: 0))
        shared = SharedEngine(self.loop, self.sender, self.receiver)
        self.prefill = PrefillWorker(worker_id, engine, connector, transfer_config=tcfg,
                                     reservation_timeout_s=reservation_timeout_s, clock=clock, warmup=warmup,
                                     shared=shared, latency_window_s=latency_window_s)
        self.decode = DecodeWorker(worker_id, engine, connector, local_prefill_threshold=local_prefill_threshold,
                                   transfer_config=tcfg, router_timeout_s=router_timeout_s, clock=clock,
                                   warmup=warmup, shared=shared, latency_window_s=latency_window_s)
        self._snapshot: WorkerStats | None = None
        self._apply()
        self.loop.start()

    # ---- role and draining (any thread) --------------------------------------------------------
    def set_role(self, role: str) -> str:
        """Which part takes new work from now on; returns the role it had. Work in flight on a
        part whose role is dropped finishes there."""
        before, self.role = self.role, _checked(role)
        self._apply()
        if before != self.role:
            log.info("%s: role %s -> %s", self.worker_id, before, self.role)
        return before

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.drain(value)

    def drain(self, value: bool = True, move: bool = True) -> None:
        """Stop (or resume) taking new work. `move`: a draining worker's running sequences move to
        other decode workers with their KV as their routers find room for them (the rest finish
        here); else they all finish here."""
        self._draining = value
        self.decode.moves.draining = value and move
        self._apply()

    def _apply(self) -> None:
        # each part reads its flag on the loop thread when a reservation comes: one store each
        self.prefill.draining = self._draining or self.role == "decode"
        self.decode.draining = self._draining or self.role == "prefill"

    # ---- both parts' API (any thread) ----------------------------------------------------------
    def reserve(self, req: PrefillReserve | DecodeReserve):
        if isinstance(req, PrefillReserve):
            return self.prefill.reserve(req)
        if isinstance(req, DecodeReserve):
            return self.decode.reserve(req)
        raise TypeError(f"reserve takes a PrefillReserve or a DecodeReserve, not {type(req).__name__}")

    def abort(self, request_id: str) -> bool:
        """A transfer id (a remote prefill here) or a request id (a request decoding here): the
        ids of the two parts never collide (`kv_transfer.shared`)."""
        return self.prefill.abort(request_id) or self.decode.abort(request_id)

    def stats(self) -> WorkerStats:
        """Both parts' stats as one (`merge_stats`), taken by the loop between steps."""
        return self._snapshot or self.loop.run(self._merged_stats)

    def held(self) -> dict[str, str]:
        return {**self.prefill.held(), **self.decode.held()}

    def kv_blocks_used(self) -> int:
        return self.loop.run(lambda: self.engine.allocator.num_used_blocks)

    def shutdown(self) -> None:
        self.loop.stop()
        self.sender.close()
        self.receiver.close()

    # ---- on the loop thread: the hooks, fanned out ----------------------------------------------
    def _before_step(self) -> None:
        self.decode.moves.sends_ended(self.sender.reap())   # (the release callbacks free what was sent)
        received = self.receiver.reap()
        self.prefill.pulls_ended(received)
        self.decode.kv_ended(received)
        self.prefill.between_steps()
        self.decode.between_steps()
        self._snapshot = self._merged_stats()
        # the per-layer hook only for a step that may complete a remote prefill: a decode step
        # without it can replay a CUDA graph (a graph cannot call back per layer)
        self.loop.layer_done = self.prefill.layer_done if self.prefill.sending() else None

    def _on_step(self, outputs) -> None:
        self.prefill.on_step(outputs)
        self.decode.publish(outputs)

    def _fail_step(self, exc: BaseException) -> None:
        self.prefill.fail_own_requests(exc)
        self.decode.fail_own_requests(exc)
        for rid in [r for r in self.engine.scheduler.requests
                    if not self.prefill.owns(r) and not self.decode.owns(r)]:
            self.engine.abort(rid)         # nobody's: nothing waits for it

    def _sent_released(self, tid: str) -> None:
        self.prefill.sent_released(tid)    # each part ignores the ids it does not hold
        self.decode.sent_released(tid)     # (its sequences moved out; its prefix sends need none)

    def _received_released(self, tid: str) -> None:
        self.prefill.pull_released(tid)
        self.decode.kv_released(tid)

    def _merged_stats(self) -> WorkerStats:
        s = self.engine.scheduler
        return merge_stats(self.prefill.collect_stats(), self.decode.collect_stats(), pool=self.pool, role=self.role,
                           draining=self._draining, engine_queue=len(s.waiting) + len(s.ready))


def _checked(role: str) -> str:
    if role not in ROLES:
        raise InvalidRole(f"unknown role {role!r}; roles are {list(ROLES)}")
    return role
