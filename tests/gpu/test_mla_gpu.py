"""Latent attention on CUDA: the Triton decode kernel in bf16 at DeepSeek-V2-Lite's sizes (16 heads,
kv_lora_rank 512, rope 64, block size 16, contexts up to 4k, decode and verify batches) against a
float32 reference on the upcast inputs (bound 1e-2, as tests/gpu/test_kernels_gpu.py); and a tiny
DeepSeek-V3 with a MoE layer, fp32 on the GPU path (Triton attention, fused kernels, CUDA graphs),
greedy token-exact against transformers' generate on the CPU."""

import pytest
import torch

from tandem.engine.attention import AttentionMetadata
from tandem.engine.mla import latent_attention_torch

if torch.cuda.is_available():  # elsewhere conftest.py skips these, and triton stays unimported
    from tandem.engine.kernels.mla_decode import mla_decode

HEADS, RANK, ROPE, BLOCK = 16, 512, 64, 16


def _batch(gen, query_lens, ctx_lens, dtype):
    seq_lens = [c + q for c, q in zip(ctx_lens, query_lens)]
    blocks = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(blocks) + 4
    cache = torch.randn(num_blocks, BLOCK, 1, RANK + ROPE, generator=gen).to(dtype).cuda()
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks) + 1, dtype=torch.int32)
    for b, n in enumerate(blocks):
        tables[b, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64, device="cuda"),
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0).to(torch.int32).cuda(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), block_tables=tables.cuda(),
        query_lens_cpu=list(query_lens), seq_lens_cpu=seq_lens, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens))
    q = torch.randn(sum(query_lens), HEADS, RANK + ROPE, generator=gen).to(dtype).cuda()
    return q, cache, meta


@pytest.mark.parametrize("query_lens,ctx_lens", [([1], [4000]), ([1] * 8, [17, 300, 1000, 64, 2048, 5, 900, 129]),
                                                 ([1] * 64, [1024] * 64), ([4, 2, 3], [700, 31, 2500])],
                         ids=["decode-1x4k", "decode-8-mixed", "decode-64x1k", "verify"])
def test_mla_decode_bf16(query_lens, ctx_lens):
    gen = torch.Generator().manual_seed(len(query_lens))
    q, cache, meta = _batch(gen, query_lens, ctx_lens, torch.bfloat16)
    scale = (128 + ROPE) ** -0.5
    out = mla_decode(q, cache, meta, RANK, scale)
    ref = latent_attention_torch(q.float(), cache.float(), RANK, meta, scale)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err


def test_tiny_deepseek_v3_on_the_gpu_path_matches_transformers(tmp_path):
    from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from tandem.engine.engine import LLMEngine
    from tandem.engine.weights import load_model
    from tests.engine.families import hf_greedy
    from tests.engine.mla_models import build_deepseek_dir

    torch.backends.cuda.matmul.allow_tf32 = False
    hf = build_deepseek_dir("v3", tmp_path, moe=True)
    model, tok, _ = load_model(str(tmp_path), "float32", "cuda")
    e = LLMEngine(EngineConfig(model="t", dtype="float32", device="cuda",
                               cache=CacheConfig(block_size=16, num_blocks=64),
                               scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128)),
                  model=model, tokenizer=tok)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 23, 90)]
    results = e.generate([{"prompt_token_ids": p, "max_tokens": 12, "ignore_eos": True} for p in prompts])
    for p, res in zip(prompts, results):
        assert res["token_ids"] == hf_greedy(hf, p, 12, eos=None), f"prompt of {len(p)}"
    assert e.runner.graph_stats["replays"] > 0
