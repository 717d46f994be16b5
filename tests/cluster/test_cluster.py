"""The whole request path on real Ray, real gRPC and real Redis: router -> decode actor (local
prefill) or router -> prefill actor -> KV over gloo -> decode actor, tokens streamed back.

Reference outputs come from the offline engine (`tandem generate`'s path), which tests/engine
checks token-for-token against transformers; one prompt is also checked against transformers here.
"""

from __future__ import annotations

import logging

import threading

import grpc
import pytest

from tandem.protos.tandem.v1 import admin_pb2, generation_pb2 as pb

MODEL = {"model.name": "smollm2-135m", "cache.num_blocks": 512}
REMOTE = {**MODEL, "decode.local_prefill_threshold": 0}  # every prompt is prefilled remotely
LOCAL = {**MODEL, "decode.local_prefill_threshold": 10**9}  # decode actors prefill everything

PROMPTS = [
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n",
    "The three laws of thermodynamics are",
    "Translate to French: The weather is nice today.\nFrench:",
    "SELECT customer_id, SUM(amount) FROM orders GROUP BY",
]
CHAT = [{"role": "user", "content": "Write a haiku about unit tests."}]


@pytest.fixture(scope="module")
def offline():
    """Greedy outputs of the offline engine, as `tandem generate` produces them."""
    from tandem.engine.config import CacheConfig, EngineConfig
    from tandem.engine.engine import LLMEngine

    e = LLMEngine(EngineConfig(model="smollm2-135m", cache=CacheConfig(num_blocks=512)))

    def run(reqs):
        return e.generate(reqs)

    return run


@pytest.fixture(scope="module")
def remote(ray_session):
    from tandem.cluster.local import RunningCluster

    c = RunningCluster({**REMOTE, "prefill.replicas": 1, "decode.replicas": 1})
    yield c
    c.close()


def test_streamed_tokens_match_offline_engine_and_transformers(remote, offline, hf_smollm2):
    ref = offline([{"prompt": p, "max_tokens": 12} for p in PROMPTS]
                  + [{"messages": CHAT, "max_tokens": 12}])
    for i, p in enumerate(PROMPTS):
        ids, text, last = remote.generate(prompt=p, max_tokens=12)
        assert ids == ref[i]["token_ids"], p
        assert text == ref[i]["text"]
        assert last.finish_reason in (pb.STOP, pb.LENGTH)
        assert last.usage.prompt_tokens == len(ref[i]["prompt_token_ids"])
    ids, _, _ = remote.generate(prompt_token_ids=ref[0]["prompt_token_ids"], max_tokens=12)
    assert ids == ref[0]["token_ids"]
    ids, _, _ = remote.generate(messages=CHAT, max_tokens=12)
    assert ids == ref[-1]["token_ids"]
    stats = remote.worker_stats()
    assert stats["decode-0"].remote_prefills >= 6, "these requests were meant to take the remote path"
    assert stats["prefill-0"].prefills >= 6
    from tandem.runtime.process import DEFAULT_GIL_SWITCH_INTERVAL_S
    for actor in ("decode-0", "prefill-0"):
        assert stats[actor].process.gil_switch_interval_s == pytest.approx(DEFAULT_GIL_SWITCH_INTERVAL_S), \
            f"{actor} serves with Python's 5 ms GIL switch interval"
        assert stats[actor].mid_step_calls >= 0

    import torch

    prompt_ids = ref[1]["prompt_token_ids"]
    with torch.inference_mode():
        out = hf_smollm2.generate(torch.tensor([prompt_ids]), max_new_tokens=12, do_sample=False, eos_token_id=2, pad_token_id=2)
    ids, _, _ = remote.generate(prompt_token_ids=prompt_ids, max_tokens=12)
    assert ids == out[0, len(prompt_ids):].tolist()


def test_first_token_from_the_prefill_actor_continues_as_one_engine_would(remote, offline):
    """The prefill actor samples the first output token (the router streams it at once) and the
    decode actor continues from it, with the sampler's state: seeded sampling gives the offline
    engine's tokens and text; a first token that ends the request (max_tokens 1, a stop string in
    it) ends it there, and no KV stays reserved on the decode actor."""
    prompt = PROMPTS[1]
    for sampling in ({"temperature": 0.8, "seed": 7, "max_tokens": 16},
                     {"temperature": 1.2, "top_k": 40, "seed": 3, "max_tokens": 16},
                     {"max_tokens": 1}):
        want = offline([{"prompt": prompt, **sampling}])[0]
        ids, text, last = remote.generate(prompt=prompt, **sampling)
        assert ids == want["token_ids"] and text == want["text"], sampling
        assert last.usage.completion_tokens == len(want["token_ids"])
    assert last.finish_reason == pb.LENGTH
    greedy = offline([{"prompt": prompt, "max_tokens": 8}])[0]
    stop = greedy["text"][:3]                   # a stop string inside the first token's text or just after
    want = offline([{"prompt": prompt, "max_tokens": 8, "stop": [stop]}])[0]
    ids, text, last = remote.generate(prompt=prompt, max_tokens=8, stop=[stop])
    assert (ids, text) == (want["token_ids"], want["text"]) and last.finish_reason == pb.STOP
    # the decode actor's reservation is freed even when its KV landed just before the abort came
    # (a worker's stats are a snapshot taken between steps: wait for one after the abort)
    used = remote.wait_idle()
    assert used.get("decode-0") == 0 and used.get("prefill-0") == 0, used


def _two_turns(cluster, session):
    first_msgs = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
    ids1, text1, last1 = cluster.generate(messages=first_msgs, session_id=session, max_tokens=40, ignore_eos=True)
    before = cluster.worker_stats()
    second = first_msgs + [{"role": "assistant", "content": text1}, {"role": "user", "content": "Add type hints."}]
    ids2, _, last2 = cluster.generate(messages=second, session_id=session, max_tokens=8)
    after = cluster.worker_stats()
    return last1, last2, before, after


def test_second_turn_hits_the_cache_remote_path(remote, caplog):
    router = remote.routers[0][1]
    router.slow_ttft_s = 0.0  # every first token is "slow": each logs where its time went
    try:
        with caplog.at_level(logging.WARNING, logger="tandem.router.server"):
            last1, last2, before, after = _two_turns(remote, "sess-remote")
    finally:
        router.slow_ttft_s = 1.0
    slow = [r.getMessage() for r in caplog.records if "slow first token" in r.getMessage()]
    assert len(slow) == 2, slow
    assert "remote on decode-0" in slow[1] and "prefill placed on prefill-0" in slow[1], slow[1]
    # the prefill actor's own split of its time, whether the token came ahead of the transfer's end
    # (the usual case) or with it
    assert "queue+compute" in slow[1] and ("KV still on the wire" in slow[1] or "KV sent to first token" in slow[1]), slow[1]
    assert last2.usage.cached_prompt_tokens >= last1.usage.prompt_tokens
    new = last2.usage.prompt_tokens - last2.usage.cached_prompt_tokens
    # the prefill actor computed exactly the uncached prompt tokens (and sampled the first output
    # token from the last one's logits)
    computed = after["prefill-0"].computed_tokens - before["prefill-0"].computed_tokens
    assert computed == new
    # the part of the prompt the decode actor had cached and the prefill actor had not (the first
    # turn's output) was pulled from the decode actor, not recomputed
    assert after["prefill-0"].pulled_tokens > before["prefill-0"].pulled_tokens
    assert after["decode-0"].remote_prefills == before["decode-0"].remote_prefills + 1


def test_second_turn_hits_the_cache_local_path(make_cluster):
    local = make_cluster({**LOCAL, "prefill.replicas": 1, "decode.replicas": 1})
    last1, last2, before, after = _two_turns(local, "sess-local")
    assert last2.usage.cached_prompt_tokens >= last1.usage.prompt_tokens
    new = last2.usage.prompt_tokens - last2.usage.cached_prompt_tokens
    d = after["decode-0"].tokens_computed - before["decode-0"].tokens_computed
    assert d == new + last2.usage.completion_tokens - 1
    assert after["prefill-0"].prefills == 0


BAD = [
    (dict(), "exactly one"),
    (dict(prompt="x", prompt_token_ids=[1, 2]), "exactly one"),
    (dict(prompt=""), "empty"),
    (dict(prompt_token_ids=[1, 10**7]), "vocabulary"),
    (dict(prompt="hi", sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
    (dict(prompt="hi", sampling=pb.SamplingParams(max_tokens=10**6)), "max_tokens"),
    (dict(prompt="hi", sampling=pb.SamplingParams(temperature=-1)), "temperature"),
    (dict(prompt="hi", sampling=pb.SamplingParams(top_p=1.5)), "top_p"),
    (dict(prompt="hi", sampling=pb.SamplingParams(top_p=0.0)), "top_p"),
    (dict(messages=[pb.ChatMessage(role="wizard", content="hi")]), "role"),
    (dict(prompt="x" * (10 << 20)), "bytes"),
]


@pytest.fixture(scope="module")
def served_after_bad_input(offline):
    """The offline engine's tokens for the request each bad-input case sends next (computed once)."""
    return offline([{"prompt": PROMPTS[1], "max_tokens": 6}])[0]["token_ids"]


@pytest.mark.parametrize("kwargs,needle", BAD)
def test_bad_input_gets_invalid_argument(remote, served_after_bad_input, kwargs, needle):
    with pytest.raises(grpc.RpcError) as err:
        list(remote.stub.Generate(pb.GenerateRequest(**kwargs), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()
    ids, _, _ = remote.generate(prompt=PROMPTS[1], max_tokens=6)
    assert ids == served_after_bad_input


ADMIN_REFUSALS = [
    ("DrainWorker", admin_pb2.DrainWorkerRequest(worker_id="decode-99"), grpc.StatusCode.NOT_FOUND, "decode-99"),
    ("SetPoolBounds", admin_pb2.SetPoolBoundsRequest(pool="embed", min=0, max=1), grpc.StatusCode.INVALID_ARGUMENT,
     "unknown pool"),
    ("SetPoolBounds", admin_pb2.SetPoolBoundsRequest(pool="decode", min=3, max=1), grpc.StatusCode.INVALID_ARGUMENT,
     "0 <= min <= max"),
]


@pytest.mark.parametrize("method,request_,code,needle", ADMIN_REFUSALS, ids=lambda x: getattr(x, "name", None))
def test_the_controllers_refusals_reach_an_admin_client_as_their_status_codes(remote, method, request_, code, needle):
    """The controller raises its own error types (tandem.wire.errors); they cross Ray and leave the
    router's Admin service with the code of the router's one table and the controller's message."""
    with pytest.raises(grpc.RpcError) as err:
        getattr(remote.admin, method)(request_, timeout=10)
    assert err.value.code() == code
    assert needle in err.value.details() and "Traceback" not in err.value.details()
    state = remote.admin.GetClusterState(admin_pb2.GetClusterStateRequest(), timeout=10)
    assert {p.name: (p.min, p.max) for p in state.pools} == {"prefill": (1, 1), "decode": (1, 1)}


def test_cancel_mid_stream_frees_every_block(remote):
    req = pb.GenerateRequest(prompt=PROMPTS[0] * 6, sampling=pb.SamplingParams(max_tokens=400, ignore_eos=True))
    call = remote.stub.Generate(req, timeout=120)
    got = 0
    for r in call:
        got += len(r.token_ids)
        if got >= 5:
            call.cancel()
            break
    assert got >= 5
    used = remote.wait_idle()
    assert used and all(v == 0 for v in used.values()), used


def test_deadline_exceeded_frees_every_block(remote):
    req = pb.GenerateRequest(prompt=PROMPTS[2] * 4, sampling=pb.SamplingParams(max_tokens=500, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as err:
        for _ in remote.stub.Generate(req, timeout=1.5):
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    used = remote.wait_idle()
    assert used and all(v == 0 for v in used.values()), used


def _generate_concurrently(c, reqs: list[dict], session_prefix: str) -> list[list[int]]:
    """Send every request at once (one thread each, released together; session i is
    `session_prefix` + i) and return their token ids in order; fails on any error."""
    results: list = [None] * len(reqs)
    errors: list = []
    start = threading.Barrier(len(reqs))

    def run(i):
        try:
            start.wait(30)
            results[i] = c.generate(prompt=reqs[i]["prompt"], max_tokens=reqs[i]["max_tokens"],
                                    session_id=f"{session_prefix}{i}")[0]
        except Exception as e:  # noqa: BLE001
            errors.append((i, e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return results


def test_32_concurrent_streams_over_2_prefill_2_decode(make_cluster):
    """32 streams at once over 2 prefill and 2 decode actors, some prefilled locally and the rest
    remotely, each with the offline engine's tokens. The tiny random model (its four actors start in
    a third of smollm2-135m's time; the engine's tests check it against transformers too): with its
    byte tokenizer these prompts are 51-109 tokens, the 8 of at most 72 always prefilled locally."""
    from tandem.engine.config import CacheConfig, EngineConfig
    from tandem.engine.engine import LLMEngine

    c = make_cluster({"model.name": "tiny-random", "cache.num_blocks": 512, "decode.local_prefill_threshold": 72,
                      "prefill.replicas": 2, "decode.replicas": 2})
    reqs = [{"prompt": f"{PROMPTS[i % 4]}\n# variant {i}: " + "x = 1\n" * (i % 7), "max_tokens": 6}
            for i in range(32)]
    ref = LLMEngine(EngineConfig(model="tiny-random", cache=CacheConfig(num_blocks=512))).generate(reqs)
    assert _generate_concurrently(c, reqs, "s") == [r["token_ids"] for r in ref]
    stats = c.worker_stats()
    assert all(stats[w].requests > 0 for w in ("decode-0", "decode-1")), "both decode actors should serve"
    assert sum(stats[w].prefills for w in ("prefill-0", "prefill-1")) > 0
    assert sum(stats[w].local_prefills for w in ("decode-0", "decode-1")) >= 8, "both paths should run"
    assert all(v == 0 for v in c.wait_idle().values())


def test_a_backlogged_prefill_pool_sends_new_prompts_to_local_prefill(make_cluster, offline):
    """prefill.max_queued_tokens: while the prefill actor holds that many prompt tokens of the
    router's remote prefills, new prompts are prefilled by the decode actor itself (every prompt
    would go remote otherwise: threshold 0); outputs are the same either way and nothing leaks."""
    c = make_cluster({**REMOTE, "prefill.max_queued_tokens": 1, "prefill.replicas": 1, "decode.replicas": 1})
    reqs = [{"prompt": f"{PROMPTS[i % 4]} # {i}\n" + "value = compute(value)\n" * 20, "max_tokens": 5}
            for i in range(8)]
    ref = offline(reqs)
    assert _generate_concurrently(c, reqs, "q") == [r["token_ids"] for r in ref]
    d = c.worker_stats()["decode-0"]
    assert d.remote_prefills >= 1 and d.local_prefills >= 1, d     # an idle prefill actor takes one
    assert d.remote_prefills + d.local_prefills == len(reqs)
    assert all(v == 0 for v in c.wait_idle().values())


def test_two_routers_share_sessions_through_redis(make_cluster, redis_server):
    # no prefill actor: the decode actors prefill everything here (LOCAL), one would only slow the start
    c = make_cluster({**LOCAL, "prefill.replicas": 0, "decode.replicas": 2}, redis_url=redis_server)
    other = c.add_router(redis_url=redis_server)
    import grpc as g

    from tandem.protos.tandem.v1 import generation_pb2_grpc

    stub2 = generation_pb2_grpc.GenerationStub(g.insecure_channel(other))
    msgs = [{"role": "user", "content": "List three prime numbers."}]
    ids1, text1, last1 = c.generate(messages=msgs, session_id="shared-1", max_tokens=24, ignore_eos=True)
    msgs2 = msgs + [{"role": "assistant", "content": text1}, {"role": "user", "content": "And three more."}]
    _, _, last2 = c.generate(stub=stub2, messages=msgs2, session_id="shared-1", max_tokens=8)
    # router 2 had never seen this session: only Redis could send it to the decode actor holding it
    assert last2.usage.cached_prompt_tokens >= last1.usage.prompt_tokens


def test_metrics_endpoint_after_traffic(remote):
    """The router process's one /metrics endpoint exposes the vLLM-style names, and traffic moves
    them by plausible amounts (the registry is per process, so compare before and after)."""
    import re
    import time
    import urllib.request

    from tandem.runtime.metrics import METRIC_NAMES, start_metrics_server

    port = start_metrics_server(0, "127.0.0.1")

    def scrape():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^(tandem:[a-z0-9_]+)(\{[^}]*\})? ([0-9.e+-]+|NaN)$", line)
            if m:
                values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(3))
        return text, values

    time.sleep(2.5)
    _, before = scrape()
    for i in (0, 1, 1):  # the repeat hits the prefix cache
        remote.generate(prompt=PROMPTS[i] * 3, max_tokens=8, ignore_eos=True, session_id="metrics")
    time.sleep(2.5)  # one controller health round + one router refresh carry the workers' counters
    text, after = scrape()
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    # every family is declared (a labelled counter with no samples yet still has its TYPE line)
    exported = {n.removesuffix("_total") for n in re.findall(r"^# TYPE (tandem:[a-z0-9_]+) ", text, re.M)}
    missing = [n for n in METRIC_NAMES if n not in exported]
    assert not missing, missing
    assert delta["tandem:time_to_first_token_seconds_count"] == 3
    assert delta["tandem:inter_token_latency_seconds_count"] >= 3 * 7
    assert 0 < delta["tandem:time_to_first_token_seconds_sum"] < 3 * 60
    assert delta["tandem:prefix_cache_queries_total"] >= delta["tandem:prefix_cache_hits_total"] > 0
    assert delta["tandem:kv_transfer_bytes_total"] > 0  # the remote path moved KV
    assert after["tandem:pool_size"] == 2  # one prefill + one decode actor


def test_speculative_decoding_through_the_cluster_keeps_greedy_output(make_cluster, offline):
    """n-gram speculation on the decode actors (deployment config) changes no token; drafts are
    proposed and accepted (usage reports them)."""
    c = make_cluster({**LOCAL, "prefill.replicas": 0, "decode.replicas": 1, "speculative.method": "ngram",
                      "speculative.num_tokens": 4})     # (LOCAL: a prefill actor would sit unused)
    code = "def area(width, height):\n    return width * height\n\n"
    msgs = [{"role": "user", "content": f"Rename `width` to `w` and `height` to `h` in this code:\n{code}"}]
    ref = offline([{"messages": msgs, "max_tokens": 40}, {"prompt": code * 3, "max_tokens": 30}])
    ids, _, last = c.generate(messages=msgs, max_tokens=40)
    assert ids == ref[0]["token_ids"]
    ids2, _, last2 = c.generate(prompt=code * 3, max_tokens=30)
    assert ids2 == ref[1]["token_ids"]
    drafted = last.usage.draft_tokens + last2.usage.draft_tokens
    accepted = last.usage.accepted_draft_tokens + last2.usage.accepted_draft_tokens
    assert drafted > 0 and 0 < accepted <= drafted
    # the steps that verified drafts reach the client too (the simulator's padded verify width)
    for u in (last.usage, last2.usage):
        assert (u.draft_steps > 0) == (u.draft_tokens > 0)
        assert u.draft_steps <= u.draft_tokens <= 4 * u.draft_steps
        assert u.draft_steps <= u.completion_tokens - 1 - u.accepted_draft_tokens


def test_deadlines_that_expire_while_the_request_is_placed_free_every_block(remote):
    """Deadlines of a few milliseconds expire while the router awaits the actors' reservations
    (the decode actor's reserve, the prefill actor's): a reservation answered after its request
    was cancelled must still be freed, not held until the KV receive times out (600 s)."""
    codes = {}
    for i in range(40):
        req = pb.GenerateRequest(prompt=PROMPTS[i % 4] * 3, sampling=pb.SamplingParams(max_tokens=4))
        try:
            for _ in remote.stub.Generate(req, timeout=0.002 + 0.001 * i):
                pass
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
        codes[code] = codes.get(code, 0) + 1
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}, codes
    assert codes.get(grpc.StatusCode.DEADLINE_EXCEEDED), codes
    used = remote.wait_idle(timeout_s=15)
    assert used and all(v == 0 for v in used.values()), (used, codes)
