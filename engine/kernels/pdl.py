"""Programmatic dependent launch (PDL, Hopper on) for the small kernels of a decode step.

A batch-1 decode step is ~300 kernel launches of a few microseconds each, and each boundary costs
the next kernel's launch and ramp after the previous one ends. A kernel launched with PDL may be
scheduled while the kernel before it still runs: it calls `enter` first, which waits
(`griddepcontrol.wait`) until the kernel before has finished and its writes are visible, then lets
the kernel after it be scheduled in turn (`griddepcontrol.launch_dependents`). So a chain of PDL
launches (norm, rotary + KV write, decode attention, merge, SiLU, and engine.kernels.gemv's GEMVs,
which load a weight tile before their wait; for latent attention and mixtures of experts, the
prepare, decode, merge and W_UV kernels of engine.kernels.mla_prepare / mla_decode and the three
launches of engine.kernels.moe_decode) overlaps each kernel's launch with the one before it.
A kernel that reads nothing another wrote before `enter` is always safe; every kernel here calls it
before any load.

`ENABLED` switches it for the small kernels: True or False where set (benchmarks compare;
TANDEM_PDL=1 or 0 in the environment sets it for a process), None (the default) leaves it to each
forward, which the model runs under `auto(on)`: on for models with FP8 projection weights, and for
a 16-bit model's one-token steps (engine.model's `_kernel_launches`). CUDA graphs record the
launches in force at capture.

A kernel of few programs may `release` the kernel after it before it waits itself (the split
decode attention's merge does, `SplitPolicy.early_release`): the o projection's GEMV is then
scheduled while the attention still runs on a few SMs, and loads its first weight tile there. On the H200 (docs/benchmarks.md,
issues 23 and 24) it took the 8B FP8 batch-1 step from 2.78 to 2.59 ms (with FP8 GEMVs prefetching
their first tile, engine.kernels.gemv), left bf16's at 1k context as it was, and made the bf16
batch-1 step at 8k context 5% slower (4.70 against 4.45-4.48 ms decode-only, two runs each), which
was not taken apart. engine.kernels.gemv has its own modes (`gemv.PDL`, `gemv.PDL_FP8`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import triton
import triton.language as tl

ENABLED: bool | None = {"1": True, "0": False}.get(os.environ.get("TANDEM_PDL", ""))
_HOPPER: dict[torch.device, bool] = {}
# what `auto` set for the forward running now (per thread: two engines of a process may step at once)
_auto: ContextVar[bool] = ContextVar("tandem_pdl_auto", default=False)


def on() -> bool:
    """Whether the small kernels launched now are PDL launches (where the device supports it)."""
    return ENABLED if ENABLED is not None else _auto.get()


@contextmanager
def auto(enable: bool) -> Iterator[None]:
    """The launches inside run with PDL `enable`d, unless ENABLED says otherwise."""
    token = _auto.set(enable)
    try:
        yield
    finally:
        _auto.reset(token)


def supported(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched with PDL (a CUDA GPU of compute capability 9+)."""
    if device.type != "cuda":
        return False
    ok = _HOPPER.get(device)
    if ok is None:
        ok = _HOPPER[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return ok


def launch_options(device: torch.device, allowed: bool = True) -> dict:
    """Keyword arguments for a small kernel's launch: its USE_PDL constexpr, and Triton's
    launch_pdl where PDL is on. `allowed`: the kernel's own switch (False: a plain launch)."""
    use = allowed and on() and supported(device)
    return {"USE_PDL": use, "launch_pdl": True} if use else {"USE_PDL": False}


@triton.jit
def enter(USE_PDL: tl.constexpr):
    """First thing in a kernel launched by launch_options: wait for the kernel before, then let the
    one after be scheduled."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def release(USE_PDL: tl.constexpr, EARLY: tl.constexpr):
    """`EARLY`: let the kernel after this one be scheduled before this one waits (then
    `enter_released` instead of `enter`). Safe: that kernel's own wait returns only once this one
    has finished, which is after this one's wait returned. Only for a kernel of few programs, so
    that the next one's programs, loading what no kernel writes (a GEMV's weights), take SMs the
    running kernels leave idle."""
    if USE_PDL and EARLY:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def enter_released(USE_PDL: tl.constexpr, RELEASED: tl.constexpr):
    """`enter`, for a kernel that called `release(USE_PDL, RELEASED)` first: the wait, and the
    release only where that one did not."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if not RELEASED:
            tl.extra.cuda.gdc_launch_dependents()
