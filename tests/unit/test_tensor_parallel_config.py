"""Per-pool tensor parallelism in the cluster config: a pool's own size or the model section's,
through YAML and `config_to_dict`; refusals before anything starts (a size the model's KV heads
cannot split); pools of different sizes are served, their KV resharded by head."""

from __future__ import annotations

import pytest

from tandem.cluster.bootstrap import check_tensor_parallel
from tandem.cluster.config import config_to_dict, load_config
from tandem.cluster.launch import up_detached
from tandem.wire.errors import ConfigError

COLOCATED = {"model.name": "tiny-random", "prefill.replicas": 0}


def test_each_pool_takes_its_own_size_or_the_models(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {name: tiny-random, tensor_parallel_size: 2}\nprefill: {tensor_parallel_size: 1}\n")
    cfg = load_config(path)
    assert cfg.engine_for("prefill").tensor_parallel_size == 1
    assert cfg.engine_for("decode").tensor_parallel_size == 2
    again = load_config(None, {"model.tensor_parallel_size": config_to_dict(cfg)["model"]["tensor_parallel_size"],
                               "prefill.tensor_parallel_size": 1})
    assert again.engine_for("decode").tensor_parallel_size == 2 and again.engine_for("prefill").tensor_parallel_size == 1


def test_bad_sizes_and_layouts_are_refused_by_name():
    with pytest.raises(ConfigError, match="pool: tensor_parallel_size must be an integer >= 1"):
        load_config(None, {"decode.tensor_parallel_size": 0})
    with pytest.raises(ConfigError, match="tensor_parallel_size 4 does not divide the 2 KV heads of model 'tiny-random'"):
        check_tensor_parallel(load_config(None, {**COLOCATED, "decode.tensor_parallel_size": 4}))
    with pytest.raises(ConfigError, match="tensor_parallel_size 4 does not divide the 2 KV heads"):
        check_tensor_parallel(load_config(None, {"model.name": "tiny-random", "prefill.tensor_parallel_size": 4}))
    check_tensor_parallel(load_config(None, {**COLOCATED, "decode.tensor_parallel_size": 2}))
    # a prefill pool and a decode pool of different sizes: the KV is resharded by head
    check_tensor_parallel(load_config(None, {"model.name": "tiny-random", "decode.tensor_parallel_size": 2}))
    check_tensor_parallel(load_config(None, {"model.name": "tiny-random", "prefill.tensor_parallel_size": 2,
                                             "roles.enabled": True, "router.placement": "cost"}))


def test_a_detached_up_refuses_sizes_the_kv_heads_cannot_split_before_anything_starts(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")      # nothing listens there: nothing may be reached
    with pytest.raises(ConfigError, match="tensor_parallel_size 4 does not divide the 2 KV heads"):
        up_detached(None, load_config(None, {"model.name": "tiny-random", "decode.tensor_parallel_size": 4}))
