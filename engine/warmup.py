"""Engine warmup: every first-time cost serving would otherwise pay inside a step (a Triton compile
stalls the whole batch for a second or more; a CUDA graph capture costs two steps) paid before the
worker reports ready. `warm_up(engine)` is `LLMEngine.warmup`.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from tandem.engine.stats import EngineStats

WARMUP_SHAPES = ((500, 1), (500, 4), (500, 16), (3000, 1), (3000, 4), (9000, 1))


def warm_up(engine, shapes: tuple[tuple[int, int], ...] = WARMUP_SHAPES, decode_tokens: int = 12,
            seed: int = 0) -> dict[str, Any]:
    """Compile every attention kernel variant (`compile_variants`), then run synthetic requests
    through the paths serving takes, so that Triton has compiled its kernels and the decode
    steps' CUDA graphs are captured now rather than inside the first real requests (then the
    decode graph of every other batch bucket and context bucket). `shapes`:
    (prompt tokens, concurrent requests) pairs; each covers a prefill (chunked when longer than
    the step's token budget), decode steps at that batch and context, and speculative verify steps
    (the prompts repeat a phrase, so an n-gram proposer drafts). One more request extends a warm
    prompt, for prefill over a cached prefix. Shapes that do not fit the cache or the model's
    context are skipped. Afterwards the engine holds no request, its prefix cache is empty and its
    stats are zero. Returns what ran and how long it took."""
    if engine.has_unfinished():
        raise RuntimeError("warmup needs an idle engine")
    t0 = time.perf_counter()
    launches = _compile_kernels(engine)
    ran = _run_warmup_requests(engine, shapes, decode_tokens, random.Random(seed))
    # a decode graph for every batch bucket the scheduler can form and every context bucket (the
    # shapes above cover a few)
    engine.runner.capture_graphs(context_len=min(2048, engine.max_model_len), all_contexts=True)
    engine.runner.capture_piecewise()   # and the prefill and mixed steps' stretches, every bucket
    engine.allocator.reset_prefix_cache()
    engine.allocator.prefix_queries = engine.allocator.prefix_hits = 0
    engine.stats = EngineStats()
    if engine.kv_cache.device.type == "cuda":
        torch.cuda.synchronize(engine.kv_cache.device)
        from tandem.engine.kernels.compile_watch import watch  # noqa: PLC0415 (triton loads only where kernels run)

        watch.arm()                 # a compile after this one is logged: warmup missed it
    return {"shapes": ran, "kernel_variants": launches, "seconds": round(time.perf_counter() - t0, 3),
            **engine.runner.graph_stats}


def _compile_kernels(engine) -> int:
    """Compiles every Triton kernel variant serving can launch; returns how many were launched."""
    launches = 0
    if engine.kv_cache.device.type == "cuda":   # from here on, every Triton compile is counted
        from tandem.engine.kernels.compile_watch import watch  # noqa: PLC0415 (triton loads only where kernels run)

        watch.install()
    if engine.runner._fused():  # the Triton ops: compile each attention variant first
        from tandem.engine.kernels.paged_attention import compile_variants  # noqa: PLC0415 (as above)

        kv = engine.kv_cache.tensor[0]
        from tandem.engine.kernels.attention_rope_kv import IN_ATTENTION  # noqa: PLC0415 (as above)

        # the variants that rotate and write the new K/V themselves, where decode steps launch them
        # (latent attention has kernels of its own)
        rope = IN_ATTENTION > 0 and engine.model_config.mla is None
        launches = compile_variants(kv[0], kv[1], engine.model_config.num_heads,
                                    sliding_window=engine.model_config.sliding_window,
                                    trees=bool(engine.config.speculative.suffix_tree_nodes),
                                    rope_cache=engine.model.rotary.cos_sin if rope else None)
    if engine.kv_cache.uses_triton_copy():  # the KV transport's gather/scatter of blocks
        from tandem.engine.kernels.block_copy import compile_variants as compile_block_copy  # noqa: PLC0415 (as above)

        launches += compile_block_copy(engine.kv_cache.tensor)
    return launches


def _run_warmup_requests(engine, shapes: tuple[tuple[int, int], ...], decode_tokens: int,
                         rng: random.Random) -> list[tuple[int, int]]:
    """Generates each (prompt tokens, batch) shape that fits, then one prefill over a cached
    prefix; returns the shapes that ran."""
    vocab = engine.model_config.vocab_size
    budget = engine.allocator.num_blocks * engine.allocator.block_size // 2
    ran, requests = [], []
    for n, batch in shapes:
        n = min(n, engine.max_model_len - decode_tokens - 1)
        if n < 8 or batch * (n + decode_tokens) > budget:
            continue
        reqs = [{"prompt_token_ids": _warmup_prompt(rng, vocab, n), "max_tokens": decode_tokens,
                 "ignore_eos": True} for _ in range(batch)]
        out = engine.generate(reqs)
        ran.append((n, batch))
        requests.append(reqs[0]["prompt_token_ids"] + out[0]["token_ids"])
    if requests:  # a prefill over a cached prefix
        ext = requests[-1] + [rng.randrange(vocab) for _ in range(300)]
        if len(ext) + decode_tokens < engine.max_model_len and len(ext) < budget:
            engine.generate([{"prompt_token_ids": ext, "max_tokens": decode_tokens, "ignore_eos": True}])
    return ran


def _warmup_prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    """n random token ids with one 64-token phrase repeated, so an n-gram proposer finds drafts."""
    phrase = [rng.randrange(vocab) for _ in range(64)]
    ids = [rng.randrange(vocab) for _ in range(n)]
    for at in range(0, n - 64, 512):
        ids[at:at + 64] = phrase
    if n >= 128:
        ids[-64:] = phrase
    return ids
