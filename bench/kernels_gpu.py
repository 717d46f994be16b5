"""Times the paged-attention kernels at Llama-3-8B shapes (32 q heads, 8 KV heads, head_dim 128,
bf16, block 16) against their floors, on one CUDA GPU.

Decode is memory-bound: its floor is the K/V bytes read once over the measured copy bandwidth
(a 2 GiB device-to-device copy, counting read + write). Prefill is matrix-bound: its floor is the
causal FLOPs over the measured bf16 matmul rate (or its bytes over the copy bandwidth, if larger).
Each timed call runs over several layers' caches so the data is well past the 50 MB L2. `--sweep`
also times tile configurations (checking each against the default's output) so the defaults can
be set from data.

    python -m bench.kernels_gpu [--sweep] [--prefill-split] [--json PATH]

`--prefill-split`: short chunks over long cached prefixes (an agent's later turn) with the prefill
launch's keys split into partitions (`SplitPolicy.prefill_split`) against one pass, each checked
against the other's output.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from tandem.engine.attention import AttentionMetadata
from tandem.engine.kernels.attention_split import set_split_policy
from tandem.engine.kernels.paged_attention import (_launch_decode, _launch_prefill, _num_sms,
                                            choose_partition_size, paged_attention)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
L2_BYTES = 50 * 2**20
DEVICE = "cuda"


def make_batch(query_lens, ctx_lens, min_bytes=4 * L2_BYTES):
    """q and enough layers of random cache that one pass over them all is >= min_bytes."""
    seq_lens = [c + q for c, q in zip(ctx_lens, query_lens)]
    blocks = [-(-s // BLOCK) for s in seq_lens]
    layer_bytes = sum(blocks) * BLOCK * KV_HEADS * HEAD_DIM * 2 * 2
    num_layers = max(1, -(-min_bytes // layer_bytes))
    kv = torch.randn(num_layers, 2, sum(blocks), BLOCK, KV_HEADS, HEAD_DIM, device=DEVICE,
                     dtype=torch.bfloat16)
    order = torch.randperm(sum(blocks), device=DEVICE).int()
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=DEVICE)
    start = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = order[start:start + n]
        start += n
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor([0] + query_lens, device=DEVICE).cumsum(0).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), block_tables=tables,
        query_lens_cpu=list(query_lens), seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    return q, kv, meta


def kv_bytes(meta):
    return sum(meta.seq_lens_cpu) * KV_HEADS * HEAD_DIM * 2 * 2


def causal_flops(meta):
    visible = sum(sum(s - q + j + 1 for j in range(q))
                  for q, s in zip(meta.query_lens_cpu, meta.seq_lens_cpu))
    return 4 * HEADS * HEAD_DIM * visible  # QK^T and PV, 2 FLOPs per multiply-add


def time_per_layer(run, kv, eager=True):
    """Median ms of run(k_cache, v_cache) per layer: eager (wrapper included; nan unless asked)
    and graph replay (kernels only)."""
    def all_layers():
        for layer in range(kv.shape[0]):
            run(kv[layer, 0], kv[layer, 1])
    all_layers()  # compile outside the timing
    eager_ms = float("nan")
    if eager:
        eager_ms = do_bench(all_layers, warmup=25, rep=200, return_mode="median") / kv.shape[0]
    graph_ms = do_bench_cudagraph(all_layers, rep=200, return_mode="median") / kv.shape[0]
    return eager_ms, graph_ms


def measure_ceilings():
    n = 2**30  # bf16 elements: 2 GiB
    src = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    src = dst = None  # 4 GiB back before the matmuls
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    mm_ms = do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return 2 * n * 2 / copy_ms / 1e6, 2 * 8192**3 / mm_ms / 1e9  # GB/s (read + write), TFLOP/s (times in ms)


def sdpa_decode_ms(meta, q):
    """Peer: torch SDPA on contiguous (unpaged) K/V of the same sizes, decode only; one buffer, so
    only sizes well past the L2 are timed."""
    b, s = meta.num_seqs, meta.max_seq_len
    if meta.max_query_len != 1 or len(set(meta.seq_lens_cpu)) != 1 or kv_bytes(meta) < 4 * L2_BYTES:
        return float("nan")
    k = torch.randn(b, KV_HEADS, s, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qb = q.view(b, HEADS, 1, HEAD_DIM)
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(qb, k, v, enable_gqa=True)  # noqa: E731
    try:
        return do_bench(fn, warmup=25, rep=200, return_mode="median")
    except Exception:  # older torch without enable_gqa
        return float("nan")


def decode_table(copy_gbs, rows):
    print(f"\ndecode (1 query token), bf16; floor = K/V bytes / copy bandwidth {copy_gbs:.0f} GB/s")
    print(f"{'batch':>5} {'ctx':>5} {'parts':>5} {'floor us':>9} {'eager us':>9} {'graph us':>9} "
          f"{'GB/s':>7} {'% copy':>6} {'sdpa us':>8}")
    for batch in (1, 8, 32, 64):
        for ctx in (1024, 8192):
            q, kv, meta = make_batch([1] * batch, [ctx - 1] * batch)
            scale = HEAD_DIM ** -0.5
            eager, graph = time_per_layer(lambda k, v: paged_attention(q, k, v, meta, scale), kv)
            size = choose_partition_size(batch, KV_HEADS, ctx, _num_sms(q.device))
            parts = 1 if size is None else triton.cdiv(ctx, size)
            floor_us = kv_bytes(meta) / copy_gbs / 1e3
            gbs = kv_bytes(meta) / (graph * 1e-3) / 1e9
            sdpa = sdpa_decode_ms(meta, q) * 1e3
            rows.append(dict(kind="decode", batch=batch, ctx=ctx, parts=parts, floor_us=floor_us,
                             eager_us=eager * 1e3, graph_us=graph * 1e3, gbs=gbs, sdpa_us=sdpa))
            print(f"{batch:>5} {ctx:>5} {parts:>5} {floor_us:>9.1f} {eager * 1e3:>9.1f} "
                  f"{graph * 1e3:>9.1f} {gbs:>7.0f} {100 * gbs / copy_gbs:>6.0f} {sdpa:>8.1f}")
            del kv


PREFILL_SHAPES = {
    "2k prompt": ([2048], [0]),
    "512 after 8k cached": ([512], [8192]),
    "4 x 1k after 4k": ([1024] * 4, [4096] * 4),
    "32 decodes, then 2k": ([1] * 32 + [2048], [4000] * 32 + [0]),  # two launches
    "2k, then 32 decodes": ([2048] + [1] * 32, [0] + [4000] * 32),  # prefill kernel for all
}


def prefill_table(mm_tflops, copy_gbs, rows):
    print(f"\nprefill / mixed, bf16; floor = max(causal FLOPs / matmul rate {mm_tflops:.0f} TFLOP/s, "
          f"K/V bytes / copy bandwidth)")
    print(f"{'shape':>22} {'floor us':>9} {'eager us':>9} {'graph us':>9} {'TFLOP/s':>8} {'% mm':>5}")
    for name, (query_lens, ctx) in PREFILL_SHAPES.items():
        q, kv, meta = make_batch(query_lens, ctx, min_bytes=L2_BYTES)
        scale = HEAD_DIM ** -0.5
        eager, graph = time_per_layer(lambda k, v: paged_attention(q, k, v, meta, scale), kv)
        flops = causal_flops(meta)
        floor_us = max(flops / (mm_tflops * 1e12) * 1e6, kv_bytes(meta) / copy_gbs / 1e3)
        tflops = flops / (graph * 1e-3) / 1e12
        rows.append(dict(kind="prefill", shape=name, floor_us=floor_us, eager_us=eager * 1e3,
                         graph_us=graph * 1e3, tflops=tflops))
        print(f"{name:>22} {floor_us:>9.1f} {eager * 1e3:>9.1f} {graph * 1e3:>9.1f} {tflops:>8.0f} "
              f"{100 * tflops / mm_tflops:>5.0f}")
        del kv


SPLIT_SHAPES = {
    "32 after 4k": ([32], [4096]), "128 after 8k": ([128], [8192]), "256 after 8k": ([256], [8192]),
    "512 after 8k": ([512], [8192]), "128 after 32k": ([128], [32768]),
    "16 decodes, 128 after 8k": ([1] * 16 + [128], [1024] * 16 + [8192]),
}


def prefill_split_table(mm_tflops, copy_gbs, rows):
    """Graph-replay time per layer of short chunks over long prefixes, one pass against split."""
    print(f"\nchunk over a cached prefix, bf16: one pass against split keys (SplitPolicy.prefill_split); "
          f"floor = max(causal FLOPs / {mm_tflops:.0f} TFLOP/s, K/V bytes / {copy_gbs:.0f} GB/s)")
    print(f"{'shape':>26} {'floor us':>9} {'one pass us':>12} {'split us':>9} {'split/one':>9} {'rel err':>8}")
    scale = HEAD_DIM ** -0.5
    for name, (query_lens, ctx) in SPLIT_SHAPES.items():
        q, kv, meta = make_batch(query_lens, ctx, min_bytes=L2_BYTES)
        times, outs = {}, {}
        for on in (False, True):
            old = set_split_policy(prefill_split=on)
            try:
                times[on] = time_per_layer(lambda k, v: paged_attention(q, k, v, meta, scale), kv, eager=False)[1]
                outs[on] = paged_attention(q, kv[0, 0], kv[0, 1], meta, scale)
            finally:
                set_split_policy(**{"prefill_split": old.prefill_split})
        err = ((outs[True].float() - outs[False].float()).norm() / outs[False].float().norm()).item()
        floor_us = max(causal_flops(meta) / (mm_tflops * 1e12) * 1e6, kv_bytes(meta) / copy_gbs / 1e3)
        rows.append(dict(kind="prefill-split", shape=name, floor_us=floor_us, one_pass_us=times[False] * 1e3,
                         split_us=times[True] * 1e3, rel_err=err))
        print(f"{name:>26} {floor_us:>9.1f} {times[False] * 1e3:>12.1f} {times[True] * 1e3:>9.1f} "
              f"{times[True] / times[False]:>9.2f} {err:>8.1e}")
        del kv


def sweep(rows):
    """Graph-replay time of each tile configuration, checked against the default's output."""
    scale = HEAD_DIM ** -0.5
    for name in ("2k prompt", "512 after 8k cached"):
        q, kv, meta = make_batch(*PREFILL_SHAPES[name], min_bytes=L2_BYTES)
        want = paged_attention(q, kv[0, 0], kv[0, 1], meta, scale)
        results = []
        for block_m in (64, 128):
            for block_n in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (2, 3):
                        out = torch.empty_like(q)
                        run = lambda k, v: _launch_prefill(q, k, v, meta, scale, out, block_m,  # noqa: E731
                                                           block_n, warps, stages)
                        try:
                            _, graph = time_per_layer(run, kv, eager=False)
                        except Exception as e:
                            print(f"  prefill {name} m{block_m} n{block_n} w{warps} s{stages}: {type(e).__name__}")
                            continue
                        run(kv[0, 0], kv[0, 1])
                        err = ((out.float() - want.float()).norm() / want.float().norm()).item()
                        results.append((graph * 1e3, block_m, block_n, warps, stages, err))
        results.sort()
        for us, block_m, block_n, warps, stages, err in results[:3]:
            print(f"  prefill {name}: {us:.1f} us  BLOCK_M={block_m} BLOCK_N={block_n} "
                  f"warps={warps} stages={stages} err={err:.1e}")
        rows += [dict(kind="sweep-prefill", shape=name, us=r[0], block_m=r[1], block_n=r[2],
                      warps=r[3], stages=r[4], err=r[5]) for r in results]
        del kv
    print("\nsweep: best configurations (us per layer, graph replay)")
    for batch, ctx in ((1, 8192), (32, 1024), (64, 8192)):
        q, kv, meta = make_batch([1] * batch, [ctx - 1] * batch)
        want = paged_attention(q, kv[0, 0], kv[0, 1], meta, scale)
        results = []
        for block_n in (32, 64, 128):
            size = choose_partition_size(batch, KV_HEADS, ctx, _num_sms(q.device), block_n)
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    out = torch.empty_like(q)
                    run = lambda k, v: _launch_decode(q, k, v, meta, scale, out, size, block_n,  # noqa: E731
                                                      warps, stages)
                    try:
                        _, graph = time_per_layer(run, kv, eager=False)
                    except Exception as e:  # out of shared memory, etc.
                        print(f"  decode b{batch} ctx{ctx} n{block_n} w{warps} s{stages}: {type(e).__name__}")
                        continue
                    run(kv[0, 0], kv[0, 1])
                    err = ((out.float() - want.float()).norm() / want.float().norm()).item()
                    results.append((graph * 1e3, block_n, warps, stages, err))
        results.sort()
        for us, block_n, warps, stages, err in results[:3]:
            print(f"  decode b={batch} ctx={ctx}: {us:.1f} us  BLOCK_N={block_n} warps={warps} "
                  f"stages={stages} err={err:.1e}")
        rows += [dict(kind="sweep-decode", batch=batch, ctx=ctx, us=r[0], block_n=r[1], warps=r[2],
                      stages=r[3], err=r[4]) for r in results]
        del kv


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time tile configurations")
    parser.add_argument("--prefill-split", action="store_true", help="only: chunks over long prefixes, split or not")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "kernels_gpu.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    copy_gbs, mm_tflops = measure_ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s (read + write), "
          f"bf16 matmul {mm_tflops:.0f} TFLOP/s, {_num_sms(torch.device('cuda'))} SMs, "
          f"torch {torch.__version__}, triton {triton.__version__}")
    rows = [dict(kind="ceilings", copy_gbs=copy_gbs, mm_tflops=mm_tflops)]
    if args.prefill_split:
        prefill_split_table(mm_tflops, copy_gbs, rows)
    elif args.sweep:
        sweep(rows)
    if not args.prefill_split:
        prefill_table(mm_tflops, copy_gbs, rows)
        decode_table(copy_gbs, rows)  # last: the reply shows the end of the output
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
