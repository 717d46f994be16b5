"""The router's view of workers by role (router.cluster_view.ClusterView.views): a worker is offered
to the choice of each part it serves now, and shows as draining in the other, so new work of a
role it just dropped goes elsewhere while its requests in flight go on."""

from __future__ import annotations

from tandem.router.cluster_view import ClusterView
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
