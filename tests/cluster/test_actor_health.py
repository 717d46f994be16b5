"""A pool actor whose request threads are all waiting still answers its health checks: the
controller kills an actor whose stats call times out, so a busy actor must never look dead.
A real pool actor (tandem.workers' WorkerActor, the tiny random model on CPU: it serves no request
here, so a larger model only slows its start) in the session's local Ray."""

from __future__ import annotations

import time

import ray

from tandem.cluster.config import load_config
from tandem.kv_transfer.torch_dist import start_rendezvous_store
from tandem.workers.actor import WorkerActor


def test_health_calls_answer_while_every_request_thread_waits(ray_session):
    engine = load_config(None, {"model.name": "tiny-random", "cache.num_blocks": 256}).engine
    # one request thread, taken by an output long-poll that waits its full 4 s (no outputs)
    store, port = start_rendezvous_store()               # (no transfer here; the actor joins it)
    actor = WorkerActor.options(max_concurrency=1, num_cpus=1).remote("decode-h", "decode", engine,
                                                                      f"127.0.0.1:{port}", 256.0)
    try:
        ray.get(actor.ready.remote(), timeout=120)
        poll = actor.get_outputs.remote(router_id="router-x", timeout_s=4.0)
        time.sleep(0.5)                                   # the long-poll holds the only request thread
        t0 = time.monotonic()
        stats = ray.get(actor.stats.remote(), timeout=2.0)
        assert stats.worker_id == "decode-h" and time.monotonic() - t0 < 2.0
        assert ray.get(actor.set_draining.remote(True), timeout=2.0).draining
        end = time.monotonic() + 2.0                      # the loop's next snapshot shows it
        while not ray.get(actor.stats.remote(), timeout=2.0).draining:
            assert time.monotonic() < end, "draining never showed in stats"
            time.sleep(0.05)
        assert ray.get(actor.set_role.remote("prefill"), timeout=2.0) == "decode"   # a health call too
        assert not ray.get(poll, timeout=10)             # the long-poll itself ends normally
    finally:
        ray.kill(actor)
