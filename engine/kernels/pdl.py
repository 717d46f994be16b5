"""Programmatic dependent launch (PDL, Hopper on) for the small kernels of a decode step.

A batch-1 decode step is ~300 kernel launches of a few microseconds each, and each boundary costs
the next kernel's launch and ramp after the previous one ends. A kernel launched with PDL may be
scheduled while the kernel before it still runs: it calls `enter` first, which waits
(`griddepcontrol.wait`) until the kernel before has finished and its writes are visible, then lets
the kernel after it be scheduled in turn (`griddepcontrol.launch_dependents`). So a chain of PDL
launches (norm, rotary + KV write, decode attention, merge, SiLU, and engine.kernels.gemv's GEMVs,
which load a weight tile before their wait) overlaps each kernel's launch with the one before it.
A kernel that reads nothing another wrote before `enter` is always safe; every kernel here calls it
before any load.

`ENABLED` switches it for the small kernels (benchmarks compare; CUDA graphs record the launches
in force at capture; TANDEM_PDL=1 in the environment turns it on for a process). It is off by
default: on the H200 (docs/benchmarks.md, issue 23) it took the 8B FP8 batch-1 step from 2.797 to
2.645 ms (with FP8 GEMVs waiting, `gemv.PDL_FP8`), left bf16's at 1k context as it was, and made
the bf16 batch-1 step at 8k context 5% slower (4.70 against 4.45-4.48 ms decode-only, two runs
each), which was not taken apart. engine.kernels.gemv has its own modes (`gemv.PDL`,
`gemv.PDL_FP8`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("TANDEM_PDL", "0") == "1"
_HOPPER: dict[torch.device, bool] = {}


def supported(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched with PDL (a CUDA GPU of compute capability 9+)."""
    if device.type != "cuda":
        return False
    ok = _HOPPER.get(device)
    if ok is None:
        ok = _HOPPER[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return ok


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a small kernel's launch: its USE_PDL constexpr, and Triton's
    launch_pdl where PDL is on."""
    on = ENABLED and supported(device)
    return {"USE_PDL": on, "launch_pdl": True} if on else {"USE_PDL": False}


@triton.jit
def enter(USE_PDL: tl.constexpr):
    """First thing in a kernel launched by launch_options: wait for the kernel before, then let the
    one after be scheduled."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
