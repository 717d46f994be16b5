"""Parity per served family (tests/engine/families.py builds each tiny checkpoint with transformers):
logits through the engine API within tolerance, greedy tokens equal to transformers' own
`generate` in fp32 (engine API, batched; and `tandem generate --model DIR` in a subprocess), and
the EOS set and chat template read from the directory.

Tolerance as in test_model_vs_hf.py: max |diff| <= 1e-3 * max |logit| + 1e-4; a dropped bias,
q/k norm or window, or a wrong head_dim, moves logits by O(1)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.engine.families import EOS, FAMILIES, IM_END, SLIDING_WINDOW, build_family_dir, hf_greedy
from tests.engine.test_model_vs_hf import _close, _our_logits

every_family = pytest.mark.parametrize("family", list(FAMILIES))


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """family -> (directory, our model, our tokenizer, transformers' model), built once."""
    from tandem.engine.weights import load_model

    built = {}

    def get(family):
        if family not in built:
            path = tmp_path_factory.mktemp(f"tiny-{family}")
            hf = build_family_dir(family, path)
            model, tok, _ = load_model(str(path))
            built[family] = (path, model, tok, hf)
        return built[family]

    return get


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@every_family
@torch.inference_mode()
def test_logits_match_transformers(family, family_models, make_engine):
    _, model, tok, hf = family_models(family)
    ids = _prompt(90, 1)  # past Mistral's window (16) and Llama-3 scaling's original context (64)
    ours = _our_logits(make_engine, model, tok, ids)
    _close(ours, hf(torch.tensor([ids])).logits[0].float())


@every_family
def test_greedy_batch_matches_transformers(family, family_models, make_engine):
    """Three prompts in one batch (chunked prefill of the longest, then decode together), 20
    tokens each: with Mistral every decode step reads past the window."""
    _, model, tok, hf = family_models(family)
    e = make_engine(model, tok, max_num_batched_tokens=32)
    prompts = [_prompt(n, seed) for seed, n in enumerate((5, 23, 41))]
    results = e.generate([{"prompt_token_ids": p, "max_tokens": 20, "ignore_eos": True} for p in prompts])
    for p, res in zip(prompts, results):
        assert res["token_ids"] == hf_greedy(hf, p, 20, eos=None), f"{family}, prompt of {len(p)}"


@every_family
def test_cli_generate_matches_transformers(family, family_models):
    path, _, _, hf = family_models(family)
    prompt = "def add(a, b):\n    return a + b\n# the sum of the first ten numbers is"
    run = subprocess.run([sys.executable, "-m", "tandem.cluster.cli", "generate", "--model", str(path),
                          "--prompt", prompt, "--max-tokens", "16", "--json", "--dtype", "float32"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(res["prompt_token_ids"]) > SLIDING_WINDOW
    eos = [EOS, IM_END] if family.startswith("qwen") else EOS
    assert res["token_ids"] == hf_greedy(hf, res["prompt_token_ids"], 16, eos=eos)


@every_family
def test_eos_set_and_chat_template_come_from_the_directory(family, family_models, make_engine):
    _, model, tok, _ = family_models(family)
    # Qwen lists <|im_end|> only in generation_config.json; everyone has </s> in config.json
    expected = {EOS, IM_END} if family.startswith("qwen") else {EOS}
    assert set(tok.eos_token_ids) == expected
    e = make_engine(model, tok)
    ids = e.tokenize(None, None, [{"role": "user", "content": "hi"}])
    assert tok.decode(ids, skip_special_tokens=False) == "<|user|>hi<|im_end|>\n<|assistant|>"


# what the GPU path does differently per family: q/k norms written back in place (Qwen3, run
# through Qwen3-MoE: the same attention, one layer of experts through the grouped GEMM, one dense),
# the window inside the kernels (Mistral); Llama's is tests/engine/test_gpu_path_cpu.py, Qwen2's biases
# are the same nn.Linear on both paths
@pytest.mark.parametrize("family", ["qwen3_moe", "mistral", "qwen3"])
def test_triton_path_matches_the_cpu_path(family, family_models):
    """The GPU path (Triton attention with the window inside the kernels, fused norm and rotary
    kernels, q/k norms written back in place, the static-buffer step, the prefill chunks' split
    forward of engine.piecewise_graphs), under the interpreter on CPU: greedy tokens equal the
    plain-torch path's for staggered arrivals and chunked prefill."""
    from tests.engine.test_gpu_path_cpu import _engine, _generate

    _, model, tok, _ = family_models(family)
    ref = _generate(_engine(model, tok))
    e = _engine(model, tok, graphs=True)
    assert _generate(e) == ref
    stats = e.runner.graph_stats
    assert stats["replays"] > 0, "no step went through the static buffers"
    if family == "qwen3_moe":   # its experts size their launches from the routing: eager prefill
        assert "mixture of experts" in stats["piecewise_off"] and stats["piecewise_replays"] == 0
    else:
        assert stats["piecewise_off"] is None and stats["piecewise_replays"] > 0, stats
