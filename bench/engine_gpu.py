"""The engine on one GPU against its roofline, and transformers' `generate` on the same weights.

One run measures the ceilings (a 2 GiB device-to-device copy, counting read + write; an
8192^3 bf16 matmul), then:
- llama3-8b-random, bf16: decode ms/step at batch 1, 8, 32, 64, 128 with 1k and 8k contexts,
  against the floor of the bytes one step must read (weights, without the embedding table, plus
  every sequence's K/V) over the copy bandwidth; prefill of 2k, 8k, 32k-token prompts: seconds
  and TFLOP/s (projections, LM head row and causal attention) against the matmul rate;
- the per-weight GEMM at batch 1 / 8 / 64 (cuBLAS, bf16, replayed from a CUDA graph): achieved
  bandwidth, the part of a decode step no kernel of ours owns; and a profile (GPU time by kernel)
  of one 8B decode step at batch 1 and 32;
- smollm2-135m-random, bf16: decode ms/step at batch 1..64, eager and with CUDA graphs;
- transformers' LlamaForCausalLM.generate on the same 8B weights: ms per decode step;
- issue 23's table (bench/engine_floor.py): step / floor at batch 1..256 through
  LLMEngine.generate, and the 512 x (1k in, 256 out) offline run.

Decode steps go through the whole engine (scheduler, prepare, CUDA graph replay, sampling):
requests are admitted as a decode actor admits them after a KV transfer (KV "already there": the
cache is filled with random values), so "step ms" is what serving pays per token of every
sequence; "gpu ms" is the forward alone (graph replay) timed with CUDA events.

    python -m bench.engine_gpu            # on the GPU; JSON under $OUT (or ./out)
    python -m bench.engine_gpu --dry-run  # CPU, tiny model and sizes: checks the script's logic
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import traceback

import torch
from engine_floor import print_floors, run_floors  # a sibling file: bench scripts run as files
from torch.profiler import ProfilerActivity, profile

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.model import TritonOps
from tandem.engine.model_runner import ModelRunner
from tandem.engine.weights import hf_state_dict, load_model
from tandem.wire.messages import SamplingParams


class Bench:
    def __init__(self, dry: bool, out_dir: str):
        self.dry = dry
        self.dev = torch.device("cpu" if dry else "cuda")
        self.out_dir = out_dir
        self.results: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "dry_run": dry, "errors": {}}
        self.gen = torch.Generator().manual_seed(0)
        self.model = None

    # ---- plumbing ---------------------------------------------------------------------------
    def sync(self):
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def save(self):
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, "engine_gpu.json"), "w") as f:
            json.dump(self.results, f, indent=1, default=str)

    def section(self, name, fn):
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one broken section must not lose the others
            self.results["errors"][name] = f"{type(e).__name__}: {e}"
            print(f"# {name} FAILED: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
        print(f"# {name}: {time.perf_counter() - t0:.1f}s", flush=True)
        self.save()
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()

    def gpu_ms(self, fn, reps=20, warmup=3) -> float:
        """Median ms of fn() by CUDA events (host clock + sync on the CPU)."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if self.dev.type == "cuda":
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

    # ---- ceilings ---------------------------------------------------------------------------
    def ceilings(self):
        n = 2**16 if self.dry else 2**30  # bf16 elements (2 GiB on the GPU)
        src = torch.randn(n, device=self.dev, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        copy_ms = self.gpu_ms(lambda: dst.copy_(src), reps=30, warmup=5)
        src = dst = None  # 4 GiB back before the matmuls
        m = 256 if self.dry else 8192
        a = torch.randn(m, m, device=self.dev, dtype=torch.bfloat16)
        b = torch.randn(m, m, device=self.dev, dtype=torch.bfloat16)
        mm_ms = self.gpu_ms(lambda: a @ b, reps=20, warmup=5)
        c = self.results["ceilings"] = {
            "device": torch.cuda.get_device_name() if self.dev.type == "cuda" else "cpu",
            "copy_gbs": 2 * n * 2 / copy_ms / 1e6, "matmul_tflops": 2 * m**3 / mm_ms / 1e9,
            "torch": torch.__version__}
        if self.dev.type == "cuda":
            import triton  # noqa: PLC0415 - installed only where CUDA is (x86_64 Linux)

            c["triton"] = triton.__version__
            c["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
        print(f"# ceilings: {c}", flush=True)

    # ---- engine helpers ---------------------------------------------------------------------
    def engine(self, model, tok, num_blocks, max_batched=2048, max_seqs=256):
        cfg = EngineConfig(model="bench", cache=CacheConfig(block_size=16, num_blocks=num_blocks,
                                                          enable_prefix_caching=False),
                           scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_batched))
        e = LLMEngine(cfg, model=model, tokenizer=tok)
        with torch.no_grad():
            e.kv_cache.tensor.normal_()  # never time on zeros
        return e

    def admit(self, e, batch, ctx, max_tokens, tag):
        """`batch` requests whose first ctx - 1 positions of KV are "in the cache" (as after a KV
        transfer); the next step computes one token each."""
        vocab = e.model_config.vocab_size
        reqs = []
        for b in range(batch):
            ids = torch.randint(3, vocab, (ctx,), generator=self.gen).tolist()
            req = e.make_request(f"{tag}-{b}", prompt_token_ids=ids,
                                 sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            assert e.allocator.admit(req, ctx), "KV cache too small for the benchmark"
            req.num_computed_tokens = ctx - 1
            e.scheduler.add_ready(req)
            reqs.append(req)
        return reqs

    def decode(self, e, batch, ctx, warmup, steps, tag, weight_bytes, kv_bytes_per_token):
        reqs = self.admit(e, batch, ctx, warmup + steps + 8, tag)
        for _ in range(warmup):  # the first steps capture this shape's graph
            e.step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            e.step()  # ends reading the sampled tokens: a full sync
            times.append((time.perf_counter() - t0) * 1e3)
        # the forward alone: replay the next step's batch (idempotent KV writes)
        e.settle()  # the last step's tokens on the host: the batch's inputs are all known
        sched = e.scheduler.schedule()
        batch_inputs = e.runner.prepare(sched)
        fwd = self.gpu_ms(lambda: e.runner.execute(batch_inputs), reps=10, warmup=2)
        t0 = time.perf_counter()
        for _ in range(10):
            e.runner.prepare(sched)
        prep = (time.perf_counter() - t0) / 10 * 1e3
        seq_len = sum(r.num_computed_tokens + 1 for r in reqs)
        for r in reqs:
            e.abort(r.request_id)
        bw = self.results["ceilings"]["copy_gbs"] * 1e9
        floor = (weight_bytes + seq_len * kv_bytes_per_token) / bw * 1e3
        step = statistics.median(times)
        return {"batch": batch, "ctx": ctx, "step_ms": step, "gpu_ms": fwd, "prepare_ms": prep,
                "floor_ms": floor, "x_floor": step / floor, "tok_s": batch / step * 1e3}

    @staticmethod
    def model_bytes(model):
        """Bytes a decode step reads of the weights: every parameter once, except an untied
        embedding table (one row per token)."""
        seen, total = set(), 0
        for name, p in model.named_parameters():
            if p.data_ptr() in seen:
                continue
            seen.add(p.data_ptr())
            if name == "embed_tokens.weight" and not model.config.tie_word_embeddings:
                continue
            total += p.numel() * p.element_size()
        return total

    @staticmethod
    def kv_bytes_per_token(model):
        c = model.config
        return c.kv_bytes_per_token * model.embed_tokens.weight.element_size()

    # ---- llama3-8b ------------------------------------------------------------------------
    def llama(self):
        name = "tiny-random" if self.dry else "llama3-8b-random"
        dtype = "float32" if self.dry else "bfloat16"
        t0 = time.perf_counter()
        model, tok, cfg = load_model(name, dtype, str(self.dev), seed=0)
        if self.dry:
            model.ops = TritonOps()
        self.sync()
        self.results["llama_load_s"] = time.perf_counter() - t0
        self.model, self.tok = model, tok
        batches = (1, 2) if self.dry else (1, 8, 32, 64, 128)
        ctxs = (64, 256) if self.dry else (1024, 8192)
        prompts = (64, 128, 256) if self.dry else (2048, 8192, 32768)
        warmup, steps = (2, 3) if self.dry else (4, 16)
        wbytes, kvb = self.model_bytes(model), self.kv_bytes_per_token(model)
        # 64 x 8k (+ steps) is the largest working set; 128 x 8k (137 GB of K/V) does not fit
        max_tokens = max(max(prompts), 64 * (ctxs[-1] + 64), 128 * (ctxs[0] + 64))
        if self.dry:
            max_tokens = 4 * (max(ctxs) + 64) + max(prompts)
        e = self.engine(model, tok, num_blocks=max_tokens // 16 + 64, max_batched=max(prompts))
        if self.dry:  # the graph path's static buffers, run eagerly (no CUDA here)
            e.runner = ModelRunner(model, e.kv_cache, self.dev, cuda_graphs=True, capture=False)
        self.results["llama"] = {"model": name, "dtype": dtype, "weight_bytes": wbytes, "kv_bytes_per_token": kvb,
                                 "num_blocks": e.kv_cache.num_blocks, "decode": [], "prefill": []}
        rows = self.results["llama"]["decode"]
        for ctx in ctxs:
            for b in batches:
                if (b * (ctx + 64)) > max_tokens:
                    rows.append({"batch": b, "ctx": ctx, "skipped": "K/V does not fit on one GPU"})
                    continue
                r = self.decode(e, b, ctx, warmup, steps, f"d{b}-{ctx}", wbytes, kvb)
                rows.append(r)
                print(f"# 8b decode {r}", flush=True)
                self.save()
        self.results["llama"]["graphs"] = e.runner.graph_stats
        for b in (1, 32):
            self.results["llama"][f"profile_b{b}"] = self.profile(e, b, ctxs[0])
        # prefill: one prompt per step, whole (the token budget is the longest prompt)
        c = cfg
        proj = c.num_layers * c.hidden_size * ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                                               + c.num_heads * c.head_dim + 3 * c.intermediate_size)
        vocab = c.vocab_size
        self._prefill_one(e, prompts[0], vocab)  # compile
        for n in prompts:
            times = [self._prefill_one(e, n, vocab) for _ in range(2 if n >= 32768 else 3)]
            s = statistics.median(times)
            attn = 4 * c.num_layers * c.num_heads * c.head_dim * n * (n + 1) // 2
            flops = 2 * proj * n + 2 * c.hidden_size * vocab + attn
            tf = flops / s / 1e12
            r = {"tokens": n, "s": s, "tflops": tf, "attention_flop_share": attn / flops,
                 "of_matmul": tf / self.results["ceilings"]["matmul_tflops"]}
            self.results["llama"]["prefill"].append(r)
            print(f"# 8b prefill {r}", flush=True)
        del e
        gc.collect()

    def profile(self, e, batch, ctx, top=14):
        """GPU time by kernel of one eager decode step (the kernels a graph replays), in us."""
        e.settle()
        reqs = self.admit(e, batch, ctx, 4, f"prof{batch}")
        batch_inputs = e.runner.prepare(e.scheduler.schedule())
        eager = lambda: e.runner.execute(batch_inputs, layer_done=lambda layer: None)  # noqa: E731
        eager()
        self.sync()
        acts = [ProfilerActivity.CUDA] if self.dev.type == "cuda" else [ProfilerActivity.CPU]
        with profile(activities=acts) as prof:
            for _ in range(3):
                eager()
            self.sync()
        for r in reqs:
            e.abort(r.request_id)
        rows = []
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0) or 0
            if self.dev.type != "cuda":
                t = ev.self_cpu_time_total
            rows.append((t / 3, ev.count // 3, ev.key[:90]))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        print(f"# profile batch {batch} ctx {ctx}: {total:.0f} us in kernels per step", flush=True)
        for t, n, k in rows[:top]:
            print(f"#   {t:8.1f} us {n:4d}x  {k}", flush=True)
        return {"total_us": total, "kernels": [{"us": t, "count": n, "name": k} for t, n, k in rows[:40]]}

    def _prefill_one(self, e, n, vocab):
        ids = torch.randint(3, vocab, (n,), generator=self.gen).tolist()
        e.add_request(f"p{n}-{time.perf_counter_ns()}", prompt_token_ids=ids,
                      sampling=SamplingParams(max_tokens=1, ignore_eos=True))
        self.sync()
        t0 = time.perf_counter()
        out = e.step()
        t = time.perf_counter() - t0
        assert out and out[0].finished
        return t

    # ---- GEMMs ----------------------------------------------------------------------------
    def gemms(self):
        model = self.model
        layer = model.layers[0]
        weights = {"qkv": layer.self_attn.qkv_proj.weight, "o": layer.self_attn.o_proj.weight,
                   "gate_up": layer.mlp.gate_up_proj.weight, "down": layer.mlp.down_proj.weight,
                   "lm_head": model.lm_head.weight}
        bw = self.results["ceilings"]["copy_gbs"]
        rows = self.results["gemm"] = []
        for m in (1, 8, 64):
            for name, w in weights.items():
                # several copies of the weight: one pass over them all is well past the 60 MB L2
                copies = [w] + [torch.randn_like(w) for _ in range(max(0, 4 - 1 if w.numel() * 2 > 2**28 else 7))]
                x = torch.randn(m, w.shape[1], device=w.device, dtype=w.dtype)

                def run():
                    for wc in copies:
                        torch.nn.functional.linear(x, wc)
                if self.dev.type == "cuda":  # replay a graph: eager launches would be what is timed
                    run()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        run()
                    ms = self.gpu_ms(graph.replay, reps=10) / len(copies)
                else:
                    ms = self.gpu_ms(run, reps=10) / len(copies)
                gbs = w.numel() * w.element_size() / ms / 1e6
                rows.append({"m": m, "weight": name, "shape": list(w.shape), "us": ms * 1e3,
                             "gbs": gbs, "of_copy": gbs / bw})
                copies = None  # the weight copies go before the next shape's
        print(f"# gemm {[(r['m'], r['weight'], round(r['of_copy'], 2)) for r in rows]}", flush=True)

    # ---- transformers ---------------------------------------------------------------------
    def peer(self):
        # the reference implementation: a test extra, loaded only for this section
        from transformers import LlamaConfig  # noqa: PLC0415
        from transformers import LlamaForCausalLM as HFLlama  # noqa: PLC0415

        model = self.model
        self.model = None
        cfg = model.config
        sd = device_hf_state_dict(model)
        old = torch.get_default_dtype()
        torch.set_default_dtype(model.embed_tokens.weight.dtype)
        try:
            with torch.device(self.dev):
                hf = HFLlama(LlamaConfig(**cfg.to_hf()))
        finally:
            torch.set_default_dtype(old)
        missing, unexpected = hf.load_state_dict(sd, strict=False)
        assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
        del sd, model
        gc.collect()
        hf.eval()
        ctx = 64 if self.dry else 1024
        rows = self.results["peer"] = []
        for batch in ((1, 2) if self.dry else (1, 32)):
            ids = torch.randint(3, cfg.vocab_size, (batch, ctx), generator=self.gen).to(self.dev)

            def gen(n):
                self.sync()
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                      min_new_tokens=n, do_sample=False, pad_token_id=0)
                self.sync()
                assert out.shape[1] == ctx + n
                return time.perf_counter() - t0
            gen(2)
            short, long_ = (2, 6) if self.dry else (4, 20)
            t_short, t_long = gen(short), gen(long_)
            r = {"batch": batch, "ctx": ctx, "step_ms": (t_long - t_short) / (long_ - short) * 1e3,
                 "transformers": __import__("transformers").__version__}
            rows.append(r)
            print(f"# transformers generate {r}", flush=True)
        hf = None  # the peer model's memory back before the next section

    # ---- smollm2 --------------------------------------------------------------------------
    def small(self):
        name = "tiny-random" if self.dry else "smollm2-135m-random"
        dtype = "float32" if self.dry else "bfloat16"
        model, tok, _ = load_model(name, dtype, str(self.dev), seed=0)
        if self.dry:
            model.ops = TritonOps()
        batches = (1, 2) if self.dry else (1, 2, 4, 8, 16, 32, 64)
        ctx = 64 if self.dry else 512
        warmup, steps = (2, 3) if self.dry else (4, 16)
        e = self.engine(model, tok, num_blocks=max(batches) * (ctx + 64) // 16 + 64)
        graph_runner = (ModelRunner(model, e.kv_cache, self.dev) if not self.dry else
                        ModelRunner(model, e.kv_cache, self.dev, cuda_graphs=True, capture=False))
        eager_runner = ModelRunner(model, e.kv_cache, self.dev, cuda_graphs=False)
        wbytes, kvb = self.model_bytes(model), self.kv_bytes_per_token(model)
        rows = self.results["smollm2"] = []
        for b in batches:
            row = {"batch": b, "ctx": ctx}
            for mode, runner in (("eager", eager_runner), ("graph", graph_runner)):
                e.runner = runner
                r = self.decode(e, b, ctx, warmup, steps, f"s{mode}{b}", wbytes, kvb)
                row[f"{mode}_step_ms"], row[f"{mode}_gpu_ms"] = r["step_ms"], r["gpu_ms"]
                row["floor_ms"] = r["floor_ms"]
            row["speedup"] = row["eager_step_ms"] / row["graph_step_ms"]
            rows.append(row)
            print(f"# smollm2 decode {row}", flush=True)

    # ---- report ---------------------------------------------------------------------------
    def table(self):
        R = self.results
        c = R.get("ceilings", {})
        print(f"\n{c.get('device')}: copy {c.get('copy_gbs', 0):.0f} GB/s (read + write), bf16 matmul "
              f"{c.get('matmul_tflops', 0):.0f} TFLOP/s; torch {c.get('torch')}, triton {c.get('triton')}")
        ll = R.get("llama", {})
        if ll.get("decode"):
            print(f"\n{ll['model']} {ll['dtype']} decode (engine step: schedule + prepare + graph replay + sampling)")
            print(f"{'batch':>5} {'ctx':>5} {'step ms':>8} {'gpu ms':>7} {'floor ms':>8} {'x floor':>7} "
                  f"{'tok/s':>8} {'prep ms':>7}")
            for r in ll["decode"]:
                if "skipped" in r:
                    print(f"{r['batch']:>5} {r['ctx']:>5}  skipped: {r['skipped']}")
                    continue
                print(f"{r['batch']:>5} {r['ctx']:>5} {r['step_ms']:>8.2f} {r['gpu_ms']:>7.2f} "
                      f"{r['floor_ms']:>8.2f} {r['x_floor']:>7.2f} {r['tok_s']:>8.0f} {r['prepare_ms']:>7.2f}")
            one = next((r for r in ll["decode"] if r.get("batch") == 1 and "step_ms" in r), None)
            b64 = next((r for r in ll["decode"] if r.get("batch") == 64 and "step_ms" in r), None)
            if one and b64:
                print(f"batch-64 / batch-1 throughput at ctx {one['ctx']}: {b64['tok_s'] / one['tok_s']:.1f}x")
        if ll.get("prefill"):
            print(f"\n{ll['model']} {ll['dtype']} prefill (one prompt, one step)")
            print(f"{'tokens':>6} {'s':>7} {'TFLOP/s':>8} {'of mm':>6} {'attn %':>6}")
            for r in ll["prefill"]:
                print(f"{r['tokens']:>6} {r['s']:>7.3f} {r['tflops']:>8.0f} {r['of_matmul']:>6.2f} "
                      f"{100 * r['attention_flop_share']:>6.0f}")
        if R.get("peer"):
            print("\ntransformers generate, same weights (ms per decode step)")
            for r in R["peer"]:
                ours = next((x for x in ll.get("decode", []) if x.get("batch") == r["batch"]
                             and x.get("ctx") == r["ctx"] and "step_ms" in x), None)
                vs = f"  ours {ours['step_ms']:.2f} ms: {r['step_ms'] / ours['step_ms']:.1f}x faster" if ours else ""
                print(f"batch {r['batch']:>3} ctx {r['ctx']}: {r['step_ms']:.1f} ms{vs}")
        if R.get("gemm"):
            print("\ncuBLAS GEMM per weight (fraction of copy bandwidth)")
            for m in sorted({r["m"] for r in R["gemm"]}):
                print(f"  m={m:>3}: " + "  ".join(f"{r['weight']} {r['of_copy']:.2f}"
                                                  for r in R["gemm"] if r["m"] == m))
        if R.get("smollm2"):
            print("\nsmollm2-135m-random bf16 decode, ctx 512: eager vs CUDA graphs (ms/step)")
            print(f"{'batch':>5} {'eager':>7} {'graph':>7} {'speedup':>7} {'gpu':>6} {'floor':>6}")
            for r in R["smollm2"]:
                print(f"{r['batch']:>5} {r['eager_step_ms']:>7.2f} {r['graph_step_ms']:>7.2f} "
                      f"{r['speedup']:>7.1f} {r['graph_gpu_ms']:>6.2f} {r['floor_ms']:>6.3f}")
        print_floors(R)
        if R["errors"]:
            print(f"\nERRORS: {R['errors']}")


def device_hf_state_dict(model) -> dict[str, torch.Tensor]:
    """Views of the model's own GPU tensors under Hugging Face names (no copy to the host)."""
    return hf_state_dict(model, on_host=False)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model and sizes (Triton interpreter)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "out")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: floor,llama,gemm,peer,small")
    parser.add_argument("--floor-rows", default="", help="the floor section's rows, e.g. 1x1024,256x1024 "
                        "(default: bench/engine_floor.ROWS)")
    parser.add_argument("--floor-profile", action="store_true",
                        help="also profile one eager decode step of each floor row (kernel times)")
    parser.add_argument("--split-below", type=int, default=0,
                        help="SplitPolicy.split_below for this run (0: the default)")
    parser.add_argument("--floor-offline", default="on", choices=("on", "off"),
                        help="the floor section's 512 x (1k in, 256 out) offline run")
    args = parser.parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --dry-run)")
    torch.manual_seed(0)
    b = Bench(args.dry_run, args.out)
    b.floor_rows = [tuple(int(x) for x in r.split("x")) for r in args.floor_rows.split(",") if r]
    b.floor_offline = args.floor_offline == "on"
    b.floor_profile = args.floor_profile
    if args.split_below:  # the decode attention's split plan (engine.kernels.attention_split), to compare
        from tandem.engine.kernels.attention_split import set_split_policy  # noqa: PLC0415 (after TRITON_INTERPRET)

        set_split_policy(split_below=args.split_below)
    skip = set(filter(None, args.skip.split(",")))
    t0 = time.perf_counter()
    b.section("ceilings", b.ceilings)
    if "floor" not in skip:
        b.section("floor", lambda: run_floors(b))
    if "small" not in skip:
        b.section("smollm2", b.small)
    if "llama" not in skip:
        b.section("llama", b.llama)
        if "gemm" not in skip:
            b.section("gemm", b.gemms)
        if "peer" not in skip:
            b.section("peer", b.peer)
    b.results["wall_s"] = time.perf_counter() - t0
    b.save()
    b.table()


if __name__ == "__main__":
    main()
