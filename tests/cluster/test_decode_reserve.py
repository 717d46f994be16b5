"""A decode actor told which prefill actor will send (the router's `prefill_id`) registers the
receive inside `reserve`, so the router needs no separate `expect` call; an abort frees those
blocks, and a receive that cannot be registered fails the reserve without keeping any block.
Real DecodeWorker and engine (smollm2-135m on CPU) with its gloo KV receiver; no Ray needed."""

from __future__ import annotations

import pytest

from decode_workers.worker import DecodeWorker
from engine.config import EngineConfig
from kv_transfer.base import TransferState
from kv_transfer.torch_dist import start_rendezvous_store


@pytest.fixture
def worker():
    store, port = start_rendezvous_store("127.0.0.1")
    w = DecodeWorker("decode-r", EngineConfig(model="smollm2-135m"), local_prefill_threshold=16,
                     rendezvous=f"127.0.0.1:{port}")
    yield w
    w.shutdown()
    del store


def used_blocks(w: DecodeWorker) -> int:
    return w.loop.run(lambda: w.engine.allocator.num_used_blocks)


def test_reserve_registers_the_receive_from_the_named_prefill_actor(worker):
    w, sampling = worker, {"max_tokens": 4, "ignore_eos": True}
    plan = w.reserve("req-1", "router-a", list(range(100, 200)), sampling, "t-1", "prefill-9")
    assert plan["mode"] == "remote" and plan["expecting"] == "prefill-9"
    assert w.receiver.poll("t-1") is TransferState.WAITING
    assert w.receiver._table.get("t-1").spec.dst_block_ids == tuple(plan["dst_block_ids"])
    assert w.receiver._table.get("t-1").peer == "prefill-9"
    # without a named prefill actor the router registers it later (`expect`), as before
    other = w.reserve("req-2", "router-a", list(range(300, 380)), sampling, "t-2")
    assert other["mode"] == "remote" and "expecting" not in other
    with pytest.raises(KeyError):
        w.receiver.poll("t-2")
    held = used_blocks(w)
    assert w.abort("req-1")
    assert w.receiver.poll("t-1") is TransferState.ABORTED
    assert used_blocks(w) == held - len(plan["dst_block_ids"])      # its blocks are free again
    assert w.abort("req-2")
    assert used_blocks(w) == 0


def test_expect_from_another_prefill_actor_redirects_the_registered_receive(worker):
    """The router's first prefill actor could not take the request: its `expect` names another,
    and the receive registered at reserve now waits for that one."""
    from kv_transfer.base import TransferSpec

    w = worker
    plan = w.reserve("req-4", "router-a", list(range(100, 200)), {"max_tokens": 4}, "t-4", "prefill-9")
    n = len(plan["dst_block_ids"])
    spec = TransferSpec("t-4", "prefill-7", "decode-r", tuple(range(w.engine.kv_cache.num_layers)),
                        tuple(range(n)), tuple(plan["dst_block_ids"]), plan["num_tokens"])
    w.expect(spec.to_msg())
    assert w.receiver._table.get("t-4").peer == "prefill-7"
    assert w.receiver.poll("t-4") is TransferState.WAITING
    assert w.abort("req-4") and used_blocks(w) == 0


def test_a_receive_that_cannot_be_registered_fails_the_reserve_and_keeps_nothing(worker):
    w = worker
    with pytest.raises(ValueError, match="distinct"):     # the sender cannot be the receiver itself
        w.reserve("req-3", "router-a", list(range(100, 200)), {"max_tokens": 4}, "t-3", "decode-r")
    assert used_blocks(w) == 0
    assert "t-3" not in w.remote and "req-3" not in w.transfer_of
