"""engine.kernels.l2_prefetch's plan (pure logic): which bytes of a layer's weights a prefetch
covers under an L2 budget, and a mode it does not know is refused by name."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.kernels import l2_prefetch


def test_whole_weights_first_then_whole_rows_of_the_next():
    o = torch.empty(64, 32, dtype=torch.bfloat16)  # 4096 bytes
    gate_up = torch.empty(256, 32, dtype=torch.bfloat16)  # 64-byte rows
    p = l2_prefetch.plan([o, gate_up], 4096 + 1000)
    assert [(w is o, n) for w, n in p.parts] == [(True, 4096), (False, 960)]  # 15 rows of 64 bytes
    assert p.nbytes == 4096 + 960


def test_a_budget_below_the_first_weight_takes_its_first_rows_only():
    o = torch.empty(64, 32, dtype=torch.float8_e4m3fn)  # 32-byte rows
    p = l2_prefetch.plan([o, torch.empty(8, 8)], 100)
    assert [(w is o, n) for w, n in p.parts] == [(True, 96)]


def test_a_budget_over_everything_takes_everything_once():
    a, b = torch.empty(4, 4), torch.empty(2, 8)
    assert [n for _, n in l2_prefetch.plan([a, b], 10**9).parts] == [64, 64]
    assert l2_prefetch.plan([a, b], 0).parts == []


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="'sideways'"):
        l2_prefetch.prefetch(torch.empty(4), 16, "sideways")


def test_off_issues_nothing_even_for_a_cpu_tensor():
    l2_prefetch.prefetch(torch.empty(4), 16, "off")  # no launch, no error
