"""Issue 29's latent-attention figures on one GPU (deepseek-v2-lite-random, bf16):

- the Triton decode kernel (engine.kernels.mla_decode) at batch 1 and 64, contexts 1k and 8k, against
  its floor (the latent cache it reads, over the copy rate measured in the same run);
- decode steps through LLMEngine (CUDA graphs) at batch 1 and 64, context 1k, against the step's
  floor: every weight a step reads (attention, routers, the dense layer, shared experts, the LM head,
  and the routed experts a batch of b tokens hits in expectation under uniform routing,
  64 * (1 - (1 - 6/64)^b) per layer) plus the batch's latent KV, over the copy rate;
- one 8k-token prefill against the bf16 matmul rate, counting active FLOPs (each token's 6 routed +
  2 shared experts, attention in the expanded form, causal);
- KV bytes per token and an 8k prompt's transfer against llama3-8b-random's, and the transfer time
  that saves at the NCCL rates measured between two H200s (docs/benchmarks.md: not measurable on one GPU).

    python3 bench/mla_gpu.py --out DIR      # on the GPU
    python3 bench/mla_gpu.py --dry-run      # CPU, a tiny DeepSeek, Triton's interpreter: checks the script

`--step-variants "base,nopdl,bmm,..."` times only batch-1 decode steps (context 1k), each variant of
the latent attention's and the MoE layer's launches on an engine of its own, interleaved
`--repeats` times (MLABench.step_variants names the tokens).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine_gpu import Bench  # noqa: E402  (a sibling file: bench scripts run as files)
from moe_step_profile import print_profile, profile_step  # noqa: E402  (as above)
from tandem.engine.attention import AttentionMetadata  # noqa: E402
from tandem.engine.build import build_model, random_fill  # noqa: E402
from tandem.engine.config import PRESETS, MLAConfig, ModelConfig, MoEConfig  # noqa: E402
from tandem.engine.model import TritonOps  # noqa: E402
from tandem.engine.model_runner import ModelRunner  # noqa: E402
from tandem.engine.tokenizer import ByteTokenizer  # noqa: E402
from tandem.wire.messages import SamplingParams  # noqa: E402

# NCCL send/recv between two Ray actors on two H200s (docs/benchmarks.md, ../shared/device/README.md)
NCCL_GBS = {16 << 20: 267.0, 128 << 20: 348.0, 1 << 30: 368.0}


def nccl_gbs(nbytes: int) -> float:
    """The measured rate of the nearest message size at or below `nbytes`."""
    return NCCL_GBS[max([s for s in NCCL_GBS if s <= nbytes] or [min(NCCL_GBS)])]


def dry_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=4,
        head_dim=24, max_position_embeddings=4096, rope_scaling=PRESETS["deepseek-v2-lite-random"].rope_scaling,
        eos_token_ids=(2,), architecture="DeepseekV2ForCausalLM",
        mla=MLAConfig(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
        moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=32, num_shared_experts=2, dense_layers=(0,)))


class MLABench(Bench):
    def kernel(self):
        from tandem.engine.kernels.mla_decode import mla_decode  # noqa: PLC0415 (Triton, after the env is set)

        rank, rope, heads, bs = (32, 8, 4, 16) if self.dry else (512, 64, 16, 16)
        rows = self.results["kernel"] = []
        for batch, ctx in ((1, 256), (2, 512)) if self.dry else ((1, 1024), (64, 1024), (1, 8192), (64, 8192)):
            nb = batch * ctx // bs
            cache = torch.randn(nb, bs, 1, rank + rope, device=self.dev, dtype=self.dtype)
            tables = torch.arange(nb, device=self.dev, dtype=torch.int32).view(batch, -1)
            meta = AttentionMetadata(
                slot_mapping=torch.zeros(batch, dtype=torch.long, device=self.dev),
                query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=self.dev),
                seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=self.dev), block_tables=tables,
                query_lens_cpu=[1] * batch, seq_lens_cpu=[ctx] * batch, max_query_len=1, max_seq_len=ctx)
            q = torch.randn(batch, heads, rank + rope, device=self.dev, dtype=self.dtype)
            run = self.graphed(lambda: mla_decode(q, cache, meta, rank, 0.1))  # eager, it is host-bound
            us = self.gpu_ms(run, reps=3 if self.dry else 50) * 1e3
            floor = cache.numel() * cache.element_size() / (self.results["ceilings"]["copy_gbs"] * 1e3)
            rows.append({"batch": batch, "ctx": ctx, "us": us, "floor_us": floor, "x_floor": us / floor,
                         "sweep": self.sweep_launch(q, cache, meta, rank) if self.sweep else {}})
            print(f"# kernel {rows[-1]}", flush=True)

    def sweep_launch(self, q, cache, meta, rank) -> dict[str, float]:
        """The partial kernel's launch choices (mla_decode.LAUNCH) and split counts, each from a graph:
        us of the kernel alone (positions worked out before the capture)."""
        from tandem.engine.kernels import mla_decode as mod  # noqa: PLC0415 (Triton, after the env is set)

        default, out = dict(mod.LAUNCH), {}
        mod.token_positions(meta, q.shape[0])
        tried = [(32, 4, 2), (64, 4, 2), (32, 8, 2), (64, 8, 3), (16, 4, 3)]
        for block_n, warps, stages in tried[:2] if self.dry else tried:
            for splits in (None, 4, 16):
                mod.LAUNCH.update(block_n=block_n, num_warps=warps, num_stages=stages)
                try:
                    run = self.graphed(lambda: mod.mla_decode(q, cache, meta, rank, 0.1, splits=splits,
                                                              reuse_positions=True))
                    out[f"n{block_n} w{warps} s{stages} splits {splits or 'auto'}"] = self.gpu_ms(
                        run, reps=3 if self.dry else 30) * 1e3
                except Exception as e:  # noqa: BLE001 - a launch that does not compile is a result too
                    out[f"n{block_n} w{warps} s{stages} splits {splits or 'auto'}"] = f"{type(e).__name__}"
        mod.LAUNCH.update(default)
        return out

    def graphed(self, fn):
        """fn captured in a CUDA graph -> its replay (fn itself on the CPU)."""
        if self.dev.type != "cuda":
            return fn
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    def prefill_s(self, e, n: int) -> float:
        """Seconds of one n-token prompt's prefill step, its token on the host (overlapped steps
        publish a step's tokens with the next one: settle)."""
        ids = torch.randint(3, self.cfg.vocab_size, (n,), generator=self.gen).tolist()
        e.add_request(f"p{n}-{time.perf_counter_ns()}", prompt_token_ids=ids,
                      sampling=SamplingParams(max_tokens=1, ignore_eos=True))
        self.sync()
        t0 = time.perf_counter()
        e.step()
        e.settle()
        t = time.perf_counter() - t0
        while e.has_unfinished():
            e.step()
        return t

    def load(self):
        t0 = time.perf_counter()
        cfg = dry_config() if self.dry else PRESETS["deepseek-v2-lite-random"]
        self.model = build_model(cfg, self.dev, self.dtype, random_fill(0, self.dev), max_positions=16384)
        if self.dry:
            self.model.ops = TritonOps()
        self.cfg, self.tok = cfg, ByteTokenizer(cfg.vocab_size, cfg.eos_token_ids)
        self.sync()
        total = sum(p.numel() for p in self.model.parameters())
        from tandem.engine.mla import LatentAttention  # noqa: PLC0415 (after the env is set)

        self.results["model"] = {"params": total, "load_s": time.perf_counter() - t0,
                                 "fused_prepare": LatentAttention.fused_prepare,
                                 "fused_absorb": LatentAttention.fused_absorb,
                                 "fused_absorb_max_pairs": LatentAttention.fused_absorb_max_pairs,
                                 "kv_bytes_per_token": self.kv_bytes_per_token(self.model)}
        print(f"# model {self.results['model']}", flush=True)

    def weights_read(self, batch: int) -> tuple[float, float]:
        """-> (bytes of weights a decode step of `batch` tokens reads, routed experts hit per layer)."""
        cfg, m = self.cfg, self.cfg.moe
        per_expert = 3 * cfg.hidden_size * m.intermediate_size * self.model.lm_head.weight.element_size()
        sparse = sum(m.is_sparse(i) for i in range(cfg.num_layers))
        hit = m.num_experts * (1 - (1 - m.top_k / m.num_experts) ** batch)
        return self.model_bytes(self.model) - sparse * (m.num_experts - hit) * per_expert, hit

    def decode_rows(self):
        ctx, batches = (64, (1, 2)) if self.dry else (1024, (1, 64))
        e = self.engine(self.model, self.tok, num_blocks=max(batches) * (ctx + 64) // 16 + 64, max_batched=8192)
        if self.dry:
            e.runner = ModelRunner(self.model, e.kv_cache, self.dev, cuda_graphs=True, capture=False)
        kvb = self.kv_bytes_per_token(self.model)
        rows = self.results["decode"] = []
        for b in batches:
            wbytes, hit = self.weights_read(b)
            r = self.decode(e, b, ctx, 2 if self.dry else 4, 3 if self.dry else 16, f"d{b}", wbytes, kvb)
            rows.append({**r, "weight_gb_read": wbytes / 1e9, "experts_hit_per_layer": hit})
            print(f"# decode {rows[-1]}", flush=True)
        self.results["graphs"] = e.runner.graph_stats
        if self.profile_steps:
            for b in batches:
                self.section(f"profile_b{b}", lambda b=b: self.profile_rows(e, b, ctx))
        n = 128 if self.dry else 8192
        self.prefill_s(e, 32 if self.dry else 256)  # compile
        s = statistics.median(self.prefill_s(e, n) for _ in range(2 if self.dry else 3))
        flops = self.prefill_flops(n)
        tf = flops / s / 1e12
        self.results["prefill"] = {"tokens": n, "s": s, "tflops": tf, "active_flops": flops,
                                   "of_matmul": tf / self.results["ceilings"]["matmul_tflops"]}
        print(f"# prefill {self.results['prefill']}", flush=True)
        if self.profile_steps:
            self.section("profile_prefill", lambda: self.profile_prefill(e, n))

    def step_variants(self, spec: str, repeats: int) -> None:
        """Batch-1 decode steps (context 1k) under each variant of the latent attention's and the MoE
        layer's launches, interleaved `repeats` times, each on an engine of its own (its own graph): a
        variant is `+`-joined tokens, `splitsN` (mla_decode.MAX_SPLITS: context slices of a batch-1
        token), `uv` (W_UV in the merge, LatentAttention.fused_uv), `bmm` (W_UV as torch.bmm, not its own
        Triton GEMV: LatentAttention.uv_gemv off), `uvrowsN` (that GEMV's outputs per program), `mergeN` (mla_decode.MERGE_RANK_BLOCK:
        the plain merge's rank columns per program), `nopdl-mla` / `nopdl-moe` / `nopdl` (plain launches
        for the latent attention's kernels, the MoE decode kernels, both), `nonorm` (the post-attention
        norm in its own launch: moe_decode.NORM_FOLD off), `base` (the defaults)."""
        from tandem.engine.kernels import mla_decode, mla_prepare, moe_decode  # noqa: PLC0415 (Triton, after the env is set)
        from tandem.engine.mla import LatentAttention  # noqa: PLC0415 (as above)

        knobs = [(mla_decode, "MAX_SPLITS"), (LatentAttention, "fused_uv"), (LatentAttention, "uv_gemv"),
                 (mla_decode, "MERGE_RANK_BLOCK"), (mla_decode, "UV_GEMV_ROWS"),
                 (mla_decode, "PDL"), (mla_prepare, "PDL"), (moe_decode, "PDL"), (moe_decode, "NORM_FOLD")]
        default = [getattr(obj, name) for obj, name in knobs]
        tokens = {"uv": [(LatentAttention, "fused_uv", True)], "bmm": [(LatentAttention, "uv_gemv", False)],
                  "nopdl-mla": [(mla_decode, "PDL", False), (mla_prepare, "PDL", False)],
                  "nopdl-moe": [(moe_decode, "PDL", False)], "nonorm": [(moe_decode, "NORM_FOLD", False)], "base": []}
        tokens["nopdl"] = tokens["nopdl-mla"] + tokens["nopdl-moe"]
        ctx, wbytes = (64, 0) if self.dry else (1024, self.weights_read(1)[0])
        times: dict[str, list[float]] = {v: [] for v in spec.split(",")}
        for _ in range(repeats):
            for variant in times:
                for (obj, name), value in zip(knobs, default):
                    setattr(obj, name, value)
                for tok in variant.split("+"):
                    if tok.startswith("splits"):
                        mla_decode.MAX_SPLITS = int(tok[6:])
                    elif tok.startswith("merge"):
                        mla_decode.MERGE_RANK_BLOCK = int(tok[5:])
                    elif tok.startswith("uvrows"):
                        mla_decode.UV_GEMV_ROWS = int(tok[6:])
                    elif tok in tokens:
                        for obj, name, value in tokens[tok]:
                            setattr(obj, name, value)
                    else:
                        raise SystemExit(f"--step-variants: unknown token {tok!r} (splitsN, mergeN, {', '.join(tokens)})")
                e = self.engine(self.model, self.tok, num_blocks=(ctx + 64) // 16 + 64, max_batched=8192)
                r = self.decode(e, 1, ctx, 2 if self.dry else 4, 3 if self.dry else 16, f"v{len(times[variant])}",
                                wbytes, self.kv_bytes_per_token(self.model))
                times[variant].append(r["step_ms"])
                print(f"# variant {variant}: {r['step_ms']:.3f} ms (floor {r['floor_ms']:.3f})", flush=True)
                del e
        for (obj, name), value in zip(knobs, default):
            setattr(obj, name, value)
        self.results["step_variants"] = {v: {"step_ms": statistics.median(t), "runs": t} for v, t in times.items()}

    def profile_prefill(self, e, n: int) -> None:
        """GPU time by part of one n-token prefill step (eager: prefill steps are not graphed)."""
        e.settle()
        ids = torch.randint(3, self.cfg.vocab_size, (n,), generator=self.gen).tolist()
        req = e.add_request(f"profp{n}", prompt_token_ids=ids, sampling=SamplingParams(max_tokens=1, ignore_eos=True))
        inputs = e.runner.prepare(e.scheduler.schedule())
        run = lambda: e.runner.execute(inputs, layer_done=lambda layer: None)  # noqa: E731
        p = profile_step(self.model, run, run, self.dev.type == "cuda", reps=1)
        e.abort(req.request_id)
        self.results["profile_prefill"] = p
        print_profile(f"profile prefill {n} tokens", p)

    def profile_rows(self, e, batch: int, ctx: int) -> None:
        """GPU time by part of one decode step of `batch` sequences, replayed from its graph."""
        e.settle()
        reqs = self.admit(e, batch, ctx, 4, f"prof{batch}")
        inputs = e.runner.prepare(e.scheduler.schedule())
        replays = e.runner.graph_stats["replays"]
        p = profile_step(self.model, lambda: e.runner.execute(inputs),
                         lambda: e.runner.execute(inputs, layer_done=lambda layer: None), self.dev.type == "cuda")
        p["graph_replays"] = e.runner.graph_stats["replays"] - replays  # 4 when the step is a graph
        p["replay_ms"] = self.gpu_ms(lambda: e.runner.execute(inputs), reps=3 if self.dry else 20)
        for r in reqs:
            e.abort(r.request_id)
        self.results[f"profile_b{batch}"] = p
        print_profile(f"profile batch {batch} x {ctx} (graph replays seen: {p['graph_replays']})", p, p["replay_ms"])

    def prefill_flops(self, n: int) -> float:
        """Active FLOPs of an n-token prefill: 2 x active weights x n (the expanded form: kv_b_proj on
        every latent), the causal attention at head dims 192 (scores) and 128 (values), the LM head once."""
        c, m, a = self.cfg, self.cfg.moe, self.cfg.mla
        h, heads = c.hidden_size, c.num_heads
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        attn_w = h * heads * qk + h * a.latent_dim + a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim) \
            + heads * a.v_head_dim * h
        sparse = sum(m.is_sparse(i) for i in range(c.num_layers))
        mlp_w = (c.num_layers - sparse) * 3 * h * c.intermediate_size \
            + sparse * (3 * h * m.intermediate_size * (m.top_k + m.num_shared_experts) + m.num_experts * h)
        attn = 2 * c.num_layers * heads * (qk + a.v_head_dim) * n * (n + 1) // 2
        return 2 * (c.num_layers * attn_w + mlp_w) * n + attn + 2 * h * c.vocab_size

    def transfer(self):
        elem = 2  # bf16
        llama = PRESETS["llama3-8b-random"].kv_bytes_per_token * elem
        ours = self.cfg.kv_bytes_per_token * elem if not self.dry else PRESETS["deepseek-v2-lite-random"].kv_bytes_per_token * elem
        n = 8192
        rows = []
        for name, per in (("llama3-8b-random", llama), ("deepseek-v2-lite-random", ours)):
            size = per * n
            rows.append({"model": name, "kv_bytes_per_token": per, "transfer_8k_mb": size / 1e6,
                         "nccl_gbs": nccl_gbs(size), "transfer_8k_ms": size / (nccl_gbs(size) * 1e9) * 1e3})
        self.results["transfer"] = rows

    def table(self):
        r = self.results
        c = r["ceilings"]
        print(f"\n{c['device']}: copy {c['copy_gbs']:.0f} GB/s (read + write), bf16 matmul {c['matmul_tflops']:.0f} TFLOP/s")
        print("\n| kernel: batch x ctx | us | latent-cache floor us | x floor |\n|---|---:|---:|---:|")
        for k in r.get("kernel", []):
            print(f"| {k['batch']} x {k['ctx']} | {k['us']:.1f} | {k['floor_us']:.1f} | {k['x_floor']:.2f} |")
        for k in r.get("kernel", []):
            if k.get("sweep"):
                best = sorted((v, c) for c, v in k["sweep"].items() if isinstance(v, float))[:4]
                print(f"sweep {k['batch']} x {k['ctx']}: best " + ", ".join(f"{c} {v:.1f} us" for v, c in best))
        print("\n| decode: batch x ctx | step ms | GPU ms (forward) | experts hit / layer | weights read GB | floor ms "
              "| step / floor | tok/s |\n|---|---:|---:|---:|---:|---:|---:|---:|")
        for d in r.get("decode", []):
            print(f"| {d['batch']} x {d['ctx']} | {d['step_ms']:.2f} | {d['gpu_ms']:.2f} | {d['experts_hit_per_layer']:.1f} "
                  f"| {d['weight_gb_read']:.2f} | {d['floor_ms']:.2f} | {d['x_floor']:.2f} | {d['tok_s']:.0f} |")
        if "prefill" in r:
            p = r["prefill"]
            print(f"\nprefill {p['tokens']} tokens: {p['s'] * 1e3:.1f} ms, {p['active_flops'] / 1e12:.1f} active TFLOP, "
                  f"{p['tflops']:.0f} TFLOP/s = {p['of_matmul']:.2f} of the matmul rate")
        print("\n| model | KV bytes / token | 8k prompt's KV MB | NCCL GB/s (two H200s) | 8k transfer ms |\n"
              "|---|---:|---:|---:|---:|")
        for t in r.get("transfer", []):
            print(f"| {t['model']} | {t['kv_bytes_per_token']:,} | {t['transfer_8k_mb']:.0f} | {t['nccl_gbs']:.0f} "
                  f"| {t['transfer_8k_ms']:.2f} |")
        if r.get("step_variants"):
            print("\n| batch-1 step variant (1k) | step ms (median of runs) | runs |\n|---|---:|---|")
            for v, d in r["step_variants"].items():
                print(f"| {v} | {d['step_ms']:.3f} | {', '.join(f'{t:.3f}' for t in d['runs'])} |")
        if r.get("errors"):
            print(f"\nerrors: {r['errors']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--profile", action="store_true", help="GPU time by part of the batch-1 and 64 decode steps")
    ap.add_argument("--skip", default="", help="comma-separated sections to leave out (kernel)")
    ap.add_argument("--sweep", action="store_true", help="time the attention kernel's launch choices")
    ap.add_argument("--fused-prepare", choices=("on", "off"), default=None,
                    help="the one-kernel latent norm + rope + cache write (default: engine.mla's default)")
    ap.add_argument("--fused-absorb", choices=("on", "off"), default=None,
                    help="small steps' W_UK in the prepare launch and W_UV in the merge (default: engine.mla's default)")
    ap.add_argument("--absorb-launch", default=None,
                    help="the fused absorbed form's limit and blocks, any of max_pairs=64,uk_block=64,block_v=32,"
                         "chunk_r=64, uv=0|1 (W_UV in the merge; default: engine.mla's and the kernels')")
    ap.add_argument("--parallel-align", choices=("on", "off"), default=None,
                    help="the many-program align above 64 pairs (default: engine.kernels.moe's default)")
    ap.add_argument("--prefill-tile", choices=("on", "off"), default=None,
                    help="128 x 128 tiles for prefill-sized expert runs (default: as engine.kernels.moe)")
    ap.add_argument("--split-down", choices=("on", "off"), default=None,
                    help="the GEMV path's down projection split over (pair, column block) (default: as engine.kernels.moe)")
    ap.add_argument("--fused-decode", choices=("on", "off"), default=None,
                    help="MoE layers of 1-4 tokens in three launches (engine.kernels.moe_decode.FUSED_DECODE; "
                         "default: as there)")
    ap.add_argument("--gemv", choices=("table", "all", "off"), default=None,
                    help="engine.kernels.gemv.POLICY for one-token projections (default: table)")
    ap.add_argument("--pdl", choices=("on", "off"), default=None,
                    help="PDL launches for the small kernels (engine.kernels.pdl.ENABLED; default: per model)")
    ap.add_argument("--step-variants", default=None,
                    help="only time batch-1 decode steps under these launch variants, comma-separated "
                         "(splitsN, mergeN, uv, bmm, uvrowsN, nopdl, nopdl-mla, nopdl-moe, nonorm, base, joined by +; see MLABench.step_variants)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds of --step-variants")
    args = ap.parse_args()
    set_options(args)
    b = MLABench(DRY, args.out)
    b.profile_steps = args.profile
    b.sweep = args.sweep
    b.dtype = torch.float32 if DRY else torch.bfloat16
    b.save = lambda: _save(b)
    b.section("ceilings", b.ceilings)
    if "kernel" not in args.skip:
        b.section("kernel", b.kernel)
    b.section("load", b.load)
    if args.step_variants:
        b.section("step_variants", lambda: b.step_variants(args.step_variants, args.repeats))
        b.table()
        return
    b.section("decode", b.decode_rows)
    b.section("transfer", b.transfer)
    b.table()


def set_options(args) -> None:
    """The gated kernels' options, where the command line sets them (the defaults otherwise)."""
    import tandem.engine.kernels.moe as moe_kernels  # noqa: PLC0415 (after the env is set)
    import tandem.engine.kernels.moe_decode as moe_decode  # noqa: PLC0415 (as above)
    from tandem.engine.mla import LatentAttention  # noqa: PLC0415 (as above)

    if getattr(args, "fused_prepare", None):
        LatentAttention.fused_prepare = args.fused_prepare == "on"
    if getattr(args, "fused_absorb", None):
        LatentAttention.fused_absorb = args.fused_absorb == "on"
    if getattr(args, "absorb_launch", None):
        set_absorb_launch(args.absorb_launch)
    if getattr(args, "parallel_align", None):
        moe_kernels.PARALLEL_ALIGN = args.parallel_align == "on"
    if getattr(args, "prefill_tile", None):
        moe_kernels.PREFILL_TILE_128 = args.prefill_tile == "on"
    if getattr(args, "split_down", None):
        moe_kernels.SPLIT_DOWN_GEMV = args.split_down == "on"
    if getattr(args, "fused_decode", None):
        moe_decode.FUSED_DECODE = args.fused_decode == "on"
    if getattr(args, "gemv", None):
        import tandem.engine.kernels.gemv as gemv  # noqa: PLC0415 (as above)

        gemv.POLICY = args.gemv
        print(f"# gemv.POLICY {gemv.POLICY}", flush=True)
    if getattr(args, "pdl", None):
        import tandem.engine.kernels.pdl as pdl  # noqa: PLC0415 (as above)

        pdl.ENABLED = args.pdl == "on"
        print(f"# pdl.ENABLED {pdl.ENABLED}", flush=True)
    print(f"# options: fused_prepare {LatentAttention.fused_prepare}, fused_absorb {LatentAttention.fused_absorb} "
          f"(up to {LatentAttention.fused_absorb_max_pairs} pairs), parallel_align {moe_kernels.PARALLEL_ALIGN}, "
          f"split_down {moe_kernels.SPLIT_DOWN_GEMV}, fused_decode {moe_decode.FUSED_DECODE}", flush=True)


def set_absorb_launch(spec: str) -> None:
    """--absorb-launch "max_pairs=128,block_v=64": the fused absorbed form's pair limit
    (LatentAttention.fused_absorb_max_pairs), W_UK's rank columns per program (mla_prepare.UK_BLOCK)
    and the W_UV merge's blocks (mla_decode.UV_LAUNCH)."""
    from tandem.engine.kernels import mla_decode, mla_prepare  # noqa: PLC0415 (after the env is set)
    from tandem.engine.mla import LatentAttention  # noqa: PLC0415 (as above)

    for item in spec.split(","):
        key, value = item.split("=")
        if key == "max_pairs":
            LatentAttention.fused_absorb_max_pairs = int(value)
        elif key == "uv":
            LatentAttention.fused_uv = bool(int(value))
        elif key == "uk_block":
            mla_prepare.UK_BLOCK = int(value)
        elif key in mla_decode.UV_LAUNCH:
            mla_decode.UV_LAUNCH[key] = int(value)
        else:
            raise SystemExit(f"--absorb-launch: unknown {key!r} (max_pairs, uk_block, block_v, chunk_r)")
    print(f"# absorb launch: max_pairs {LatentAttention.fused_absorb_max_pairs}, uv {LatentAttention.fused_uv}, "
          f"uk_block {mla_prepare.UK_BLOCK}, "
          f"{mla_decode.UV_LAUNCH}", flush=True)


def _save(b: Bench) -> None:
    import json  # noqa: PLC0415 (only here)

    os.makedirs(b.out_dir, exist_ok=True)
    with open(os.path.join(b.out_dir, "mla_gpu.json"), "w") as f:
        json.dump(b.results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
