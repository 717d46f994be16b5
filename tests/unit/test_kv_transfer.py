"""KV transfer over the in-process fake transport: the real sender/receiver state machines, no Ray,
no torch.distributed groups. Their contract: order, aborts, timeouts, dead and restarted peers,
releases. (Batching and staging: test_kv_batching.py; direct copies: test_kv_direct_copy.py; what
goes on the wire: test_kv_frames.py.)"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch

from tandem.kv_transfer.base import KVTransferAborted, KVTransferError, KVTransferTimeout, TransferState
from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.fake import FakeNetwork, make_fake_pair
from tandem.kv_transfer.receiver import LayerStreamReceiver
from tandem.kv_transfer.records import TransferTable
from tandem.kv_transfer.sender import LayerStreamSender
from tandem.kv_transfer.testing import TensorBlockStore
from tandem.kv_transfer.torch_dist import backend_for

from tests.unit.kv_factories import (DST, FAST, LAYER_BYTES, SRC, Releases, assert_layer_copied,
                                     assert_next_transfer_arrives, make_spec, stream, until)


def test_the_transfer_table_walks_only_unfinished_transfers():
    """Expiry and per-peer counts run on every poll and reap (a decode actor's every step): they
    walk the unfinished transfers, not the thousands of finished ones the table keeps; every way
    a transfer ends takes it off that set, and expiry still finds a late one."""
    now = [0.0]
    table = TransferTable(lambda _rid: None, [TransferState.FAILED], clock=lambda: now[0])
    for i in range(2000):
        table.add(make_spec(f"old-{i}"), peer="p")
        table.finish(f"old-{i}", TransferState.DONE)
    rec = table.add(make_spec("done"), peer="p")
    table.start_work("done")
    table.end_work(rec, 4)                                    # all its layers: DONE
    table.add(make_spec("aborted"), peer="p")
    table.finish("aborted", TransferState.ABORTED)
    table.add(make_spec("peer-died"), peer="q")
    assert table.fail_peer("q", KVTransferError("gone")) == ["peer-died"]
    table.add(make_spec("late"), peer="p", deadline=5.0)
    table.add(make_spec("live"), peer="p", deadline=50.0)
    assert table.active_with("p") == 2 and table.active_with("q") == 0
    now[0] = 10.0
    assert ("late", TransferState.FAILED) in table.reap()
    assert list(table._live) == ["live"] and table.active_with("p") == 1
    table.finish("live", TransferState.DONE)
    assert not table._live


def test_layers_stream_in_order_bit_exact_into_dst_blocks(pair):
    sender, receiver, net, src, dst, s_rel, r_rel = pair
    spec = make_spec()
    receiver.expect(spec)
    sender.begin(spec)
    assert receiver.poll(spec.request_id) is TransferState.WAITING
    for n, layer in enumerate(spec.layers, start=1):
        sender.send_layer(spec.request_id, layer)
        until(lambda: receiver.progress(spec.request_id)[0] == n)
        assert_layer_copied(src, dst, layer)
        if n < spec.num_layers:
            assert receiver.poll(spec.request_id) is TransferState.TRANSFERRING
            assert dst.cache[layer + 1].abs().sum() == 0          # later layers not yet written
    assert receiver.wait(spec.request_id, timeout=2) is TransferState.DONE
    assert sender.wait(spec.request_id, timeout=2) is TransferState.DONE
    untouched = [b for b in range(12) if b not in DST]
    assert dst.cache[:, :, untouched].abs().sum() == 0
    assert receiver.reap() == [(spec.request_id, TransferState.DONE)]
    assert r_rel.calls == Counter()                  # DONE: the blocks stay with the request
    assert s_rel.calls == Counter({spec.request_id: 1})  # sender's blocks are free to go
    assert s_rel.threads == {threading.get_ident()}      # callbacks run on the owner's thread


def test_second_transfer_reuses_the_link_and_interleaves(pair):
    sender, receiver, net, src, dst, *_ = pair
    a = make_spec("a", layers=(0, 1, 2, 3), src=(0, 1), dst=(2, 3))
    b = make_spec("b", layers=(1, 3), src=(4, 5, 6), dst=(7, 8, 11))
    for s in (a, b):
        receiver.expect(s)
        sender.begin(s)
    for la, lb in [(0, 1), (1, 3)]:
        sender.send_layer("a", la)
        sender.send_layer("b", lb)
    sender.send_layer("a", 2)
    sender.send_layer("a", 3)
    assert receiver.wait("a", 2) is TransferState.DONE and receiver.wait("b", 2) is TransferState.DONE
    for layer in range(4):
        assert_layer_copied(src, dst, layer, (0, 1), (2, 3))
    for layer in (1, 3):
        assert_layer_copied(src, dst, layer, (4, 5, 6), (7, 8, 11))
    assert net.links_created == 1


def test_send_layer_out_of_order_is_refused(pair):
    sender, receiver, *_ = pair
    spec = make_spec()
    receiver.expect(spec)
    sender.begin(spec)
    with pytest.raises(ValueError):
        sender.send_layer(spec.request_id, 1)
    with pytest.raises(KeyError):
        sender.send_layer("nope", 0)


def test_receiver_abort_mid_transfer_frees_blocks_on_both_sides(pair):
    sender, receiver, net, src, dst, s_rel, r_rel = pair
    spec = make_spec()
    receiver.expect(spec)
    prefill = stream(sender, spec, 0.05)                     # a slow prefill
    until(lambda: receiver.progress(spec.request_id)[0] >= 1)
    receiver.abort(spec.request_id)
    assert r_rel.calls == Counter({spec.request_id: 1})       # released before abort() returns
    assert receiver.poll(spec.request_id) is TransferState.ABORTED
    with pytest.raises(KVTransferAborted):
        sender.wait(spec.request_id, timeout=2)                # the sender learned and stopped
    assert s_rel.calls == Counter({spec.request_id: 1})
    receiver.abort(spec.request_id)                            # idempotent
    prefill.join()
    sender.abort(spec.request_id)
    time.sleep(0.15)
    assert dst.cache[3, :, list(DST)].abs().sum() == 0         # nothing landed after the abort
    assert r_rel.calls[spec.request_id] == 1 and s_rel.calls[spec.request_id] == 1


def test_sender_abort_reaches_the_receiver(pair):
    sender, receiver, net, src, dst, s_rel, r_rel = pair
    spec = make_spec()
    receiver.expect(spec)
    sender.begin(spec)
    sender.send_layer(spec.request_id, 0)
    until(lambda: receiver.progress(spec.request_id)[0] == 1)
    sender.abort(spec.request_id)
    assert s_rel.calls == Counter({spec.request_id: 1})
    with pytest.raises(KVTransferAborted):
        receiver.wait(spec.request_id, timeout=2)
    assert r_rel.calls == Counter({spec.request_id: 1})
    sender.send_layer(spec.request_id, 1)                      # prefill finishing its layers: ignored
    assert sender.poll(spec.request_id) is TransferState.ABORTED


def test_slow_peer_times_out_and_releases(pair):
    sender, receiver, net, src, dst, s_rel, r_rel = pair
    spec = make_spec(layers=(0, 1))
    receiver.expect(spec)
    stream(sender, spec, FAST.timeout_s + 0.5)                # > timeout_s between layers
    until(lambda: receiver.progress(spec.request_id)[0] == 1)
    with pytest.raises(KVTransferTimeout):
        receiver.wait(spec.request_id, timeout=5)
    assert receiver.poll(spec.request_id) is TransferState.FAILED
    assert r_rel.calls == Counter({spec.request_id: 1})
    # the late layer is dropped, not written into released blocks
    until(lambda: sender.poll(spec.request_id).terminal)
    time.sleep(0.05)
    assert dst.cache[1, :, list(DST)].abs().sum() == 0


def test_caller_wait_timeout_fails_the_transfer(pair):
    sender, receiver, net, src, dst, s_rel, r_rel = pair
    spec = make_spec()
    receiver.expect(spec)                                       # the sender never starts
    t0 = time.monotonic()
    with pytest.raises(KVTransferTimeout):
        receiver.wait(spec.request_id, timeout=0.1)
    assert time.monotonic() - t0 < 1
    assert receiver.poll(spec.request_id) is TransferState.FAILED
    assert r_rel.calls == Counter({spec.request_id: 1})
    assert receiver.reap() == [(spec.request_id, TransferState.FAILED)]


def test_peer_dies_after_layer_k_fails_both_sides(pair):
    sender, receiver, net, src, dst, s_rel, r_rel = pair
    net.set_faults("prefill-0", "decode-0", die_after_layers=2)
    spec = make_spec()
    receiver.expect(spec)
    sender.send(spec)
    with pytest.raises(KVTransferError) as info:
        receiver.wait(spec.request_id, timeout=2)
    assert not isinstance(info.value, KVTransferAborted)
    assert receiver.progress(spec.request_id) == (2, 4)
    with pytest.raises(KVTransferError):
        sender.wait(spec.request_id, timeout=2)
    assert r_rel.calls == Counter({spec.request_id: 1})
    assert s_rel.calls == Counter({spec.request_id: 1})
    # the pair reconnects for the next transfer
    net.set_faults("prefill-0", "decode-0")
    again = make_spec("req-2")
    receiver.expect(again)
    sender.send(again)
    assert receiver.wait("req-2", timeout=2) is TransferState.DONE
    assert net.links_created == 2
    # every staging buffer came back, from the broken link's messages too
    sender.wait("req-2", timeout=2)
    worker = sender._workers["decode-0"]       # a slot is given back just after its message retires
    until(lambda: not worker.window.messages and worker.streamed.staging.idle)
    loop = receiver._loops["prefill-0"]
    until(lambda: not loop.landings and loop.streamed.staging.idle)


def test_data_before_expect_fails_the_later_expect(pair):
    sender, receiver, net, src, dst, s_rel, r_rel = pair
    first = make_spec("first", layers=(0,))
    receiver.expect(first)                          # opens the link
    early = make_spec("early", layers=(0,))
    sender.send(early)
    sender.send(first)
    assert receiver.wait("first", 2) is TransferState.DONE
    receiver.expect(early)
    assert receiver.poll("early") is TransferState.FAILED
    assert r_rel.calls == Counter({"early": 1})


def test_layout_mismatch_fails_cleanly():
    src = TensorBlockStore(num_blocks=12, head_dim=8, generator=torch.Generator().manual_seed(1))
    dst = TensorBlockStore(num_blocks=12, head_dim=16)
    rel = Releases()
    sender, receiver, _ = make_fake_pair(src, dst, config=FAST, on_receiver_release=rel)
    spec = make_spec(layers=(0,))
    receiver.expect(spec)
    sender.send(spec)
    with pytest.raises(KVTransferError, match="layout mismatch"):
        receiver.wait(spec.request_id, 2)
    assert rel.calls == Counter({spec.request_id: 1})
    assert dst.cache.abs().sum() == 0
    sender.close()
    receiver.close()


def test_begin_prepares_the_link_and_an_abort_before_any_layer_leaks_nothing(pair):
    """begin() has the worker connect and build the block index while the prefill computes; a
    transfer aborted before its first layer drops what was prepared once the worker is idle."""
    sender, receiver, net, src, dst, s_rel, r_rel = pair
    spec = make_spec("req-early")
    receiver.expect(spec)
    sender.begin(spec)
    worker = sender._workers["decode-0"]
    until(lambda: worker.link is not None and spec.request_id in worker.streamed.index)
    sender.abort(spec.request_id)
    receiver.abort(spec.request_id)
    until(lambda: not worker.streamed.index and not worker.prepared)
    assert s_rel.calls == Counter({spec.request_id: 1})
    nxt = make_spec("req-next")          # the prepared link carries the next transfer
    receiver.expect(nxt)
    sender.send(nxt)
    assert receiver.wait(nxt.request_id, 2) is TransferState.DONE
    for layer in nxt.layers:
        assert_layer_copied(src, dst, layer)


def test_the_senders_owner_is_signalled_when_a_transfer_ends():
    """The prefill loop sleeps between polls; the sender signals it from its own thread when a
    transfer is done, so the first token is handed over at once."""
    src = TensorBlockStore(num_blocks=12, generator=torch.Generator().manual_seed(2))
    net, signals = FakeNetwork(), []
    sender = LayerStreamSender(src, net.connector("prefill-0"), FAST,
                               on_transition=lambda: signals.append(threading.get_ident()))
    receiver = LayerStreamReceiver(TensorBlockStore(num_blocks=12), net.connector("decode-0"), FAST)
    try:
        spec = make_spec("req-sig")
        receiver.expect(spec)
        sender.send(spec)
        assert receiver.wait(spec.request_id, 2) is TransferState.DONE
        until(lambda: len(signals) == 1)
        assert signals[0] != threading.get_ident()        # from the transport's thread
        assert sender.poll(spec.request_id) is TransferState.DONE
    finally:
        sender.close()
        receiver.close()


def test_a_registered_receive_can_be_pointed_at_another_sender_until_data_arrives(pair):
    """The decode actor registers a receive naming the prefill actor asked first; when another one
    takes the request, `redirect` points it there (same blocks). Refused once data has arrived."""
    sender, receiver, net, src, dst, s_rel, r_rel = pair
    first_choice = TransferSpec("req-r", "prefill-9", "decode-0", (0, 1, 2, 3), (), DST, 11)
    receiver.expect(first_choice)
    spec = make_spec("req-r")                         # from prefill-0, with its source blocks
    with pytest.raises(ValueError, match="keeps its layers and blocks"):
        receiver.redirect(make_spec("req-r", dst=(5, 9, 2)))
    receiver.redirect(spec)
    sender.send(spec)
    assert receiver.wait("req-r", 2) is TransferState.DONE
    for layer in spec.layers:
        assert_layer_copied(src, dst, layer)
    with pytest.raises(KVTransferError, match="cannot be redirected"):
        receiver.redirect(spec)


def test_backend_follows_the_cache_device():
    assert backend_for("cpu") == "gloo"
    assert backend_for(torch.device("cuda", 1)) == "nccl"
    assert backend_for("cuda") == "nccl"


def test_close_fails_unfinished_transfers_and_releases(pair):
    sender, receiver, net, src, dst, s_rel, r_rel = pair
    spec = make_spec()
    receiver.expect(spec)
    sender.begin(spec)
    sender.send_layer(spec.request_id, 0)
    until(lambda: sender.progress(spec.request_id) == (1, 4))
    receiver.close()
    sender.close()
    assert receiver.poll(spec.request_id) is TransferState.FAILED
    assert sender.poll(spec.request_id) is TransferState.FAILED
    assert r_rel.calls == Counter({spec.request_id: 1})
    assert s_rel.calls == Counter({spec.request_id: 1})


def test_an_unexpected_error_in_the_receiver_fails_its_transfers_and_the_next_one_works():
    """A bug or a failed allocation on the receiving thread must not leave transfers hanging: they
    fail, their blocks are released, and the next transfer from that peer gets a fresh loop."""
    src = TensorBlockStore(num_blocks=12, generator=torch.Generator().manual_seed(5))

    class FlakyStore(TensorBlockStore):
        fail = 1

        def scatter_layers(self, layers, block_ids, data):
            if self.fail:
                self.fail -= 1
                raise RuntimeError("CUDA out of memory (simulated)")
            super().scatter_layers(layers, block_ids, data)

    dst, rel = FlakyStore(num_blocks=12), Releases()
    sender, receiver, _ = make_fake_pair(src, dst, config=FAST, on_receiver_release=rel)
    try:
        first = make_spec("req-a")
        receiver.expect(first)
        sender.send(first)
        with pytest.raises(KVTransferError, match="out of memory"):
            receiver.wait(first.request_id, 2)
        assert rel.calls == Counter({first.request_id: 1})
        try:        # let the sender see the broken link first: a break fails what is queued then
            sender.wait(first.request_id, 2)
        except KVTransferError:
            pass
        assert_next_transfer_arrives(sender, receiver, src, dst, "req-b")
    finally:
        sender.close()
        receiver.close()


def test_begin_checks_the_link_in_one_lookup_while_the_receivers_epoch_is_unchanged(pair):
    """The full check (receiver aborted? link still current?) costs three store round trips on the
    real connector; while the receiver's epoch (one round trip) is unchanged since the last full
    check, begin() skips it. An abort notice or a dead peer changes the epoch, and the next
    transfer is checked in full again: the abort is found, the pair rebuilt."""
    sender, receiver, net, src, dst, s_rel, r_rel = pair
    conn = sender.connector
    checks = Counter()
    for name in ("is_current", "abort_posted"):
        real = getattr(conn, name)
        setattr(conn, name, lambda *a, _real=real, _name=name: (checks.update([_name]), _real(*a))[1])

    def transfer(rid: str) -> TransferState:
        spec = make_spec(rid)
        receiver.expect(spec)
        sender.begin(spec)
        worker = sender._workers["decode-0"]
        until(lambda: spec.request_id in worker.prepared or sender.poll(rid).terminal)
        for layer in spec.layers:
            sender.send_layer(rid, layer)
        try:
            return receiver.wait(rid, 2)
        except KVTransferError:
            return receiver.poll(rid)

    assert transfer("r1") is TransferState.DONE           # first: full check (the link is new)
    first = checks.copy()
    assert first["abort_posted"] >= 1
    assert transfer("r2") is TransferState.DONE           # epoch unchanged: no full check at begin
    assert checks == first
    spec = make_spec("r3")                                 # the receiver aborts r3 before it starts
    receiver.expect(spec)
    receiver.abort("r3")
    sender.begin(spec)
    until(lambda: sender.poll("r3") is TransferState.ABORTED)
    assert checks["abort_posted"] > first["abort_posted"]
    net.kill("decode-0")                                   # the pair dies: checked in full, rebuilt
    until(lambda: "prefill-0" not in receiver._loops)     # (the receiver's reader has seen it)
    before = checks["is_current"]
    assert transfer("r4") is TransferState.DONE
    assert checks["is_current"] > before and net.links_created == 2
    for layer in range(4):
        assert_layer_copied(src, dst, layer)


def test_a_message_the_receiver_never_takes_fails_its_transfer_on_time():
    """Data posted to a receiver that stopped reading (alive, link open): the sender's transfer
    fails once the message is older than timeout_s, without anyone waiting on it."""
    src = TensorBlockStore(num_blocks=12, generator=torch.Generator().manual_seed(13))
    dst = TensorBlockStore(num_blocks=12)
    sender, receiver, net = make_fake_pair(src, dst, config=FAST)
    try:
        net.set_faults("prefill-0", "decode-0", held_sends=True)
        spec = make_spec()
        sender.send(spec)            # nobody reads this pipe: the receiver never expected it
        t0 = time.monotonic()
        until(lambda: sender.poll(spec.request_id) is TransferState.FAILED, timeout=3)
        assert time.monotonic() - t0 < FAST.timeout_s + 1.0
    finally:
        sender.close()
        receiver.close()


def test_a_restarted_receiver_fails_only_the_transfers_on_the_old_link():
    """The receiver restarts while a message to it is posted (it will never complete, nor fail):
    the next transfer's link check finds the pair replaced, fails the transfer that was in flight
    at once, and the new transfer goes over a new link, bit-exact, instead of waiting out the old
    message's timeout and failing with it."""
    src = TensorBlockStore(num_blocks=12, generator=torch.Generator().manual_seed(14))
    dst = TensorBlockStore(num_blocks=12)
    config = KVTransferConfig(timeout_s=2.0, start_timeout_s=2.0, connect_timeout_s=2.0,
                              max_message_bytes=LAYER_BYTES)
    sender, receiver, net = make_fake_pair(src, dst, config=config)
    try:
        net.set_faults("prefill-0", "decode-0", held_sends=True)
        stuck = make_spec("stuck", src=(2, 4, 6), dst=(0, 2, 4))
        sender.send(stuck)           # to a receiver that is gone: nobody reads this pipe
        until(lambda: sender._workers["decode-0"].window.messages)
        net.replace_pipe("prefill-0", "decode-0")       # it came back: a new pipe
        net.set_faults("prefill-0", "decode-0")
        t0 = time.monotonic()
        fresh = make_spec("fresh")
        receiver.expect(fresh)
        sender.send(fresh)
        assert receiver.wait("fresh", 3) is TransferState.DONE
        assert time.monotonic() - t0 < config.timeout_s     # did not wait out the old message
        for layer in fresh.layers:
            assert_layer_copied(src, dst, layer)
        assert sender.poll("stuck") is TransferState.FAILED
        assert sender.wait("fresh", 2) is TransferState.DONE
    finally:
        sender.close()
        receiver.close()


def test_the_receiver_builds_a_transfers_block_index_at_expect_and_drops_it_if_no_data_comes(pair):
    """expect() has the receive thread copy the destination block ids while it is idle (not when
    the first message lands); a transfer aborted before its data came leaves no index behind."""
    sender, receiver, net, src, dst, s_rel, r_rel = pair
    first = make_spec("first")
    receiver.expect(first)
    loop = receiver._loops["prefill-0"]
    until(lambda: "first" in loop.index)
    assert loop.index["first"].tolist() == list(DST)
    receiver.abort("first")
    later = make_spec("later", dst=(2, 4, 6))
    receiver.expect(later)                       # the thread wakes, prunes, prepares
    until(lambda: "later" in loop.index and "first" not in loop.index)
    sender.send(later)
    assert receiver.wait("later", 2) is TransferState.DONE
    for layer in later.layers:
        assert_layer_copied(src, dst, layer, SRC, (2, 4, 6))
    until(lambda: not loop.index)
