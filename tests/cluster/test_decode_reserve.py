"""A decode actor told which prefill actor will send (the router's `prefill_id`) registers the
receive inside `reserve`, so the router needs no separate `expect` call; an abort frees those
blocks, and a receive that cannot be registered fails the reserve without keeping any block.
Real DecodeWorker and engine (smollm2-135m on CPU) with its gloo KV receiver; no Ray needed."""

from __future__ import annotations

import time

import pytest

from tandem.decode_workers.worker import DecodeWorker
from tandem.engine.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.kv_transfer.base import KVTransferError, TransferState
from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.torch_dist import DistConnector, start_rendezvous_store
from tandem.wire.errors import NoReservation
from tandem.wire.messages import DecodeReserve, OutputError, SamplingParams


@pytest.fixture
def worker():
    store, port = start_rendezvous_store("127.0.0.1")
    # 512 blocks: each test holds a few; the default (sized from memory, 2 GiB on CPU) took ~1.4 s to zero
    engine = LLMEngine(EngineConfig(model="smollm2-135m", cache=CacheConfig(num_blocks=512)))
    tcfg = KVTransferConfig(start_timeout_s=600.0)
    w = DecodeWorker("decode-r", engine, DistConnector("decode-r", f"127.0.0.1:{port}", engine.kv_cache.device, tcfg),
                     local_prefill_threshold=16, transfer_config=tcfg)
    yield w
    w.shutdown()
    del store


def used_blocks(w: DecodeWorker) -> int:
    return w.kv_blocks_used()


def reserve(w: DecodeWorker, rid: str, ids: list[int], transfer_id: str | None = None,
            prefill_id: str | None = None, **sampling):
    sp = SamplingParams(**{"max_tokens": 4, **sampling})
    return w.reserve(DecodeReserve(rid, "router-a", ids, sp, transfer_id=transfer_id, prefill_id=prefill_id))


def test_reserve_registers_the_receive_from_the_named_prefill_actor(worker):
    w = worker
    plan = reserve(w, "req-1", list(range(100, 200)), "t-1", "prefill-9", ignore_eos=True)
    assert plan.remote and plan.expecting == "prefill-9"
    assert w.receiver.poll("t-1") is TransferState.WAITING
    assert w.receiver._table.get("t-1").spec.dst_block_ids == tuple(plan.dst_block_ids)
    assert w.receiver._table.get("t-1").peer == "prefill-9"
    assert w.held() == {"req-1": "receiving", "t-1": "receiving"}
    # without a named prefill actor the router registers it later (`expect`), as before
    other = reserve(w, "req-2", list(range(300, 380)), "t-2", ignore_eos=True)
    assert other.remote and other.expecting is None
    with pytest.raises(KeyError):
        w.receiver.poll("t-2")
    held = used_blocks(w)
    assert w.abort("req-1")
    assert w.receiver.poll("t-1") is TransferState.ABORTED
    assert used_blocks(w) == held - len(plan.dst_block_ids)      # its blocks are free again
    assert w.abort("req-2")
    assert used_blocks(w) == 0


def test_expect_from_another_prefill_actor_redirects_the_registered_receive(worker):
    """The router's first prefill actor could not take the request: its `expect` names another,
    and the receive registered at reserve now waits for that one."""
    w = worker
    plan = reserve(w, "req-4", list(range(100, 200)), "t-4", "prefill-9")
    n = len(plan.dst_block_ids)
    spec = TransferSpec("t-4", "prefill-7", "decode-r", tuple(range(w.engine.kv_cache.num_layers)),
                        tuple(range(n)), tuple(plan.dst_block_ids), plan.num_tokens)
    w.expect(spec)
    assert w.receiver._table.get("t-4").peer == "prefill-7"
    assert w.receiver.poll("t-4") is TransferState.WAITING
    assert w.abort("req-4") and used_blocks(w) == 0


def test_a_receive_that_cannot_be_registered_fails_the_reserve_and_keeps_nothing(worker):
    w = worker
    plan = reserve(w, "req-self", list(range(100, 200)), "t-self", "decode-r")
    assert not plan.remote                               # named as its own prefill actor: prefills locally
    assert w.abort("req-self") and used_blocks(w) == 0
    w.receiver.close()                                   # a receiver that takes no transfer
    with pytest.raises(KVTransferError, match="closed"):
        reserve(w, "req-3", list(range(300, 400)), "t-3", "prefill-7")
    assert used_blocks(w) == 0
    assert w.held() == {}
    with pytest.raises(NoReservation):                     # and nothing to `expect` into
        w.expect(TransferSpec("t-3", "prefill-7", "decode-r", (0,), (), (0,), 16))


def wait_for(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_an_abort_after_the_kv_landed_but_before_the_loop_saw_it_frees_the_blocks(worker):
    """The router aborts a request whose first token ended it (max_tokens 1, a stop string) while
    its transfer has just finished, before the decode loop reaped it: no release is owed for a
    DONE transfer, so the reap hands the blocks back."""
    w = worker
    reserve(w, "req-a", list(range(100, 200)), "t-a", "prefill-9")
    assert used_blocks(w) > 0

    def land_then_abort():                      # one loop turn: no reap in between
        w.receiver._table.finish("t-a", TransferState.DONE)
        return w._abort("req-a")

    assert w.loop.run(land_then_abort)
    assert wait_for(lambda: used_blocks(w) == 0), used_blocks(w)
    assert w.held() == {}


def test_an_abort_while_a_layer_is_copied_frees_the_blocks_once_the_copy_ends(worker):
    """The blocks must not be reused while a layer is still being written into them, and must
    come back once it is."""
    w = worker
    reserve(w, "req-b", list(range(100, 200)), "t-b", "prefill-9")
    held = used_blocks(w)

    def claim_then_abort():
        rec = w.receiver._table.start_work("t-b")   # as the transport does for a layer
        w._abort("req-b")
        return rec

    rec = w.loop.run(claim_then_abort)
    time.sleep(0.1)                                   # many idle polls of the loop
    assert used_blocks(w) == held                     # still being written into
    assert w.held() == {"t-b": "releasing"}          # the request is gone, its transfer not yet
    w.receiver._table.end_work(rec, 0)                # the copy ends, on the transport's thread
    assert wait_for(lambda: used_blocks(w) == 0), used_blocks(w)
    assert w.held() == {}


def test_a_transfer_failing_mid_copy_frees_its_blocks_after_the_copy_and_reports_once(worker):
    """The failure is reaped (the router hears of it) before the layer in flight is copied: the
    blocks come back when it is."""
    from tandem.kv_transfer.base import KVTransferError

    w = worker
    reserve(w, "req-c", list(range(100, 200)), "t-c", "prefill-9")
    held = used_blocks(w)

    def claim_then_fail():
        rec = w.receiver._table.start_work("t-c")
        w.receiver._table.finish("t-c", TransferState.FAILED, KVTransferError("peer lost"))
        return rec

    rec = w.loop.run(claim_then_fail)
    errors = []
    assert wait_for(lambda: errors.extend(m for m in w.get_outputs("router-a", 0.05)
                                          if isinstance(m, OutputError)) or errors)
    assert [m.request_id for m in errors] == ["req-c"] and "failed" in errors[0].error
    assert w.held() == {"t-c": "releasing"} and used_blocks(w) == held
    w.receiver._table.end_work(rec, 0)
    assert wait_for(lambda: used_blocks(w) == 0), used_blocks(w)
    assert w.held() == {}


def test_a_request_aborted_mid_stream_leaves_nothing_behind(worker):
    """Cancelled streams are common (a coding agent stops a turn): an abort leaves no per-request
    state on the decode actor, which runs for weeks."""
    w = worker
    plan = reserve(w, "req-l", list(range(100, 140)), max_tokens=400, ignore_eos=True)
    assert not plan.remote
    got = []
    assert wait_for(lambda: got.extend(t for m in w.get_outputs("router-a", 0.2) for t in m.token_ids)
                    or len(got) >= 3, timeout_s=60)
    assert w.held() == {"req-l": "in_engine"}
    assert w.abort("req-l")
    assert wait_for(lambda: used_blocks(w) == 0)
    assert w.held() == {}
