"""Two Ray actors sharing ONE GPU (half a GPU each), for machines with a single GPU: the direct copy
between processes (CUDA IPC handles, the source-id arena, the ack cells) moves KV bit-exact, and a
request prefilled by one actor and decoded by the other gives the tokens the colocated path gives.
NCCL cannot pair two ranks on one device, so only the direct path runs here; tests/gpu/
test_two_gpus.py covers NCCL and two devices."""

from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")

from tandem.kv_transfer.base import TransferSpec  # noqa: E402
from tandem.kv_transfer.torch_dist import start_rendezvous_store  # noqa: E402

from tests.gpu.test_two_gpus import BLOCKS, LAYER_BYTES, LAYERS, Endpoint, _generate  # noqa: E402

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(torch.cuda.device_count() != 1, reason="for machines with exactly one GPU")]


@pytest.fixture(scope="module")
def ray_one_gpu():
    if not ray.is_initialized():
        ray.init(num_cpus=8, num_gpus=1, resources={"tandem_prefill": 64, "tandem_decode": 64},
                 include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def test_direct_copy_between_two_processes_on_one_gpu_is_bit_exact(ray_one_gpu):
    store, port = start_rendezvous_store("127.0.0.1")
    addr = f"127.0.0.1:{port}"
    half = Endpoint.options(num_gpus=0.5)
    sender = half.remote("prefill-0", addr, 7, LAYERS * LAYER_BYTES)
    receiver = half.remote("decode-0", addr, None, LAYERS * LAYER_BYTES)
    try:
        g = torch.Generator().manual_seed(3)
        for rid in ("a", "b", "c"):      # "a" opens the link; "c" is all ready at once (a prefix pull)
            src = torch.randperm(BLOCKS, generator=g)[:40].tolist()
            dst = torch.randperm(BLOCKS, generator=g)[:40].tolist()
            spec = TransferSpec(rid, "prefill-0", "decode-0", tuple(range(LAYERS)), src, dst, 40 * 16).to_msg()
            ray.get(receiver.expect.remote(spec))
            ray.get((sender.send_all if rid == "c" else sender.stream).remote(spec))
            assert ray.get(receiver.wait.remote(rid)) == "done"
            assert ray.get(sender.wait.remote(rid)) == "done"
            sent, got = ray.get([sender.blocks.remote(src), receiver.blocks.remote(dst)])
            assert sent.abs().sum() > 0
            assert torch.equal(sent, got)
        assert ray.get(sender.direct.remote()) is True
    finally:
        for a in (sender, receiver):
            ray.kill(a)
        del store


def test_prefill_and_decode_actors_on_one_gpu_match_colocated(ray_one_gpu):
    base = {"model.name": "smollm2-135m-random", "model.device": "cuda", "model.dtype": "float32",
            "prefill.num_gpus": 0.5, "decode.num_gpus": 0.5, "router.metrics_port": None,
            "scheduler.max_num_batched_tokens": 256, "speculative.method": "off", "model.warmup": False,
            "cache.num_blocks": 2048}   # both actors share the device: a fixed cache each
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 40000, (n,), generator=g).tolist() for n in (700, 90, 1500)]
    remote, counters = _generate({**base, "prefill.replicas": 1, "decode.replicas": 1,
                                  "decode.local_prefill_threshold": 0}, prompts)
    assert counters.get("remote_prefills", 0) == len(prompts) + 1, counters
    assert counters.get("transfer_failures", 0) == 0, counters
    local, counters = _generate({**base, "prefill.replicas": 0, "decode.replicas": 1,
                                 "decode.local_prefill_threshold": float("inf")}, prompts)
    assert counters.get("local_prefills", 0) == len(prompts) + 1, counters
    assert remote == local
