"""Weights pulled into the L2 on a side stream while a one-token decode step waits on small kernels.

A batch-1 decode step reads every weight once, so its floor is the weights over the copy rate. But
between a layer's q/k/v projection and its o projection run the rotary + KV write, the decode
attention and its merge: ~10 us a layer on an H200 in which the memory system reads a few MB of K/V
and otherwise idles. Here a kernel on a second stream, forked after the q/k/v GEMV and joined before
the GEMV that reads the weight, brings the o projection and the first rows of gate/up into the L2
in that window, so those GEMVs read them at the L2's rate. The same idea for communication windows
is PRESERVE's (arXiv 2501.08192). It is a hint: a line not yet there is read from memory as before,
so it never changes a result, only when the bytes move.

`MODE` picks the instruction ("off" by default; TANDEM_L2_PREFETCH sets it for a process):
- "line": `prefetch.global.L2` per 128-byte line;
- "last": the same with the L2's evict_last priority, so the GEMVs streaming through the L2 in
  between do not push the lines out first;
- "bulk": `cp.async.bulk.prefetch.L2.global`, one copy-engine request per 16 KB (Hopper).
`BUDGET` is the share of the L2 a layer's prefetch may fill.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MODES = ("off", "line", "last", "bulk")
MODE = os.environ.get("TANDEM_L2_PREFETCH", "off")
BUDGET = float(os.environ.get("TANDEM_L2_PREFETCH_BUDGET", "0.6"))
_LINE = 128
_BULK = 16384
_THREADS = 128  # per program: 4 warps, one pointer each


@triton.jit
def _prefetch_kernel(base, nbytes, out_ptr, CHUNK: tl.constexpr, MODE: tl.constexpr):
    # each thread covers CHUNK bytes: one bulk request, or CHUNK / 128 line prefetches
    offs = (tl.program_id(0) * 128 + tl.arange(0, 128)).to(tl.int64) * CHUNK
    ptrs = base + tl.where(offs + CHUNK <= nbytes, offs, 0)
    done = tl.zeros((128,), dtype=tl.int32)
    if MODE == 3:
        done += tl.inline_asm_elementwise(f"cp.async.bulk.prefetch.L2.global [$1], {CHUNK}; mov.u32 $0, 0;",
                                          "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
    else:
        for i in tl.static_range(CHUNK // 128):
            if MODE == 2:
                done += tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;",
                                                  "=r,l", [ptrs + i * 128], dtype=tl.int32, is_pure=False, pack=1)
            else:
                done += tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;",
                                                  "=r,l", [ptrs + i * 128], dtype=tl.int32, is_pure=False, pack=1)
    # never true (every asm returns 0); keeps the asm live whatever the compiler thinks of its result
    tl.store(out_ptr + tl.arange(0, 128), done, mask=done != 0)


def prefetch(t: torch.Tensor, nbytes: int, mode: str | None = None) -> None:
    """Ask the L2 for the first `nbytes` of contiguous `t` (rounded down to whole chunks), on the
    current stream."""
    mode = MODE if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"L2 prefetch mode {mode!r}: expected one of {', '.join(MODES)}")
    if mode == "off" or nbytes <= 0:
        return
    if not t.is_cuda or not t.is_contiguous():
        raise ValueError("l2_prefetch.prefetch takes a contiguous CUDA tensor")
    chunk = _BULK if mode == "bulk" else 1024
    nbytes = min(nbytes, t.numel() * t.element_size()) // chunk * chunk
    if nbytes == 0:
        return
    base = t.view(-1).view(torch.uint8)
    sink = _sinks.get(t.device)
    if sink is None:
        sink = _sinks[t.device] = torch.zeros(_THREADS, dtype=torch.int32, device=t.device)
    grid = (triton.cdiv(nbytes // chunk, _THREADS),)
    _prefetch_kernel[grid](base, nbytes, sink, CHUNK=chunk, MODE=MODES.index(mode), num_warps=4)


_sinks: dict[torch.device, torch.Tensor] = {}


@dataclass
class Plan:
    """What one layer prefetches: (tensor, bytes) in the order its GEMVs read them."""
    parts: list[tuple[torch.Tensor, int]]

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.parts)


def plan(weights: list[torch.Tensor], budget_bytes: int) -> Plan:
    """The longest prefix of `weights` (each read front to back, in this order) that fits in
    `budget_bytes`: whole tensors, then the first rows of the one that does not fit."""
    parts, left = [], budget_bytes
    for w in weights:
        if left <= 0:
            break
        size = w.numel() * w.element_size()
        take = min(size, left)
        if take < size:  # whole rows: a GEMV program reads its rows start to end
            row = size // w.shape[0]
            take = take // row * row
        if take > 0:
            parts.append((w, take))
        left -= take
    return Plan(parts)


def budget(device: torch.device) -> int:
    """Bytes a layer's prefetch may fill: BUDGET of the device's L2."""
    return int(BUDGET * torch.cuda.get_device_properties(device).L2_cache_size)


class SideStream:
    """Per-device side stream and the pending prefetches' events, keyed by the weight they cover:
    `fork` issues a plan after the work queued so far; `join(w)` makes the current stream wait
    for the prefetch covering `w` (a no-op if none is pending). Captured into CUDA graphs as a
    branch and an edge."""

    def __init__(self):
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pending: dict[int, torch.cuda.Event] = {}

    def fork(self, p: Plan, mode: str | None = None) -> None:
        if not p.parts:
            return
        dev = p.parts[0][0].device
        side = self._streams.get(dev)
        if side is None:
            side = self._streams[dev] = torch.cuda.Stream(dev)
        main = torch.cuda.current_stream(dev)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for w, n in p.parts:
                prefetch(w, n, mode)
                ev = torch.cuda.Event()
                ev.record(side)
                self._pending[id(w)] = ev

    def join(self, w: torch.Tensor) -> None:
        ev = self._pending.pop(id(w), None)
        if ev is not None:
            torch.cuda.current_stream(w.device).wait_event(ev)

    def join_all(self) -> None:
        """Every pending prefetch joined into the current stream (the end of a forward: a graph
        capture must end with no open branch)."""
        for ev in self._pending.values():
            torch.cuda.current_stream().wait_event(ev)
        self._pending.clear()
