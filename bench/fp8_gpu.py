"""FP8 weights on one GPU (issue 24 item 4): the weight-only Triton GEMM and torch._scaled_mm against
bf16 cuBLAS on the 8B projections, then whole decode steps through LLMEngine (CUDA graphs).

One run measures, in order:
- the ceilings: a 2 GiB device-to-device copy (read + write) and an 8192^3 bf16 matmul;
- kernels, llama3-8b's four projections at M = 1..256 tokens: bf16 F.linear, the Triton kernel
  (a small sweep of tile configs per M bucket: the best is kept for the rest of the run and
  printed, and the committed heuristic in engine/kernels/fp8_gemm.py is meant to match it) and
  `_scaled_mm` with per-token activation scales; each replayed from a CUDA graph over enough
  weight copies to be well past the L2. The smallest M from which `_scaled_mm` beats the kernel
  on the sum of the four becomes `SCALED_MM_MIN_TOKENS` for the rest of the run;
- llama3-8b-random decode ms/step, bf16 and FP8 (quantized at load), batch 1, 64, 256, context
  1k (bench/engine_gpu.py's helpers: requests admitted with their KV "already there", engine steps
  with CUDA graphs), against the floor (weights + KV bytes over the copy bandwidth);
- quality, FP8 against bf16 on 256 random 64-token prompts: max and mean |logit difference| at
  the last position, greedy first-token agreement, and the share of 32 greedy tokens that match;
- llama3-70b-random FP8 (built and quantized layer by layer) decode at batch 1 and 64 against
  its floor; qwen2.5-32b-random bf16 and FP8 at batch 1 and 64 against theirs.
- at batch 1, where each step goes: the host's phases (engine.last_step) and the GPU time of
  each kernel of an eager forward (torch.profiler; the graph replays the same kernels).

`--tuned fp8_sweep.json` (bench/fp8_sweep.py's output, same run) replaces the committed one-token
configs by the sweep's best per weight shape for the whole run.

    python3 bench/fp8_gpu.py            # on the GPU; JSON under $OUT (or ./out)
    python3 bench/fp8_gpu.py --dry-run  # CPU, tiny model and sizes: checks the script's logic
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from engine_gpu import Bench  # a sibling file: bench scripts run as files
import tandem.engine.quant.fp8 as fp8_quant
from tandem.engine.model import TritonOps
from tandem.engine.model_runner import ModelRunner
from tandem.engine.weights import load_model
from tandem.wire.messages import SamplingParams

fp8_kernel = None  # tandem.engine.kernels.fp8_gemm, imported by FP8Bench (Triton)

M_SWEEP = (1, 16, 32, 64, 128, 256)
# M bucket -> tile configs tried: (block_m, block_n, block_k, num_warps, num_stages)
CANDIDATES = {
    16: [(16, 16, 256, 4, 4), (16, 32, 256, 4, 4), (16, 16, 512, 4, 3), (16, 32, 128, 4, 6),
         (16, 64, 128, 4, 4), (16, 16, 128, 2, 6), (16, 64, 256, 4, 3), (16, 32, 512, 4, 3),
         (16, 64, 256, 8, 4), (16, 128, 128, 8, 4), (16, 32, 256, 4, 6), (16, 16, 256, 2, 5)],
    32: [(32, 32, 128, 4, 4), (32, 64, 128, 4, 4), (32, 32, 256, 4, 3), (32, 64, 64, 4, 5)],
    64: [(64, 64, 128, 4, 4), (64, 128, 128, 8, 3), (64, 64, 64, 4, 5), (64, 32, 128, 4, 4)],
    256: [(128, 128, 128, 8, 3), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4), (128, 256, 64, 8, 3)],
}
# one token: the CUDA-core kernel, (block_n, block_k, num_warps, num_stages)
GEMV = [(8, 512, 4, 3), (16, 512, 4, 3), (16, 256, 4, 4), (32, 256, 4, 3), (16, 1024, 8, 2), (32, 512, 8, 3),
        (8, 1024, 4, 2), (64, 128, 4, 4), (4, 1024, 4, 3), (32, 128, 4, 4), (16, 512, 8, 4), (8, 256, 2, 4)]


class FP8Bench(Bench):
    def __init__(self, dry: bool, out_dir: str, quick: bool = False):
        super().__init__(dry, out_dir)
        self.quick = quick  # one token only: the batch-1 kernels and decode step
        global fp8_kernel
        import tandem.engine.kernels.fp8_gemm as fp8_kernel  # noqa: PLC0415 (triton loads after main sets TRITON_INTERPRET)

    def save(self):
        super().save()
        os.replace(os.path.join(self.out_dir, "engine_gpu.json"), os.path.join(self.out_dir, "fp8_gpu.json"))

    # ---- kernels ------------------------------------------------------------------------------
    def _graph_us(self, fn_per_copy, copies) -> float:
        """Microseconds per call of fn_per_copy(copy), replayed from one graph over all copies."""
        def run():
            for c in copies:
                fn_per_copy(c)
        if self.dev.type != "cuda":
            return self.gpu_ms(run, reps=2, warmup=1) / len(copies) * 1e3
        run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        return self.gpu_ms(graph.replay, reps=10) / len(copies) * 1e3

    def shapes(self):
        """name -> (N, K, token counts swept): llama3-8b's projections, then llama3-70b's."""
        if self.dry:
            return {"qkv": (128, 64, (1, 2)), "o": (64, 64, (1, 2)), "70b-down": (64, 256, (1,))}
        if self.quick:
            return {"qkv": (6144, 4096, (1,)), "o": (4096, 4096, (1,)), "gate_up": (28672, 4096, (1,)),
                    "down": (4096, 14336, (1,))}
        return {"qkv": (6144, 4096, M_SWEEP), "o": (4096, 4096, M_SWEEP), "gate_up": (28672, 4096, M_SWEEP),
                "down": (4096, 14336, M_SWEEP), "70b-qkv": (10240, 8192, (1, 16, 64)),
                "70b-o": (8192, 8192, (1, 16, 64)), "70b-gate_up": (57344, 8192, (1, 16, 64)),
                "70b-down": (8192, 28672, (1, 16, 64))}

    def kernels(self):
        rows = self.results["kernels"] = []
        best = self.results["tuned"] = {}
        for name, (n, k, ms) in self.shapes().items():
            w = torch.randn(n, k, device=self.dev, dtype=torch.bfloat16) * k ** -0.5
            ncopy = 2 if self.dry else max(2, int(2**29 // (n * k)))  # >= 512 MB of FP8 (bf16: 1 GB)
            bf = [w] + [torch.randn_like(w) for _ in range(ncopy - 1)]
            q8 = [fp8_quant.quantize_fp8(c) for c in bf]
            for m in ms:
                x = torch.randn(m, k, device=self.dev, dtype=torch.bfloat16)
                r = {"weight": name, "n": n, "k": k, "m": m,
                     "bf16_us": self._graph_us(lambda c: F.linear(x, c), bf)}
                r["triton_us"], cfg, tried = self._best_triton(x, q8, m, n, k)
                best.setdefault(name, {})[m] = cfg
                self.results.setdefault("sweep", {}).setdefault(name, {})[m] = tried
                if not self.dry:
                    r["scaled_mm_us"] = self._graph_us(lambda c: fp8_quant.scaled_mm_linear(x, c[0], c[1], None), q8)
                r["fp8_bytes_gbs"] = n * k / r["triton_us"] / 1e3
                rows.append(r)
                print(f"# kernel {r} cfg {cfg}", flush=True)
            bf = q8 = None
            self.save()
        self._pick_crossover(rows)

    def _best_triton(self, x, q8, m, n, k):
        """(us, config) of the fastest candidate tile config (and the committed heuristic's) at M = m."""
        bucket = next(b for b in sorted(CANDIDATES) if m <= b or b == max(CANDIDATES))
        cands = [fp8_kernel.GemmConfig(*c) for c in CANDIDATES[bucket]]
        if m == 1:
            cands += [fp8_kernel.GemmConfig(1, *c, gemv=True) for c in GEMV]
        cands.append(fp8_kernel.choose_config(m, n, k, 0))
        if self.dry:
            cands = [fp8_kernel.GemmConfig(16, 16, 32, 4, 2)] + ([fp8_kernel.GemmConfig(1, 16, 32, gemv=True)]
                                                                 if m == 1 else [])
        out = []
        for cfg in dict.fromkeys(cands):
            try:
                us = self._graph_us(lambda c, cfg=cfg: fp8_kernel.fp8_gemm(x, c[0], c[1], config=cfg), q8)
            except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
                print(f"# config {cfg} failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            out.append((us, cfg))
        us, cfg = min(out, key=lambda t: t[0])
        return us, cfg, sorted((round(u, 2), str(c)) for u, c in out)

    def _pick_crossover(self, rows):
        """Tuned tiles for the rest of the run, and the token count from which _scaled_mm wins."""
        tuned = self.results["tuned"]

        def choose(m, n, k, group_k, elem_bytes=2):
            for name, (nn_, kk, _) in self.shapes().items():
                if (nn_, kk) == (n, k) and not group_k and elem_bytes == 2:
                    ms = sorted(tuned[name])
                    return tuned[name][next((b for b in ms if m <= b), ms[-1])]
            return heuristic(m, n, k, group_k, elem_bytes)
        heuristic = fp8_kernel.choose_config
        fp8_kernel.choose_config = choose
        if self.dry:
            return
        by_m = {}
        for r in (r for r in rows if not r["weight"].startswith("70b")):
            t, s = by_m.get(r["m"], (0.0, 0.0))
            by_m[r["m"]] = (t + r["triton_us"], s + r["scaled_mm_us"])
        if len(by_m) < 2:  # --quick: the committed crossover stays
            return
        wins = [m for m, (t, s) in sorted(by_m.items()) if s < t]
        cross = wins[0] if wins and all(m in wins for m in by_m if m >= wins[0]) else max(by_m) + 1
        fp8_quant.SCALED_MM_MIN_TOKENS = cross
        self.results["scaled_mm_min_tokens"] = cross
        print(f"# _scaled_mm from {cross} tokens; per-M sums (triton us, scaled_mm us): {by_m}", flush=True)


    # ---- decode, quality ------------------------------------------------------------------------
    def decode_rows(self, label, model, tok, batches, ctx):
        wb, kvb = weight_bytes(model), self.kv_bytes_per_token(model)
        e = self.engine(model, tok, num_blocks=max(batches) * (ctx + 64) // 16 + 64, max_seqs=max(batches))
        if self.dry:  # the graph path's static buffers, run eagerly (no CUDA here)
            e.runner = ModelRunner(model, e.kv_cache, self.dev, cuda_graphs=True, capture=False)
        warmup, steps = (2, 3) if self.dry else (4, 12)
        rows = []
        for b in batches:
            r = self.decode(e, b, ctx, warmup, steps, f"{label}-{b}", wb, kvb)
            r.update(model=label, weight_bytes=wb)
            if b == 1:
                r["host_phases_ms"] = self.phases(e, ctx, label)
                self.results.setdefault("profile", {})[label] = self.profile(e, 1, ctx, top=24)
            rows.append(r)
            print(f"# decode {r}", flush=True)
        self.results.setdefault("graphs", {})[label] = e.runner.graph_stats
        del e
        self.free()
        return rows

    def phases(self, e, ctx, tag):
        """Median host ms per phase of a batch-1 decode step (engine.step's last_step: schedule,
        prepare, launch, sample + wait, output)."""
        reqs = self.admit(e, 1, ctx, 32, f"{tag}-phases")
        for _ in range(3):
            e.step()
        seen = []
        for _ in range(12):
            e.step()
            seen.append(e.last_step[5])
        for r in reqs:
            e.abort(r.request_id)
        e.settle()
        return [statistics.median(p[i] for p in seen) * 1e3 for i in range(len(seen[0]))]

    def free(self):
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()

    def llama8b(self):
        name = "tiny-random" if self.dry else "llama3-8b-random"
        dtype = "float32" if self.dry else "bfloat16"
        batches, ctx = ((1, 2, 4) if self.dry else (1,) if self.quick else (1, 64, 256)), (64 if self.dry else 1024)
        rows = self.results["decode_8b"] = []
        for label, quant in (("8b-bf16", None), ("8b-fp8", "fp8")):
            t0 = time.perf_counter()
            model, tok, _ = load_model(name, dtype, str(self.dev), seed=0, quantization=quant)
            self.sync()
            self.results[f"load_s_{label}"] = time.perf_counter() - t0
            if self.dry:
                model.ops = TritonOps()
            rows += self.decode_rows(label, model, tok, batches, ctx)
            setattr(self, label.replace("-", "_"), model)
            self.tok = tok

    def quality(self):
        ref, fp8, tok = getattr(self, "8b_bf16", None), getattr(self, "8b_fp8", None), self.tok
        n, plen, new = (8, 16, 4) if self.dry else (256, 64, 32)
        vocab = ref.config.vocab_size
        prompts = [torch.randint(3, vocab, (plen,), generator=self.gen).tolist() for _ in range(n)]
        la, lb = (self._last_logits(m, tok, prompts) for m in (ref, fp8))
        diff = (la - lb).abs()
        reqs = [{"prompt_token_ids": p, "max_tokens": new, "ignore_eos": True} for p in prompts]
        ga, gb = ([r["token_ids"] for r in self.engine(m, tok, num_blocks=n * (plen + new) // 16 + 2 * n,
                                                       max_seqs=n).generate(reqs)] for m in (ref, fp8))
        same = sum(x == y for a, b in zip(ga, gb) for x, y in zip(a, b))
        prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ga, gb))
        q = self.results["quality"] = {
            "prompts": n, "prompt_tokens": plen, "max_abs_logit_diff": diff.max().item(),
            "mean_abs_logit_diff": diff.mean().item(), "logit_std_bf16": la.std().item(),
            "greedy_first_token_agreement": (la.argmax(-1) == lb.argmax(-1)).float().mean().item(),
            "greedy_token_agreement": same / (n * new), "matched_prefix_share": prefix / (n * new),
            "new_tokens": new}
        print(f"# quality {q}", flush=True)
        del self.__dict__["8b_bf16"], self.__dict__["8b_fp8"]
        self.free()

    def _last_logits(self, model, tok, prompts):
        """[len(prompts), vocab] fp32: the logits after each whole prompt, one prefill step."""
        tokens = sum(map(len, prompts))
        e = self.engine(model, tok, num_blocks=tokens // 16 + 2 * len(prompts), max_batched=tokens,
                        max_seqs=len(prompts))
        for i, p in enumerate(prompts):
            e.add_request(f"q{i}", prompt_token_ids=p, sampling=SamplingParams(max_tokens=1, ignore_eos=True))
        batch = e.runner.prepare(e.scheduler.schedule())
        with torch.no_grad():
            hidden = model(batch.input_ids, batch.positions, e.kv_cache.tensor, batch.meta)
            last = torch.tensor([len(p) for p in prompts], device=hidden.device).cumsum(0) - 1
            logits = model.compute_logits(hidden[last])
        for i in range(len(prompts)):
            e.abort(f"q{i}")
        del e
        return logits

    def llama70b(self):
        name = "tiny-random" if self.dry else "llama3-70b-random"
        dtype = "float32" if self.dry else "bfloat16"
        if self.dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        model, tok, _ = load_model(name, dtype, str(self.dev), seed=0, quantization="fp8")
        self.sync()
        self.results["load_s_70b"] = time.perf_counter() - t0
        if self.dev.type == "cuda":
            self.results["load_peak_gib_70b"] = torch.cuda.max_memory_allocated() / 2**30
        print(f"# 70b fp8 built in {self.results['load_s_70b']:.0f} s, peak "
              f"{self.results.get('load_peak_gib_70b', 0):.1f} GiB", flush=True)
        if self.dry:
            model.ops = TritonOps()
        self.results["decode_70b"] = self.decode_rows("70b-fp8", model, tok, (1, 2) if self.dry else (1, 64),
                                                      64 if self.dry else 1024)
        del model
        self.free()


    def qwen32b(self):
        name = "tiny-random" if self.dry else "qwen2.5-32b-random"
        dtype = "float32" if self.dry else "bfloat16"
        rows = self.results["decode_32b"] = []
        for label, quant in (("32b-bf16", None), ("32b-fp8", "fp8")):
            model, tok, _ = load_model(name, dtype, str(self.dev), seed=0, quantization=quant)
            if self.dry:
                model.ops = TritonOps()
            rows += self.decode_rows(label, model, tok, (1, 2) if self.dry else (1, 64), 64 if self.dry else 1024)
            del model
            self.free()


def apply_tuned(path: str) -> dict:
    """Make fp8_gemm take bench/fp8_sweep.py's best one-token config for each weight shape it
    swept (the committed choose_config elsewhere). -> {"N,K": config}."""
    with open(path) as f:
        best = json.load(f)["best"]
    base = fp8_kernel.choose_config

    def choose(m, n, k, group_k, elem_bytes=2):
        c = best.get(f"{n},{k}")
        if m == 1 and c is not None and not group_k:
            return fp8_kernel.GemmConfig(1, c[0], c[1], c[2], c[3], gemv=True)
        return base(m, n, k, group_k, elem_bytes)
    fp8_kernel.choose_config = choose
    return best


def weight_bytes(model) -> int:
    """Bytes a decode step reads: parameters and buffers (FP8 scales) once, the embedding table not."""
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.data_ptr() in seen or "rotary" in name:
            continue
        seen.add(t.data_ptr())
        if name == "embed_tokens.weight" and not model.config.tie_word_embeddings:
            continue
        total += t.numel() * t.element_size()
    return total


def print_table(R):
    c = R.get("ceilings", {})
    print(f"\n{c.get('device')}: copy {c.get('copy_gbs', 0):.0f} GB/s (read + write), bf16 matmul "
          f"{c.get('matmul_tflops', 0):.0f} TFLOP/s; torch {c.get('torch')}, triton {c.get('triton')}")
    if R.get("kernels"):
        print("\nllama3-8b projections, us per GEMM (CUDA graph replay over weight copies past the L2)")
        print(f"{'weight':>8} {'M':>4} {'bf16':>8} {'fp8 triton':>10} {'scaled_mm':>9} {'triton/bf16':>11} "
              f"{'fp8 GB/s':>8}")
        for r in R["kernels"]:
            sm = r.get("scaled_mm_us", float("nan"))
            print(f"{r['weight']:>8} {r['m']:>4} {r['bf16_us']:>8.1f} {r['triton_us']:>10.1f} {sm:>9.1f} "
                  f"{r['triton_us'] / r['bf16_us']:>11.2f} {r['fp8_bytes_gbs']:>8.0f}")
        print(f"_scaled_mm from {R.get('scaled_mm_min_tokens')} tokens; tuned tiles: {R.get('tuned')}")
    rows = R.get("decode_8b", []) + R.get("decode_32b", []) + R.get("decode_70b", [])
    if rows:
        print("\ndecode step, context 1k (engine step: schedule + prepare + graph replay + sampling)")
        print(f"{'model':>8} {'batch':>5} {'step ms':>8} {'gpu ms':>7} {'floor ms':>8} {'x floor':>7} {'tok/s':>7} "
              f"{'vs bf16':>7}")
        bf = {(r["model"][:-5], r["batch"]): r["step_ms"] for r in rows if r["model"].endswith("-bf16")}
        for r in rows:
            base = bf.get((r["model"][:-4], r["batch"])) if r["model"].endswith("-fp8") else None
            rel = r["step_ms"] / base if base else float("nan")
            print(f"{r['model']:>8} {r['batch']:>5} {r['step_ms']:>8.2f} {r['gpu_ms']:>7.2f} {r['floor_ms']:>8.2f} "
                  f"{r['x_floor']:>7.2f} {r['tok_s']:>7.0f} {rel:>7.2f}")
    for label, p in R.get("profile", {}).items():
        r = next(r for r in rows if r["model"] == label and r["batch"] == 1)
        print(f"\n{label} batch 1: step {r['step_ms']:.2f} ms, graph replay {r['gpu_ms']:.2f} ms, kernels "
              f"(eager) {p['total_us'] / 1e3:.2f} ms; host ms (schedule, prepare, launch, sample+wait, "
              f"output) {[round(x, 3) for x in r.get('host_phases_ms', [])]}")
        for k in p["kernels"][:12]:
            print(f"  {k['us']:8.1f} us {k['count']:4d}x  {k['name'][:70]}")
    q = R.get("quality")
    if q:
        print(f"\nFP8 vs bf16 (8B), {q['prompts']} random {q['prompt_tokens']}-token prompts: logits max |diff| "
              f"{q['max_abs_logit_diff']:.3f}, mean {q['mean_abs_logit_diff']:.3f} (bf16 std "
              f"{q['logit_std_bf16']:.3f}); greedy first token {q['greedy_first_token_agreement']:.1%}, "
              f"{q['new_tokens']} greedy tokens {q['greedy_token_agreement']:.1%} equal, matched prefix "
              f"{q['matched_prefix_share']:.1%}")
    if R.get("tuned_gemv"):
        print(f"one-token configs from the sweep: {R['tuned_gemv']}")
    for k in ("load_s_8b-bf16", "load_s_8b-fp8", "load_s_70b", "load_peak_gib_70b"):
        if k in R:
            print(f"{k}: {R[k]:.1f}")
    if R["errors"]:
        print(f"\nerrors: {R['errors']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model and sizes (Triton interpreter)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "out")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: kernels,8b,quality,70b,32b")
    parser.add_argument("--tuned", default="", help="bench/fp8_sweep.py's JSON: its one-token configs for this run")
    parser.add_argument("--quick", action="store_true", help="batch 1 only: the M=1 sweep and 8B decode step")
    args = parser.parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --dry-run)")
    torch.manual_seed(0)
    b = FP8Bench(args.dry_run, args.out, args.quick)
    if args.tuned:
        b.results["tuned_gemv"] = apply_tuned(args.tuned)
    skip = set(filter(None, args.skip.split(",")))
    b.section("ceilings", b.ceilings)
    for name, fn in (("kernels", b.kernels), ("8b", b.llama8b), ("quality", b.quality), ("70b", b.llama70b),
                     ("32b", b.qwen32b)):
        if name not in skip:
            b.section(name, fn)
    print_table(b.results)


if __name__ == "__main__":
    main()
