"""DeepSeek latent attention through the GPU path on CPU (Triton's interpreter): the absorbed form
on engine.kernels.mla_decode, the fused norm kernels and the static-buffer (CUDA graph) steps give
the plain-torch path's greedy tokens (also with the one-kernel norm + rope + cache write), with staggered arrivals and chunked prefill (a 35-token prompt
under a 24-token budget), V3 and V2 (no q LoRA, default rope); small steps take the absorbed form's
fused launches (W_UK in the prepare kernel, W_UV in the merge: LatentAttention.fused_absorb, spied
on); speculative verify steps (1 + 3 query tokens per sequence, drafts partly accepted, partly
rolled back) on both paths give plain greedy decoding's tokens, the verify steps fused too; the
one-token projections through engine.kernels.gemv give them too."""

from __future__ import annotations

import pytest

from tests.engine.mla_models import build_deepseek_dir
from tests.engine.test_gpu_path_cpu import PROMPTS, _engine


def _load(tmp_path_factory, version):
    from tandem.engine.weights import load_model

    path = tmp_path_factory.mktemp(f"tiny-deepseek-{version}-paths")
    build_deepseek_dir(version, path)
    model, tok, _ = load_model(str(path))
    return model, tok


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return _load(tmp_path_factory, "v3")


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    return _load(tmp_path_factory, "v2")


def _spy_fused_absorb(monkeypatch) -> dict[str, list]:
    """Counts the absorbed form's fused launches: -> {"steps": each fused layer call's longest query,
    "prepare_uk": its calls, "merge_uv": the merges that applied W_UV}."""
    from tandem.engine.kernels import mla_decode, mla_prepare
    from tandem.engine.mla import LatentAttention

    seen = {"steps": [], "prepare_uk": [], "merge_uv": []}
    fused, uk, merge = LatentAttention._absorbed_fused, mla_prepare.mla_prepare_uk, mla_decode.merge_partials

    def absorbed_fused(self, q, kv, positions, cos_sin, cache, meta, kernel):
        seen["steps"].append(meta.max_query_len)
        return fused(self, q, kv, positions, cos_sin, cache, meta, kernel)

    monkeypatch.setattr(LatentAttention, "_absorbed_fused", absorbed_fused)
    monkeypatch.setattr(mla_prepare, "mla_prepare_uk", lambda *a, **kw: seen["prepare_uk"].append(1) or uk(*a, **kw))
    monkeypatch.setattr(mla_decode, "merge_partials", lambda acc, ml, rank, dtype, w_uv=None, **kw: (
        w_uv is not None and seen["merge_uv"].append(1)) or merge(acc, ml, rank, dtype, w_uv, **kw))
    return seen


def _generate(e):
    reqs = [{"prompt_token_ids": p, "max_tokens": 4, "ignore_eos": True} for p in PROMPTS[:3]]
    return [r["token_ids"] for r in e.generate(reqs, arrivals=[0, 0, 2])]


@pytest.mark.parametrize("version,overlap,fused_prepare", [("v3", False, True), ("v3", True, True),
                                                            ("v3", False, False), ("v2", False, True)],
                         ids=["plain", "overlapped", "torch-prepare", "v2"])
def test_triton_path_matches_the_cpu_path(version, overlap, fused_prepare, monkeypatch, request):
    """overlapped: each step's input ids come from the previous step's tokens on the device.
    fused_prepare (the default): the latent's norm, rope and cache write in one kernel
    (engine.kernels.mla_prepare), and steps of up to fused_absorb_max_pairs (token, head) pairs with
    W_UK in the prepare launch (and, in the overlapped case, W_UV in the merge); torch-prepare: as
    the torch steps, and the absorbed form's products as torch.bmm."""
    pytest.importorskip("triton")
    from tandem.engine.mla import LatentAttention

    monkeypatch.setattr(LatentAttention, "fused_prepare", fused_prepare)
    uv = overlap  # the overlapped case also takes W_UV in the merge (LatentAttention.fused_uv, off by default)
    monkeypatch.setattr(LatentAttention, "fused_uv", uv)
    model, tok = request.getfixturevalue(version)
    ref = _generate(_engine(model, tok))
    seen = _spy_fused_absorb(monkeypatch)
    e = _engine(model, tok, graphs=True)
    e.overlap = overlap
    assert _generate(e) == ref
    assert e.runner.graph_stats["replays"] > 0, "no step went through the static buffers"
    fused = len(seen["steps"])
    assert len(seen["prepare_uk"]) == fused and len(seen["merge_uv"]) == (fused if uv else 0)
    assert fused > 0 if fused_prepare else fused == 0, seen["steps"]


@pytest.fixture(scope="module")
def v3_moe(tmp_path_factory):
    from tandem.engine.weights import load_model

    path = tmp_path_factory.mktemp("tiny-deepseek-v3-moe-paths")
    build_deepseek_dir("v3", path, moe=True)
    model, tok, _ = load_model(str(path))
    return model, tok


def test_one_token_projections_take_the_gemv_and_keep_the_tokens(v3_moe, monkeypatch):
    """gemv.POLICY "all": a lone sequence's one-token steps run the latent attention's q/kv_a (with
    the layer's input norm folded in) and o projections and the shared experts' gate/up through
    engine.kernels.gemv (and their down with its SiLU folded in), with the plain path's greedy tokens."""
    pytest.importorskip("triton")
    from tandem.engine.kernels import gemv, moe_decode

    # the shared experts take the GEMV on the seven-launch MoE path (moe_decode's three launches
    # hold them otherwise: tests/engine/test_moe_decode.py)
    monkeypatch.setattr(moe_decode, "FUSED_DECODE", False)
    model, tok = v3_moe
    req = [{"prompt_token_ids": PROMPTS[0], "max_tokens": 5, "ignore_eos": True}]
    ref = [r["token_ids"] for r in _engine(model, tok).generate(req)]
    shapes = []
    for name in ("gemv", "silu_gemv", "norm_gemv"):
        real = getattr(gemv, name)
        monkeypatch.setattr(gemv, name, lambda *a, _real=real, **kw: shapes.append(tuple(a[4 if len(a) > 4 else 1].shape))
                            or _real(*a, **kw))
    monkeypatch.setattr(gemv, "POLICY", "all")
    assert [r["token_ids"] for r in _engine(model, tok, graphs=True).generate(req)] == ref
    attn = model.layers[0].self_attn
    mlp = next(layer.mlp for layer in model.layers if hasattr(layer.mlp, "shared_experts"))
    want = {tuple(attn.qkv_a_proj.weight.shape), tuple(attn.o_proj.weight.shape),
            tuple(mlp.shared_experts.gate_up_proj.weight.shape), tuple(mlp.shared_experts.down_proj.weight.shape)}
    assert want <= set(shapes), (want, set(shapes))


class _HalfRightProposer:
    """Drafts the tokens plain greedy decoding will produce, the last of each draft made wrong: every
    verify step accepts some and rolls back the rest."""

    def __init__(self, future: dict[str, list[int]], vocab: int):
        self.future, self.vocab, self.proposed = future, vocab, 0

    def propose(self, wanted):
        from tandem.engine.speculative.proposer import Draft

        out = {}
        for r, k in wanted:
            nxt = list(self.future[r.request_id][len(r.output_token_ids):][:k])
            if nxt:
                nxt[-1] = (nxt[-1] + 1) % self.vocab
                out[r.request_id] = Draft(nxt)
                self.proposed += len(nxt)
        return out

    def release(self, request_id):
        pass


@pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton-graphs"])
def test_speculative_verify_steps_match_plain_decoding(v3, triton, monkeypatch):
    """Verify steps of 1 + 3 query tokens per sequence through the absorbed form (torch, or the
    Triton kernels in the static-buffer path, the fused launches for these small steps): accepted
    drafts and rolled-back ones give exactly plain greedy decoding's tokens."""
    import copy

    from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
    from tandem.engine.engine import LLMEngine
    from tandem.engine.model import TritonOps
    from tandem.engine.model_runner import ModelRunner

    model, tok = v3
    reqs = [{"prompt_token_ids": p, "max_tokens": 6, "ignore_eos": True, "request_id": f"r{i}"}
            for i, p in enumerate(PROMPTS[:3])]
    plain = [r["token_ids"] for r in _engine(model, tok).generate(reqs)]
    cfg = EngineConfig(model="test", cache=CacheConfig(block_size=8, num_blocks=64),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                       speculative=SpeculativeConfig(method="ngram", num_tokens=3, verify_token_cost=0.0,
                                                     max_verify_tokens=4096, probe_interval=1))
    proposer = _HalfRightProposer({f"r{i}": t for i, t in enumerate(plain)}, model.config.vocab_size)
    if triton:
        model = copy.deepcopy(model)
        model.ops = TritonOps()
    seen = _spy_fused_absorb(monkeypatch)
    e = LLMEngine(cfg, model=model, tokenizer=tok, proposer=proposer)
    if triton:
        e.runner = ModelRunner(model, e.kv_cache, "cpu", cuda_graphs=True, capture=False,
                               graph_batch_sizes=(1, 2, 4, 8), max_graph_tokens=32)
    assert [r["token_ids"] for r in e.generate(reqs)] == plain
    assert proposer.proposed > 0 and e.stats.accepted_draft_tokens > 0
    assert not triton or e.runner.graph_stats["replays"] > 0, "no verify step went through the static buffers"
    assert max(seen["steps"], default=0) == (4 if triton else 0), seen["steps"]  # verify steps fused
    assert len(seen["prepare_uk"]) == len(seen["steps"]) and not seen["merge_uv"]  # W_UV as torch.bmm (the default)
