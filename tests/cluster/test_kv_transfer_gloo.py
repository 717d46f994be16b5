"""Real gloo between two Ray actor processes: pairwise groups over a TCPStore hosted by the driver
(as the controller hosts it), layer-by-layer transfers, aborts, a killed sender, a restarted one."""

from __future__ import annotations

import threading
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from tandem.kv_transfer.spec import TransferSpec  # noqa: E402
from tandem.kv_transfer.config import KVTransferConfig  # noqa: E402
from tandem.kv_transfer.torch_dist import start_rendezvous_store  # noqa: E402

pytestmark = pytest.mark.timeout(180)

NUM_LAYERS, NUM_BLOCKS = 4, 16
CONFIG = dict(timeout_s=3.0, start_timeout_s=20.0, connect_timeout_s=20.0)


@ray.remote(num_cpus=0)
class KVEndpoint:
    """A prefill-like or decode-like actor around a TensorBlockStore; states come back as strings."""

    def __init__(self, actor_id: str, role: str, rendezvous: str, seed: int | None):
        from tandem.kv_transfer.config import KVTransferConfig
        from tandem.kv_transfer.testing import TensorBlockStore
        from tandem.kv_transfer.torch_dist import make_dist_receiver, make_dist_sender

        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        self.store = TensorBlockStore(num_layers=NUM_LAYERS, num_blocks=NUM_BLOCKS, block_size=4,
                                      num_heads=2, head_dim=8, generator=gen)
        self.released: list[str] = []
        make = make_dist_sender if role == "sender" else make_dist_receiver
        self.end = make(actor_id, self.store, rendezvous, KVTransferConfig(**CONFIG),
                        on_release=self.released.append)

    def expect(self, spec_msg: dict) -> None:
        self.end.expect(TransferSpec.from_msg(spec_msg))

    def stream(self, spec_msg: dict, layer_delay_s: float = 0.0) -> None:
        """Like a prefill: one layer at a time, `layer_delay_s` of "compute" before each."""
        spec = TransferSpec.from_msg(spec_msg)
        self.end.begin(spec)

        def run() -> None:
            for layer in spec.layers:
                time.sleep(layer_delay_s)
                self.end.send_layer(spec.request_id, layer)
        threading.Thread(target=run, daemon=True).start()

    def poll(self, rid: str) -> str:
        return self.end.poll(rid).value

    def progress(self, rid: str) -> tuple[int, int]:
        return self.end.progress(rid)

    def wait(self, rid: str, timeout: float) -> str:
        try:
            return self.end.wait(rid, timeout).value
        except Exception as exc:
            return type(exc).__name__

    def abort(self, rid: str) -> None:
        self.end.abort(rid)

    def releases(self) -> list[str]:
        self.end.reap()
        return list(self.released)

    def payload(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        return self.store.gather_blocks(layer, block_ids)

    def untouched_sum(self, used: list[int]) -> float:
        others = [b for b in range(NUM_BLOCKS) if b not in used]
        return float(self.store.cache[:, :, others].abs().sum())

    def groups(self) -> tuple[int, int]:
        return self.end.connector.group_count(), self.end.connector.links_created


def make_spec(rid: str, sender: str, src=(3, 0, 7, 12), dst=(5, 9, 1, 14),
              receiver: str = "decode-0") -> dict:
    return TransferSpec(rid, sender, receiver, tuple(range(NUM_LAYERS)), src, dst,
                        num_tokens=4 * len(src)).to_msg()


def until(cond, timeout: float = 10.0):
    end = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def cluster(ray_session):
    store, port = start_rendezvous_store("127.0.0.1")
    addr = f"127.0.0.1:{port}"
    receiver = KVEndpoint.remote("decode-0", "receiver", addr, None)
    sender = KVEndpoint.remote("prefill-0", "sender", addr, 1234)
    ray.get([receiver.groups.remote(), sender.groups.remote()])
    yield addr, sender, receiver
    for a in (sender, receiver):
        ray.kill(a)
    del store


def test_layers_arrive_bit_exact_over_gloo(cluster):
    _, sender, receiver = cluster
    spec = make_spec("r1", "prefill-0")
    ray.get(receiver.expect.remote(spec))
    ray.get(sender.stream.remote(spec))
    assert ray.get(receiver.wait.remote("r1", 20)) == "done"
    for layer in range(NUM_LAYERS):
        got = ray.get(receiver.payload.remote(layer, spec["dst_block_ids"]))
        want = ray.get(sender.payload.remote(layer, spec["src_block_ids"]))
        assert want.abs().sum() > 0 and torch.equal(got, want), layer
    assert ray.get(receiver.untouched_sum.remote(spec["dst_block_ids"])) == 0
    assert until(lambda: ray.get(sender.poll.remote("r1")) == "done")
    assert ray.get(sender.releases.remote()) == ["r1"]
    assert ray.get(receiver.releases.remote()) == []


def test_second_transfer_reuses_the_pair_group(cluster):
    _, sender, receiver = cluster
    spec = make_spec("r2", "prefill-0", src=(1, 2), dst=(11, 10))
    ray.get(receiver.expect.remote(spec))
    ray.get(sender.stream.remote(spec))
    assert ray.get(receiver.wait.remote("r2", 20)) == "done"
    for layer in range(NUM_LAYERS):
        assert torch.equal(ray.get(receiver.payload.remote(layer, [11, 10])),
                           ray.get(sender.payload.remote(layer, [1, 2])))
    assert ray.get(sender.groups.remote()) == (1, 1)
    assert ray.get(receiver.groups.remote()) == (1, 1)


def test_receiver_abort_frees_blocks_on_both_sides(cluster):
    _, sender, receiver = cluster
    spec = make_spec("r3", "prefill-0", src=(4, 5), dst=(6, 7))
    ray.get(receiver.expect.remote(spec))
    ray.get(sender.stream.remote(spec, 0.4))              # a slow prefill
    until(lambda: ray.get(receiver.progress.remote("r3"))[0] >= 1)
    ray.get(receiver.abort.remote("r3"))
    assert ray.get(receiver.poll.remote("r3")) == "aborted"
    assert ray.get(receiver.releases.remote()).count("r3") == 1
    assert until(lambda: ray.get(sender.poll.remote("r3")) == "aborted", timeout=5)
    assert ray.get(sender.releases.remote()).count("r3") == 1
    assert ray.get(sender.groups.remote()) == (1, 1)      # an abort does not cost the link


def test_killed_sender_fails_the_transfer_and_a_restarted_one_reconnects(cluster):
    addr, _, receiver = cluster
    doomed = KVEndpoint.remote("prefill-9", "sender", addr, 99)
    spec = make_spec("r4", "prefill-9")
    ray.get(receiver.expect.remote(spec))
    ray.get(doomed.stream.remote(spec, 0.5))
    until(lambda: ray.get(receiver.progress.remote("r4"))[0] >= 1)
    ray.kill(doomed)
    t0 = time.monotonic()
    assert until(lambda: ray.get(receiver.poll.remote("r4")) == "failed",
                 timeout=CONFIG["timeout_s"] + 2)
    assert time.monotonic() - t0 < CONFIG["timeout_s"] + 2
    assert ray.get(receiver.wait.remote("r4", 1)) == "KVTransferError"
    assert ray.get(receiver.releases.remote()).count("r4") == 1

    reborn = KVEndpoint.remote("prefill-9", "sender", addr, 7)   # same id, new process
    spec = make_spec("r5", "prefill-9", src=(8,), dst=(13,))
    ray.get(receiver.expect.remote(spec))
    ray.get(reborn.stream.remote(spec))
    assert ray.get(receiver.wait.remote("r5", 20)) == "done"
    for layer in range(NUM_LAYERS):
        assert torch.equal(ray.get(receiver.payload.remote(layer, [13])),
                           ray.get(reborn.payload.remote(layer, [8])))
    ray.kill(reborn)


def test_restarted_receiver_gets_a_fresh_group_from_the_same_sender(cluster):
    addr, sender, _ = cluster
    live_before, made_before = ray.get(sender.groups.remote())
    for attempt, rid in enumerate(("r6", "r7")):
        decode = KVEndpoint.remote("decode-7", "receiver", addr, None)   # same id both times
        spec = make_spec(rid, "prefill-0", src=(2, 3), dst=(4, 0), receiver="decode-7")
        ray.get(decode.expect.remote(spec))
        ray.get(sender.stream.remote(spec))
        assert ray.get(decode.wait.remote(rid, 20)) == "done", attempt
        assert torch.equal(ray.get(decode.payload.remote(3, [4, 0])),
                           ray.get(sender.payload.remote(3, [2, 3])))
        ray.kill(decode)
    # the link to the dead incarnation was dropped when the new one was found, not reused
    assert ray.get(sender.groups.remote()) == (live_before + 1, made_before + 2)


@ray.remote(num_cpus=0)
def _read_frames(rendezvous: str, count: int, unix_frames: bool) -> tuple[list[dict], bool]:
    """A receiver in a process of its own: read `count` frames, answer the hello, close."""
    from tandem.kv_transfer.torch_dist import DistConnector

    link = DistConnector("decode-long", rendezvous, "cpu",
                         KVTransferConfig(**CONFIG, unix_frames=unix_frames)).connect("prefill-long", as_sender=False)
    frames = [link.recv_frame(20) for _ in range(count)]
    link.send_verdict(False, "no IPC here")
    time.sleep(0.5)
    on_socket = link.frames is not None
    link.close(broken=False)
    return frames, on_socket


@pytest.mark.parametrize("unix_frames", [True, False], ids=["unix-socket", "gloo"])
def test_long_control_frames_and_the_direct_copy_verdict(ray_session, unix_frames):
    """A frame longer than the fixed head (a direct copy's block ids) goes as head and tail and
    arrives whole, in order with the frames around it, on the pair's Unix socket (one host) and on
    its gloo group; the receiver's answer to "hello" reaches the sender out of band (the store)."""
    from tandem.kv_transfer.torch_dist import DistConnector

    store, port = start_rendezvous_store("127.0.0.1")
    addr = f"127.0.0.1:{port}"
    big = {"op": "ready", "rid": "r", "src": bytes(range(256)) * 64}        # 16 KiB of ids
    frames = [{"op": "hello", "cache": None}, big, {"op": "end", "rid": "r"}]
    reader = _read_frames.remote(addr, len(frames), unix_frames)
    link = DistConnector("prefill-long", addr, "cpu", KVTransferConfig(**CONFIG, unix_frames=unix_frames)).connect(
        "decode-long", as_sender=True)
    assert (link.frames is not None) is unix_frames
    for frame in frames:
        link.send_frame(frame, 20)
    assert link.wait_verdict(20) == (False, "no IPC here")
    assert ray.get(reader, timeout=30) == (frames, unix_frames)
    link.close(broken=False)
    del store
