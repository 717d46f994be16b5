"""Factories and checks shared by the KV transfer tests over the in-process fake network
(tests/unit/test_kv_*.py): seeded block stores joined by a fake pair, specs, release recorders."""

from __future__ import annotations

import threading
import time
from collections import Counter

import torch

from tandem.kv_transfer.base import TransferState
from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.fake import make_fake_pair
from tandem.kv_transfer.testing import TensorBlockStore

SRC, DST = (3, 0, 7), (5, 9, 1)
LAYER_BYTES = 2 * len(SRC) * 4 * 2 * 8 * 4      # K and V of 3 blocks of 4 tokens, 2 heads of 8, fp32
# One layer per message, as when a prefill queues each layer as it computes it: these tests step
# through a transfer layer by layer. The batching of ready layers has its own tests
# (test_kv_batching.py). A message may be 1 s late before its transfer fails: the timeout tests
# wait past it, and a garbage collection of the test process (over 0.5 s seen in CI) stays under it.
FAST = KVTransferConfig(timeout_s=1.0, start_timeout_s=2.0, connect_timeout_s=2.0,
                        max_message_bytes=LAYER_BYTES)


def make_spec(rid: str = "req-1", layers=(0, 1, 2, 3), src=SRC, dst=DST) -> TransferSpec:
    return TransferSpec(request_id=rid, sender_id="prefill-0", receiver_id="decode-0",
                        layers=tuple(layers), src_block_ids=src, dst_block_ids=dst,
                        num_tokens=4 * len(src) - 1)


class Releases:
    """Release callback that records calls and the thread they ran on."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.threads: set[int] = set()

    def __call__(self, rid: str) -> None:
        self.calls[rid] += 1
        self.threads.add(threading.get_ident())


def open_pair(shareable: bool = False):
    """A fake pair over seeded 12-block stores, with release recorders; `shareable`: the stores
    hand out handles, so the pair copies directly (tests/unit/test_kv_direct_copy.py)."""
    src = TensorBlockStore(num_blocks=12, generator=torch.Generator().manual_seed(0), shareable=shareable)
    dst = TensorBlockStore(num_blocks=12, shareable=shareable)
    s_rel, r_rel = Releases(), Releases()
    sender, receiver, net = make_fake_pair(src, dst, config=FAST, on_sender_release=s_rel,
                                           on_receiver_release=r_rel)
    return sender, receiver, net, src, dst, s_rel, r_rel


def until(cond, timeout: float = 10.0) -> None:
    """Waits for `cond()`, which another thread makes true; fails after `timeout` seconds."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.005)


def stream(sender, spec, gap_s: float) -> threading.Thread:
    """A slow prefill: begin, then one layer every `gap_s`, from a thread of its own."""
    def run():
        sender.begin(spec)
        for layer in spec.layers:
            time.sleep(gap_s)
            sender.send_layer(spec.request_id, layer)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def assert_layer_copied(src, dst, layer, src_ids=SRC, dst_ids=DST) -> None:
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(dst.block(layer, d), src.block(layer, s)), (layer, s, d)


def assert_next_transfer_arrives(sender, receiver, src, dst, rid: str = "req-next") -> None:
    """After a failure: the next transfer on the same pair arrives whole."""
    spec = make_spec(rid)
    receiver.expect(spec)
    sender.send(spec)
    assert receiver.wait(spec.request_id, 3) is TransferState.DONE
    for layer in spec.layers:
        assert_layer_copied(src, dst, layer)
