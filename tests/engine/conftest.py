"""Engine test fixtures: the real smollm2-135m (ours; transformers' on the same GGUF is tests/conftest's
`hf_smollm2`, shared with tests/cluster), a tiny
random Llama (GQA, Llama-3 rope scaling, untied embeddings) with its transformers twin, and a
check that every engine a test made ends with all its KV blocks free."""

from __future__ import annotations

import os

import pytest
import torch

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_engines = []


@pytest.fixture(scope="session")
def smollm2():
    from tandem.engine.weights import load_model

    model, tok, cfg = load_model("smollm2-135m")
    return model, tok


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(our tiny-random model, its tokenizer, transformers' LlamaForCausalLM on the same weights)."""
    from transformers import LlamaForCausalLM

    from tandem.engine.weights import load_model, save_hf_dir

    model, tok, cfg = load_model("tiny-random", seed=1234)
    path = save_hf_dir(model, tmp_path_factory.mktemp("tiny-hf"))
    hf = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, tok, hf


@pytest.fixture
def make_engine():
    """make_engine(model, tok, num_blocks=..., max_num_batched_tokens=..., ...) -> LLMEngine"""
    from tandem.engine.engine import LLMEngine

    def make(model, tok, *, num_blocks=512, block_size=16, max_num_batched_tokens=2048, max_num_seqs=64,
             prefix_caching=True):
        cfg = EngineConfig(model="test", cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                          enable_prefix_caching=prefix_caching),
                           scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                     max_num_batched_tokens=max_num_batched_tokens))
        e = LLMEngine(cfg, model=model, tokenizer=tok)
        _engines.append(e)
        return e

    yield make
    engines = list(_engines)
    _engines.clear()
    for e in engines:
        assert not e.has_unfinished(), "a test left requests in flight"
        e.allocator.check_invariants()
        assert e.allocator.num_free_blocks == e.allocator.num_blocks, (
            f"{e.allocator.num_used_blocks} KV blocks still held after the test")
