"""cluster.config: pool settings that shape the request path, from YAML and from flags."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from tandem.cluster.config import load_config
from tandem.wire.errors import ConfigError


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


def test_kv_transfer_section_from_yaml_and_overrides(tmp_path):
    cfg = load_config(None).kv_transfer
    assert cfg.direct_copy and cfg.unix_frames and cfg.start_timeout_s == 600.0
    path = tmp_path / "c.yaml"
    path.write_text("kv_transfer: {direct_copy: false, timeout_s: 10}\n")
    cfg = load_config(path).kv_transfer
    assert not cfg.direct_copy and cfg.timeout_s == 10 and cfg.start_timeout_s == 600.0
    assert load_config(None, {"kv_transfer.direct_copy": False}).kv_transfer.direct_copy is False
    with pytest.raises(ConfigError, match="timeout_s must be > 0"):
        load_config(None, {"kv_transfer.timeout_s": 0})
    path.write_text("kv_transfer: {direct: false}\n")
    with pytest.raises(ConfigError, match="unknown key.*direct_copy"):
        load_config(path)


def test_the_config_and_the_cli_s_help_load_neither_torch_nor_ray():
    """`tandem --help`, `status`, `simulate` and the config's readers stay light: KVTransferConfig
    lives in the torch-free kv_transfer.config, and Ray loads only when a cluster starts."""
    code = ("import sys, contextlib\nimport tandem.cluster.config\nfrom tandem.cluster.cli import main\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(None):\n    main(['--help'])\n"
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_adaptive_layout_config_and_its_refusals():
    from tandem.cluster.config import ADAPTIVE
    cfg = load_config(None, {**ADAPTIVE, "decode.replicas": 3, "prefill.replicas": 0})
    assert cfg.roles.enabled and cfg.router.placement == "cost" and cfg.decode.role == "mixed"
    assert cfg.decode.local_prefill_threshold == 0
    with pytest.raises(ConfigError, match="router.placement: cost"):
        load_config(None, {"roles.enabled": True})
    with pytest.raises(ConfigError, match="role must be"):
        load_config(None, {"decode.role": "both"})
    with pytest.raises(ConfigError, match="placement must be"):
        load_config(None, {"router.placement": "magic"})
    with pytest.raises(ConfigError, match="period_s"):
        load_config(None, {"roles.period_s": 0})


def test_max_expected_wait_s_is_a_router_key():
    """Defect (issue 27): the documented key was refused by the loader."""
    from tandem.cluster.config import load_config
    from tandem.wire.errors import ConfigError

    assert load_config(None, {"router.max_expected_wait_s": 4.5}).router.max_expected_wait_s == 4.5
    assert load_config(None, {}).router.max_expected_wait_s == 15.0
    with pytest.raises(ConfigError, match="max_expected_wait_s"):
        load_config(None, {"router.max_expected_wait_s": -1})


def test_a_cluster_that_could_never_decode_is_refused():
    with pytest.raises(ConfigError, match="no worker would decode: the decode pool's replicas are 0"):
        load_config(None, {"decode.replicas": 0})
    with pytest.raises(ConfigError, match="no worker would decode"):   # a prefill pool prefills only
        load_config(None, {"decode.replicas": 0, "prefill.replicas": 4})
    assert load_config(None, {"decode.replicas": 0, "autoscaler.enabled": True}).autoscale   # the autoscaler keeps decode_min
    assert load_config(None, {"decode.replicas": 0, "prefill.replicas": 2, "prefill.role": "mixed"})
    assert load_config(None, {"prefill.replicas": 0}).decode.replicas == 1   # colocated: decode workers only


def test_a_config_file_that_cannot_be_read_or_parsed_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read .*missing.yaml: No such file or directory"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("router:\n  port: [1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml is not valid YAML: .*\(line \d+\)"):
        load_config(bad)
