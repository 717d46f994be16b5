"""engine.moe against transformers' own MoE blocks on the same weights, in fp32: Qwen3-MoE's
(softmax top-k, renormalised), DeepSeek-V2's (softmax, greedy and group-limited top-k, routed
scaling, shared experts) and DeepSeek-V3's (sigmoid scores, bias-corrected grouped top-k,
renormalised and scaled). Plus which layers are sparse, the `qwen3-30b-a3b-random` preset's
parameter counts on the meta device, and the refusals (FP8, tensor parallelism, a broken
checkpoint). Whole-model parity is test_families.py's `qwen3_moe` family."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file
import torch
import transformers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from tandem.engine.architectures import UnsupportedModelError, config_from_hf
from tandem.engine.config import PRESETS, ModelConfig, MoEConfig
from tandem.engine.model import LlamaForCausalLM, TritonOps
from tandem.engine.moe import MLP, SparseMoE, build_mlp
from tandem.engine.parallel.sharding import check_shardable
from tandem.engine.build import build_model, random_fill
from tandem.engine.weights import hf_state_dict, load_model, resolve_model_dir
from tandem.wire.errors import ConfigError
from tests.engine.families import build_family_dir

H, I, E = 64, 16, 8  # noqa: E741 (the experts' width, as in the papers)


def _ours(moe: MoEConfig) -> SparseMoE:
    cfg = ModelConfig(vocab_size=32, hidden_size=H, intermediate_size=48, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, moe=moe)
    return SparseMoE(cfg)


def _copy_from_hf(ours: SparseMoE, hf: torch.nn.Module, seed: int) -> None:
    """Redraw transformers' block (its init leaves the router and bias at 0), copy it into ours."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.state_dict().items():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if "bias" in name else p.shape[-1] ** -0.5))
        sd = hf.state_dict()
        ours.gate.weight.copy_(sd["gate.weight"])
        if ours.gate.e_score_correction_bias is not None:
            ours.gate.e_score_correction_bias.copy_(sd["gate.e_score_correction_bias"])
        ours.w13.copy_(sd["experts.gate_up_proj"])
        ours.w2.copy_(sd["experts.down_proj"])
        if ours.shared_experts is not None:
            s = "shared_experts."
            ours.shared_experts.gate_up_proj.weight.copy_(torch.cat([sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"]]))
            ours.shared_experts.down_proj.weight.copy_(sd[s + "down_proj.weight"])


def _hf_blocks():
    common = dict(hidden_size=H, moe_intermediate_size=I, num_experts_per_tok=3)
    v2 = dict(common, n_routed_experts=E, n_shared_experts=2, routed_scaling_factor=2.5)
    return {
        "qwen3": (Qwen3MoeSparseMoeBlock(transformers.Qwen3MoeConfig(**common, num_experts=E, norm_topk_prob=True)),
                  MoEConfig(num_experts=E, top_k=3, intermediate_size=I, norm_topk_prob=True)),
        "v2-greedy": (DeepseekV2Moe(transformers.DeepseekV2Config(**v2, topk_method="greedy")),
                      MoEConfig(num_experts=E, top_k=3, intermediate_size=I, num_shared_experts=2,
                                routed_scaling_factor=2.5)),
        "v2-group-limited": (DeepseekV2Moe(transformers.DeepseekV2Config(**v2, topk_method="group_limited_greedy",
                                                                        n_group=4, topk_group=2)),
                             MoEConfig(num_experts=E, top_k=3, intermediate_size=I, num_shared_experts=2,
                                       topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                       routed_scaling_factor=2.5)),
        "v3-noaux-tc": (DeepseekV3MoE(transformers.DeepseekV3Config(**dict(v2, n_shared_experts=1), n_group=4, topk_group=2,
                                                                   norm_topk_prob=True)),
                        MoEConfig(num_experts=E, top_k=3, intermediate_size=I, num_shared_experts=1, scoring="sigmoid",
                                  topk_method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
                                  routed_scaling_factor=2.5)),
    }


@pytest.mark.parametrize("kind", ["qwen3", "v2-greedy", "v2-group-limited", "v3-noaux-tc"])
@torch.inference_mode()
def test_block_matches_transformers(kind):
    hf, moe = _hf_blocks()[kind]
    ours = _ours(moe)
    _copy_from_hf(ours, hf.float().eval(), seed=len(kind))
    x = torch.randn(1, 37, H, generator=torch.Generator().manual_seed(1))
    want = hf(x)[0]
    got = ours(x[0])
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
    # the group restriction matters on these inputs: plain top-k would choose other experts
    if moe.topk_method != "greedy":
        method = "greedy" if moe.topk_method == "group_limited_greedy" else moe.topk_method
        plain = _ours(MoEConfig(**{**moe.__dict__, "topk_method": method, "n_group": 1, "topk_group": 1}))
        plain.load_state_dict(ours.state_dict())
        assert not torch.allclose(plain(x[0]), want, atol=1e-4)


def test_the_score_bias_stays_fp32_in_a_bf16_model():
    moe = MoEConfig(num_experts=E, top_k=2, intermediate_size=I, scoring="sigmoid", topk_method="noaux_tc",
                    n_group=4, topk_group=2)
    cfg = ModelConfig(vocab_size=32, hidden_size=H, intermediate_size=48, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, moe=moe)
    model = build_model(cfg, "cpu", torch.bfloat16, random_fill(0, "cpu"))  # the serving path: meta, then filled
    gate = model.layers[0].mlp.gate
    assert gate.weight.dtype == torch.bfloat16 and gate.e_score_correction_bias.dtype == torch.float32
    assert gate.e_score_correction_bias.abs().sum() > 0
    bias = hf_state_dict(model)["model.layers.0.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and torch.equal(bias, gate.e_score_correction_bias.detach())
    block = SparseMoE(cfg)  # an fp32 block cast to bf16 keeps the bias's fp32 values, not bf16-rounded ones
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(torch.linspace(0, 1, E) + 1e-4)
    want = block.gate.e_score_correction_bias.detach().clone()
    assert torch.equal(block.to(torch.bfloat16).gate.e_score_correction_bias, want)


@pytest.mark.parametrize("kind,tokens", [("v3-noaux-tc", 9), ("v2-group-limited", 1)])
@torch.inference_mode()
def test_fused_path_matches_the_torch_path_with_shared_experts(kind, tokens):
    """forward_fused (the CUDA path: the routing kernel, the grouped GEMM at 9 tokens or the GEMV
    path at 1, the shared experts' output added in the last launch), under the interpreter, equals
    forward on DeepSeek-style blocks."""
    hf, moe = _hf_blocks()[kind]
    ours = _ours(moe)
    _copy_from_hf(ours, hf.float().eval(), seed=5)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(2))
    got = ours.forward_fused(x, TritonOps())
    assert torch.allclose(got, ours(x), rtol=1e-5, atol=1e-6)


def test_sparse_layers_follow_the_config():
    def layers(**moe_keys):
        hf = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 32, "hidden_size": H, "intermediate_size": 48,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "num_experts": E, "num_experts_per_tok": 2, "moe_intermediate_size": I, **moe_keys}
        cfg = config_from_hf(hf)
        return [type(build_mlp(cfg, i)).__name__ for i in range(4)]

    assert layers() == ["SparseMoE"] * 4
    assert layers(decoder_sparse_step=2) == ["MLP", "SparseMoE", "MLP", "SparseMoE"]
    assert layers(mlp_only_layers=[0, 3]) == ["MLP", "SparseMoE", "SparseMoE", "MLP"]
    back = config_from_hf(config_from_hf({**json.loads(json.dumps(_tiny_qwen3_moe_hf())), "mlp_only_layers": [1]}).to_hf())
    assert back.moe.dense_layers == (1,) and back.moe.norm_topk_prob and back.architecture == "Qwen3MoeForCausalLM"


def _tiny_qwen3_moe_hf():
    return {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 32, "hidden_size": H, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_local_experts": E, "num_experts_per_tok": 2, "moe_intermediate_size": I, "norm_topk_prob": True}


def test_qwen3_30b_a3b_preset_has_the_published_parameter_counts():
    cfg = PRESETS["qwen3-30b-a3b-random"]
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    per_expert = 3 * cfg.moe.intermediate_size * cfg.hidden_size
    idle = sum(isinstance(layer.mlp, SparseMoE) for layer in model.layers) * (cfg.moe.num_experts - cfg.moe.top_k)
    active = total - idle * per_expert
    assert abs(total / 30.53e9 - 1) < 0.005, total  # Qwen: 30.5B total, 3.3B activated
    assert abs(active / 3.35e9 - 1) < 0.01, active
    assert all(isinstance(layer.mlp, SparseMoE) for layer in model.layers) and not isinstance(model.layers[0].mlp, MLP)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    build_family_dir("qwen3_moe", path)
    return path


def _broken(tiny_dir, tmp_path, config=None, drop=None):
    dst = tmp_path / "broken"
    shutil.copytree(tiny_dir, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    if drop:
        tensors = load_file(str(dst / "model.safetensors"))
        del tensors[drop]
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("config,drop,message", [
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}, None,
     "FP8 quantization_config with mixture-of-experts layers is not implemented for Qwen3MoeForCausalLM"),
    ({"shared_expert_intermediate_size": 64}, None, "shared_expert_intermediate_size=64 is not implemented"),
    (None, "model.layers.0.mlp.experts.5.up_proj.weight", "'model.layers.0.mlp.experts.5.up_proj.weight' that "
                                                          "Qwen3MoeForCausalLM needs is missing"),
])
def test_checkpoint_refusals_name_the_thing(tiny_dir, tmp_path, config, drop, message):
    with pytest.raises(UnsupportedModelError, match=message):
        resolve_model_dir(str(_broken(tiny_dir, tmp_path, config, drop)))


def test_fp8_and_tensor_parallel_are_refused(tiny_dir):
    with pytest.raises(ConfigError, match="quantization fp8 with mixture-of-experts layers"):
        load_model(str(tiny_dir), quantization="fp8")
    cfg = resolve_model_dir(str(tiny_dir)) and config_from_hf(json.loads((tiny_dir / "config.json").read_text()))
    with pytest.raises(ConfigError, match="tensor_parallel_size 2 with the mixture-of-experts model"):
        check_shardable(cfg, 2, str(tiny_dir))
    with pytest.raises(ConfigError, match="topk_method 'softmax_tc' is not implemented"):
        MoEConfig(num_experts=E, top_k=2, intermediate_size=I, topk_method="softmax_tc")
