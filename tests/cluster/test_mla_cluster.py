"""DeepSeek latent attention through the whole cluster: a tiny DeepSeek-V2 checkpoint written by
transformers (V2-Lite's shape: no q LoRA, a dense layer then a MoE layer; tests/engine/mla_models.py),
one prefill and one decode actor with every prompt prefilled remotely, so each prompt's latent KV
([kv_lora_rank + rope] per token per layer: one cache plane, not K and V) crosses over gloo; tokens
streamed over gRPC, equal to transformers' own greedy `generate` on the same directory."""

from __future__ import annotations

import pytest

from tandem.engine.tokenizer import HFTokenizer
from tandem.protos.tandem.v1 import generation_pb2 as pb
from tests.engine.families import EOS, hf_greedy
from tests.engine.mla_models import build_deepseek_dir


@pytest.fixture(scope="module")
def deepseek_v2(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-deepseek-v2")
    return path, build_deepseek_dir("v2", path, moe=True)


def test_deepseek_latent_kv_moves_from_prefill_to_decode(make_cluster, deepseek_v2):
    path, hf = deepseek_v2
    c = make_cluster({"model.name": str(path), "cache.num_blocks": 256, "prefill.replicas": 1,
                      "decode.replicas": 1, "decode.local_prefill_threshold": 0})
    prompts = ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n", "Q: 2 + 2?\nA:"]
    tok = HFTokenizer.from_dir(path)
    for prompt in prompts:
        got, _, last = c.generate(prompt=prompt, max_tokens=16)
        ids = tok.encode(prompt)
        assert last.usage.prompt_tokens == len(ids)
        assert got == hf_greedy(hf, ids, 16, eos=EOS), prompt
        assert last.finish_reason in (pb.STOP, pb.LENGTH)
    stats = c.worker_stats()
    assert stats["decode-0"].remote_prefills >= len(prompts), "meant to take the remote-prefill path"
