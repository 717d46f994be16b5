"""The one-token FP8 GEMV (engine/kernels/fp8_gemm.py) swept over tile configs on every projection
shape of llama3-8b, qwen2.5-32b and llama3-70b (with the LM heads), in one device call.

For each shape [N, K]: bf16 F.linear (cuBLAS), the committed config (`choose_config(1, N, K)`) and
every candidate (rows per program, K tile, warps, pipeline stages), each replayed from a
CUDA graph over enough weight copies to be well past the L2 (>= 512 MB of FP8). Prints, per shape,
the best config, its us and GB/s of FP8 weight, against the device copy rate, and writes
`fp8_sweep.json` ({"best": {"N,K": [block_n, block_k, warps, stages]}, ...}), which
`bench/fp8_gpu.py --tuned` applies for the rest of its run.

    python3 bench/fp8_sweep.py               # on the GPU; JSON under $OUT (or ./out)
    python3 bench/fp8_sweep.py --committed   # only bf16 and the committed configs (the final table)
    python3 bench/fp8_sweep.py --dry-run     # CPU (Triton interpreter), tiny shapes: the logic
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

# name -> (N, K): the fused projections (q/k/v, gate/up) and the untied LM head
SHAPES = {
    "8b-qkv": (6144, 4096), "8b-o": (4096, 4096), "8b-gate_up": (28672, 4096), "8b-down": (4096, 14336),
    "8b-head": (128256, 4096),
    "32b-qkv": (7168, 5120), "32b-o": (5120, 5120), "32b-gate_up": (55296, 5120), "32b-down": (5120, 27648),
    "32b-head": (152064, 5120),
    "70b-qkv": (10240, 8192), "70b-o": (8192, 8192), "70b-gate_up": (57344, 8192), "70b-down": (8192, 28672),
    "70b-head": (128256, 8192),
}
# (block_n, block_k, num_warps, num_stages). Run 5 (commit 9ca8e1a) also tried split-K variants
# (K in 2-8 ranges, the last program adding the partials): slower on every shape, so gone.
CANDIDATES = [
    (4, 512, 2, 4), (4, 1024, 4, 3), (8, 512, 4, 3), (4, 1024, 4, 1), (8, 1024, 4, 2), (8, 1024, 8, 2),
    (4, 2048, 4, 1), (4, 2048, 8, 2), (2, 2048, 4, 2), (2, 1024, 2, 3), (16, 512, 4, 3), (16, 512, 8, 3),
    (16, 1024, 8, 2), (32, 256, 4, 3), (8, 256, 2, 4), (2, 4096, 4, 1), (4, 4096, 8, 1), (1, 2048, 2, 2),
    (32, 512, 8, 2), (2, 512, 1, 4), (4, 256, 1, 4), (8, 512, 2, 4), (4, 512, 2, 6), (2, 1024, 2, 4),
]


def gpu_ms(fn, reps: int, cuda: bool) -> float:
    fn()
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_us(fn, copies, cuda: bool) -> float:
    """us per call of fn(copy), replayed from one CUDA graph over all copies (eager on the CPU)."""
    def run():
        for c in copies:
            fn(c)
    if not cuda:
        return gpu_ms(run, 1, False) / len(copies) * 1e3
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return gpu_ms(graph.replay, 10, True) / len(copies) * 1e3


def copy_gbs(dev, n: int) -> float:
    src = torch.randn(n, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = gpu_ms(lambda: dst.copy_(src), 20, dev.type == "cuda")
    return 2 * n * 2 / ms / 1e6


def sweep_shape(kernel, quant, n, k, dev, candidates, dry):
    """{config tuple: us} for one shape, plus bf16's us."""
    cuda = dev.type == "cuda"
    ncopy = 2 if dry else max(2, (1 << 29) // (n * k))
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5
    bf = [w] + [torch.randn_like(w) * k ** -0.5 for _ in range(ncopy - 1)]
    q8 = [quant.quantize_fp8(c) for c in bf]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    res = {"bf16": graph_us(lambda c: F.linear(x, c), bf, cuda)}
    del bf
    ref = F.linear(x.float(), quant.dequantize_fp8(*q8[0]))
    for c in candidates:
        cfg = kernel.GemmConfig(1, c[0], c[1], c[2], c[3], gemv=True)
        try:
            out = kernel.fp8_gemm(x, *q8[0], config=cfg)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                raise AssertionError(f"relative error {err:.3g}")
            res[c] = graph_us(lambda p, cfg=cfg: kernel.fp8_gemm(x, *p, config=cfg), q8, cuda)
        except Exception as e:  # noqa: BLE001 - a config that does not compile or is wrong is skipped
            print(f"# {n}x{k} {c} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
    return res


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--committed", action="store_true", help="only bf16 and the committed config per shape")
    parser.add_argument("--shapes", default="", help="comma-separated name prefixes (default: all)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "out")
    args = parser.parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import tandem.engine.kernels.fp8_gemm as kernel  # noqa: PLC0415 (after TRITON_INTERPRET is set)
    import tandem.engine.quant.fp8 as quant  # noqa: PLC0415

    dev = torch.device("cpu" if args.dry_run else "cuda")
    torch.manual_seed(0)
    shapes = {"8b-o": (64, 96), "8b-down": (40, 256)} if args.dry_run else SHAPES
    prefixes = tuple(filter(None, args.shapes.split(",")))
    shapes = {k: v for k, v in shapes.items() if not prefixes or k.startswith(prefixes)}
    cands = [(16, 32, 4, 2), (8, 64, 2, 3)] if args.dry_run else CANDIDATES
    copy = copy_gbs(dev, 1 << 16 if args.dry_run else 1 << 30)
    R = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "copy_gbs": copy,
         "shapes": {}, "best": {}}
    print(f"# {R['device']}: copy {copy:.0f} GB/s (read + write)", flush=True)
    for name, (n, k) in shapes.items():
        c = kernel.choose_config(1, n, k, 0)
        committed = (c.block_n, c.block_k, c.num_warps, c.num_stages)
        tried = [committed] if args.committed else list(dict.fromkeys([committed] + cands))
        res = sweep_shape(kernel, quant, n, k, dev, tried, args.dry_run)
        timed = {cfg: us for cfg, us in res.items() if cfg != "bf16"}
        best = min(timed, key=timed.get)
        R["best"][f"{n},{k}"] = list(best)
        R["shapes"][name] = {"n": n, "k": k, "bf16_us": res["bf16"], "committed": list(committed),
                             "committed_us": timed.get(committed), "best": list(best), "best_us": timed[best],
                             "all": sorted([round(us, 2), list(cfg)] for cfg, us in timed.items())}
        print(f"# {name} {R['shapes'][name]['all'][:6]}", flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8_sweep.json"), "w") as f:
            json.dump(R, f, indent=1)
    print(f"\none-token GEMV, us per call (graph replay past the L2); copy {copy:.0f} GB/s")
    print(f"{'shape':>12} {'N':>6} {'K':>6} {'bf16':>7} {'committed':>9} {'best':>7} {'best/bf16':>9} "
          f"{'GB/s':>6} best config (block_n, block_k, warps, stages)")
    for name, s in R["shapes"].items():
        cu = s["committed_us"] or float("nan")
        print(f"{name:>12} {s['n']:>6} {s['k']:>6} {s['bf16_us']:>7.1f} {cu:>9.1f} {s['best_us']:>7.1f} "
              f"{s['best_us'] / s['bf16_us']:>9.2f} {s['n'] * s['k'] / s['best_us'] / 1e3:>6.0f} {s['best']}")


if __name__ == "__main__":
    main()
