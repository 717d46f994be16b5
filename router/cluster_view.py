"""The router's view of the cluster: membership and load from the controller (refreshed in the
background), actor handles looked up by name, and one output pump per worker (any worker may
decode: its role can change in place) that long-polls its batched step outputs
(tandem.wire.messages.StepOutput, OutputError) and hands each request's share to that request's
queue; when the actor dies, every queue gets a WorkerLostNotice. Placement sees a worker in the
choice of each part ("prefill", "decode") it serves now (`WorkerEntry.serves`, by its role), and
as draining in the other, so new work of a dropped role goes elsewhere while its work in flight
goes on."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from tandem.placement import WorkerView
from tandem.wire.cluster import ClusterState
from tandem.wire.messages import WorkerLostNotice

log = logging.getLogger(__name__)


class ClusterView:
    def __init__(self, controller, router_id: str, namespace: str, refresh_s: float = 0.25):
        self.controller = controller
        self.router_id = router_id
        self.namespace = namespace
        self.refresh_s = refresh_s
        self.state = ClusterState()
        self.handles: dict[str, Any] = {}
        self.inflight: dict[str, int] = {}  # requests this router has on each worker right now
        self.queues: dict[str, asyncio.Queue] = {}  # request id -> its outputs
        self._pumps: dict[str, asyncio.Task] = {}
        self._task: asyncio.Task | None = None
        self.on_refresh = None  # called with each new state (metrics)
        # called with the id of a worker that left the cluster or whose output pump failed: what it
        # held (KV, cached prefixes) is gone; a worker coming back under the same id starts cold
        self.on_gone = None

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_loop())

    async def stop(self) -> None:
        for t in [self._task, *self._pumps.values()]:
            if t is not None:
                t.cancel()
        self._pumps.clear()

    async def refresh(self) -> None:
        self.state = await self.controller.cluster_state.remote()
        if self.on_refresh is not None:
            self.on_refresh(self.state)
        live = set()
        for w in self.state.workers:
            wid = w.worker_id
            live.add(wid)
            if w.state in ("ready", "draining") and wid not in self.handles:
                try:
                    self.handles[wid] = ray.get_actor(w.actor_name, namespace=self.namespace)
                except ValueError:
                    continue
            if wid in self.handles and wid not in self._pumps:
                self._pumps[wid] = asyncio.create_task(self._pump(wid))
        for wid in list(self.handles):
            if wid not in live:
                self.handles.pop(wid, None)
                pump = self._pumps.pop(wid, None)
                if pump is not None:
                    pump.cancel()
                self._gone(wid)

    def _gone(self, wid: str) -> None:
        if self.on_gone is not None:
            self.on_gone(wid)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception as e:  # noqa: BLE001 - the controller may be restarting
                log.warning("cluster refresh failed: %s", e)

    async def _pump(self, wid: str) -> None:
        handle = self.handles[wid]
        while True:
            try:
                msgs = await handle.get_outputs.remote(router_id=self.router_id, timeout_s=0.5)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the worker died; its requests get an error
                log.warning("output pump of %s stopped: %s", wid, e)
                for q in list(self.queues.values()):
                    q.put_nowait(WorkerLostNotice(wid, f"worker {wid} lost: {e}"))
                self._pumps.pop(wid, None)
                self.handles.pop(wid, None)
                self._gone(wid)
                return
            for m in msgs:
                q = self.queues.get(m.request_id)
                if q is not None:
                    q.put_nowait(m)

    # ---- views for routing -------------------------------------------------------------------
    def views(self, pool: str) -> list[WorkerView]:
        """The workers for `pool`'s choice ("prefill" | "decode"): every worker, as draining where
        it does not serve that part now."""
        out = []
        for w in self.state.workers:
            if w.worker_id not in self.handles:
                continue
            s = w.load()
            mine = self.inflight.get(w.worker_id, 0)
            state = w.state if w.serves(pool) or w.state == "dead" else "draining"
            out.append(WorkerView(w.worker_id, pool, state, running=max(s.running, mine), waiting=s.waiting,
                                  kv_blocks_used=s.kv_blocks_used, kv_blocks_total=s.kv_blocks_total))
        return out

    def handle(self, wid: str):
        return self.handles.get(wid)
