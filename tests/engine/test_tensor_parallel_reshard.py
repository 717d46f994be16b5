"""KV resharding between workers of different tensor-parallel sizes (kv_transfer.reshard,
kv_transfer.tp_ends, kv_transfer.rank_ends): the head-routing plan (pure), and whole transfers
through the real senders and receivers over the in-process fake network, every rank's cache
compared with the full model's KV it must hold."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from tandem.kv_transfer import tp_ends
from tandem.kv_transfer.base import KVTransferError, TransferState
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.fake import FakeNetwork
from tandem.kv_transfer.rank_ends import RankTransport
from tandem.kv_transfer.reshard import HeadSliceStore, head_routes, rank_actor_id, rank_specs, split_actor_id
from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.testing import InProcessRanks, TensorBlockStore
from tandem.kv_transfer.tp_ends import ReshardingReceiver, ReshardingSender, TPLayout
from tandem.wire.errors import ConfigError

H, D, LAYERS, BLOCKS = 4, 8, 3, 12
FAST = KVTransferConfig(start_timeout_s=10.0, timeout_s=10.0, connect_timeout_s=10.0)


def _plan(heads, s, d):
    return [(r.src_rank, r.dst_rank, list(r.heads), list(r.src_heads), list(r.dst_heads))
            for r in head_routes(heads, s, d)]


def test_head_routes_pair_the_ranks_that_share_heads():
    assert _plan(4, 1, 1) == [(0, 0, [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3])]
    assert _plan(4, 2, 2) == [(0, 0, [0, 1], [0, 1], [0, 1]), (1, 1, [2, 3], [0, 1], [0, 1])]
    assert _plan(4, 2, 1) == [(0, 0, [0, 1], [0, 1], [0, 1]), (1, 0, [2, 3], [0, 1], [2, 3])]
    assert _plan(4, 1, 2) == [(0, 0, [0, 1], [0, 1], [0, 1]), (0, 1, [2, 3], [2, 3], [0, 1])]
    assert _plan(4, 4, 2) == [(0, 0, [0], [0], [0]), (1, 0, [1], [0], [1]), (2, 1, [2], [0], [0]),
                              (3, 1, [3], [0], [1])]
    assert _plan(8, 2, 4)[1] == (0, 1, [2, 3], [2, 3], [0, 1])
    for s, d in ((1, 4), (4, 1), (2, 4), (4, 2)):   # each head exactly once
        assert sorted(h for r in head_routes(8, s, d) for h in r.heads) == list(range(8))


def test_head_routes_refuse_splits_of_partial_heads_by_name():
    with pytest.raises(ConfigError, match="sender's tensor_parallel_size 3 does not divide the model's 4 KV heads"):
        head_routes(4, 3, 1)
    with pytest.raises(ConfigError, match="receiver's tensor_parallel_size 8 does not divide"):
        head_routes(4, 1, 8)


def test_rank_specs_name_each_pair_and_keep_blocks_and_layers():
    spec = TransferSpec("r#1", "prefill-0", "decode-1", (0, 1), (3, 4), (7, 8), 5)
    same = rank_specs(spec, 4, 2, 2)
    assert [(s.request_id, s.sender_id, s.receiver_id) for _, s in same] == [
        ("r#1", "prefill-0", "decode-1"), ("r#1", "prefill-0/tp1", "decode-1/tp1")]
    split = [s for _, s in rank_specs(spec, 4, 2, 1)]
    assert [(s.request_id, s.sender_id, s.receiver_id) for s in split] == [
        ("r#1@0.0", "prefill-0", "decode-1"), ("r#1@1.0", "prefill-0/tp1", "decode-1")]
    assert all((s.layers, s.src_block_ids, s.dst_block_ids) == ((0, 1), (3, 4), (7, 8)) for s in split)
    assert split_actor_id(rank_actor_id("decode-1", 3)) == ("decode-1", 3)
    assert split_actor_id("decode-1") == ("decode-1", 0)


def test_head_slice_store_gathers_and_scatters_only_its_heads():
    cache = TensorBlockStore(LAYERS, BLOCKS, 4, H, D, generator=torch.Generator().manual_seed(0))
    view = HeadSliceStore(cache, range(1, 3))
    got = view.gather_layers(range(0, 2), [5, 2])
    assert got.shape == (2, 2, 2, 4, 2, D)
    assert torch.equal(got, cache.tensor[0:2, :, [5, 2], :, 1:3])
    before = cache.tensor.clone()
    view.scatter_layers(range(1, 3), [0], torch.ones(2, 2, 1, 4, 2, D))
    assert (cache.tensor[1:3, :, 0, :, 1:3] == 1).all()
    before[1:3, :, 0, :, 1:3] = 1
    assert torch.equal(cache.tensor, before)


def _worker(net, worker_id, tp, sending, full, tps):
    """A worker of `tp` ranks whose rank r cache holds its heads of `full` (None: zeros), ->
    (rank 0's end, rank caches, rank transports)."""
    caches = [TensorBlockStore(LAYERS, BLOCKS, 4, H // tp, D) for _ in range(tp)]
    if full is not None:
        for r, c in enumerate(caches):
            c.tensor.copy_(full[..., r * H // tp:(r + 1) * H // tp, :])

    def layout(rank):
        return TPLayout(worker_id, rank, tp, H, tps.__getitem__)
    ranks = {r: RankTransport(caches[r], net.connector(rank_actor_id(worker_id, r)), FAST, layout(r))
             for r in range(1, tp)}
    released = []
    cls = ReshardingSender if sending else ReshardingReceiver
    end = cls(caches[0], net.connector(worker_id), FAST, layout(0), InProcessRanks(ranks) if ranks else None,
              on_release=released.append)
    end.released = released
    return end, caches, ranks


def _reap_until(end, rid, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for got, state in end.reap():
            if got == rid:
                return state
        time.sleep(0.005)
    raise AssertionError(f"{rid} did not end")


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)])
def test_a_transfer_between_tp_sizes_lands_every_head_on_its_rank(src_tp, dst_tp):
    full = torch.randn(LAYERS, 2, BLOCKS, 4, H, D, generator=torch.Generator().manual_seed(1))
    net, tps = FakeNetwork(), {"prefill-0": src_tp, "decode-0": dst_tp}
    sender, _, send_ranks = _worker(net, "prefill-0", src_tp, True, full, tps)
    receiver, dst_caches, recv_ranks = _worker(net, "decode-0", dst_tp, False, None, tps)
    src, dst = (1, 4, 6), (9, 0, 3)
    spec = TransferSpec("req-1#0", "prefill-0", "decode-0", tuple(range(LAYERS)), src, dst, 10)
    receiver.expect(spec)
    sender.begin(spec)
    sender.step = lambda: 1                        # the step that writes the layers
    for layer in range(LAYERS):
        sender.send_layer(spec.request_id, layer)
    for t in send_ranks.values():
        t.stepped(1)                               # the step that wrote the layers ran there too
    assert _reap_until(sender, spec.request_id) is TransferState.DONE
    assert _reap_until(receiver, spec.request_id) is TransferState.DONE
    assert sender.released == [spec.request_id] and receiver.released == []   # received blocks stay
    for r, c in enumerate(dst_caches):
        want = full[:, :, list(src), :, r * H // dst_tp:(r + 1) * H // dst_tp]
        assert torch.equal(c.tensor[:, :, list(dst)], want), f"receiver rank {r}"
    assert sender.poll(spec.request_id) is TransferState.DONE
    for t in [*send_ranks.values(), *recv_ranks.values()]:
        t.close()
    sender.close()
    receiver.close()


def test_a_rank_that_cannot_send_fails_the_whole_transfer_and_releases_once(monkeypatch):
    """TP=2 -> TP=1 where sender rank 1 never gets its step: rank 0's half lands, the transfer
    fails (settle times out there and aborts), and each side releases its blocks once."""
    net, tps = FakeNetwork(), {"prefill-0": 2, "decode-0": 1}
    fast = KVTransferConfig(start_timeout_s=0.5, timeout_s=0.5, connect_timeout_s=5.0)
    sender, _, send_ranks = _worker(net, "prefill-0", 2, True, torch.zeros(LAYERS, 2, BLOCKS, 4, H, D), tps)
    receiver, _, _ = _worker(net, "decode-0", 1, False, None, tps)
    for end in (sender, receiver):
        end.inner.config = fast
    sender.step = lambda: 1                        # a step rank 1 never runs
    spec = TransferSpec("req-2#0", "prefill-0", "decode-0", tuple(range(LAYERS)), (1,), (2,), 3)
    receiver.expect(spec)
    sender.begin(spec)
    for layer in range(LAYERS):
        sender.send_layer(spec.request_id, layer)
    monkeypatch.setattr(tp_ends, "SETTLE_TIMEOUT_S", 0.3)
    assert _reap_until(sender, spec.request_id) is not TransferState.DONE
    assert _reap_until(receiver, spec.request_id) in (TransferState.FAILED, TransferState.ABORTED)
    assert sender.released == [spec.request_id] and receiver.released == [spec.request_id]
    send_ranks[1].close()
    sender.close()
    receiver.close()


class _GoneRanks(InProcessRanks):
    """Rank 1 dies once its transfers are registered: every later call fails (as a Ray call to a
    dead actor does)."""

    def call(self, rank, op, *args):
        if op in ("expect", "begin"):
            return super().call(rank, op, *args)
        raise RuntimeError(f"rank {rank} is gone")


def test_a_rank_gone_mid_transfer_fails_it_with_the_reason_and_releases_once():
    """TP=1 -> TP=2 where receiver rank 1 dies: rank 0's half lands, the worker-level receive
    fails naming the rank, and its blocks are released once (the decode part frees them and its
    router moves the request)."""
    full = torch.randn(LAYERS, 2, BLOCKS, 4, H, D, generator=torch.Generator().manual_seed(3))
    net, tps = FakeNetwork(), {"prefill-0": 1, "decode-0": 2}
    sender, _, _ = _worker(net, "prefill-0", 1, True, full, tps)
    receiver, _, recv_ranks = _worker(net, "decode-0", 2, False, None, tps)
    receiver.ranks = _GoneRanks(recv_ranks)
    spec = TransferSpec("req-3#0", "prefill-0", "decode-0", tuple(range(LAYERS)), (4, 5), (0, 1), 8)
    receiver.expect(spec)
    sender.begin(spec)
    for layer in range(LAYERS):
        sender.send_layer(spec.request_id, layer)
    assert _reap_until(receiver, spec.request_id) is TransferState.FAILED
    with pytest.raises(KVTransferError, match="rank 1 is gone"):
        receiver.wait(spec.request_id, 0)
    assert receiver.released == [spec.request_id]
    for t in recv_ranks.values():
        t.close()
    sender.close()
    receiver.close()


def test_a_sending_rank_sends_each_layer_as_its_step_writes_it():
    """TP=2 -> TP=1: rank 1 sends layer L once its own step wrote layer L (`layer_written`),
    before the step ends, and the rest when it ends."""
    full = torch.randn(LAYERS, 2, BLOCKS, 4, H, D, generator=torch.Generator().manual_seed(4))
    net, tps = FakeNetwork(), {"prefill-0": 2, "decode-0": 1}
    sender, _, send_ranks = _worker(net, "prefill-0", 2, True, full, tps)
    receiver, _, _ = _worker(net, "decode-0", 1, False, None, tps)
    spec = TransferSpec("req-4#0", "prefill-0", "decode-0", tuple(range(LAYERS)), (2, 3), (5, 6), 8)
    receiver.expect(spec)
    sender.begin(spec)
    sender.step = lambda: 1
    sender.send_layer(spec.request_id, 0)          # asks rank 1 to send as its step 1 writes
    rank1, half = send_ranks[1], "req-4#0@1.0"

    def landed():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            done = receiver.inner.progress(half)[0]
            if done == want:
                return done
            time.sleep(0.005)
        return receiver.inner.progress(half)[0]
    want = 0
    assert landed() == 0                           # nothing written on rank 1 yet
    rank1.layer_written(0)
    rank1.layer_written(1)
    want = 2
    assert landed() == 2                           # the layers written so far, not the last one
    for layer in range(1, LAYERS):
        sender.send_layer(spec.request_id, layer)
    rank1.stepped(1)
    assert _reap_until(receiver, spec.request_id) is TransferState.DONE
    assert torch.equal(receiver.inner.store.tensor[:, :, [5, 6]], full[:, :, [2, 3]])
    rank1.close()
    sender.close()
    receiver.close()


def test_redirect_and_abort_act_on_every_rank_level_transfer():
    """A receive registered from one TP=2 sender is redirected to another of the same size (which
    delivers it), refused toward one of another size; an aborted one is reported and released once."""
    full = torch.randn(LAYERS, 2, BLOCKS, 4, H, D, generator=torch.Generator().manual_seed(5))
    net, tps = FakeNetwork(), {"prefill-0": 2, "prefill-1": 2, "prefill-2": 1, "decode-0": 2}
    sender, _, send_ranks = _worker(net, "prefill-1", 2, True, full, tps)
    receiver, dst_caches, recv_ranks = _worker(net, "decode-0", 2, False, None, tps)
    spec = TransferSpec("req-5#0", "prefill-0", "decode-0", tuple(range(LAYERS)), (), (7, 8), 8)
    receiver.expect(spec)
    with pytest.raises(KVTransferError, match="another tensor-parallel size"):
        receiver.redirect(dataclasses.replace(spec, sender_id="prefill-2"))
    moved = dataclasses.replace(spec, sender_id="prefill-1", src_block_ids=(1, 2))
    receiver.redirect(moved)
    sender.begin(moved)
    for layer in range(LAYERS):
        sender.send_layer(moved.request_id, layer)
    send_ranks[1].stepped(1)
    assert _reap_until(receiver, spec.request_id) is TransferState.DONE
    for r, c in enumerate(dst_caches):
        assert torch.equal(c.tensor[:, :, [7, 8]], full[:, :, [1, 2], :, r * 2:(r + 1) * 2])
    gone = dataclasses.replace(spec, request_id="req-6#0", sender_id="prefill-1")
    receiver.expect(gone)
    receiver.abort(gone.request_id)
    assert _reap_until(receiver, gone.request_id) is TransferState.ABORTED
    assert receiver.released == [gone.request_id]
    assert recv_ranks[1].receiver.poll(gone.request_id) is TransferState.ABORTED
    for t in [*send_ranks.values(), *recv_ranks.values()]:
        t.close()
    sender.close()
    receiver.close()
