"""tandem.client (sync and asyncio) against a real local cluster: generate and stream, sessions that
hit the cache, logprobs, health and admin, one exception class per status, an early-closed stream
that frees its KV, and `tandem chat` driving a session through it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from tandem.client import (AsyncClient, Client, FinishReason, InvalidRequest, NotFound, Overloaded, TandemError,
                           Unauthenticated)
from tandem.router.auth import BearerTokenInterceptor, TokenStore

TOKEN = "client-test-token-0123456789abcdef"


@pytest.fixture(scope="module")
def cluster(ray_session):
    from tandem.cluster.local import RunningCluster

    c = RunningCluster({"model.name": "tiny-random", "cache.num_blocks": 256, "prefill.replicas": 1,
                        "decode.replicas": 1, "decode.local_prefill_threshold": 0})
    store = TokenStore(None, TOKEN)
    c.auth_target = c.add_router(interceptors=(BearerTokenInterceptor(store),), token_store=store)
    yield c
    c.close()


@pytest.fixture
def client(cluster):
    with Client(cluster.target, timeout=120) as c:
        yield c


def test_generate_and_stream_agree_with_the_raw_stub(cluster, client):
    ids, text, last = cluster.generate(prompt="hello world", max_tokens=12, ignore_eos=True)
    done = client.generate(prompt="hello world", max_tokens=12, ignore_eos=True)
    assert (done.text, done.token_ids, done.finish_reason) == (text, ids, FinishReason.LENGTH)
    assert done.usage.completion_tokens == 12 and done.usage.prompt_tokens == last.usage.prompt_tokens
    assert done.request_id
    chunks = list(client.stream(prompt="hello world", max_tokens=12, ignore_eos=True))
    assert "".join(c.text for c in chunks) == text and chunks[-1].finish_reason is FinishReason.LENGTH
    assert all(c.usage is None for c in chunks[:-1]) and chunks[0].request_id


def test_logprobs_come_typed(client):
    done = client.generate(prompt="abc", max_tokens=5, ignore_eos=True, logprobs=2)
    assert len(done.logprobs) == 5
    for tok, lp in zip(done.token_ids, done.logprobs):   # greedy: each token is its distribution's top
        assert lp.token_id == tok and lp.top[0][0] == tok and lp.logprob == pytest.approx(lp.top[0][1])
    assert client.generate(prompt="abc", max_tokens=2).logprobs == []


def test_a_session_reuses_its_cache(client):
    chat = client.session()
    first = chat.send("Tell me a story about a robot.", max_tokens=8, ignore_eos=True)
    second = chat.send("And then?", max_tokens=8, ignore_eos=True)
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
    assert chat.messages[1]["content"] == first.text
    assert second.usage.cached_prompt_tokens > 0


def test_each_status_has_its_exception(cluster, client):
    with pytest.raises(InvalidRequest) as e:
        client.generate(prompt="x", max_tokens=10**6)
    assert "max_tokens" in e.value.details
    with pytest.raises(Unauthenticated):
        Client(cluster.auth_target).generate(prompt="x", max_tokens=1)
    ok = Client(cluster.auth_target, token=TOKEN).generate(prompt="x", max_tokens=1)
    assert ok.usage.completion_tokens == 1
    with pytest.raises(NotFound):
        client.drain_worker("no-such-worker")
    assert issubclass(NotFound, TandemError)


def test_overload_carries_retry_after(cluster):
    from tandem.router.admission import AdmissionConfig, AdmissionLimiter

    target = cluster.add_router()
    cluster.routers[-1][1].limiter = AdmissionLimiter(AdmissionConfig(max_in_flight=1, max_queue=0))
    with Client(target, timeout=120) as c:
        running = c.stream(prompt="long", max_tokens=200, ignore_eos=True)
        next(running)
        with pytest.raises(Overloaded) as e:
            c.generate(prompt="x", max_tokens=1)
        assert e.value.retry_after_s is not None and e.value.retry_after_s > 0
        running.close()     # leaving early cancels the request: its KV is freed
    used = cluster.wait_idle()
    assert used and all(v == 0 for v in used.values())


def _one_slot_router(cluster):
    from tandem.router.admission import AdmissionConfig, AdmissionLimiter

    target = cluster.add_router()
    router = cluster.routers[-1][1]
    router.limiter = AdmissionLimiter(AdmissionConfig(max_in_flight=1, max_queue=0))
    return target, router


def _generate_as_it_ends(agent, running):
    """`agent`'s request, sent while the stream `running` holds the room; the stream closes 0.3 s in."""
    import threading

    timer = threading.Timer(0.3, running.close)
    timer.start()
    try:
        return agent.generate(prompt="x", max_tokens=2, ignore_eos=True)
    finally:
        timer.cancel()
        running.close()


def test_max_retries_sends_a_shed_request_again_after_the_hint(cluster):
    """Client(max_retries=N): a request refused before its first chunk (RESOURCE_EXHAUSTED) is sent
    again after the router's hint and answered once the slot frees; the same request without
    retries is refused; nothing is leaked."""
    target, router = _one_slot_router(cluster)
    with Client(target, timeout=120) as holder, Client(target, timeout=120, max_retries=3) as agent:
        running = holder.stream(prompt="long", max_tokens=200, ignore_eos=True)
        next(running)       # the one running slot is taken
        with pytest.raises(Overloaded):
            holder.generate(prompt="x", max_tokens=1)        # (no retries: refused at once)
        refused = router.counters["errors"]
        assert router.hub.registry.get_sample_value("tandem:requests_shed_total", {"reason": "admission"}) >= 1
        done = _generate_as_it_ends(agent, running)          # the slot frees before the hint runs out
    assert done.usage.completion_tokens == 2 and done.text
    assert router.counters["errors"] >= refused + 1         # refused first (cancellations do not count)
    assert cluster.wait_idle() and router.limiter.running == 0 and router.limiter.waiting == 0


def test_the_async_client_retries_a_shed_request_too(cluster):
    target, router = _one_slot_router(cluster)
    before = router.counters["errors"]

    async def go():
        async with AsyncClient(target, timeout=120) as holder, AsyncClient(target, timeout=120,
                                                                          max_retries=3) as agent:
            running = holder.stream(prompt="long", max_tokens=200, ignore_eos=True)
            await running.__anext__()
            loop = asyncio.get_running_loop()
            loop.call_later(0.3, lambda: asyncio.ensure_future(running.aclose()))
            done = await agent.generate(prompt="x", max_tokens=2, ignore_eos=True)
            await running.aclose()
            return done

    done = asyncio.run(go())
    assert done.usage.completion_tokens == 2
    assert router.counters["errors"] >= before + 1          # refused first (cancellations do not count)
    assert cluster.wait_idle() and router.limiter.running == 0 and router.limiter.waiting == 0


def test_the_batch_guard_refuses_what_its_batch_has_no_room_for_and_a_retry_gets_in(cluster):
    """A cost-placing router's batch guard (RouterConfig.batch_guard) on a real cluster: its perf
    model says one sequence steps in 20 ms and two in 30 ms, against a 25 ms TPOT SLO. While one
    stream decodes, a new request is refused (RESOURCE_EXHAUSTED, with the reason), costs nothing,
    and a client with retries gets in once the stream has ended."""
    from tandem.perf_model import PerfModel
    from tandem.router.placing import CostPlacement

    target = cluster.add_router()
    router = cluster.routers[-1][1]
    perf = PerfModel(prefill_base_s=0.001, prefill_per_token_s=1e-5, prefill_attn_s=0.0, decode_base_s=0.01,
                     decode_per_seq_s=0.01, decode_per_ctx_token_s=0.0, transfer_base_s=0.001,
                     transfer_per_token_s=0.0, request_overhead_s=0.001, remote_overhead_s=0.001)
    router.placer.cost = CostPlacement(perf, 60.0, 0.025)
    with Client(target, timeout=120) as holder, Client(target, timeout=120, max_retries=5) as agent:
        running = holder.stream(prompt="long", max_tokens=200, ignore_eos=True)
        next(running)       # one sequence decodes: a second would step past 25 ms
        with pytest.raises(Overloaded, match="TPOT SLO") as refused:
            holder.generate(prompt="x", max_tokens=1)
        assert refused.value.retry_after_s == 1.0                  # the router's hint, in trailing metadata
        assert router.placer.counters["batch_guard_refused"] >= 1
        assert router.hub.registry.get_sample_value("tandem:requests_shed_total", {"reason": "batch_guard"}) >= 1
        done = _generate_as_it_ends(agent, running)
    assert done.usage.completion_tokens == 2 and done.text
    assert all(v == 0 for v in cluster.wait_idle().values())    # nothing held by the refused requests
    router.placer.cost = None


def test_health_and_admin(client):
    assert client.health() == "SERVING"
    state = client.cluster_state()
    assert {p.name for p in state.pools} == {"prefill", "decode"}
    deadline = time.monotonic() + 30      # a worker's KV size comes with its first stats (a loaded machine: seconds)
    while state.pool("decode").workers[0].kv_blocks_total == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        state = client.cluster_state()
    decode = state.pool("decode")
    assert decode.size == 1 and decode.workers[0].state == "ready" and decode.workers[0].kv_blocks_total > 0
    pool = client.set_pool_bounds("decode", 1, 2)
    assert (pool.name, pool.min, pool.max) == ("decode", 1, 2)
    client.set_pool_bounds("decode", 1, 1)


def test_async_client(cluster):
    async def run():
        async with AsyncClient(cluster.target, timeout=120) as c:
            done = await c.generate(prompt="hello world", max_tokens=6, ignore_eos=True)
            streamed = [ch async for ch in c.stream(prompt="hello world", max_tokens=6, ignore_eos=True)]
            chat = c.session()
            await chat.send("hi there, robot", max_tokens=4, ignore_eos=True)
            second = await chat.send("again", max_tokens=4, ignore_eos=True)
            with pytest.raises(InvalidRequest):
                await c.generate(prompt="x", max_tokens=10**6)
            gen = c.stream(prompt="stop me", max_tokens=300, ignore_eos=True)
            await anext(gen)
            await gen.aclose()
            return done, streamed, second, await c.health()

    done, streamed, second, health = asyncio.run(run())
    assert done.text == "".join(c.text for c in streamed) and done.usage.completion_tokens == 6
    assert second.usage.cached_prompt_tokens > 0 and health == "SERVING"
    used = cluster.wait_idle()
    assert used and all(v == 0 for v in used.values())


def test_tandem_chat_runs_a_session_through_the_client(cluster):
    out = subprocess.run([sys.executable, "-m", "tandem.cluster.cli", "chat", "--target", cluster.target,
                          "--max-tokens", "4", "--session", "cli-chat-1"], input="hello\nagain\n\n",
                         capture_output=True, text=True, timeout=120, env={**os.environ, "TANDEM_AUTH_TOKEN": ""})
    assert out.returncode == 0, out.stderr
    assert "session cli-chat-1" in out.stderr and out.stdout.count("assistant> ") == 2
    usage = [line for line in out.stderr.splitlines() if "prompt tokens" in line]
    assert len(usage) == 2 and " 0 cached" not in usage[1]     # the second turn hit the session's cache


def test_tandem_bench_drives_the_openai_edge(cluster, tmp_path):
    """`tandem bench --api openai`: the agent-small sessions over POST /v1/completions, recorded as
    over gRPC (the model's limits probed through the HTTP edge; token counts, cache hits)."""
    import json

    port = cluster.routers[0][1].http_port
    cmd = [sys.executable, "-m", "tandem.cluster.cli", "bench", "--api", "openai", "--target", f"127.0.0.1:{port}",
           "--workload", "agent-small", "--rate", "2", "--duration", "3", "--sessions", "2", "--max-context", "400",
           "--out", str(tmp_path), "--label", "http"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "TANDEM_AUTH_TOKEN": ""})
    assert proc.returncode == 0, proc.stderr
    assert "(openai)" in proc.stdout
    report = json.loads((tmp_path / "bench-http.json").read_text())
    assert report["config"]["vocab_size"] == 512 and report["config"]["api"] == "openai"
    reqs = report["runs"][0]["requests"]
    assert reqs and all(r["status"] == "OK" and r["finish_reason"] == "LENGTH" for r in reqs)
    assert all(r["completion_tokens"] == r["max_tokens"] == len(r["token_times_s"]) for r in reqs)
    assert any(r["turn"] > 0 for r in reqs) and all(r["cached_prompt_tokens"] > 0 for r in reqs if r["turn"] > 0)
