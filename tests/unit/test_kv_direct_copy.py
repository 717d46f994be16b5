"""Direct copies (KVTransferConfig.direct_copy) over the in-process fake transport: the receiver
maps the sender's cache and copies blocks straight out of it; the link carries control frames only.
On CPU, TensorBlockStore(shareable=True) hands out in-process handles where CUDA stores hand out
CUDA IPC handles (the GPU tests run the real thing between two actors)."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from tandem.kv_transfer.base import TransferState
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.fake import make_fake_pair
from tandem.kv_transfer.testing import TensorBlockStore

from tests.unit.kv_factories import (DST, FAST, Releases, assert_layer_copied,
                                     assert_next_transfer_arrives, make_spec, open_pair, stream, until)


def _worker(sender):
    return sender._workers["decode-0"]


@pytest.fixture
def direct():
    opened = open_pair(shareable=True)
    yield opened
    opened[0].close()
    opened[1].close()


def test_all_ready_and_streamed_transfers_copy_directly_and_move_no_data(direct):
    sender, receiver, net, src, dst, s_rel, r_rel = direct
    ready, streamed = make_spec("req-1"), make_spec("req-2", src=(4, 5, 6), dst=(2, 8, 10))
    sender.trace = []
    receiver.expect(ready)
    receiver.expect(streamed)
    sender.send(ready)
    stream(sender, streamed, 0.02).join()
    for spec in (ready, streamed):
        assert receiver.wait(spec.request_id, 3) is TransferState.DONE
        assert sender.wait(spec.request_id, 3) is TransferState.DONE
        for layer in spec.layers:
            assert_layer_copied(src, dst, layer, spec.src_block_ids, spec.dst_block_ids)
    pipe = net._pipes[("prefill-0", "decode-0")]
    assert _worker(sender).direct.active and pipe.data.empty() and pipe.verdict == (True, "")
    assert pipe.layers_sent == 8            # announced by "ready" frames, none went as data
    # the all-ready one is one frame; the streamed one up to a frame per layer
    assert 2 <= pipe.frames_sent <= 5
    sender.reap()
    receiver.reap()
    assert s_rel.calls == {"req-1": 1, "req-2": 1} and not r_rel.calls
    # the streamed one's source ids went through the arena, put there at begin() (its slot came
    # back); the all-ready one had no time to overlap an upload with: its ids went in its frame
    worker = _worker(sender)
    assert {rid for _t, what, rid in sender.trace if what == "send.ids slot"} == {"req-2"}
    assert worker.direct.ids_in_frames == 1 and not worker.direct.arena and worker.direct.id_ring.idle


def test_an_all_ready_send_on_a_direct_link_leaves_from_the_callers_thread(direct):
    """Once the link is up and direct, an all-ready send with nothing queued announces its layers
    from the caller's thread (no hand-over to the transport's), and arrives exact; the link is
    verified afterwards, on the transport's thread (a moved epoch with a current link is fine)."""
    sender, receiver, net, src, dst, s_rel, r_rel = direct
    sender.trace = []
    specs = [make_spec(f"req-{i}", src=(i, 4 + i, 8 + i), dst=(2 * i, 2 * i + 1, 11 - i)) for i in range(3)]
    for i, spec in enumerate(specs):
        receiver.expect(spec)
        if i == 2:
            net.epoch += 1                   # as an abort notice elsewhere would move it
        sender.send(spec)
        assert receiver.wait(spec.request_id, 3) is TransferState.DONE
        assert sender.wait(spec.request_id, 3) is TransferState.DONE
        for layer in spec.layers:
            assert_layer_copied(src, dst, layer, spec.src_block_ids, spec.dst_block_ids)
    now = {rid for _t, what, rid in sender.trace if what == "send.now"}
    threads = {rid for _t, what, rid in sender.trace if what == "send.begin"}   # the worker's check
    assert now == {"req-1", "req-2"} and not now & threads     # the fast path, whole
    assert "req-0" in threads                                  # the first one made the link
    until(lambda: _worker(sender).epoch_seen == net.connector("prefill-0").peer_epoch("decode-0"))


def test_the_sender_holds_its_blocks_until_the_receiver_has_copied_them():
    """The source blocks are released (and may be reused) only once the receiver acked its copy:
    while the copy is held up, the sender's transfer is not done."""
    copying, go_on = threading.Event(), threading.Event()

    class SlowCopy(TensorBlockStore):
        def copy_from_peer(self, *args):
            copying.set()
            go_on.wait(5)
            super().copy_from_peer(*args)

    src = TensorBlockStore(num_blocks=12, generator=torch.Generator().manual_seed(1), shareable=True)
    dst = SlowCopy(num_blocks=12, shareable=True)
    s_rel = Releases()
    config = KVTransferConfig(timeout_s=5.0, start_timeout_s=5.0, connect_timeout_s=2.0)
    sender, receiver, _net = make_fake_pair(src, dst, config=config, on_sender_release=s_rel)
    try:
        spec = make_spec()
        receiver.expect(spec)
        sender.send(spec)
        assert copying.wait(3)
        assert not sender.poll(spec.request_id).terminal and not s_rel.calls
        go_on.set()
        assert sender.wait(spec.request_id, 3) is TransferState.DONE
        sender.reap()
        assert s_rel.calls == {spec.request_id: 1}
        assert receiver.wait(spec.request_id, 3) is TransferState.DONE
        for layer in spec.layers:
            assert_layer_copied(src, dst, layer)
    finally:
        go_on.set()
        sender.close()
        receiver.close()


@pytest.mark.parametrize("why", ["direct copies are off here", "the sender is on another machine"])
def test_a_receiver_that_will_not_map_the_cache_says_why_and_the_data_goes_through_the_link(
        monkeypatch, why):
    """The receiver answers the hello with no, and why: direct copies turned off on its side, or a
    sender on another machine (a CUDA IPC handle means nothing there: boot ids are compared before
    opening one). The transfer then goes through the link, whole."""
    sender, receiver, net, src, dst, _s_rel, _r_rel = open_pair(shareable=True)
    if why.startswith("direct"):
        receiver.config = replace(FAST, direct_copy=False)
    else:
        import tandem.kv_transfer.direct_send as direct_send
        monkeypatch.setattr(direct_send, "machine_id", lambda: "another-machine")
    try:
        spec = make_spec()
        receiver.expect(spec)
        sender.send(spec)
        assert receiver.wait(spec.request_id, 3) is TransferState.DONE
        for layer in spec.layers:
            assert_layer_copied(src, dst, layer)
        pipe = net._pipes[("prefill-0", "decode-0")]
        assert pipe.verdict == (False, f"KVTransferError: {why}")
        assert not _worker(sender).direct.active and pipe.layers_sent == 4 and pipe.data.empty()
    finally:
        sender.close()
        receiver.close()


def test_receiver_abort_mid_transfer_releases_once_and_the_next_transfer_copies(direct):
    sender, receiver, net, src, dst, s_rel, r_rel = direct
    spec = make_spec()
    receiver.expect(spec)
    before = dst.tensor.clone()
    sender.begin(spec)
    sender.send_layer(spec.request_id, 0)
    until(lambda: receiver.progress(spec.request_id)[0] >= 1)
    receiver.abort(spec.request_id)
    for layer in spec.layers[1:]:
        sender.send_layer(spec.request_id, layer)
    until(lambda: sender.poll(spec.request_id).terminal)
    receiver.reap()
    assert r_rel.calls == {spec.request_id: 1}
    for layer in spec.layers[1:]:            # nothing after the abort was written
        for d in DST:
            assert torch.equal(dst.block(layer, d), before[layer, :, d])
    assert_next_transfer_arrives(sender, receiver, src, dst, "req-2")


def test_sender_dies_mid_transfer_fails_it_on_both_sides(direct):
    sender, receiver, net, src, dst, s_rel, r_rel = direct
    net.set_faults("prefill-0", "decode-0", die_after_layers=2)
    spec = make_spec()
    receiver.expect(spec)
    stream(sender, spec, 0.02).join()
    until(lambda: receiver.poll(spec.request_id).terminal and sender.poll(spec.request_id).terminal)
    assert receiver.poll(spec.request_id) is TransferState.FAILED
    assert sender.poll(spec.request_id) is TransferState.FAILED
    receiver.reap()
    sender.reap()
    assert r_rel.calls == {spec.request_id: 1} and s_rel.calls == {spec.request_id: 1}


class SharesLess(TensorBlockStore):
    """Shares a 12-block cache but indexes 200 blocks: a sender whose ids do not fit what it shared."""

    def share(self, tensor=None):
        if tensor is None:
            tensor = self.tensor[:, :, :12].contiguous()
        return super().share(tensor)


def test_ids_in_the_frame_outside_the_mapped_cache_fail_that_transfer_only():
    """When the ids travel in the frame (an all-ready send; also a streamed one when the arena is
    full), the receiver range-checks them against the cache it mapped: that transfer fails with a
    message that says so, its blocks are released once, nothing is written, and the next transfer
    copies."""
    src = SharesLess(num_blocks=200, generator=torch.Generator().manual_seed(3), shareable=True)
    dst = TensorBlockStore(num_blocks=12, shareable=True)
    r_rel = Releases()
    sender, receiver, _net = make_fake_pair(src, dst, config=FAST, on_receiver_release=r_rel)
    try:
        bad = make_spec("req-bad", src=(150, 0, 7))
        receiver.expect(bad)
        sender.send(bad)
        until(lambda: receiver.poll(bad.request_id).terminal)
        with pytest.raises(Exception, match="outside the sender's 0..11"):
            receiver.wait(bad.request_id, 1)
        assert sender._workers["decode-0"].direct.ids_in_frames == 1
        receiver.reap()
        assert r_rel.calls == {bad.request_id: 1}
        assert not dst.tensor.any()               # nothing was copied
        assert_next_transfer_arrives(sender, receiver, src, dst, "req-ok")
    finally:
        sender.close()
        receiver.close()


def test_a_streamed_transfer_whose_ids_overflow_the_arena_sends_them_in_its_frame(direct, monkeypatch):
    import tandem.kv_transfer.direct_send as direct_send
    monkeypatch.setattr(direct_send, "_ID_ARENA_BYTES", 8)          # room for one id, not three
    sender, receiver, net, src, dst, s_rel, r_rel = direct
    spec = make_spec("req-big", src=(4, 5, 6), dst=(2, 8, 10))
    receiver.expect(spec)
    stream(sender, spec, 0.01).join()
    assert receiver.wait(spec.request_id, 3) is TransferState.DONE
    for layer in spec.layers:
        assert_layer_copied(src, dst, layer, spec.src_block_ids, spec.dst_block_ids)
    assert _worker(sender).direct.ids_in_frames == 1


def test_ids_in_the_arena_are_clamped_into_the_mapped_cache():
    """Ids read from the sender's arena are not seen on the receiver's host (on the GPU the kernel
    reads them): a bad one is clamped into the mapped cache, so nothing outside it is read and the
    link carries on; the next transfer is exact. (Streamed: begin() puts its ids in the arena.)"""
    src = SharesLess(num_blocks=200, generator=torch.Generator().manual_seed(3), shareable=True)
    dst = TensorBlockStore(num_blocks=12, shareable=True)
    sender, receiver, _net = make_fake_pair(src, dst, config=FAST)
    try:
        bad = make_spec("req-bad", src=(150, 0, 7))
        receiver.expect(bad)
        stream(sender, bad, 0.01).join()
        assert receiver.wait(bad.request_id, 3) is TransferState.DONE
        assert sender._workers["decode-0"].direct.ids_in_frames == 0
        for layer in bad.layers:                  # block 150 read as the last shared block, 11
            assert torch.equal(dst.block(layer, DST[0]), src.block(layer, 11))
        assert_next_transfer_arrives(sender, receiver, src, dst, "req-ok")
    finally:
        sender.close()
        receiver.close()


def test_a_copy_seen_after_the_timeout_is_not_counted():
    """The sender gives up on an unacked copy after timeout_s and may reuse its blocks: a copy the
    receiver sees complete later than that must not make the transfer DONE."""
    class SlowCopy(TensorBlockStore):
        def copy_from_peer(self, *args):
            threading.Event().wait(FAST.timeout_s + 0.5)
            super().copy_from_peer(*args)

    src = TensorBlockStore(num_blocks=12, generator=torch.Generator().manual_seed(4), shareable=True)
    dst = SlowCopy(num_blocks=12, shareable=True)
    r_rel = Releases()
    sender, receiver, _net = make_fake_pair(src, dst, config=FAST, on_receiver_release=r_rel)
    try:
        spec = make_spec()
        receiver.expect(spec)
        sender.send(spec)
        until(lambda: receiver.poll(spec.request_id).terminal)
        assert receiver.poll(spec.request_id) is TransferState.FAILED
        with pytest.raises(Exception, match="completed after"):
            receiver.wait(spec.request_id, 1)
        receiver.reap()
        assert r_rel.calls == {spec.request_id: 1}
    finally:
        sender.close()
        receiver.close()


class FakeReadyEvent:
    """A layer's ready event as a prefill records it: complete once `set()`; counts the host's
    queries, to tell waiting from polling."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    def set(self) -> None:
        self._done.set()


def test_a_layer_still_being_computed_is_waited_for_not_polled(direct):
    """Direct copies: the transport's thread hands a layer's pending ready event to a waiter that
    blocks on it, instead of polling it (every poll takes the GIL from the prefill launching its
    next layers). Nothing is announced before the event completes; the layer leaves at once after."""
    sender, receiver, net, src, dst, s_rel, r_rel = direct
    warm = make_spec("warm")                  # the link up and direct first
    receiver.expect(warm)
    sender.send(warm)
    assert receiver.wait(warm.request_id, 3) is TransferState.DONE
    spec = make_spec("req-2", layers=(0, 1))
    receiver.expect(spec)
    sender.begin(spec)
    first, second = FakeReadyEvent(), FakeReadyEvent()
    sender.send_layer(spec.request_id, 0, first)
    sender.send_layer(spec.request_id, 1, second)
    threading.Event().wait(0.3)               # the "prefill" is still computing layer 0
    assert receiver.progress(spec.request_id)[0] == 0
    assert first.queries <= 3, f"{first.queries} queries in 0.3 s: polled, not waited for"
    first.set()
    until(lambda: receiver.progress(spec.request_id)[0] == 1, timeout=1)
    second.set()
    assert receiver.wait(spec.request_id, 3) is TransferState.DONE
    for layer in spec.layers:
        assert_layer_copied(src, dst, layer)
