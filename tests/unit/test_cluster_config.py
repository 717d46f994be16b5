"""cluster.config: pool settings that shape the request path, from YAML and from flags."""

from __future__ import annotations

import math

import pytest

from cluster.config import load_config
from engine.config import ConfigError


def test_prefill_queue_limit_from_yaml_and_overrides(tmp_path):
    assert math.isinf(load_config(None).prefill.max_queued_tokens)   # default: always remote
    path = tmp_path / "c.yaml"
    path.write_text("prefill: {replicas: 2, max_queued_tokens: 16384}\n")
    assert load_config(path).prefill.max_queued_tokens == 16384
    assert load_config(path, {"prefill.max_queued_tokens": 4096}).prefill.max_queued_tokens == 4096
    path.write_text("prefill: {max_queued_tokens: .inf}\n")
    assert math.isinf(load_config(path).prefill.max_queued_tokens)
    with pytest.raises(ConfigError, match="max_queued_tokens must be > 0"):
        load_config(None, {"prefill.max_queued_tokens": 0})
