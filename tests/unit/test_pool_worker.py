"""The worker of both parts (tandem.workers.worker.PoolWorker) on CPU against fakes: two workers on
the fake network prefill for each other and decode over one engine each, with one connector each
carrying both directions (prefix pulls included); a role change while requests are in flight on
both parts stops new work of the dropped part only, loses nothing and leaks no KV block."""

from __future__ import annotations

import threading
import time

import pytest

from tandem.kv_transfer.fake import FakeNetwork
from tandem.kv_transfer.spec import TransferSpec
from tandem.wire.errors import InvalidRole, WorkerUnavailable
from tandem.wire.messages import DecodeReserve, OutputError, PrefillReserve, SamplingParams, StepOutput
from tests.unit.kv_factories import until
from tests.unit.worker_factories import create_engine, create_pool_worker

SP = SamplingParams(max_tokens=6, ignore_eos=True)
LONG = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture
def net():
    return FakeNetwork()


@pytest.fixture
def a(net):
    w = create_pool_worker(net, "a", "prefill")
    yield w
    w.shutdown()


@pytest.fixture
def b(net):
    w = create_pool_worker(net, "b", "decode")
    yield w
    w.shutdown()


def one_engine(ids: list[int], sp: SamplingParams = SP) -> list[int]:
    return create_engine().generate([{"prompt_token_ids": ids, "max_tokens": sp.max_tokens,
                                      "ignore_eos": sp.ignore_eos}])[0]["token_ids"]


class RemotePrefill:
    """The router's remote-prefill flow between two workers, in steps: `reserve` (both sides, the
    prefix pull when the decoder holds more of the prompt), `start` (on a thread), `finish` (hand
    the first token over, collect the outputs)."""

    def __init__(self, prefiller, decoder, rid: str, ids: list[int], sp: SamplingParams = SP):
        self.p, self.d, self.rid, self.ids, self.sp = prefiller, decoder, rid, ids, sp
        self.tid = f"{rid}#t"
        self.done: dict = {}

    def reserve(self) -> "RemotePrefill":
        p, d, tid, bs = self.p, self.d, self.tid, 16
        self.plan = d.reserve(DecodeReserve(self.rid, "router", self.ids, self.sp, transfer_id=tid,
                                            prefill_id=p.worker_id))
        self.res = p.reserve(PrefillReserve(tid, self.ids, self.sp))
        assert self.plan.remote and self.plan.expecting == p.worker_id
        self.layers = tuple(range(p.engine.kv_cache.num_layers))
        if self.plan.cached_tokens > self.res.cached_tokens:
            at = self.res.cached_tokens // bs
            dst = self.res.block_ids[at:self.plan.cached_tokens // bs]
            pull = TransferSpec(f"{tid}/pull", d.worker_id, p.worker_id, self.layers,
                                self.plan.prefix_block_ids[at:at + len(dst)], dst, len(dst) * bs)
            p.prefill.expect_pull(pull, tid, self.plan.cached_tokens)
            d.decode.send_prefix(pull)
        return self

    def start(self) -> "RemotePrefill":
        plan, n = self.plan, len(self.plan.dst_block_ids)
        spec = TransferSpec(self.tid, self.p.worker_id, self.d.worker_id, self.layers,
                            self.res.block_ids[plan.first_block:plan.first_block + n], plan.dst_block_ids,
                            plan.num_tokens)
        threading.Thread(target=lambda: self.done.setdefault("result", self.p.prefill.start(spec)), daemon=True).start()
        return self

    def finish(self) -> list[int]:
        first = self.p.prefill.first_token(self.tid, timeout_s=10)
        assert self.d.decode.first_token(self.rid, first.first)
        out = [first.first.token_id] + collect(self.d, self.rid)
        until(lambda: "result" in self.done)
        return out


def collect(w, rid: str, router: str = "router", timeout_s: float = 20.0) -> list[int]:
    """`rid`'s tokens from `w`'s outbox until it finishes (other requests' outputs are put back)."""
    out, end = [], time.monotonic() + timeout_s
    while time.monotonic() < end:
        for m in w.decode.get_outputs(router, 0.2):
            if m.request_id != rid:
                w.decode.outboxes.put(router, [m])
                continue
            assert not isinstance(m, OutputError), m
            out += m.token_ids
            if isinstance(m, StepOutput) and m.finished:
                return out
    raise AssertionError(f"{rid} did not finish: {out}")


def assert_clean(*workers) -> None:
    for w in workers:
        until(lambda w=w: w.held() == {} and w.kv_blocks_used() == 0)


def test_two_workers_prefill_for_each_other_over_one_connector_each(a, b):
    a.set_role("mixed")
    b.set_role("mixed")
    ab = RemotePrefill(a, b, "r-ab", list(range(10, 90))).reserve()
    ba = RemotePrefill(b, a, "r-ba", list(range(100, 170))).reserve()
    ab.start()
    ba.start()
    assert ab.finish() == one_engine(ab.ids)
    assert ba.finish() == one_engine(ba.ids)
    assert_clean(a, b)
    assert a.stats().role == "mixed" and a.stats().prefills == 1 and a.stats().remote_prefills == 1


def test_a_prefix_pull_and_a_send_share_the_link_between_two_workers(a, b):
    a.set_role("mixed")
    b.set_role("mixed")
    prefix = list(range(200, 248))                       # three whole blocks
    b.reserve(DecodeReserve("warm", "router", prefix, SamplingParams(max_tokens=3)))
    collect(b, "warm")                                   # prefilled locally: in b's cache now
    ids = prefix + list(range(300, 340))
    rp = RemotePrefill(a, b, "r-pull", ids).reserve()     # a pulls b's prefix, then sends to b
    other = RemotePrefill(b, a, "r-other", list(range(400, 470))).reserve()   # and b sends to a
    rp.start()
    other.start()
    assert rp.finish() == one_engine(ids)
    assert other.finish() == one_engine(other.ids)
    assert a.stats().pulled_tokens == 48
    assert_clean(a, b)


def test_a_role_change_stops_new_work_of_the_dropped_part_and_finishes_what_is_in_flight(a, b):
    a.set_role("mixed")
    local = list(range(500, 510))                        # short: a prefills and decodes it itself
    a.reserve(DecodeReserve("r-local", "router", local, LONG))
    rp = RemotePrefill(a, b, "r-remote", list(range(10, 90))).reserve()   # a's prefill part holds it
    t0 = time.perf_counter()
    assert a.set_role("decode") == "mixed"               # a lent to decode: no new prefills
    took = time.perf_counter() - t0
    with pytest.raises(WorkerUnavailable):
        a.reserve(PrefillReserve("late#t", list(range(600, 680)), SP))
    rp.start()                                           # its reservation was made before: it runs
    assert rp.finish() == one_engine(rp.ids)
    assert a.set_role("prefill") == "decode"             # and back: no new decodes
    with pytest.raises(WorkerUnavailable):
        a.reserve(DecodeReserve("late", "router", local, SP))
    assert collect(a, "r-local") == one_engine(local, LONG)   # decoding in flight went on
    assert a.stats().role == "prefill" and not a.stats().draining
    assert_clean(a, b)
    assert took < 0.05


def test_a_worker_named_as_its_own_prefill_worker_prefills_locally(b):
    b.set_role("mixed")
    plan = b.reserve(DecodeReserve("r-self", "router", list(range(10, 90)), SP, transfer_id="r-self#t",
                                   prefill_id="b"))
    assert not plan.remote
    assert collect(b, "r-self") == one_engine(list(range(10, 90)))
    assert_clean(b)


def test_draining_stops_both_parts_and_an_unknown_role_is_refused(b):
    b.set_role("mixed")
    b.draining = True
    with pytest.raises(WorkerUnavailable):
        b.reserve(DecodeReserve("x", "router", list(range(10, 20)), SP))
    with pytest.raises(WorkerUnavailable):
        b.reserve(PrefillReserve("x#t", list(range(10, 90)), SP))
    with pytest.raises(InvalidRole):
        b.set_role("both")
    assert b.role == "mixed" and b.stats().draining


def test_a_failing_step_fails_each_parts_requests_once_and_frees_their_kv(a, b):
    a.set_role("mixed")
    a.reserve(DecodeReserve("r-dec", "router", list(range(10, 20)), SamplingParams(max_tokens=200, ignore_eos=True)))
    until(lambda: a.stats().running == 1)
    a.loop.run(a.loop.inject_step_failure, None)
    out = []
    until(lambda: out.extend(a.decode.get_outputs("router", 0.1)) or any(isinstance(m, OutputError) for m in out))
    assert [m.request_id for m in out if isinstance(m, OutputError)] == ["r-dec"]
    assert_clean(a)
    assert a.stats().step_failures == 1


def test_roles_flipping_all_the_time_lose_no_accepted_request_and_leak_no_block(a, b):
    """Two workers whose roles change every few milliseconds while requests go both ways: every
    request either is refused at its reservation (WorkerUnavailable, as a router sees it) or
    finishes with the one-engine output; at the end neither holds anything."""
    stop = threading.Event()

    def flip():
        roles = ("prefill", "decode", "mixed")
        i = 0
        while not stop.is_set():
            a.set_role(roles[i % 3])
            b.set_role(roles[(i + 1) % 3])
            i += 1
            time.sleep(0.003)

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    done, refused = 0, 0
    try:
        for i in range(12):
            src, dst = (a, b) if i % 2 else (b, a)
            ids = list(range(20 + 7 * i, 100 + 7 * i))
            try:
                rp = RemotePrefill(src, dst, f"r-flip-{i}", ids).reserve()
            except WorkerUnavailable:
                refused += 1
                for w, rid in ((dst, f"r-flip-{i}"), (src, f"r-flip-{i}#t")):
                    w.abort(rid)                      # the router drops the half it got
                continue
            assert rp.start().finish() == one_engine(ids)
            done += 1
    finally:
        stop.set()
        flipper.join()
    assert done + refused == 12 and done > 0, (done, refused)
    assert_clean(a, b)


def test_the_latency_window_reaches_both_parts_reports(net):
    """autoscaler.latency_window_s (carried to each worker actor) is the span of the TTFT and TPOT
    percentiles both parts report: a sample older than it is gone from the report."""
    now = [100.0]
    w = create_pool_worker(net, "c", "decode", latency_window_s=5.0, clock=lambda: now[0])
    try:
        assert w.prefill.latency.window_s == w.decode.tpot.window_s == 5.0
        w.decode.tpot.add(now[0], 0.02)
        assert w.decode.tpot.percentiles(now[0] + 4.0)["p90"] == 0.02
        assert w.decode.tpot.percentiles(now[0] + 6.0)["p90"] is None
    finally:
        w.shutdown()
