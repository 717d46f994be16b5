"""Penalties on the GPU (engine/penalties.py): the dense device-side state against the CPU's sparse
path step after step, and greedy generation with penalties on the GPU's overlapped, graph-replayed
path (fp32) giving the CPU engine's tokens."""

from __future__ import annotations

import copy

import pytest
import torch

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.penalties import Penalties
from tandem.engine.weights import load_model
from tandem.wire.messages import SamplingParams


def test_dense_on_cuda_matches_sparse_on_cpu():
    gen = torch.Generator().manual_seed(0)
    vocab = 49152
    sps = [SamplingParams(presence_penalty=0.4, frequency_penalty=0.3), SamplingParams(),
           SamplingParams(repetition_penalty=1.3), SamplingParams(presence_penalty=-1, repetition_penalty=0.8)]
    prompts = [torch.randint(0, vocab, (300,), generator=gen).tolist() for _ in sps]
    outputs = [[] for _ in sps]
    gpu = Penalties()  # dense: the logits are on CUDA
    for step in range(12):
        logits = torch.randn(len(sps), vocab, generator=gen) * 4
        rows = [(i, f"r{i}", sp, prompts[i], list(outputs[i])) for i, sp in enumerate(sps)]
        on_gpu = logits.cuda()
        gpu.apply(on_gpu, rows)
        on_cpu = logits.clone()
        Penalties().apply(on_cpu, rows)
        assert torch.allclose(on_gpu.cpu(), on_cpu, atol=1e-5), step
        for i, out in enumerate(outputs):
            out.append(int(torch.randint(0, 50, (), generator=gen)) if step % 2 else prompts[i][step])
    assert gpu.dense is None and gpu._counts is not None and gpu._counts.is_cuda


@pytest.mark.parametrize("overlap", [True, False])
def test_penalized_greedy_on_the_gpu_matches_the_cpu(overlap):
    model, tok, _ = load_model("smollm2-135m-random", "float32", "cpu", seed=7)
    gen = torch.Generator().manual_seed(3)
    reqs = [{"prompt_token_ids": torch.randint(3, 1000, (n,), generator=gen).tolist(), "max_tokens": 24,
             "ignore_eos": True, **kw}
            for n, kw in ((40, {"frequency_penalty": 1.0}), (7, {}), (120, {"repetition_penalty": 1.5,
                                                                          "presence_penalty": 0.5}))]

    def tokens(device):
        m = copy.deepcopy(model).to(device)
        e = LLMEngine(EngineConfig(model="test", device=device, cache=CacheConfig(num_blocks=256),
                                   scheduler=SchedulerConfig(max_num_seqs=8)), model=m, tokenizer=tok)
        if device == "cuda":
            e.overlap = overlap
        return [r["token_ids"] for r in e.generate(reqs)]

    assert tokens("cuda") == tokens("cpu")
