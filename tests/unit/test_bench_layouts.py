"""bench/disagg_vs_colocated.py's cluster configs: the two headline modes, and --layouts for the
pool-ratio sweep (P:D splits, 0:N colocated) that `tandem up` is started with."""

import math
from types import SimpleNamespace

import pytest

from bench.disagg_vs_colocated import mode_configs


def _args(**kw):
    base = dict(device="cuda", model="llama3-8b-random", chunk=8192, max_num_seqs=64, speculative="ngram",
                num_blocks=0, gpus=2, prefill=0, threshold=256, layouts="")
    return SimpleNamespace(**{**base, **kw})


def test_two_modes_split_the_gpus():
    c = mode_configs(_args())
    assert (c["disaggregated"]["prefill"]["replicas"], c["disaggregated"]["decode"]["replicas"]) == (1, 1)
    assert c["disaggregated"]["decode"]["local_prefill_threshold"] == 256
    assert (c["colocated"]["prefill"]["replicas"], c["colocated"]["decode"]["replicas"]) == (0, 2)
    assert math.isinf(c["colocated"]["decode"]["local_prefill_threshold"])
    assert c["colocated"]["decode"]["num_gpus"] == 1 and c["colocated"]["model"]["dtype"] == "bfloat16"


def test_layouts_give_one_config_per_split():
    c = mode_configs(_args(layouts="1:3,2:2,3:1,0:4"))
    assert list(c) == ["1P:3D", "2P:2D", "3P:1D", "colocated x4"]
    assert [(v["prefill"]["replicas"], v["decode"]["replicas"]) for v in c.values()] == [(1, 3), (2, 2), (3, 1), (0, 4)]
    assert c["3P:1D"]["decode"]["local_prefill_threshold"] == 256
    assert math.isinf(c["colocated x4"]["decode"]["local_prefill_threshold"])
    with pytest.raises(SystemExit, match="P:D"):
        mode_configs(_args(layouts="2:0"))
