"""Tests under tests/gpu need a CUDA GPU; on any other machine they are collected and skipped."""

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    # this hook sees the whole session's items, so mark only the ones in this folder
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(skip)
