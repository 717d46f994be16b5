"""Triton kernels of the GPU path: paged attention, KV-cache writes, and the fused elementwise ops.

Each kernel has one Python wrapper next to it that checks dtype, shape and strides (ValueError on
bad input) and launches it; every wrapper has a plain-torch reference it is tested against
(`engine.attention` for attention and KV writes). Import the wrappers from their modules:

    from tandem.engine.kernels.paged_attention import paged_attention
    from tandem.engine.kernels.kv_write import write_kv
    from tandem.engine.kernels.fused import rms_norm, rotary_embedding, silu_and_mul

This package itself imports no Triton, so `triton_available()` is safe to call anywhere.
On a machine without CUDA the kernels run under Triton's interpreter when `TRITON_INTERPRET=1` is set
before triton is first imported in the process (Triton 3.9 fixes the mode of its own library
functions at import); that is how the kernel tests run on CPU.
"""

from __future__ import annotations

import os

import torch


def triton_available() -> bool:
    """True when the kernels can run here: there is a CUDA GPU or the interpreter is on
    (`TRITON_INTERPRET=1`), and Triton imports. Imports triton only in those two cases."""
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"):
        return False
    try:
        import triton  # noqa: F401, PLC0415 (triton loads only where kernels run)
    except ImportError:
        return False
    return True
