"""Issue 29's MoE figures on one GPU: the grouped expert GEMM (engine.kernels.moe) against the
plain-torch path (engine.moe.experts_torch) and against its memory floor, on Qwen3-30B-A3B's
expert shapes (H 2048, I 768, 128 experts, 8 per token) at 1, 8, 64 and 256 tokens (the default
path, each path forced, and the whole layer with its router); then
qwen3-30b-a3b-random decode steps at batch 1 and 64 against their floor, if time allows.

Kernel floor: the bytes of the experts the routing actually chose (each distinct expert's gate, up
and down weights, read once) over the device-to-device copy rate measured in the same run (read
plus write counted, as bench/engine_floor.py does). The Triton path is timed eagerly and replayed
from a CUDA graph (what a decode step runs; the capture also shows it has no host sync). Decode floor: every weight a step reads (attention,
routers, norms, the LM head, and the experts a batch of that size chooses in expectation under
uniform routing, 128 * (1 - (1 - 8/128)^b) per layer) plus the batch's KV, over the copy rate.

    python bench/moe_gpu.py --out DIR [--skip kernels,decode] [--decode-limit-s 60] [--decode-sweep]
    python bench/moe_gpu.py --dry-run     # CPU, tiny shapes, Triton's interpreter: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tandem.engine.config import CacheConfig, EngineConfig, ModelConfig, MoEConfig, SchedulerConfig  # noqa: E402
from tandem.engine.engine import LLMEngine  # noqa: E402
from tandem.engine.kernels.moe import MoEKernelConfig, default_config, fused_experts  # noqa: E402
from tandem.engine.model import TritonOps  # noqa: E402
from tandem.engine.moe import SparseMoE, experts_torch  # noqa: E402
from tandem.engine.weights import load_model  # noqa: E402

SHAPES = dict(hidden=2048, inter=768, experts=128, top_k=8)
DRY_SHAPES = dict(hidden=64, inter=48, experts=8, top_k=2)
TOKENS, DRY_TOKENS = (1, 8, 64, 256), (1, 5)
# tried besides the default per token count on the grouped path: (block_m, block_n, block_k, warps, stages)
ALTERNATES = ((16, 32, 128, 4, 4), (64, 64, 64, 4, 3))


def timed_us(fn, dev, reps: int) -> float:
    """Median of `reps` timings of fn() in microseconds (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def graph_us(fn, dev, reps: int) -> float | None:
    """fn() captured in a CUDA graph and replayed 20 times per timing (None on CPU)."""
    if dev.type != "cuda":
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def replay():
        for _ in range(20):
            graph.replay()
    return timed_us(replay, dev, reps) / 20


def copy_gbs(dev) -> float:
    """Device-to-device copy rate, read plus write counted, GB/s."""
    n = (1 << 28) if dev.type == "cuda" else (1 << 20)
    a, b = torch.empty(n, dtype=torch.float32, device=dev), torch.empty(n, dtype=torch.float32, device=dev)
    us = timed_us(lambda: b.copy_(a), dev, 10)
    return 2 * a.numel() * 4 / us / 1e3


def kernel_rows(dev, dtype, shapes, tokens_list, rate_gbs, reps) -> list[dict]:
    h, i, e, k = shapes["hidden"], shapes["inter"], shapes["experts"], shapes["top_k"]
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, generator=gen, device=dev) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen, device=dev) * i ** -0.5).to(dtype)
    layer = moe_layer(w13, w2, k, gen)
    rows = []
    for t in tokens_list:
        x = torch.randn(t, h, generator=gen, device=dev).to(dtype)
        weights, ids = torch.randn(t, e, generator=gen, device=dev).softmax(-1).topk(k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).contiguous()
        ref = experts_torch(x.float(), w13.float(), w2.float(), weights, ids)
        out = fused_experts(x, w13, w2, weights, ids)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        hit = int(ids.unique().numel())
        floor_us = hit * 3 * i * h * w13.element_size() / (rate_gbs * 1e3)
        r = {"tokens": t, "experts_hit": hit, "rel_err_vs_fp32_torch": err, "floor_us": floor_us,
             "torch_us": timed_us(lambda: experts_torch(x, w13, w2, weights, ids), dev, reps),
             "default": default_config(t * k, e, dtype).__dict__}
        r["triton_us"] = timed_us(lambda: fused_experts(x, w13, w2, weights, ids), dev, reps)
        r["triton_graph_us"] = graph_us(lambda: fused_experts(x, w13, w2, weights, ids), dev, reps)
        for path in ("gemv", "grouped"):
            r[f"{path}_graph_us"] = graph_us(lambda: fused_experts(x, w13, w2, weights, ids, path=path), dev, reps)
            r[f"{path}_err"] = ((fused_experts(x, w13, w2, weights, ids, path=path).float() - ref).norm()
                                / ref.norm()).item()
        r["layer_graph_us"] = graph_us(lambda: layer.forward_fused(x, None), dev, reps)
        r["alternates_graph_us"] = {}
        for alt in ALTERNATES if dev.type == "cuda" else ():
            cfg = MoEKernelConfig(*alt)
            r["alternates_graph_us"][str(alt)] = graph_us(
                lambda: fused_experts(x, w13, w2, weights, ids, cfg, path="grouped"), dev, reps)
        print(f"# kernel {json.dumps(r)}", flush=True)
        rows.append(r)
    return rows


GEMV_SHAPES = {"deepseek-v2-lite": dict(hidden=2048, inter=1408, experts=64, top_k=6), "qwen3-30b": SHAPES}
# (gate/up BLOCK_N, BLOCK_K), (down BLOCK_N, BLOCK_K) of the one-token GEMV path
GEMV_TRIED = [((16, 256), (16, 256)), ((32, 256), (16, 256)), ((16, 512), (16, 512)), ((16, 256), (32, 128)),
              ((16, 256), (8, 512)), ((8, 512), (16, 256)), ((32, 128), (32, 256))]


def gemv_sweep(dev, dtype, rate_gbs, reps) -> list[dict]:
    """The one-token GEMV path's tiles (engine.kernels.moe GEMV_* and DOWN_GEMV_*) from a graph, against
    the chosen experts' floor, at DeepSeek-V2-Lite's and Qwen3-30B's expert shapes."""
    import tandem.engine.kernels.moe as mk  # noqa: PLC0415 (Triton, after the env is set)

    default = (mk.GEMV_BLOCK_N, mk.GEMV_BLOCK_K, mk.DOWN_GEMV_BLOCK_N, mk.DOWN_GEMV_BLOCK_K)
    rows = []
    for name, sh in GEMV_SHAPES.items():
        h, i, e, k = sh["hidden"], sh["inter"], sh["experts"], sh["top_k"]
        gen = torch.Generator(device=dev).manual_seed(0)
        w13 = (torch.randn(e, 2 * i, h, generator=gen, device=dev) * h ** -0.5).to(dtype)
        w2 = (torch.randn(e, h, i, generator=gen, device=dev) * i ** -0.5).to(dtype)
        x = torch.randn(1, h, generator=gen, device=dev).to(dtype)
        weights, ids = torch.randn(1, e, generator=gen, device=dev).softmax(-1).topk(k, dim=-1)
        floor = k * 3 * i * h * w13.element_size() / (rate_gbs * 1e3)
        for (gn, gk), (dn, dk) in GEMV_TRIED[:2] if DRY else GEMV_TRIED:
            mk.GEMV_BLOCK_N, mk.GEMV_BLOCK_K, mk.DOWN_GEMV_BLOCK_N, mk.DOWN_GEMV_BLOCK_K = gn, gk, dn, dk
            try:
                us = graph_us(lambda: fused_experts(x, w13, w2, weights.contiguous(), ids, path="gemv"), dev, reps)
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile is a result too
                us = f"{type(exc).__name__}"
            rows.append({"shape": name, "gate_up": (gn, gk), "down": (dn, dk), "us": us, "floor_us": floor})
            print(f"# gemv {rows[-1]}", flush=True)
    mk.GEMV_BLOCK_N, mk.GEMV_BLOCK_K, mk.DOWN_GEMV_BLOCK_N, mk.DOWN_GEMV_BLOCK_K = default
    return rows


# engine.kernels.moe_decode's tiles tried at DeepSeek-V2-Lite's layer (the first is its default)
# (each program's bytes in flight per tile: rows x block_k x 2; launch 3's per SM do not depend on
# its rows, 2048 x block_k x 2 / 132, so its wider K tiles are tried with fewer rows too)
DECODE_TRIED = [{}, {"gate_up_rows": 4}, {"gate_up_rows": 16}, {"gate_up_block_k": 1024}, {"gate_up_block_k": 256},
                {"down_rows": 2}, {"down_rows": 8}, {"down_block_k": 1024}, {"down_block_k": 1024, "down_rows": 2},
                {"down_block_k": 256}, {"num_warps": 2}, {"num_warps": 8}, {"num_stages": 1}, {"num_stages": 3}]


def decode_sweep(dev, dtype, rate_gbs, reps) -> list[dict]:
    """DeepSeek-V2-Lite's MoE layer (router, 6 of 64 experts, 2 shared) at 1-4 tokens from a graph:
    the seven launches (moe_decode.FUSED_DECODE off) against the three at each tile of DECODE_TRIED,
    over the layer's floor (the router's, the shared experts' and the chosen experts' weights, each
    read once), with each output's distance from the seven launches'."""
    import dataclasses  # noqa: PLC0415 (only here)

    import tandem.engine.kernels.moe_decode as md  # noqa: PLC0415 (Triton, after the env is set)

    sh = DRY_SHAPES if DRY else GEMV_SHAPES["deepseek-v2-lite"]
    h, i, e, k = sh["hidden"], sh["inter"], sh["experts"], sh["top_k"]
    cfg = ModelConfig(vocab_size=32, hidden_size=h, intermediate_size=4 * h, num_layers=1, num_heads=4,
                      num_kv_heads=4, head_dim=h // 4,
                      moe=MoEConfig(num_experts=e, top_k=k, intermediate_size=i, num_shared_experts=2))
    gen = torch.Generator(device=dev).manual_seed(0)
    with torch.device(dev):
        layer = SparseMoE(cfg).to(dtype).requires_grad_(False)
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, generator=gen, device=dev) * p.shape[-1] ** -0.5)
    ops, flag, tiles = TritonOps(), md.FUSED_DECODE, md.TILES
    rows = []
    for t in (1, 2) if DRY else (1, 2, 3, 4):
        x = torch.randn(t, h, generator=gen, device=dev).to(dtype)
        md.FUSED_DECODE = False
        want = layer.forward_fused(x, ops)
        hit = int(md.moe_decode(x, layer.gate.weight, cfg.moe, None, layer.w13, layer.w2,
                                layer.shared_experts.gate_up_proj.weight,
                                layer.shared_experts.down_proj.weight).ids.unique().numel())
        floor = (e + 3 * 2 * i + hit * 3 * i) * h * x.element_size() / (rate_gbs * 1e3)
        r = {"tokens": t, "experts_hit": hit, "floor_us": floor,
             "seven_launches_us": graph_us(lambda: layer.forward_fused(x, ops), dev, reps), "three_launches": []}
        md.FUSED_DECODE = True
        for change in DECODE_TRIED[:2] if DRY else DECODE_TRIED:
            md.TILES = dataclasses.replace(tiles, **change)
            try:
                us = graph_us(lambda: layer.forward_fused(x, ops), dev, reps)
                out = layer.forward_fused(x, ops)
                err = ((out.float() - want.float()).norm() / want.float().norm()).item()
                r["three_launches"].append({"tiles": md.TILES.__dict__, "us": us, "rel_err_vs_seven": err})
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile is a result too
                r["three_launches"].append({"tiles": md.TILES.__dict__, "us": None, "error": f"{type(exc).__name__}"})
        md.FUSED_DECODE, md.TILES = flag, tiles
        print(f"# decode layer {json.dumps(r)}", flush=True)
        rows.append(r)
    return rows


PREFILL_TRIED = [None, (64, 128, 64, 8, 3), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3), (128, 64, 64, 4, 3),
                 (64, 128, 64, 4, 4), (128, 256, 64, 8, 3)]


def prefill_sweep(dev, dtype, tokens: int, reps: int) -> list[dict]:
    """The grouped path's tiles at a prefill's size on DeepSeek-V2-Lite's experts (random routing):
    TFLOP/s counting each pair's three projections (None: default_config's tile)."""
    sh = DRY_SHAPES if DRY else GEMV_SHAPES["deepseek-v2-lite"]
    h, i, e, k = sh["hidden"], sh["inter"], sh["experts"], sh["top_k"]
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, generator=gen, device=dev) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen, device=dev) * i ** -0.5).to(dtype)
    x = torch.randn(tokens, h, generator=gen, device=dev).to(dtype)
    weights, ids = torch.randn(tokens, e, generator=gen, device=dev).softmax(-1).topk(k, dim=-1)
    weights = weights.contiguous()
    flops = 2 * tokens * k * 3 * h * i
    rows = []
    for tile in PREFILL_TRIED[:2] if DRY else PREFILL_TRIED:
        cfg = MoEKernelConfig(*tile) if tile else None
        try:
            us = timed_us(lambda: fused_experts(x, w13, w2, weights, ids, cfg, path="grouped"), dev, reps)
            rows.append({"tile": tile or default_config(tokens * k, e, dtype).__dict__, "us": us,
                         "tflops": flops / us / 1e6})
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile is a result too
            rows.append({"tile": tile, "us": None, "error": f"{type(exc).__name__}"})
        print(f"# prefill tile {rows[-1]}", flush=True)
    return rows


def moe_layer(w13: torch.Tensor, w2: torch.Tensor, top_k: int, gen) -> SparseMoE:
    """A Qwen3-MoE layer (softmax top-k, renormalised) on these experts and a random router: the
    whole layer as a decode step runs it (router GEMM, routing kernel, experts)."""
    e, two_i, h = w13.shape
    cfg = ModelConfig(vocab_size=32, hidden_size=h, intermediate_size=two_i // 2, num_layers=1, num_heads=4,
                      num_kv_heads=4, head_dim=h // 4,
                      moe=MoEConfig(num_experts=e, top_k=top_k, intermediate_size=two_i // 2, norm_topk_prob=True))
    with torch.device(w13.device):
        layer = SparseMoE(cfg).to(w13.dtype)
    with torch.no_grad():
        layer.w13.copy_(w13), layer.w2.copy_(w2)
        layer.gate.weight.copy_(torch.randn(e, h, generator=gen, device=w13.device) * h ** -0.5)
    return layer.requires_grad_(False)


def decode_rows(dev, batches, ctx, rate_gbs, deadline) -> list[dict]:
    """Decode step time of a `*-random` MoE preset: (t(long) - t(short)) / (long - short) over one
    generate of `batch` prompts of `ctx` tokens each (the prefill cancels out)."""
    name, dtype = ("tiny-moe", "float32") if DRY else ("qwen3-30b-a3b-random", "bfloat16")
    model, tok, cfg = load_model(name, dtype, str(dev), seed=0) if not DRY else _dry_model(dev)
    short, long_ = (2, 4) if DRY else (4, 36)
    blocks = max(batches) * (ctx + long_ + 16) // 16 + 16
    e = LLMEngine(EngineConfig(model="bench", cache=CacheConfig(block_size=16, num_blocks=blocks,
                                                               enable_prefix_caching=False),
                               scheduler=SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=8192)),
                  model=model, tokenizer=tok)
    gen = torch.Generator().manual_seed(1)

    def run(b, n):
        reqs = [{"prompt_token_ids": torch.randint(3, cfg.vocab_size, (ctx,), generator=gen).tolist(),
                 "max_tokens": n, "ignore_eos": True} for _ in range(b)]
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        e.generate(reqs)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    rows = []
    for b in batches:
        if time.monotonic() > deadline:
            break
        if dev.type == "cuda":
            e.runner.capture_graphs((b,), ctx + long_ + 16)
        run(b, short)  # compiles, untimed
        step_ms = (run(b, long_) - run(b, short)) / (long_ - short) * 1e3
        floor = decode_floor_ms(model, cfg, b, ctx + (short + long_) / 2, rate_gbs)
        r = {"model": name, "batch": b, "ctx": ctx, "step_ms": step_ms, **floor}
        r["x_floor"] = step_ms / r["floor_ms"]
        print(f"# decode {json.dumps(r)}", flush=True)
        rows.append(r)
    return rows


def decode_floor_ms(model, cfg, batch: int, context: float, rate_gbs: float) -> dict:
    m, elem = cfg.moe, model.lm_head.weight.element_size()
    per_expert = 3 * m.intermediate_size * cfg.hidden_size
    sparse = sum(m.is_sparse(i) for i in range(cfg.num_layers))
    all_params = sum(p.numel() for p in model.parameters()) - model.embed_tokens.weight.numel()
    experts_hit = m.num_experts * (1 - (1 - m.top_k / m.num_experts) ** batch)
    read = (all_params - sparse * (m.num_experts - experts_hit) * per_expert) * elem
    kv = batch * context * cfg.kv_bytes_per_token * elem
    return {"experts_hit_expected": experts_hit, "weight_gb_read": read / 1e9,
            "floor_ms": (read + kv) / (rate_gbs * 1e9) * 1e3}


def _dry_model(dev):
    from tandem.engine.build import build_model, random_fill  # noqa: PLC0415 (the dry run only)
    from tandem.engine.config import PRESETS  # noqa: PLC0415 (as above)
    from tandem.engine.tokenizer import ByteTokenizer  # noqa: PLC0415 (as above)

    cfg = ModelConfig(**{**PRESETS["tiny-random"].__dict__, "architecture": "Qwen3MoeForCausalLM", "qk_norm": True,
                         "moe": MoEConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True)})
    model = build_model(cfg, dev, torch.float32, random_fill(0, dev))
    model.ops = TritonOps()  # the GPU path (the grouped GEMM) under the interpreter
    return model, ByteTokenizer(cfg.vocab_size, cfg.eos_token_ids), cfg


def print_table(res: dict, kernels: bool = True) -> None:
    if kernels:
        print_kernels(res)
    if res.get("decode"):
        print("\n| model | batch x ctx | step ms | experts read / layer (expected) | weights read GB | floor ms "
              "| step / floor |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for r in res["decode"]:
            print(f"| {r['model']} | {r['batch']} x {r['ctx']} | {r['step_ms']:.2f} | {r['experts_hit_expected']:.1f} "
                  f"| {r['weight_gb_read']:.2f} | {r['floor_ms']:.2f} | {r['x_floor']:.2f} |")


def print_kernels(res: dict) -> None:
    print(f"\ncopy rate {res['copy_gbs']:.0f} GB/s (read + write); {res['dtype']}; shapes {res['shapes']}")
    print("| tokens | experts hit | floor us | torch us | Triton us (eager) | Triton us (graph) | graph / floor "
          "| gemv path (graph) | grouped path (graph) | best other grouped tile | layer incl. router (graph) "
          "| rel. err vs fp32 (gemv, grouped) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in res["kernels"]:
        alts = {k: v for k, v in r["alternates_graph_us"].items() if v is not None}
        best = min(alts.items(), key=lambda kv: kv[1]) if alts else None
        g = r["triton_graph_us"]
        ratio = f"{g / r['floor_us']:.2f}" if g else "-"
        print(f"| {r['tokens']} | {r['experts_hit']} | {r['floor_us']:.1f} | {r['torch_us']:.1f} | {r['triton_us']:.1f} "
              f"| {_us(g)} | {ratio} | {_us(r['gemv_graph_us'])} | {_us(r['grouped_graph_us'])} "
              f"| {best[0] + f' {best[1]:.1f}' if best else '-'} | {_us(r['layer_graph_us'])} "
              f"| {r['gemv_err']:.1e}, {r['grouped_err']:.1e} |")


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip", default="")
    ap.add_argument("--decode-limit-s", type=float, default=90.0)
    ap.add_argument("--gemv-sweep", action="store_true", help="time the one-token GEMV path's tiles")
    ap.add_argument("--prefill-sweep", type=int, default=0, help="time the grouped path's tiles at this many tokens")
    ap.add_argument("--parallel-align", choices=("on", "off"), default=None,
                    help="the many-program align above 64 pairs (default: engine.kernels.moe's default)")
    ap.add_argument("--split-down", choices=("on", "off"), default=None,
                    help="the GEMV path's down projection split over (pair, column block) (default: as engine.kernels.moe)")
    ap.add_argument("--fused-decode", choices=("on", "off"), default=None,
                    help="MoE layers of 1-4 tokens in three launches (engine.kernels.moe_decode.FUSED_DECODE; "
                         "default: as there)")
    ap.add_argument("--decode-sweep", action="store_true",
                    help="time DeepSeek-V2-Lite's MoE layer at 1-4 tokens: seven launches against moe_decode's three")
    args = ap.parse_args()
    from mla_gpu import set_options  # noqa: PLC0415 (a sibling bench file, after the env is set)

    set_options(args)
    dev = torch.device("cpu" if DRY else "cuda")
    dtype = torch.float32 if DRY else torch.bfloat16
    rate = copy_gbs(dev)
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "copy_gbs": rate,
           "dtype": str(dtype), "shapes": DRY_SHAPES if DRY else SHAPES}
    if "kernels" not in args.skip:
        res["kernels"] = kernel_rows(dev, dtype, res["shapes"], DRY_TOKENS if DRY else TOKENS, rate, 3 if DRY else 20)
        save(res, args.out)
        print_table(res)
    if args.gemv_sweep:
        res["gemv_sweep"] = gemv_sweep(dev, dtype, rate, 3 if DRY else 20)
        save(res, args.out)
        for r in res["gemv_sweep"]:
            us = r["us"] if not isinstance(r["us"], float) else f"{r['us']:.1f} us ({r['us'] / r['floor_us']:.2f}x floor)"
            print(f"gemv {r['shape']}: gate/up {r['gate_up']}, down {r['down']}: {us}")
    if args.decode_sweep:
        res["decode_sweep"] = decode_sweep(dev, dtype, rate, 3 if DRY else 20)
        save(res, args.out)
        for r in res["decode_sweep"]:
            best = min((c for c in r["three_launches"] if c["us"]), key=lambda c: c["us"], default=None)
            print(f"decode layer {r['tokens']} tokens: floor {r['floor_us']:.1f} us, seven launches "
                  f"{_us(r['seven_launches_us'])}, three {_us(best and best['us'])} ({best and best['tiles']})")
    if args.prefill_sweep:
        res["prefill_sweep"] = prefill_sweep(dev, dtype, args.prefill_sweep, 3 if DRY else 10)
        save(res, args.out)
    if "decode" not in args.skip:
        deadline = time.monotonic() + args.decode_limit_s
        res["decode"] = decode_rows(dev, (1, 4) if DRY else (1, 64), 64 if DRY else 512, rate, deadline)
        save(res, args.out)
        print_table(res, kernels=False)


def save(res: dict, out: str | None) -> None:
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "moe_gpu.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
