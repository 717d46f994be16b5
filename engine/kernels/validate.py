"""Argument checks shared by the kernel wrappers: each raises ValueError naming the argument and
what was expected, so a bad call fails in Python instead of reading or writing the wrong memory."""

from __future__ import annotations

import torch
from triton.runtime.jit import JITFunction

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def require_tensor(name: str, t: object, *, ndim: int, dtypes: tuple[torch.dtype, ...],
                   last_dim_contiguous: bool = True) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {t.dtype}")
    if last_dim_contiguous and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    return t


def require_same(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor, *,
                 shape: bool = False, dtype: bool = True) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")
    if dtype and t.dtype != ref.dtype:
        raise ValueError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}")
    if shape and t.shape != ref.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)} but {ref_name} has {tuple(ref.shape)}")


def require_runnable(t: torch.Tensor, kernel: object) -> None:
    """Compiled kernels need CUDA tensors; the interpreter (TRITON_INTERPRET=1) takes CPU tensors."""
    interpreted = not isinstance(kernel, JITFunction)
    if t.device.type != "cuda" and not interpreted:
        raise ValueError(f"Triton kernels need CUDA tensors (got {t.device}); on CPU set "
                         "TRITON_INTERPRET=1 before triton is first imported, or use the torch path")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
