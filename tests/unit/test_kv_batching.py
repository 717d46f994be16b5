"""KV transfer over the in-process fake transport, the streamed path's batching: layers ready
together travel as few, equal messages, within the window of bytes in flight, staged in one
preallocated ring on each end; gathers and scatters of runs of layers match plain indexing."""

from __future__ import annotations

import threading

import pytest
import torch

from tandem.kv_transfer.base import StagingRing, TransferState, layer_runs, plan_messages
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.fake import make_fake_pair
from tandem.kv_transfer.testing import TensorBlockStore

from tests.unit.kv_factories import (DST, LAYER_BYTES, Releases, assert_layer_copied, make_spec,
                                     until)


def test_ready_layers_beyond_the_window_wait_for_room():
    """Six ready layers, one per message, four messages in flight at most: a first frame for four,
    a second for two once room frees up, in order, bit-exact."""
    src = TensorBlockStore(num_layers=6, num_blocks=12, generator=torch.Generator().manual_seed(4))
    dst = TensorBlockStore(num_layers=6, num_blocks=12)
    config = KVTransferConfig(timeout_s=2.0, start_timeout_s=2.0, connect_timeout_s=2.0,
                              max_message_bytes=LAYER_BYTES, max_inflight_messages=4)
    sender, receiver, net = make_fake_pair(src, dst, config=config)
    try:
        net.set_faults("prefill-0", "decode-0", delay_s=0.1)
        first = make_spec("req-0", layers=(0,), src=(2,), dst=(3,))
        spec = make_spec(layers=range(6))
        receiver.expect(first)
        receiver.expect(spec)
        sender.send(first)
        sender.send(spec)
        assert receiver.wait(spec.request_id, 3) is TransferState.DONE
        for layer in spec.layers:
            assert_layer_copied(src, dst, layer)
        assert _messages(sender) == 1 + 6
        assert net._pipes[("prefill-0", "decode-0")].frames_sent == 3
    finally:
        sender.close()
        receiver.close()


def test_staging_ring_reuses_one_allocation_in_fifo_order():
    st = StagingRing(4096, torch.device("cpu"))
    a, la = st.take((250,), torch.float32)                  # 1000 bytes at 0
    b, lb = st.take((1000,), torch.uint8)                   # at 1024 (512-byte aligned)
    c, lc = st.take((1500,), torch.uint8)                   # at 2048
    base = st._mem.data_ptr()
    assert [x.data_ptr() - base for x in (a, b, c)] == [0, 1024, 2048]
    d, ld = st.take((600,), torch.uint8)                    # no room: a tensor of its own
    big, lbig = st.take((5000,), torch.uint8)               # larger than the ring: its own too
    assert ld is None and lbig is None and d.data_ptr() != base
    a.fill_(1.0)
    b.fill_(2)
    c.fill_(3)
    assert torch.equal(a, torch.ones(250)) and int(b.sum()) == 2000 and int(c.sum()) == 4500   # disjoint
    assert not st.fits([1024]) and st.fits([512]) and not st.fits([513])   # only the end is free
    st.give(la)                                             # the oldest: its space comes back
    st.give(ld)                                             # None: nothing to give back
    assert st.fits([1024]) and not st.fits([1025]) and st.fits([512, 1024])
    e, le = st.take((1024,), torch.uint8)                   # wraps to the front
    assert e.data_ptr() == base
    st.give(lc)                                             # out of order: held until b goes
    assert not st.idle
    st.give(lb)
    st.give(le)
    assert st.idle and st.fits([4096])
    f, lf = st.take((4096,), torch.uint8)
    assert lf is not None and f.data_ptr() == base and st._mem.data_ptr() == base


def test_plan_messages_as_few_and_as_equal_as_possible():
    assert plan_messages(32, 8) == [8, 8, 8, 8]                 # 8k Llama-3-8B, 256 MiB messages
    assert plan_messages(31, 8) == [8, 8, 8, 7]
    assert plan_messages(9, 4) == [3, 3, 3]                     # within one layer of each other
    assert plan_messages(32, 32) == [32] and plan_messages(1, 8) == [1]
    for n, per in [(32, 8), (100, 3), (9, 4), (256, 2), (5, 8)]:
        parts = plan_messages(n, per)
        assert sum(parts) == n and max(parts) <= per and max(parts) - min(parts) <= 1
        assert len(parts) == -(-n // per)


def ring_leases(monkeypatch) -> list:
    """From now on, the lease of every staging buffer taken, on both ends (None: a tensor of its
    own, which on the GPU path would be a device allocation)."""
    taken: list = []
    real = StagingRing.take

    def spy(self, shape, dtype):
        buf, lease = real(self, shape, dtype)
        taken.append(lease)
        return buf, lease

    monkeypatch.setattr(StagingRing, "take", spy)
    return taken


def test_transfers_stage_their_messages_in_the_preallocated_ring(monkeypatch):
    """Every message of a run of transfers, on both ends, is staged in the one allocation (a
    fresh tensor would be a device allocation on the GPU path)."""
    taken = ring_leases(monkeypatch)
    src = TensorBlockStore(num_blocks=12, generator=torch.Generator().manual_seed(6))
    dst = TensorBlockStore(num_blocks=12)
    config = KVTransferConfig(timeout_s=2.0, start_timeout_s=2.0, connect_timeout_s=2.0,
                              max_message_bytes=2 * LAYER_BYTES)
    sender, receiver, _ = make_fake_pair(src, dst, config=config)
    try:
        for i in range(3):
            spec = make_spec(f"req-{i}")
            receiver.expect(spec)
            sender.send(spec)
            assert receiver.wait(spec.request_id, 2) is TransferState.DONE
            for layer in spec.layers:
                assert_layer_copied(src, dst, layer)
        assert len(taken) >= 2 * 3 * 2 and None not in taken     # >= 2 messages a transfer, both ends
    finally:
        sender.close()
        receiver.close()


def test_receiver_abort_between_parts_of_one_frame_writes_nothing_more():
    """Four ready layers go as four messages under one frame. The receiver aborts while the first
    is being scattered: the other three are received and dropped (the link stays in step), none
    lands in the released blocks, the blocks are released once, every staging slot comes back,
    and the next transfer on the link arrives whole."""
    src = TensorBlockStore(num_blocks=12, generator=torch.Generator().manual_seed(8))
    scattering, go_on = threading.Event(), threading.Event()

    class SlowStore(TensorBlockStore):
        hold = True

        def scatter_layers(self, layers, block_ids, data):
            if self.hold:
                self.hold = False
                scattering.set()
                go_on.wait(5)
            super().scatter_layers(layers, block_ids, data)

    dst, rel = SlowStore(num_blocks=12), Releases()
    config = KVTransferConfig(timeout_s=2.0, start_timeout_s=2.0, connect_timeout_s=2.0,
                              max_message_bytes=LAYER_BYTES)          # one layer per message
    sender, receiver, net = make_fake_pair(src, dst, config=config, on_receiver_release=rel)
    try:
        net.set_faults("prefill-0", "decode-0", delay_s=0.1)         # the layers queue up meanwhile
        spec = make_spec("req-parts")
        receiver.expect(spec)
        sender.send(spec)
        assert scattering.wait(3)
        receiver.abort(spec.request_id)          # the first layer is being scattered right now
        go_on.set()                              # releases run on the owner's poll, once it lands
        until(lambda: receiver.poll(spec.request_id) is TransferState.ABORTED and rel.calls[spec.request_id] == 1)
        assert net._pipes[("prefill-0", "decode-0")].frames_sent == 1   # one frame, four parts
        loop = receiver._loops["prefill-0"]
        until(lambda: not loop.landings and loop.streamed.staging.idle)
        for layer in (1, 2, 3):                  # nothing after the abort was written
            assert dst.cache[layer, :, list(DST)].abs().sum() == 0
        net.set_faults("prefill-0", "decode-0")
        nxt = make_spec("req-after", src=(1, 4, 6), dst=(0, 2, 4))
        receiver.expect(nxt)
        sender.send(nxt)
        assert receiver.wait(nxt.request_id, 2) is TransferState.DONE
        for layer in nxt.layers:
            assert_layer_copied(src, dst, layer, (1, 4, 6), (0, 2, 4))
        assert rel.calls[spec.request_id] == 1
    finally:
        go_on.set()
        sender.close()
        receiver.close()


def test_layer_runs_split_a_message_into_consecutive_layers():
    assert layer_runs([0, 1, 2, 3]) == [(0, range(0, 4))]
    assert layer_runs([4, 5, 7, 8, 9, 2]) == [(0, range(4, 6)), (2, range(7, 10)), (5, range(2, 3))]
    assert layer_runs([3]) == [(0, range(3, 4))]


def test_multi_layer_gather_and_scatter_match_plain_indexing():
    """One kernel per run of layers: the same bytes as indexing each layer's blocks in torch."""
    src = TensorBlockStore(num_layers=5, num_blocks=9, generator=torch.Generator().manual_seed(7))
    dst = TensorBlockStore(num_layers=5, num_blocks=9)
    ids, to = [4, 0, 7], [2, 8, 5]
    want = torch.stack([src.tensor[layer][:, ids] for layer in range(1, 4)])
    out = torch.full_like(want, -1.0)
    assert src.gather_layers(range(1, 4), ids, out=out) is out
    assert torch.equal(out, want)
    assert torch.equal(src.gather_layers(range(1, 4), ids), want)
    dst.scatter_layers(range(1, 4), to, out)
    for layer in range(5):
        for s, d in zip(ids, to):
            expect = src.block(layer, s) if 1 <= layer < 4 else torch.zeros_like(src.block(layer, s))
            assert torch.equal(dst.block(layer, d), expect), (layer, s, d)
    assert int((dst.tensor != 0).sum()) == 3 * 3 * dst.tensor[0, :, 0].numel()   # nothing else written


def _messages(sender) -> int:
    return sum(w.messages_sent for w in sender._workers.values())


@pytest.mark.parametrize("max_layers, messages", [(4, 1), (2, 2), (1, 4)])
def test_layers_ready_together_travel_as_few_messages(max_layers, messages):
    """All four layers queued at once (a prefill that finished before the link was free) go as
    ceil(4 / layers per message) messages, each one gather and one send, announced by one frame,
    still bit-exact."""
    src = TensorBlockStore(num_blocks=12, generator=torch.Generator().manual_seed(3))
    dst = TensorBlockStore(num_blocks=12)
    config = KVTransferConfig(timeout_s=2.0, start_timeout_s=2.0, connect_timeout_s=2.0,
                              max_message_bytes=max_layers * LAYER_BYTES)
    sender, receiver, net = make_fake_pair(src, dst, config=config)
    try:
        # A first transfer's frame is slow to leave, so the second's layers, queued one by one
        # meanwhile, are all waiting when the worker gets to them.
        net.set_faults("prefill-0", "decode-0", delay_s=0.1)
        first = make_spec("req-0", layers=(0,), src=(2,), dst=(3,))
        spec = make_spec()
        receiver.expect(first)
        receiver.expect(spec)
        sender.send(first)
        sender.send(spec)
        assert receiver.wait(spec.request_id, 2) is TransferState.DONE
        assert sender.wait(spec.request_id, 2) is TransferState.DONE
        assert receiver.poll(first.request_id) is TransferState.DONE
        for layer in spec.layers:
            assert_layer_copied(src, dst, layer)
        assert _messages(sender) == 1 + messages
        # one control frame announces all of them: the receiver posts every receive at once
        assert net._pipes[("prefill-0", "decode-0")].frames_sent == 2
    finally:
        sender.close()
        receiver.close()


def test_a_layer_larger_than_the_message_limit_still_goes_whole(pair):
    sender, receiver, net, src, dst, s_rel, r_rel = pair    # FAST: one layer per message
    spec = make_spec(src=(3, 0, 7, 11), dst=(5, 9, 1, 2))  # 4 blocks: a layer is over the limit
    receiver.expect(spec)
    sender.send(spec)
    assert receiver.wait(spec.request_id, 2) is TransferState.DONE
    for layer in spec.layers:
        assert_layer_copied(src, dst, layer, (3, 0, 7, 11), (5, 9, 1, 2))
    assert _messages(sender) == 4


def test_ready_layers_beyond_a_window_of_bytes_go_in_turns_of_equal_messages():
    """Twelve ready layers, up to four per message: with the window holding all of them one frame
    announces three messages of four; with a window of eight layers, two frames (eight layers, then
    four once room frees up), bit-exact both times."""
    src = TensorBlockStore(num_layers=12, num_blocks=12, generator=torch.Generator().manual_seed(11))
    dst = TensorBlockStore(num_layers=12, num_blocks=12)
    config = KVTransferConfig(timeout_s=2.0, start_timeout_s=2.0, connect_timeout_s=2.0,
                              max_message_bytes=4 * LAYER_BYTES)
    sender, receiver, net = make_fake_pair(src, dst, config=config)
    sender.trace = []
    try:
        spec = make_spec(layers=range(12))
        receiver.expect(spec)
        sender.send(spec)
        assert receiver.wait(spec.request_id, 2) is TransferState.DONE
        for layer in spec.layers:
            assert_layer_copied(src, dst, layer)
        assert net._pipes[("prefill-0", "decode-0")].frames_sent == 1
        posted = [int(what.split()[1]) for _t, what, _rid in sender.trace if what.startswith("send.posted")]
        assert posted == [4, 4, 4]
        sender.config = KVTransferConfig(timeout_s=2.0, start_timeout_s=2.0, connect_timeout_s=2.0,
                                         max_message_bytes=4 * LAYER_BYTES, max_inflight_messages=2)
        sender.trace = []
        frames = net._pipes[("prefill-0", "decode-0")].frames_sent
        again = make_spec("again", layers=range(12), src=(1, 4, 6), dst=(0, 2, 4))
        receiver.expect(again)
        sender.send(again)
        assert receiver.wait("again", 2) is TransferState.DONE
        for layer in again.layers:
            assert_layer_copied(src, dst, layer, (1, 4, 6), (0, 2, 4))
        posted = [int(what.split()[1]) for _t, what, _rid in sender.trace if what.startswith("send.posted")]
        assert posted == [4, 4, 4]
        assert net._pipes[("prefill-0", "decode-0")].frames_sent == frames + 2
    finally:
        sender.close()
        receiver.close()


def test_a_window_of_bytes_sends_ready_layers_in_turns_staged_in_the_ring(monkeypatch):
    """The window holds four layers (max_inflight_messages 1 of four layers): twelve ready layers
    go in turns of at most four, the next as room comes back, every message staged in the
    preallocated ring on both ends."""
    taken = ring_leases(monkeypatch)
    src = TensorBlockStore(num_layers=12, num_blocks=12, generator=torch.Generator().manual_seed(12))
    dst = TensorBlockStore(num_layers=12, num_blocks=12)
    config = KVTransferConfig(timeout_s=2.0, start_timeout_s=2.0, connect_timeout_s=2.0,
                              max_message_bytes=4 * LAYER_BYTES, max_inflight_messages=1)
    sender, receiver, net = make_fake_pair(src, dst, config=config)
    sender.trace = []
    try:
        net.set_faults("prefill-0", "decode-0", held_sends=True)    # room comes back as data lands
        spec = make_spec(layers=range(12))
        receiver.expect(spec)
        sender.send(spec)
        assert receiver.wait(spec.request_id, 3) is TransferState.DONE
        assert sender.wait(spec.request_id, 3) is TransferState.DONE
        for layer in spec.layers:
            assert_layer_copied(src, dst, layer)
        posted = [int(what.split()[1]) for _t, what, _rid in sender.trace if what.startswith("send.posted")]
        assert sum(posted) == 12 and max(posted) <= 4
        assert net._pipes[("prefill-0", "decode-0")].frames_sent >= 3     # at most 4 layers a turn
        assert taken and None not in taken
    finally:
        sender.close()
        receiver.close()
