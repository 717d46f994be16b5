"""The router's view of workers by role (router.cluster_view.ClusterView.views): a worker is offered
to the choice of each part it serves now, and shows as draining in the other, so new work of a
role it just dropped goes elsewhere while its requests in flight go on."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tandem.router.cluster_view import ClusterView
from tandem.router.placing import Placer
from tandem.wire.cluster import ClusterState, WorkerEntry


def view_of(*workers: WorkerEntry) -> ClusterView:
    view = ClusterView(controller=None, router_id="router-a", namespace="ns")
    view.state = ClusterState(workers=workers)
    view.handles = {w.worker_id: object() for w in workers}
    return view


def test_each_choice_offers_the_workers_that_serve_that_part_and_shows_the_rest_draining():
    view = view_of(WorkerEntry("prefill-0", "prefill", "ready", role="decode"),    # lent to decode
                   WorkerEntry("decode-0", "decode", "ready"),                     # its pool's role
                   WorkerEntry("decode-1", "decode", "ready", role="mixed"),
                   WorkerEntry("decode-2", "decode", "draining", role="mixed"))
    assert {w.worker_id: w.state for w in view.views("decode")} == {
        "prefill-0": "ready", "decode-0": "ready", "decode-1": "ready", "decode-2": "draining"}
    assert {w.worker_id: w.state for w in view.views("prefill")} == {
        "prefill-0": "draining", "decode-0": "draining", "decode-1": "ready", "decode-2": "draining"}
    assert all(w.pool == "prefill" for w in view.views("prefill"))


def test_a_worker_that_leaves_takes_its_cached_prefixes_out_of_the_routers_index():
    """The prefix index must not steer sessions to a worker id whose cache died with it (a worker
    restarted under the same id starts cold)."""
    states = [ClusterState(workers=(WorkerEntry("decode-0", "decode", "ready"), WorkerEntry("decode-1", "decode", "ready"))),
              ClusterState(workers=(WorkerEntry("decode-1", "decode", "ready"),))]

    async def cluster_state():
        return states.pop(0)

    view = ClusterView(controller=SimpleNamespace(cluster_state=SimpleNamespace(remote=cluster_state)),
                       router_id="router-a", namespace="ns")
    placer = Placer(view, block_size=16, num_layers=2, counters={})
    placer.prefix.record("decode-0", [b"a", b"b"])
    placer.prefix.record("decode-1", [b"a"])

    async def go():
        view.handles = {"decode-0": object(), "decode-1": object()}
        # their output pumps, as running (refresh starts none for them)
        view._pumps = {w: asyncio.get_running_loop().create_future() for w in view.handles}
        await view.refresh()                   # both still there
        assert placer.prefix.match([b"a", b"b"]) == {"decode-0": 2, "decode-1": 1}
        await view.refresh()                   # decode-0 left
        assert placer.prefix.match([b"a", b"b"]) == {"decode-1": 1}
        assert "decode-0" not in view.handles

    asyncio.run(go())
