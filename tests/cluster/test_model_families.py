"""A served family other than Llama through the whole cluster: a tiny Qwen3-MoE checkpoint written by
transformers (Qwen3's per-head q/k norms with head_dim 32 != hidden / heads, and a mixture of
experts in one of its two layers; tests/engine/families.py), one prefill and one decode actor with every prompt prefilled remotely (KV over gloo), tokens streamed
over gRPC, equal to transformers' own greedy `generate` on the same directory."""

from __future__ import annotations

import pytest

from tandem.engine.tokenizer import HFTokenizer
from tandem.protos.tandem.v1 import generation_pb2 as pb
from tests.engine.families import EOS, IM_END, build_family_dir, hf_greedy


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    return path, build_family_dir("qwen3_moe", path)


def test_qwen3_moe_over_grpc_matches_transformers(make_cluster, qwen3_moe):
    path, hf = qwen3_moe
    c = make_cluster({"model.name": str(path), "cache.num_blocks": 256, "prefill.replicas": 1,
                      "decode.replicas": 1, "decode.local_prefill_threshold": 0})
    prompts = ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n", "Q: 2 + 2?\nA:"]
    tok = HFTokenizer.from_dir(path)
    for prompt in prompts:
        got, _, last = c.generate(prompt=prompt, max_tokens=16)  # the router tokenizes
        ids = tok.encode(prompt)
        assert last.usage.prompt_tokens == len(ids)
        assert got == hf_greedy(hf, ids, 16, eos=[EOS, IM_END]), prompt
        assert last.finish_reason in (pb.STOP, pb.LENGTH)
    stats = c.worker_stats()
    assert stats["decode-0"].remote_prefills >= len(prompts), "meant to take the remote-prefill path"
