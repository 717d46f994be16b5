"""Latent attention on CUDA: the Triton decode kernel in bf16 at DeepSeek-V2-Lite's sizes (16 heads,
kv_lora_rank 512, rope 64, block size 16, contexts up to 4k, decode and verify batches) against a
float32 reference on the upcast inputs (bound 1e-2, as tests/gpu/test_kernels_gpu.py); and a tiny
DeepSeek-V3 with a MoE layer, fp32 on the GPU path (Triton attention, fused kernels, CUDA graphs),
greedy token-exact against transformers' generate on the CPU, with the latent's norm + rope + cache
write as torch steps and as one kernel (engine.kernels.mla_prepare, also alone in bf16); and the
absorbed form's fused launches for small steps (W_UK in the prepare kernel, W_UV in the merge:
LatentAttention.fused_absorb) on a V2-Lite layer in bf16, eager and replayed from a CUDA graph."""

import pytest
import torch

from tandem.engine.attention import AttentionMetadata
from tandem.engine.mla import latent_attention_torch

if torch.cuda.is_available():  # elsewhere conftest.py skips these, and triton stays unimported
    from tandem.engine.kernels.mla_decode import mla_decode
    from tandem.engine.kernels.mla_prepare import mla_prepare

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


@pytest.mark.parametrize("interleave", [True, False])
def test_mla_prepare_bf16(interleave):
    """The latent's norm, rope and cache write in one kernel at V2-Lite's sizes (64 tokens, one a
    padding row) against engine.mla's torch steps on the same bf16 inputs."""
    from tandem.engine.mla import apply_latent_rope, write_latent_torch
    from tandem.engine.model import RMSNorm

    gen = torch.Generator().manual_seed(5)
    T, nope = 64, 128
    proj = torch.randn(T, HEADS * (nope + ROPE) + RANK + ROPE, generator=gen).bfloat16().cuda()
    q, kv = proj[:, :HEADS * (nope + ROPE)].view(T, HEADS, nope + ROPE), proj[:, HEADS * (nope + ROPE):]
    cos_sin = torch.randn(4096, ROPE, generator=gen).cuda()
    positions = torch.randint(0, 4096, (T,), generator=gen).cuda()
    slots = torch.randperm(80 * BLOCK, generator=gen)[:T].cuda()
    slots[7] = -1
    norm = RMSNorm(RANK, 1e-6).cuda().bfloat16()
    norm.weight.data.normal_(1.0, 0.1)
    cache = torch.randn(80, BLOCK, 1, RANK + ROPE, generator=gen).bfloat16().cuda()
    ref = cache.clone()
    c, k_pe = kv.split([RANK, ROPE], dim=-1)
    k_rot = apply_latent_rope(k_pe[:, None], positions, cos_sin, interleave)[:, 0]
    keep = slots >= 0
    write_latent_torch(torch.cat([norm(c), k_rot], dim=-1)[keep], ref, slots[keep])
    q_pe = mla_prepare(q, kv, positions, cos_sin, norm.weight, 1e-6, cache, slots, nope, interleave)
    ref_q_pe = apply_latent_rope(q[..., nope:], positions, cos_sin, interleave)
    assert ((q_pe.float() - ref_q_pe.float()).norm() / ref_q_pe.float().norm()).item() < 1e-2
    assert ((cache.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


@pytest.mark.parametrize("fused_prepare", [False, True], ids=["torch-prepare", "fused-prepare"])
def test_tiny_deepseek_v3_on_the_gpu_path_matches_transformers(tmp_path, fused_prepare, monkeypatch):
    from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from tandem.engine.engine import LLMEngine
    from tandem.engine.weights import load_model
    from tests.engine.families import hf_greedy
    from tests.engine.mla_models import build_deepseek_dir

    from tandem.engine.mla import LatentAttention

    monkeypatch.setattr(LatentAttention, "fused_prepare", fused_prepare)
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


@pytest.mark.parametrize("query_len,ctx_len", [(2048, 0), (512, 1500)], ids=["prompt", "after-a-prefix-hit"])
def test_expanded_prefill_runs_a_fused_sdpa_kernel(query_len, ctx_len):
    """The expanded form at V2-Lite's sizes runs with SDPA's fused kernels only (a 3-D input would
    leave it the math form, an [H, L, L] fp32 score matrix: 1 s for an 8k prefill on the H200),
    and gives the math form's output."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tandem.engine.config import PRESETS
    from tandem.engine.mla import LatentAttention

    attn = LatentAttention(PRESETS["deepseek-v2-lite-random"], 0).cuda().bfloat16()
    for p in attn.parameters():
        p.data.normal_(0.0, 0.05)
    gen = torch.Generator().manual_seed(9)
    _, cache, meta = _batch(gen, [query_len], [ctx_len], torch.bfloat16)
    q_nope = torch.randn(query_len, HEADS, 128, generator=gen).bfloat16().cuda()
    q_pe = torch.randn(query_len, HEADS, ROPE, generator=gen).bfloat16().cuda()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        fused = attn._expanded(q_nope, q_pe, cache, meta)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = attn._expanded(q_nope, q_pe, cache, meta)
    assert ((fused.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


def _layer_step(query_lens, ctx_lens, seed):
    """A V2-Lite attention layer (bf16, random weights) and one step's inputs on it: -> (layer, x
    [T, 2048], positions, cos_sin, kv_cache [1, 1, blocks, 16, 1, 576], meta with the new tokens' slots)."""
    from tandem.engine.config import PRESETS
    from tandem.engine.mla import LatentAttention, LatentRotary

    cfg = PRESETS["deepseek-v2-lite-random"]
    torch.manual_seed(seed)
    attn = LatentAttention(cfg, 0).cuda().bfloat16()
    for name, p in attn.named_parameters():
        p.data.normal_(*((1.0, 0.1) if "layernorm" in name else (0.0, 0.05)))
    gen = torch.Generator().manual_seed(seed)
    _, cache, meta = _batch(gen, query_lens, ctx_lens, torch.bfloat16)
    tables = meta.block_tables.cpu()
    slots = [tables[b, p // BLOCK].item() * BLOCK + p % BLOCK
             for b, (q, s) in enumerate(zip(query_lens, meta.seq_lens_cpu)) for p in range(s - q, s)]
    positions = [p for q, s in zip(query_lens, meta.seq_lens_cpu) for p in range(s - q, s)]
    meta.slot_mapping = torch.tensor(slots, dtype=torch.int64, device="cuda")
    x = torch.randn(sum(query_lens), cfg.hidden_size, generator=gen).bfloat16().cuda()
    cos_sin = LatentRotary(cfg, 8192).cos_sin.cuda()
    return attn, x, torch.tensor(positions, device="cuda"), cos_sin, cache[None, None], meta


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


UV_MODES = {"uv-gemv": (False, True), "uv-in-merge": (True, False), "uv-bmm": (False, False)}


@pytest.mark.parametrize("uv", list(UV_MODES))
@pytest.mark.parametrize("query_lens,ctx_lens", [([1], [4000]), ([4], [1500]), ([1] * 4, [17, 300, 2048, 5])],
                         ids=["decode-1x4k", "verify-1-plus-3", "decode-4"])
def test_fused_absorbed_form_bf16(query_lens, ctx_lens, uv):
    """The layer's attention with W_UK in the prepare launch (mla_prepare_uk, the partial kernel,
    the merge, W_UV's own GEMV: the default; or W_UV as torch.bmm), or in 3 launches (the merge applying W_UV too),
    against the bmm form's 5 on the same bf16 inputs (2e-3: the same rounding points, the sums'
    order apart; on an H200 0 at one token, 3.3e-4 and 4.5e-4 at four) and a float32 reference (2e-2,
    as test_mla_decode_bf16's; measured 5.4e-3 to 6.3e-3, the bmm form's to the digit); then
    captured in a CUDA graph and replayed twice on new inputs, each against an eager run on them."""
    import copy

    attn, x, positions, cos_sin, kv_cache, meta = _layer_step(query_lens, ctx_lens, len(query_lens))
    attn.fused_uv, attn.uv_gemv = UV_MODES[uv]
    assert attn.absorbs_in_kernels(x.shape[0], meta)
    bmm = copy.deepcopy(attn)
    bmm.fused_absorb = False
    run = lambda layer, x, cache: layer._attend(x, positions, cos_sin, cache, meta, kernel=mla_decode)  # noqa: E731
    fused, plain = run(attn, x, kv_cache.clone()), run(bmm, x, kv_cache.clone())
    ref = copy.deepcopy(attn).float()._attend(x.float(), positions, cos_sin, kv_cache.float(), meta, kernel=None)
    assert _rel(fused, plain) < 2e-3 and _rel(fused, ref) < 2e-2, (_rel(fused, plain), _rel(fused, ref))

    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(attn, static_x, kv_cache)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run(attn, static_x, kv_cache)
    for i in range(2):
        static_x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(100 + i)).bfloat16())
        graph.replay()
        want = run(attn, static_x, kv_cache.clone())
        assert _rel(static_out, want) < 1e-3, (i, _rel(static_out, want))


@pytest.mark.parametrize("uv", list(UV_MODES))
@pytest.mark.parametrize("merge_block", [None, 128], ids=["merge-whole-rank", "merge-128"])
def test_pdl_launches_give_the_plain_launches_bits(uv, merge_block, monkeypatch):
    """The fused absorbed form's kernels (prepare with W_UK, partial, merge, W_UV after it or in it)
    launched with PDL, eager and from a CUDA graph of three layers' calls back to back (each kernel's
    programs scheduled while the one before runs), give the plain launches' bits: PDL moves when a
    kernel starts, never what it reads (tests/engine/test_pdl.py checks the waits in the PTX)."""
    from tandem.engine.kernels import mla_decode as decode_mod
    from tandem.engine.kernels import pdl

    monkeypatch.setattr(decode_mod, "MERGE_RANK_BLOCK", merge_block)
    attn, x, positions, cos_sin, kv_cache, meta = _layer_step([1], [4000], 3)
    attn.fused_uv, attn.uv_gemv = UV_MODES[uv]
    run = lambda x, cache: attn._attend(x, positions, cos_sin, cache, meta, kernel=mla_decode)  # noqa: E731
    chain = lambda x, cache: run(run(run(x, cache) @ torch.ones(2048, 2048, device="cuda").bfloat16() / 2048, cache)  # noqa: E731
                                 .contiguous(), cache)
    plain = run(x, kv_cache.clone())
    plain_chain = chain(x, kv_cache.clone())
    with pdl.auto(True):
        assert pdl.on() and pdl.supported(x.device)
        assert torch.equal(run(x, kv_cache.clone()), plain)
        static_x, cache = x.clone(), kv_cache.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain(static_x, cache)  # compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(static_x, cache)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain_chain)
