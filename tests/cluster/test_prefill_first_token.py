"""The prefill actor hands out a prompt's first output token as soon as it is sampled, ahead of
the KV transfer's end, and never leaves a caller of `first_token` waiting on a transfer that
failed. A real PrefillWorker (smollm2-135m on CPU) over the real transport (gloo, a TCPStore
rendezvous); its decode peer never joins, so the transfer cannot finish before the connect
timeout, while the prompt's compute does. Also: a request's blocks are not freed while a prefix
pull may still write into them."""

from __future__ import annotations

import threading
import time

import pytest

from tandem.engine.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.kv_transfer.base import TransferState
from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.torch_dist import DistConnector, start_rendezvous_store
from tandem.prefill_workers.worker import PrefillWorker
from tandem.wire.errors import NoReservation, TransferFailed
from tandem.wire.messages import PrefillReserve, SamplingParams


@pytest.fixture
def prefill():
    store, port = start_rendezvous_store("127.0.0.1")
    engine = LLMEngine(EngineConfig(model="smollm2-135m", cache=CacheConfig(num_blocks=256)))
    tcfg = KVTransferConfig(connect_timeout_s=4.0, timeout_s=4.0)
    w = PrefillWorker("prefill-t", engine, DistConnector("prefill-t", f"127.0.0.1:{port}", engine.kv_cache.device, tcfg),
                      transfer_config=tcfg)
    yield w
    w.shutdown()
    del store


def reserve(prefill: PrefillWorker, tid: str, ids: list[int]):
    return prefill.reserve(PrefillReserve(tid, ids, SamplingParams(max_tokens=4)))


def test_first_token_comes_before_the_transfer_ends(prefill):
    ids = list(range(100, 180))
    res = reserve(prefill, "t1", ids)
    spec = TransferSpec("t1", "prefill-t", "decode-absent", tuple(range(prefill.engine.kv_cache.num_layers)),
                        tuple(res.block_ids), tuple(range(len(res.block_ids))), len(ids))
    outcome: dict = {}

    def start():
        try:
            outcome["result"] = prefill.start(spec)
        except Exception as e:  # noqa: BLE001
            outcome["error"] = e
        outcome["at"] = time.monotonic()

    t = threading.Thread(target=start)
    t.start()
    got = prefill.first_token("t1", timeout_s=30)
    at = time.monotonic()
    assert "at" not in outcome, "start returned first: the token waited for the transfer"
    # the same token a plain engine samples after this prompt (greedy); the worker's engine is busy
    ref = LLMEngine(prefill.engine.config).generate([{"prompt_token_ids": ids, "max_tokens": 1}])[0]
    assert [got.first.token_id] == ref["token_ids"]
    assert set(got.timings) == {"prefix pull", "queue+compute"}
    t.join(60)
    assert isinstance(outcome.get("error"), TransferFailed) and outcome["at"] > at   # the peer never joined
    assert prefill.kv_blocks_used() == 0 and prefill.held() == {}     # and its blocks came back


def test_first_token_of_a_transfer_that_never_started_raises_at_once(prefill):
    bad = TransferSpec("t-unknown", "prefill-t", "decode-absent", (0,), (0,), (0,), 16)
    with pytest.raises(NoReservation):
        prefill.start(bad)                                   # no reservation under that id
    t0 = time.monotonic()
    with pytest.raises(Exception):
        prefill.first_token("t-unknown", timeout_s=30)
    assert time.monotonic() - t0 < 1.0


def _reserve_with_pull(prefill, tid: str, pid: str) -> list[int]:
    """Reserve `tid` and register a pull of its first block from a decode actor; -> its blocks."""
    ids = list(range(100, 180))
    res = reserve(prefill, tid, ids)
    pull = TransferSpec(pid, "decode-absent", "prefill-t", tuple(range(prefill.engine.kv_cache.num_layers)),
                        (7,), tuple(res.block_ids[:1]), 16)
    prefill.expect_pull(pull, tid, 16)
    return res.block_ids


def _used_after_polls(prefill) -> int:
    time.sleep(0.1)                       # many idle polls of the loop
    return prefill.kv_blocks_used()


def test_an_abort_while_a_pull_copies_a_layer_keeps_the_blocks_until_the_copy_ends(prefill):
    _reserve_with_pull(prefill, "t-p", "pull-p")
    held = prefill.kv_blocks_used()
    assert held > 0

    def claim_then_abort():                   # one loop turn: a layer of the pull is being copied
        rec = prefill.receiver._table.start_work("pull-p")
        assert prefill._abort("t-p")
        return rec

    rec = prefill.loop.run(claim_then_abort)
    assert prefill.receiver.poll("pull-p") is TransferState.ABORTED
    assert _used_after_polls(prefill) == held        # not reusable while written into
    assert prefill.held() == {"t-p": "parked"}
    prefill.receiver._table.end_work(rec, 0)          # the copy ends, on the transport's thread
    deadline = time.monotonic() + 10
    while _used_after_polls(prefill) and time.monotonic() < deadline:
        pass
    assert _used_after_polls(prefill) == 0
    assert prefill.held() == {}


def test_an_abort_after_a_pull_landed_unseen_frees_the_blocks_at_its_reap(prefill):
    _reserve_with_pull(prefill, "t-q", "pull-q")

    def land_then_abort():
        prefill.receiver._table.finish("pull-q", TransferState.DONE)
        return prefill._abort("t-q")

    assert prefill.loop.run(land_then_abort)
    assert _used_after_polls(prefill) == 0
    assert prefill.held() == {}


def test_a_start_the_sender_refuses_keeps_nothing(prefill):
    """A spec whose source blocks are not the reservation's: `start` raises with the reason, the
    first-token waiter is answered, and the reservation's blocks come back."""
    ids = list(range(100, 180))
    res = reserve(prefill, "t-bad", ids)
    assert prefill.kv_blocks_used() > 0
    n = prefill.engine.kv_cache.num_blocks
    spec = TransferSpec("t-bad", "prefill-t", "decode-absent", tuple(range(prefill.engine.kv_cache.num_layers)),
                        (n + 5,) * len(res.block_ids), tuple(range(len(res.block_ids))), len(ids))
    with pytest.raises(ValueError, match="outside"):
        prefill.start(spec)
    with pytest.raises(Exception):
        prefill.first_token("t-bad", timeout_s=5)
    assert prefill.kv_blocks_used() == 0 and prefill.held() == {}
    assert not prefill.abort("t-bad")            # nothing left to abort


def test_a_reservation_never_started_is_freed_and_a_late_start_refused(prefill):
    """The router crashed between `reserve` and `start`: the blocks come back after
    reservation_timeout_s, and a start that comes later says why it is refused."""
    prefill.reservation_timeout_s = 2.0       # well past the check below, GC pauses included
    ids = list(range(100, 180))
    res = reserve(prefill, "t-late", ids)
    used = prefill.kv_blocks_used
    assert used() > 0
    time.sleep(0.2)
    assert used() > 0                                   # not before its time
    deadline = time.monotonic() + 10
    while used() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert used() == 0 and prefill.stats().reservations_expired == 1
    spec = TransferSpec("t-late", "prefill-t", "decode-absent", tuple(range(prefill.engine.kv_cache.num_layers)),
                        tuple(res.block_ids), tuple(range(len(res.block_ids))), len(ids))
    with pytest.raises(NoReservation, match="not started within"):
        prefill.start(spec)


def test_a_pull_that_lands_before_start_is_used_not_recomputed(prefill):
    """On a fast link the prefix pull can land (and be reaped) before the router's `start` call
    arrives: the request then computes only past the pulled prefix, as when it lands after."""
    res_blocks = _reserve_with_pull(prefill, "t-early", "pull-early")      # pulls 16 tokens of the 80
    before = prefill.stats()
    prefill.loop.run(lambda: prefill.receiver._table.finish("pull-early", TransferState.DONE))
    deadline = time.monotonic() + 10
    while prefill.stats().pulled_tokens == before.pulled_tokens and time.monotonic() < deadline:
        time.sleep(0.01)                                      # reaped by the loop, start not yet come
    assert prefill.held() == {"t-early": "reserved"}
    spec = TransferSpec("t-early", "prefill-t", "decode-absent", tuple(range(prefill.engine.kv_cache.num_layers)),
                        tuple(res_blocks[:5]), tuple(range(5)), 80)

    def start():
        try:
            prefill.start(spec)
        except Exception:  # noqa: BLE001 - its decode peer never joins: fails after the first token
            pass

    threading.Thread(target=start, daemon=True).start()
    prefill.first_token("t-early", timeout_s=30)
    after = prefill.stats()
    assert after.pulled_tokens - before.pulled_tokens == 16
    assert after.computed_tokens - before.computed_tokens == 80 - 16
