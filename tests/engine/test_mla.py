"""Latent attention (engine.mla) against transformers' deepseek_v2/v3 on tiny random checkpoints
(tests/engine/mla_models.py): logits within tolerance through both forms (a short prompt takes
the absorbed form, a long one the expanded form), greedy tokens equal to transformers' `generate`
in fp32 with chunked prefill, decode in a batch and a prefix-cache hit; the two forms against each
other; the latent cache's shape and its block moves; the config's round trip and refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.engine.architectures import UnsupportedModelError, config_from_hf
from tandem.engine.attention import BATCHED_MAX_QUERY_LEN
from tandem.engine.build import build_model, random_fill
from tandem.engine.config import PRESETS, EngineConfig, SpeculativeConfig
from tandem.engine.kv_cache import KVCache
from tandem.engine.mla import check_engine_config
from tandem.engine.parallel.sharding import check_shardable
from tandem.wire.errors import ConfigError
from tests.engine.families import hf_greedy
from tests.engine.mla_models import VERSIONS, build_deepseek_dir
from tests.engine.test_model_vs_hf import _close, _our_logits

every_version = pytest.mark.parametrize("version", list(VERSIONS))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """version -> (directory, our model, our tokenizer, transformers' model), built once."""
    from tandem.engine.weights import load_model

    built = {}

    def get(version):
        if version not in built:
            path = tmp_path_factory.mktemp(f"tiny-deepseek-{version}")
            hf = build_deepseek_dir(version, path, moe=True)  # layer 0 dense, layer 1 MoE
            model, tok, _ = load_model(str(path))
            built[version] = (path, model, tok, hf)
        return built[version]

    return get


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@every_version
@pytest.mark.parametrize("n", [40, 90])  # absorbed (<= BATCHED_MAX_QUERY_LEN tokens), expanded
@torch.inference_mode()
def test_logits_match_transformers(version, n, deepseek, make_engine):
    _, model, tok, hf = deepseek(version)
    assert (n <= BATCHED_MAX_QUERY_LEN) == (n == 40)
    ids = _prompt(n, 1)  # 90: past V3's YaRN original context (32)
    _close(_our_logits(make_engine, model, tok, ids), hf(torch.tensor([ids])).logits[0].float())


@every_version
def test_greedy_batch_matches_transformers(version, deepseek, make_engine):
    """Three prompts in one batch (chunked prefill of the longest, then decode together), 16 tokens
    each; then the longest again with a longer one: its blocks come from the prefix cache and the
    rest prefills in the expanded form."""
    _, model, tok, hf = deepseek(version)
    e = make_engine(model, tok, max_num_batched_tokens=32)
    prompts = [_prompt(n, seed) for seed, n in enumerate((5, 23, 41))]
    results = e.generate([{"prompt_token_ids": p, "max_tokens": 16, "ignore_eos": True} for p in prompts])
    for p, res in zip(prompts, results):
        assert res["token_ids"] == hf_greedy(hf, p, 16, eos=None), f"{version}, prompt of {len(p)}"
    e = make_engine(model, tok)
    long = prompts[2] + _prompt(80, 7)
    e.generate([{"prompt_token_ids": long[:48], "max_tokens": 4, "ignore_eos": True}])
    res = e.generate([{"prompt_token_ids": long, "max_tokens": 8, "ignore_eos": True}])[0]
    assert e.allocator.prefix_hits == 48  # three blocks of the first request's prompt
    assert res["token_ids"] == hf_greedy(hf, long, 8, eos=None)


@torch.inference_mode()
def test_absorbed_and_expanded_forms_agree(deepseek, make_engine):
    """The same step through both forms: a decode token after a prefix gives the same output."""
    _, model, tok, _ = deepseek("v3")
    e = make_engine(model, tok)
    req = e.add_request("x", prompt_token_ids=_prompt(20, 3))
    batch = e.runner.prepare(e.scheduler.schedule())
    x = torch.randn(20, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    attn = model.layers[0].self_attn
    cache = e.kv_cache.tensor
    attn._attend(x, batch.positions, model.rotary.cos_sin, cache, batch.meta, kernel=None)
    q_nope, q_pe = attn.project(x)[0].split([attn.nope, attn.rope], dim=-1)
    from tandem.engine.mla import apply_latent_rope

    q_pe = apply_latent_rope(q_pe, batch.positions, model.rotary.cos_sin, attn.interleave)
    layer_cache = cache[0, 0]
    absorbed = attn._absorbed(q_nope, q_pe, layer_cache, batch.meta, None)
    expanded = attn._expanded(q_nope, q_pe, layer_cache, batch.meta)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-4, atol=1e-5)
    e.abort(req.request_id)


def test_latent_cache_shape_and_block_moves(deepseek):
    _, model, _, _ = deepseek("v2")
    cfg = model.config
    shape = model.kv_cache_shape(6, 4)
    assert shape == (cfg.num_layers, 1, 6, 4, 1, 32 + 8)
    assert cfg.kv_bytes_per_token == cfg.num_layers * 40  # one latent + rope vector per layer
    src, dst = KVCache(shape, torch.float32, "cpu"), KVCache(shape, torch.float32, "cpu")
    src.tensor.copy_(torch.randn(shape))
    assert src.bytes_per_block == cfg.num_layers * 4 * 40 * 4
    data = src.gather_layers(range(0, cfg.num_layers), [1, 4])
    assert data.shape == (cfg.num_layers, *src.block_payload_shape(2)) == (cfg.num_layers, 1, 2, 4, 1, 40)
    dst.scatter_layers(range(0, cfg.num_layers), [0, 5], data)
    assert torch.equal(dst.tensor[:, :, [0, 5]], src.tensor[:, :, [1, 4]])


@every_version
def test_config_round_trip(version, deepseek):
    path, model, _, _ = deepseek(version)
    cfg = model.config
    assert cfg.mla is not None and cfg.num_kv_heads == cfg.num_heads and cfg.head_dim == 16 + 8
    assert config_from_hf(cfg.to_hf()) == cfg


def test_refusals(deepseek):
    _, model, _, _ = deepseek("v3")
    hf = model.config.to_hf()

    def refused(match, **change):
        with pytest.raises(UnsupportedModelError, match=match):
            config_from_hf({**hf, **change})

    refused("rope_scaling type 'dynamic'", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    refused("num_key_value_heads=2", num_key_value_heads=2)
    refused("quantization_config", quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"})
    refused("moe_layer_freq=2", n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            first_k_dense_replace=1, moe_layer_freq=2)
    refused("scoring_func='softmax' with topk_method='noaux_tc'", n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, first_k_dense_replace=1, scoring_func="softmax", topk_method="noaux_tc")
    v2 = {**hf, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "n_routed_experts": 8,
          "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
          "scoring_func": "softmax", "topk_method": "greedy"}
    with pytest.raises(UnsupportedModelError, match="norm_topk_prob=true"):
        config_from_hf({**v2, "norm_topk_prob": True})
    with pytest.raises(ConfigError, match="latent-attention"):
        check_shardable(dataclasses.replace(model.config, moe=None), 2, "tiny-v3")
    with pytest.raises(ConfigError, match="fp8 with latent attention"):
        build_model(dataclasses.replace(model.config, moe=None), "cpu", torch.float32, random_fill(0, "cpu"), fp8=True)
    with pytest.raises(ConfigError, match="tree drafts"):
        check_engine_config(model.config, EngineConfig(speculative=SpeculativeConfig(method="suffix",
                                                                                     suffix_tree_nodes=8)))
    with pytest.raises(ValueError, match="rope_scaling type 'dynamic'"):
        from tandem.engine.mla import latent_rope

        latent_rope(dataclasses.replace(model.config, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))


def test_deepseek_v2_lite_preset_counts():
    """15.7B parameters, 2.4B active per token (V2-Lite's published figures), on the meta device;
    the latent cache is 27 x 576 elements a token."""
    from tandem.engine.model import LlamaForCausalLM

    cfg = PRESETS["deepseek-v2-lite-random"]
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions=16)
    total = sum(p.numel() for p in model.parameters())
    m = cfg.moe
    per_expert = 3 * cfg.hidden_size * m.intermediate_size
    routed_total = per_expert * m.num_experts * (cfg.num_layers - 1)
    active = total - routed_total + per_expert * m.top_k * (cfg.num_layers - 1) - cfg.vocab_size * cfg.hidden_size
    assert abs(total / 15.7e9 - 1) < 0.01, total
    assert abs(active / 2.4e9 - 1) < 0.03, active  # the embedding lookup not counted
    assert cfg.kv_bytes_per_token == 27 * 576
    assert config_from_hf(cfg.to_hf()) == cfg


# DeepSeek-V2-Lite's config.json as the Hub has it (rope_scaling with "type", keys the engine ignores)
V2_LITE_HUB = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "ep_size": 1,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 1.0,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "scoring_func": "softmax", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "greedy", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 102400}


def test_v2_lite_hub_config_reads_as_the_preset():
    assert config_from_hf(V2_LITE_HUB) == PRESETS["deepseek-v2-lite-random"]


@torch.inference_mode()
def test_a_v3_checkpoint_with_its_multi_token_prediction_layer_loads_and_leaves_it_unread(
        tmp_path, make_engine, monkeypatch):
    """Real DeepSeek-V3 checkpoints ship layer num_hidden_layers (the MTP module: enorm, hnorm,
    eh_proj, a whole decoder layer, its own embedding and head) under config.json's
    num_nextn_predict_layers. It loads, its tensors are never read, and the logits are
    transformers' (whose DeepseekV3ForCausalLM drops them too); one layer past it is refused."""
    from safetensors.torch import save_file

    from tandem.engine import build
    from tandem.engine.weights import load_model

    hf = build_deepseek_dir("v3", tmp_path, moe=True)
    layers, h = hf.config.num_hidden_layers, hf.config.hidden_size
    assert hf.config.num_nextn_predict_layers == 1  # transformers' default for V3
    p = f"model.layers.{layers}."
    mtp = {p + "enorm.weight": torch.ones(h), p + "hnorm.weight": torch.ones(h),
           p + "eh_proj.weight": torch.randn(h, 2 * h), p + "embed_tokens.weight": torch.randn(256, h),
           p + "shared_head.head.weight": torch.randn(256, h), p + "self_attn.kv_a_proj_with_mqa.weight":
           torch.randn(40, h), p + "mlp.experts.0.down_proj.weight": torch.randn(h, 32)}
    save_file(mtp, str(tmp_path / "model-mtp.safetensors"))
    read = []
    real = build.CheckpointReader.get
    monkeypatch.setattr(build.CheckpointReader, "get", lambda self, name: read.append(name) or real(self, name))
    model, tok, cfg = load_model(str(tmp_path))
    assert cfg.mtp_layers == 1 and read and not any(n.startswith(p) for n in read)
    ids = _prompt(40, 3)
    _close(_our_logits(make_engine, model, tok, ids), hf(torch.tensor([ids])).logits[0].float())
    assert config_from_hf(cfg.to_hf()) == cfg

    save_file({f"model.layers.{layers + 1}.enorm.weight": torch.ones(h)}, str(tmp_path / "model-extra.safetensors"))
    with pytest.raises(UnsupportedModelError, match=rf"model-extra.safetensors: tensor 'model.layers.{layers + 1}"
                                                    r"\.enorm\.weight' is not used by DeepseekV3ForCausalLM"):
        load_model(str(tmp_path))
    (tmp_path / "model-extra.safetensors").unlink()
    config = (tmp_path / "config.json").read_text().replace('"num_nextn_predict_layers": 1',
                                                           '"num_nextn_predict_layers": 0')
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(UnsupportedModelError, match=f"tensor '{p}"):  # no MTP layer declared
        load_model(str(tmp_path))
