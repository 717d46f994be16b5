"""The engine's model against Hugging Face transformers running the same weights, in fp32.

Tolerance: both sides compute in fp32 with different operation orders (fused qkv/gate-up matmuls,
SDPA vs eager attention), so logits differ by accumulated rounding: ~1e-5 relative per op over 30
layers. We allow max |diff| <= 1e-3 * max |logit| + 1e-4, far below the gaps that decide greedy
tokens, and far above fp32 noise; a real bug (wrong rotary layout, GQA grouping, a missing norm)
moves logits by O(1).
"""

from __future__ import annotations

import torch

from tandem.engine.config import PRESETS


def _our_logits(make_engine, model, tok, ids):
    e = make_engine(model, tok)
    req = e.add_request("x", prompt_token_ids=ids)
    sched = e.scheduler.schedule()
    batch = e.runner.prepare(sched)
    hidden = model(batch.input_ids, batch.positions, e.kv_cache.tensor, batch.meta)
    logits = model.compute_logits(hidden)
    e.abort(req.request_id)
    return logits


def _close(ours, ref):
    tol = 1e-3 * ref.abs().max().item() + 1e-4
    err = (ours - ref).abs().max().item()
    assert err <= tol, f"max |logit diff| {err:.3g} > {tol:.3g}"


@torch.inference_mode()
def test_smollm2_logits_match_transformers(smollm2, hf_smollm2, make_engine):
    model, tok = smollm2
    ids = tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    ours = _our_logits(make_engine, model, tok, ids)
    ref = hf_smollm2(torch.tensor([ids])).logits[0].float()
    _close(ours, ref)


@torch.inference_mode()
def test_tiny_random_logits_match_transformers(tiny, make_engine):
    model, tok, hf = tiny
    cfg = PRESETS["tiny-random"]
    assert cfg.num_kv_heads < cfg.num_heads and cfg.rope_scaling and not cfg.tie_word_embeddings
    # long enough that Llama-3 rope scaling's low/high frequency bands both matter (original 256)
    ids = torch.randint(3, cfg.vocab_size, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = _our_logits(make_engine, model, tok, ids)
    ref = hf(torch.tensor([ids])).logits[0].float()
    _close(ours, ref)


@torch.inference_mode()
def test_bf16_logits_close_to_fp32(tiny, make_engine):
    from tandem.engine.weights import load_model

    model32, tok, _ = tiny
    model16, _, _ = load_model("tiny-random", dtype="bfloat16", seed=1234)
    ids = list(range(3, 67))
    a = _our_logits(make_engine, model32, tok, ids)
    b = _our_logits(make_engine, model16, tok, ids)
    rel = ((a - b).norm() / a.norm()).item()
    assert rel < 3e-2, f"bf16 logits relative error {rel:.3g}"


def _hf_greedy(hf, ids, n, eos):
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                          pad_token_id=eos)
    return out[0, len(ids):].tolist()


def test_greedy_chat_matches_transformers_and_stops_at_eos(smollm2, hf_smollm2, make_engine):
    model, tok = smollm2
    e = make_engine(model, tok)
    msgs = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
    res = e.generate([{"messages": msgs, "max_tokens": 40}])[0]
    ref = _hf_greedy(hf_smollm2, res["prompt_token_ids"], 40, eos=2)
    assert res["token_ids"] == ref
    assert res["finish_reason"] == "stop" and res["token_ids"][-1] == 2, "expected the model to end its turn"
    assert "Paris" in res["text"]


def test_greedy_raw_prompts_match_transformers(smollm2, hf_smollm2, make_engine):
    model, tok = smollm2
    e = make_engine(model, tok)
    prompts = ["def quicksort(arr):", "The three primary colors are", "import numpy as np\nx = np."]
    results = e.generate([{"prompt": p, "max_tokens": 24} for p in prompts])
    for res in results:
        assert res["token_ids"] == _hf_greedy(hf_smollm2, res["prompt_token_ids"], 24, eos=2)
        assert res["finish_reason"] in ("stop", "length")


def test_tiny_random_greedy_matches_transformers(tiny, make_engine):
    model, tok, hf = tiny
    e = make_engine(model, tok)
    ids = list(range(10, 50))
    res = e.generate([{"prompt_token_ids": ids, "max_tokens": 30, "ignore_eos": True}])[0]
    assert res["token_ids"] == _hf_greedy(hf, ids, 30, eos=None)
