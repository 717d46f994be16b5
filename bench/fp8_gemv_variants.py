"""Why the one-token FP8 GEMV streams its weights slower than the bf16 one (issue 24): kernel
variants at llama3-8b's projection shapes, each over a few tile configs, against the copy rate.

- `cvt`: engine.kernels.gemv as committed (e4m3x2 -> f16x2 conversions, then each f16 to f32).
- `int`: the e4m3 byte placed into an fp32's bits by integer ops (sign-extend, shift, mask: the
  value times 2^-120), the input vector pre-scaled by 2^32 and the sum by 2^88, so every product
  and sum is the same power-of-two multiple of the `cvt` one (identical results).
- `int3`: `int` with each thread's 16 columns summed in registers before the accumulator, so the
  accumulator is [block_n, block_k / 16]: fewer registers, larger tiles.
- `cvt3`: `cvt` with `int3`'s per-thread sums.
- `dot`: the tile widened to fp16 and multiplied on tensor cores against the vector padded to 16
  columns (fp16 input: a check of the ceiling, not a kernel to ship as is).
- `stream`: the same tiles read as int32 and summed as integers: the memory ceiling of the loop.

    python3 bench/fp8_gemv_variants.py            # on the GPU
    python3 bench/fp8_gemv_variants.py --dry-run  # CPU, Triton interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os

import torch

def kernels():
    import triton  # noqa: PLC0415 (after --dry-run sets TRITON_INTERPRET)
    import triton.language as tl  # noqa: PLC0415 (as above)

    @triton.jit
    def gemv_var(x_ptr, w_ptr, s_ptr, out_ptr, N, K, stride_wn,
                 MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_mask = rn < N
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
        if MODE == 2 or MODE == 5:
            acc = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
        elif MODE == 3:
            acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
        elif MODE == 4:
            acc = tl.zeros((BLOCK_N, BLOCK_K // 4), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + rk
            if MODE == 4:  # int32 words of the same rows
                rk4 = tl.arange(0, BLOCK_K // 4)
                words = tl.load(w_rows.to(tl.pointer_type(tl.int32)) + (k0 // 4 + rk4)[None, :],
                                mask=n_mask[:, None], other=0)
                acc += words
            else:
                wb = tl.load(w_rows + ks[None, :], mask=n_mask[:, None], other=0.0)
                h = tl.load(x_ptr + ks).to(tl.float32)
                # e4m3 bytes -> fp32 holding value * 2^-120: sign at bit 31, exponent + mantissa at 20..26
                wi = ((wb.to(tl.int8, bitcast=True).to(tl.int32) << 20) & -2014314496).to(tl.float32, bitcast=True)
                if MODE == 0:
                    acc += wb.to(tl.float32) * h[None, :]
                elif MODE == 1:
                    acc += wi * (h * 4294967296.0)[None, :]
                elif MODE == 2:
                    p = wi * (h * 4294967296.0)[None, :]
                    acc += tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // 16, 16)), axis=2)
                elif MODE == 5:
                    p = wb.to(tl.float32) * h[None, :]
                    acc += tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // 16, 16)), axis=2)
                else:
                    hp = tl.where(tl.arange(0, 16)[None, :] == 0, h[:, None], 0.0).to(tl.float16)
                    acc = tl.dot(wb.to(tl.float16), hp, acc)
        if MODE == 4:
            out = tl.sum(acc, axis=1).to(tl.float32)
        elif MODE == 3:
            out = tl.sum(acc, axis=1)
        else:
            out = tl.sum(acc, axis=1)
        s = tl.load(s_ptr + rn, mask=n_mask, other=0.0)
        if MODE == 1 or MODE == 2:
            out *= s * 3.0948500982134507e26  # 2^88
        else:
            out *= s
        tl.store(out_ptr + rn, out.to(out_ptr.dtype.element_ty), mask=n_mask)

    return triton, gemv_var


MODES = {"cvt": 0, "int": 1, "int3": 2, "dot": 3, "stream": 4, "cvt3": 5}
CONFIGS = {  # mode -> (block_n, block_k, num_warps, num_stages)
    "cvt": [(4, 512, 2, 4), (8, 512, 4, 3), (4, 1024, 4, 3), (8, 1024, 4, 2), (16, 512, 8, 3), (4, 1024, 4, 1),
            (4, 2048, 8, 2), (8, 1024, 8, 2)],
    "int": [(4, 512, 2, 4), (8, 512, 4, 3), (4, 1024, 4, 3), (8, 1024, 4, 2), (16, 512, 8, 3), (4, 1024, 4, 1),
            (4, 2048, 8, 2), (8, 1024, 8, 2)],
    "cvt3": [(4, 1024, 4, 3), (8, 1024, 4, 3), (8, 2048, 8, 2), (16, 1024, 8, 3), (16, 2048, 8, 2),
             (32, 512, 8, 3), (8, 1024, 4, 1), (16, 1024, 4, 1), (4, 2048, 4, 2), (8, 2048, 4, 2)],
    "int3": [(4, 2048, 4, 2), (8, 2048, 4, 2), (4, 1024, 4, 3), (8, 1024, 4, 3), (8, 2048, 8, 2), (16, 1024, 8, 3), (16, 2048, 8, 2),
             (32, 512, 8, 3), (8, 1024, 4, 1), (16, 1024, 4, 1)],
    "dot": [(16, 256, 4, 3), (32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (32, 512, 4, 3), (16, 512, 4, 4)],
    "stream": [(4, 512, 2, 4), (4, 1024, 4, 3), (8, 1024, 4, 2), (16, 1024, 8, 3), (4, 1024, 4, 1), (4, 2048, 4, 2),
               (8, 2048, 8, 2)],
}
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def gpu_us(dev, fn, copies, reps=20):
    """Microseconds per fn(copy), replayed from one CUDA graph over all copies (nan on the CPU)."""
    for c in copies:
        fn(c)
    if dev.type != "cuda":
        return float("nan")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in copies:
            fn(c)
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / reps / len(copies)


def measure_shape(name, n, k, dev, dry, launch, quantize_fp8):
    """-> rows of (mode, config, us, GB/s, error against x @ dequantized W)."""
    ncopy = 2 if dry else max(2, int(2 ** 29 // (n * k)))  # >= 512 MB of weights: past the L2
    ws = [quantize_fp8(torch.randn(n, k, device=dev) * k ** -0.5) for _ in range(ncopy)]
    x = torch.randn(1, k, device=dev, dtype=torch.float32 if dry else torch.bfloat16)
    ref = x.float() @ (ws[0][0].float() * ws[0][1]).t()
    rows = []
    for mode, cfgs in CONFIGS.items():
        for cfg in [(16, 32, 4, 1)] if dry else cfgs:
            out = torch.empty(1, n, device=dev, dtype=x.dtype)

            def run(c, cfg=cfg, mode=mode, out=out):
                launch(x, c[0], c[1], out, MODES[mode], *cfg)
            try:
                run(ws[0])
                err = ((out.float() - ref).norm() / ref.norm()).item()
                us = gpu_us(dev, run, ws)
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is reported and skipped
                print(f"# {name} {mode} {cfg} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            exact = mode != "dot" and mode != "stream"
            rows.append(dict(shape=name, mode=mode, config=list(cfg), us=us, gbs=n * k / us / 1e3, rel_err=err))
            print(f"{name:>8} {mode:>6} {str(cfg):>18} {us:8.2f} us {rows[-1]['gbs']:6.0f} GB/s err {err:.2e}",
                  flush=True)
            if exact and not err < 2e-2:
                raise SystemExit(f"{mode} is wrong at {name}: relative error {err}")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT") or "out")
    args = p.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    triton, gemv_var = kernels()
    from tandem.engine.quant.fp8 import quantize_fp8  # noqa: PLC0415 (after TRITON_INTERPRET)

    def launch(x, w, scale, out, mode, bn, bk, nw, ns):
        n, k = w.shape
        gemv_var[(triton.cdiv(n, bn),)](x, w, scale, out, n, k, w.stride(0), MODE=mode, BLOCK_N=bn, BLOCK_K=bk,
                                       num_warps=nw, num_stages=ns)

    dev = torch.device("cpu" if args.dry_run else "cuda")
    shapes = {"qkv": (48, 64), "down": (32, 128)} if args.dry_run else SHAPES
    torch.manual_seed(0)
    rows = []
    for name, (n, k) in shapes.items():
        rows += measure_shape(name, n, k, dev, args.dry_run, launch, quantize_fp8)
    print("\nbest per shape and mode (us, GB/s, config)")
    for name in shapes:
        line = [f"{name:>8}"]
        for mode in CONFIGS:
            rs = [r for r in rows if r["shape"] == name and r["mode"] == mode]
            if rs:
                b = min(rs, key=lambda r: r["us"])
                line.append(f"{mode} {b['us']:.1f} {b['gbs']:.0f} {tuple(b['config'])}")
        print(" | ".join(line))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fp8_gemv_variants.json"), "w") as f:
        json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
