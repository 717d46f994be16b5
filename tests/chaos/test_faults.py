"""Faults on real processes: kill -9 a decode actor mid-stream and a prefill actor mid-transfer,
restart redis-server during traffic. Every in-flight request ends with the right tokens (or a clear
status) within its deadline, KV in use returns to zero on every live actor, and the controller
restores the pool."""

from __future__ import annotations

import os
import signal
import threading
import time

from tandem.protos.tandem.v1 import admin_pb2

TINY = {"model.name": "tiny-random", "cache.num_blocks": 512}


def _reference(model, reqs, num_blocks=512):
    from tandem.engine.config import CacheConfig, EngineConfig
    from tandem.engine.engine import LLMEngine

    return [r["token_ids"] for r in LLMEngine(EngineConfig(model=model, cache=CacheConfig(num_blocks=num_blocks)))
            .generate(reqs)]


def _streams(c, reqs, results, errors, started=None):
    def run(i):
        try:
            kw = dict(reqs[i])
            prompt = kw.pop("prompt")
            results[i] = c.generate(prompt=prompt, session_id=f"chaos{i}", timeout=240, **kw)[0]
        except Exception as e:  # noqa: BLE001
            errors.append((i, e))

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
    for t in ts:
        t.start()
    return ts


def _worker_pid(c, worker_id):
    state = c.admin.GetClusterState(admin_pb2.GetClusterStateRequest(), timeout=10)
    return next(w.pid for p in state.pools for w in p.workers if w.id == worker_id)


def _wait(pred, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_kill_decode_actor_mid_stream(make_cluster):
    # decode actors prefill everything here: no prefill actor (one would only slow the start)
    c = make_cluster({**TINY, "decode.local_prefill_threshold": 10**9, "prefill.replicas": 0, "decode.replicas": 2})
    reqs = [{"prompt": f"migrate me {i} " + "xy" * i, "max_tokens": 400, "ignore_eos": True} for i in range(6)]
    ref = _reference("tiny-random", reqs)
    results, errors = [None] * len(reqs), []
    threads = _streams(c, reqs, results, errors)
    _wait(lambda: getattr(c.worker_stats().get("decode-1"), "running", 0) > 0, 60, "streams on decode-1")
    os.kill(_worker_pid(c, "decode-1"), signal.SIGKILL)
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert results == ref, "greedy streams must continue on another actor with no gap and no duplicate"
    # the controller notices, forgets the dead actor and starts a replacement
    _wait(lambda: sum(1 for w in c.worker_stats() if w.startswith("decode")) == 2, 120, "a replacement decode actor")
    assert "decode-1" not in c.worker_stats()
    used = c.wait_idle()
    assert all(v == 0 for v in used.values()), used
    ids, _, _ = c.generate(prompt=reqs[0]["prompt"], max_tokens=10, ignore_eos=True)
    assert ids == ref[0][:10]


def test_kill_prefill_actor_mid_transfer(make_cluster):
    c = make_cluster({"model.name": "smollm2-135m", "cache.num_blocks": 1024, "decode.local_prefill_threshold": 0,
                      "prefill.replicas": 1, "decode.replicas": 1, "scheduler.max_num_batched_tokens": 256})
    words = "one two three four five six seven eight nine ten".split()
    # two ~700-token prompts of 3 chunks each (four took twice as long): the kill finds both admitted
    # on prefill-0, part way through their chunks
    reqs = [{"prompt": " ".join(words[(i + j) % 10] for j in range(700)) + f" end {i}", "max_tokens": 6}
            for i in range(2)]
    ref = _reference("smollm2-135m", reqs, 1024)
    results, errors = [None] * len(reqs), []
    threads = _streams(c, reqs, results, errors)
    _wait(lambda: getattr(c.worker_stats().get("prefill-0"), "running", 0) > 0, 60, "a prefill in progress")
    os.kill(_worker_pid(c, "prefill-0"), signal.SIGKILL)
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert results == ref
    _wait(lambda: "prefill-1" in c.worker_stats(), 120, "a replacement prefill actor")
    used = c.wait_idle()
    assert all(v == 0 for v in used.values()), used


def test_redis_restart_during_traffic(make_cluster, redis_server_factory):
    from tests.conftest import start_redis_server

    redis = redis_server_factory()
    c = make_cluster({**TINY, "decode.local_prefill_threshold": 10**9, "prefill.replicas": 0, "decode.replicas": 1},
                     redis_url=redis.url)     # (local prefill only: no prefill actor)
    stop = threading.Event()
    errors, done = [], [0]

    def traffic(k):
        msgs = [{"role": "user", "content": f"session {k}"}]
        while not stop.is_set():
            try:
                _, text, _ = c.generate(messages=msgs, session_id=f"redis{k}", max_tokens=8, timeout=60)
                msgs = msgs[-4:] + [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
                done[0] += 1
            except Exception as e:  # noqa: BLE001
                errors.append(e)

    sessions = c.routers[0][1].sessions

    def served(n):  # n more requests answered from now on (or an error, asserted below)
        target = done[0] + n
        return lambda: done[0] >= target or bool(errors)

    ts = [threading.Thread(target=traffic, args=(k,)) for k in range(3)]
    for t in ts:
        t.start()
    _wait(served(6), 60, "sessions written to Redis")
    redis.stop()  # kill -9
    # the router notices, serves from its memory and retries Redis (every 1 s) while it is down
    _wait(lambda: not sessions.redis_up or bool(errors), 60, "the router to notice Redis is down")
    down_at = time.monotonic()
    more = served(6)
    _wait(lambda: more() and time.monotonic() - down_at > 1.5, 60, "requests served while Redis is down")
    restarted = start_redis_server(redis.port)
    try:
        # ... and writes its sessions back once Redis answers again, then goes on through it
        _wait(lambda: sessions.redis_up or bool(errors), 60, "the router to use Redis again")
        _wait(served(6), 60, "requests served after the restart")
        stop.set()
        for t in ts:
            t.join(60)
        assert not errors, errors[:3]
        assert done[0] > 10
    finally:
        restarted.stop()


def _actor(c, worker_id):
    import ray

    state = ray.get(c.cluster.controller.cluster_state.remote())
    name = state.worker(worker_id).actor_name
    return ray.get_actor(name, namespace=c.cluster.namespace)


def test_a_failing_step_costs_its_requests_a_retry_not_the_actor(make_cluster):
    """A decode step that raises (a kernel error, an OOM) fails the requests in it; their routers
    place them again from the tokens already streamed, so the greedy outputs are unchanged; the
    actor keeps serving (no replacement) and no KV leaks."""
    import ray

    c = make_cluster({**TINY, "decode.local_prefill_threshold": 10**9, "prefill.replicas": 0, "decode.replicas": 1})
    reqs = [{"prompt": f"poison {i} " + "ab" * (i + 3), "max_tokens": 120, "ignore_eos": True} for i in range(4)]
    ref = _reference("tiny-random", reqs)
    decode = _actor(c, "decode-0")
    ray.get(decode.inject_step_failure.remote(None), timeout=30)   # the next step with work raises
    results, errors = [None] * len(reqs), []
    for t in _streams(c, reqs, results, errors):
        t.join(240)
    assert not errors, errors
    assert results == ref
    stats = c.worker_stats()["decode-0"]
    assert stats.step_failures == 1 and stats.last_step_error.startswith("InjectedStepFailure")
    assert stats.loop_error is None
    used = c.wait_idle()
    assert all(v == 0 for v in used.values()), used
    assert c.generate(prompt=reqs[1]["prompt"], max_tokens=10, ignore_eos=True)[0] == ref[1][:10]


def test_a_failing_prefill_step_falls_back_to_local_prefill(make_cluster):
    import ray

    c = make_cluster({**TINY, "decode.local_prefill_threshold": 0, "prefill.replicas": 1, "decode.replicas": 1})
    reqs = [{"prompt": "remote prefill that will fail once " * 6, "max_tokens": 12, "ignore_eos": True}]
    ref = _reference("tiny-random", reqs)
    ray.get(_actor(c, "prefill-0").inject_step_failure.remote(None), timeout=30)
    ids, _, last = c.generate(prompt=reqs[0]["prompt"], max_tokens=12, ignore_eos=True)
    assert ids == ref[0]
    stats = c.worker_stats()
    assert stats["prefill-0"].step_failures == 1 and stats["prefill-0"].loop_error is None
    used = c.wait_idle()
    assert all(v == 0 for v in used.values()), used
    # the prefill actor still serves: the next remote prefill goes through it
    before = stats["prefill-0"].prefills
    assert c.generate(prompt="and now a prompt that prefills remotely " * 5, max_tokens=4)[0]
    assert c.worker_stats()["prefill-0"].prefills == before + 1


def test_a_worker_whose_engine_loop_stopped_is_replaced(make_cluster):
    """Three failing steps in a row stop a decode actor's engine loop for good (as a sticky device
    error would): its health answers carry the loop error, so the controller takes it for dead at
    once, kills and replaces it. Each request it held is placed again from the tokens it streamed
    (greedy outputs unchanged), and later ones go elsewhere. A health answer used to reset the
    count of missed checks before adding this one, so such a worker stayed "ready" for good."""
    import ray

    c = make_cluster({**TINY, "decode.local_prefill_threshold": 10**9, "prefill.replicas": 0, "decode.replicas": 2})
    reqs = [{"prompt": f"stop the loop {i} " + "ab" * (i + 2), "max_tokens": 24, "ignore_eos": True} for i in range(4)]
    ref = _reference("tiny-random", reqs)
    ray.get(_actor(c, "decode-0").inject_step_failure.remote(None, 3), timeout=30)
    # one at a time: with both idle, each new request goes to decode-0 (ties go to the smaller
    # id), fails there and moves on, until the third failure in a row stops its loop
    results = [c.generate(prompt=r["prompt"], max_tokens=r["max_tokens"], ignore_eos=True, session_id=f"loop{i}",
                          timeout=120)[0] for i, r in enumerate(reqs)]
    assert results == ref
    _wait(lambda: "decode-0" not in c.worker_stats(), 60, "the controller to take decode-0 for dead")
    _wait(lambda: sum(1 for w in c.worker_stats() if w.startswith("decode")) == 2, 120, "a replacement decode actor")
    used = c.wait_idle()
    assert all(v == 0 for v in used.values()), used
    assert c.generate(prompt=reqs[0]["prompt"], max_tokens=10, ignore_eos=True)[0] == ref[0][:10]
