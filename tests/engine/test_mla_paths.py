"""DeepSeek latent attention through the GPU path on CPU (Triton's interpreter): the absorbed form
on engine.kernels.mla_decode, the fused norm kernels and the static-buffer (CUDA graph) steps give
the plain-torch path's greedy tokens, with staggered arrivals and chunked prefill (a 35-token prompt
under a 24-token budget). Verify steps (several query tokens per sequence) through the kernel are
tests/engine/test_mla_kernels.py's verify case."""

from __future__ import annotations

import pytest

from tests.engine.mla_models import build_deepseek_dir
from tests.engine.test_gpu_path_cpu import PROMPTS, _engine


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    from tandem.engine.weights import load_model

    path = tmp_path_factory.mktemp("tiny-deepseek-v3-paths")
    build_deepseek_dir("v3", path)
    model, tok, _ = load_model(str(path))
    return model, tok


def _generate(e):
    reqs = [{"prompt_token_ids": p, "max_tokens": 4, "ignore_eos": True} for p in PROMPTS[:3]]
    return [r["token_ids"] for r in e.generate(reqs, arrivals=[0, 0, 2])]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_triton_path_matches_the_cpu_path(v3, overlap):
    """overlapped: each step's input ids come from the previous step's tokens on the device."""
    pytest.importorskip("triton")
    model, tok = v3
    ref = _generate(_engine(model, tok))
    e = _engine(model, tok, graphs=True)
    e.overlap = overlap
    assert _generate(e) == ref
    assert e.runner.graph_stats["replays"] > 0, "no step went through the static buffers"
