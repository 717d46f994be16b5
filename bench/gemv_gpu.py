"""The batch-1 decode step with its norms and SiLU folded into the projections' GEMVs
(engine/kernels/gemv.py), on one GPU (issues 23 and 24: the batch-1 aims).

One run measures, in order:
- the ceilings (bench/engine_gpu.py: device copy rate, bf16 matmul rate);
- kernels, per projection shape of llama3-8b and qwen2.5-32b and per weight dtype (bf16, FP8 per
  channel): what a one-token step runs today (add + RMSNorm then the projection for q/k/v and
  gate/up; SiLU-and-mul then the projection for down; o alone; bf16 projections in cuBLAS, FP8
  in the GEMV) against the fused GEMV over a few tile configs, each replayed from one CUDA graph
  over enough weight copies to be past the L2. Prints the best config per shape (the decode steps
  below use the committed ones) and the shapes where the fused GEMV beats the separate launches (engine.kernels.gemv.WINS is meant to hold
  those that also win in the decode step);
- llama3-8b-random decode steps at batch 1, context 1k or --ctx (bench/fp8_gpu.py's decode rows: CUDA
  graphs, the overlapped step, the kernel profile of one eager forward), bf16 with the fused
  GEMV off (cuBLAS and the separate launches), on where engine.kernels.gemv.WINS says (the
  default), and on for every projection and prologue; FP8 likewise; with programmatic dependent
  launch off, waiting, or prefetching (gemv.PDL); each against the floor (bytes over the copy
  rate) and FP8 against bf16.

    python3 bench/gemv_gpu.py            # on the GPU; JSON under $OUT (or ./out)
    python3 bench/gemv_gpu.py --dry-run  # CPU (Triton interpreter), tiny shapes: the script's logic
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch
import torch.nn.functional as F

from fp8_gpu import FP8Bench  # a sibling file: bench scripts run as files
import tandem.engine.quant.fp8 as fp8_quant
from tandem.engine.model import TritonOps
from tandem.engine.weights import load_model

# tandem.engine.kernels.gemv / .fused / .pdl / .attention_rope_kv / .attention_split / .paged_attention,
# imported after TRITON_INTERPRET is set
gemv_mod = fused_mod = pdl_mod = rope_kv = split_mod = paged_mod = rows_mod = None

# name -> (N, K, what precedes the projection in a layer)
SHAPES = {"8b-qkv": (6144, 4096, "norm"), "8b-o": (4096, 4096, "none"), "8b-gate_up": (28672, 4096, "norm"),
          "8b-down": (4096, 14336, "silu"), "8b-lm_head": (128256, 4096, "none"),
          "32b-qkv": (7168, 5120, "norm"), "32b-o": (5120, 5120, "none"),
          "32b-gate_up": (55296, 5120, "norm"), "32b-down": (5120, 27648, "silu")}
# (block_n, block_k, num_warps, num_stages, thread_sums)
BF16_CANDIDATES = [(4, 512, 4, 4, False), (4, 256, 2, 4, False), (8, 256, 4, 3, False), (4, 1024, 4, 2, False),
                   (8, 512, 4, 3, False), (2, 1024, 4, 3, False), (4, 1024, 4, 2, True), (8, 1024, 4, 2, True),
                   (4, 2048, 8, 2, True)]
FP8_CANDIDATES = [(4, 512, 2, 4, False), (4, 1024, 4, 1, False), (4, 1024, 4, 3, False), (8, 512, 4, 3, False),
                  (4, 2048, 4, 2, True), (8, 2048, 4, 2, True), (4, 1024, 4, 3, True), (8, 1024, 4, 3, True),
                  (8, 2048, 8, 2, True), (16, 2048, 8, 2, True), (8, 1024, 4, 1, True), (16, 1024, 8, 3, True),
                  (16, 1024, 8, 2, True), (32, 512, 8, 2, True), (32, 512, 4, 2, True), (16, 1024, 4, 2, True)]

# engine.kernels.gemv_rows (several rows of x): (block_n, block_k, num_warps, num_stages)
ROWS_CANDIDATES = {"fp8": [(4, 512, 1, 2), (8, 512, 1, 2), (2, 512, 1, 2), (4, 1024, 1, 2), (4, 256, 1, 2),
                           (8, 256, 1, 2), (2, 1024, 1, 2), (4, 512, 2, 2)],
                   "bf16": [(4, 256, 1, 2), (8, 256, 1, 2), (2, 256, 1, 2), (4, 512, 1, 2), (2, 512, 1, 2),
                            (4, 128, 1, 2), (8, 128, 1, 2), (4, 256, 2, 2)]}


class GemvBench(FP8Bench):
    def save(self):
        super(FP8Bench, self).save()
        os.replace(os.path.join(self.out_dir, "engine_gpu.json"), os.path.join(self.out_dir, "gemv_gpu.json"))

    def kernel_shapes(self):
        if self.dry:
            return {"qkv": (48, 64, "norm"), "o": (32, 64, "none"), "down": (32, 96, "silu")}
        return {k: v for k, v in SHAPES.items() if k.split("-")[0] in self.models}

    def kernels(self):
        rows = self.results["kernels"] = []
        for name, (n, k, pre) in self.kernel_shapes().items():
            for wdt in ("bf16", "fp8"):
                rows.append(self._shape(name, n, k, pre, wdt))
                print(f"# kernel {rows[-1]}", flush=True)
                self.save()
        wins = sorted({("16bit" if r["weight"] == "bf16" else "fp8", r["n"], r["k"], r["before"]) for r in rows
                       if r["fused_us"] < r["separate_us"]})
        self.results["kernel_wins"] = wins
        print(f"# shapes where the fused GEMV wins alone: {wins}", flush=True)


    def _shape(self, name, n, k, pre, wdt):
        dt = torch.float32 if self.dry else torch.bfloat16
        ncopy = 2 if self.dry else max(2, int(2**29 // (n * k)))  # >= 512 MB of FP8 (bf16: 1 GB)
        ws = [torch.randn(n, k, device=self.dev, dtype=dt) * k ** -0.5 for _ in range(ncopy)]
        if wdt == "fp8":
            ws = [fp8_quant.quantize_fp8(w) for w in ws]
        else:
            ws = [(w, None) for w in ws]
        x = torch.randn(1, 2 * k if pre == "silu" else k, device=self.dev, dtype=dt)
        res = torch.randn(1, k, device=self.dev, dtype=dt)
        g = torch.rand(k, device=self.dev, dtype=dt) + 0.5

        def project(h, c):
            return F.linear(h, c[0]) if c[1] is None else fp8_quant.fp8_linear(h, c[0], c[1], None, 0)

        def separate(c, project_it=True):
            if pre == "norm":
                h, _ = fused_mod.rms_norm(x, g, 1e-5, res)
            elif pre == "silu":
                h = fused_mod.silu_and_mul(x)
            else:
                h = x
            return project(h, c) if project_it else h

        def fused(c, cfg):
            if pre == "norm":
                return gemv_mod.norm_gemv(x, res, g, 1e-5, c[0], c[1], config=cfg)[0]
            if pre == "silu":
                return gemv_mod.silu_gemv(x, c[0], c[1], config=cfg)
            return gemv_mod.gemv(x, c[0], c[1], config=cfg)

        ref = separate(ws[0]).float()
        r = {"shape": name, "n": n, "k": k, "before": pre, "weight": wdt,
             "separate_us": self._graph_us(separate, ws)}
        if pre == "norm":
            r["norm_alone_us"] = self._graph_us(lambda c: fused_mod.rms_norm(x, g, 1e-5, res), ws[:1] * 8)
        cands = [(8, 32, 2, 2, False), (8, 32, 2, 2, True)] if self.dry else (
            FP8_CANDIDATES if wdt == "fp8" else BF16_CANDIDATES)
        committed = gemv_mod.choose_gemv_config(n, k, ws[0][0].dtype, 0, pre)
        tried = self._sweep(name, wdt, cands, committed, lambda c, cfg: fused(c, cfg), ref, ws)
        r.update(fused_us=tried[0][0], fused_config=list(tried[0][1]),
                 committed_us=next((u for u, c in tried if c == dataclasses.astuple(committed)), None),
                 weight_gbs=n * k * (1 if wdt == "fp8" else 2) / tried[0][0] / 1e3,
                 all=[[round(u, 2), list(c)] for u, c in tried])
        if pre != "none" and wdt == "fp8":  # an FP8 step that keeps the prologue apart runs the plain GEMV
            h = separate(None, project_it=False)
            plain = self._sweep(name + "-plain", wdt, cands, gemv_mod.choose_gemv_config(n, k, ws[0][0].dtype),
                                lambda c, cfg: gemv_mod.gemv(h, c[0], c[1], config=cfg), ref, ws)
            r.update(plain_us=plain[0][0], all_plain=[[round(u, 2), list(c)] for u, c in plain])
        r["fused_over_separate"] = r["fused_us"] / r["separate_us"]
        r["kind"] = "fp8" if wdt == "fp8" else "16bit"
        del ws
        self.free()
        return r

    def rows(self):
        """Each 8B projection for M rows of x: cuBLAS (bf16) or engine.quant.fp8's FP8 linear (the
        step's path today) against engine.kernels.gemv_rows over its candidate tiles, and the
        one-token GEMV as the yardstick. us per call, CUDA-graph replays over weight copies past the L2."""
        out = self.results["rows"] = []
        dt = torch.float32 if self.dry else torch.bfloat16
        for name, (n, k, _) in self.kernel_shapes().items():
            if name.endswith("lm_head") or (not self.dry and not name.startswith("8b")):
                continue
            for wdt in ("bf16", "fp8"):
                ncopy = 2 if self.dry else max(2, int(2**29 // (n * k)))
                ws = [torch.randn(n, k, device=self.dev, dtype=dt) * k ** -0.5 for _ in range(ncopy)]
                ws = [fp8_quant.quantize_fp8(w) for w in ws] if wdt == "fp8" else [(w, None) for w in ws]
                one = torch.randn(1, k, device=self.dev, dtype=dt)
                r = {"shape": name, "n": n, "k": k, "weight": wdt,
                     "one_token_us": self._graph_us(lambda c: gemv_mod.gemv(one, c[0], c[1]), ws)}
                for m in self.row_counts:
                    x = torch.randn(m, k, device=self.dev, dtype=dt)
                    base = ((lambda c, x=x: F.linear(x, c[0])) if wdt == "bf16" else
                            (lambda c, x=x: fp8_quant.fp8_linear(x, c[0], c[1], None, 0)))
                    ref = base(ws[0]).float()
                    tried = []
                    for c in ([(8, 32, 1, 2), (4, 32, 1, 1)] if self.dry else ROWS_CANDIDATES[wdt]):
                        cfg = rows_mod.RowsConfig(*c)
                        try:
                            got = rows_mod.gemv_rows(x, ws[0][0], ws[0][1], config=cfg).float()
                            err = ((got - ref).norm() / ref.norm()).item()
                            if not err < 2e-2:
                                raise AssertionError(f"relative error {err:.3g}")
                            tried.append((self._graph_us(lambda w, x=x, cfg=cfg: rows_mod.gemv_rows(
                                x, w[0], w[1], config=cfg), ws), c))
                        except Exception as e:  # noqa: BLE001 - a config that does not compile or is wrong is skipped
                            print(f"# rows {name} {wdt} m={m} {c} failed: {type(e).__name__}: {str(e)[:120]}",
                                  flush=True)
                    tried.sort()
                    r[f"m{m}"] = {"base_us": self._graph_us(base, ws), "rows_us": tried[0][0] if tried else None,
                                  "config": list(tried[0][1]) if tried else None,
                                  "all": [[round(u, 2), list(c)] for u, c in tried]}
                out.append(r)
                print(f"# rows {r}", flush=True)
                del ws
                self.free()
        self.save()

    def _sweep(self, name, wdt, cands, committed, run, ref, ws):
        """-> [(us, config)] fastest first, of the candidates that compile and match ref."""
        tried = []
        for c in dict.fromkeys([dataclasses.astuple(committed), *cands]):
            cfg = gemv_mod.GemvConfig(*c)
            try:
                out = run(ws[0], cfg).float()
                err = ((out - ref).norm() / ref.norm()).item()
                if not err < 2e-2:
                    raise AssertionError(f"relative error {err:.3g} against the separate launches")
                tried.append((self._graph_us(lambda w, cfg=cfg: run(w, cfg), ws), c))
            except Exception as e:  # noqa: BLE001 - a config that does not compile or is wrong is skipped
                print(f"# {name} {wdt} {c} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return sorted(tried)

    def use_swept_configs(self):
        """The decode steps below run with this run's best tile per (weight kind, shape, prologue)
        (engine.kernels.gemv._TUNED updated in place; --configs swept)."""
        for r in self.results.get("kernels", []):
            gemv_mod._TUNED[(r["kind"], r["n"], r["k"], r["before"])] = gemv_mod.GemvConfig(*r["fused_config"])
            if r["before"] != "none":  # the plain GEMV of the same weight, where a step runs the prologue apart
                for _, c in r.get("all_plain", [])[:1]:
                    gemv_mod._TUNED[(r["kind"], r["n"], r["k"], "none")] = gemv_mod.GemvConfig(*c)

    # dtype -> (gemv.POLICY, gemv.PDL, the FP8 prologues taken in "table" ("norm": q/k/v and
    # gate/up), PDL for the small kernels (engine.kernels.pdl.ENABLED))
    STEP_VARIANTS = {
        "bf16": (("off", "off", "", False), ("table", "prefetch", "", False), ("table", "prefetch", "", True),
                 ("table", "wait", "", True)),
        "fp8": (("table", "off", "", False), ("table", "off", "", True), ("table", "prefetch", "", True),
                ("table", "wait", "", True), ("all", "prefetch", "", True)),
    }

    def steps(self):
        name = "tiny-random" if self.dry else "llama3-8b-random"
        dtype = "float32" if self.dry else "bfloat16"
        ctx = 64 if self.dry else self.ctx
        rows = self.results["decode_8b"] = []
        if self.configs == "swept":
            self.use_swept_configs()
        table, folding, acting = gemv_mod.WINS, gemv_mod.FOLD_KINDS, gemv_mod.ACT_KINDS
        in_attention, split_policy = rope_kv.IN_ATTENTION, split_mod.POLICY
        rows_table, rows_default = rows_mod.ROWS, rows_mod.ROWS_DEFAULT
        every, none = frozenset({"16bit", "fp8", "fp32"}), frozenset()
        fold_kinds, act_kinds = {"fold": every, "nofold": none}, {"act": every, "noact": none}
        for label, quant in (("8b-bf16", None), ("8b-fp8", "fp8")):
            t0 = time.perf_counter()
            model, tok, _ = load_model(name, dtype, str(self.dev), seed=0, quantization=quant)
            self.sync()
            self.results[f"load_s_{label}"] = time.perf_counter() - t0
            if self.dry:
                model.ops = TritonOps()
            norm_keys = {("fp8", *lin.weight.shape, "norm") for layer in model.layers
                         for lin in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj)}
            silu_keys = {("fp8", *layer.mlp.down_proj.weight.shape, "silu") for layer in model.layers}
            tuned = dict(gemv_mod._TUNED)
            for rep in range(self.repeats):  # interleaved, so a drift of the machine hits every variant
                for policy, pdl, extra, small in (self.variants or self.STEP_VARIANTS)[label.split("-")[1]]:
                    # "auto": the defaults (bf16 prefetching; FP8 as the small kernels go)
                    gemv_mod.POLICY, gemv_mod.PDL = policy, "prefetch" if pdl == "auto" else pdl
                    gemv_mod.PDL_FP8 = None if pdl == "auto" else pdl
                    pdl_mod.ENABLED = small
                    tokens = set(filter(None, extra.split("+")))
                    gemv_mod.WINS = (table | (norm_keys if "norm" in tokens else set())
                                     | (silu_keys if "silu" in tokens else set()))
                    gemv_mod.FOLD_KINDS = next((fold_kinds[t] for t in tokens if t in fold_kinds), folding)
                    gemv_mod.ACT_KINDS = next((act_kinds[t] for t in tokens if t in act_kinds), acting)
                    rope_kv.IN_ATTENTION = (1 << 30 if "inattn" in tokens else 0 if "noinattn" in tokens
                                            else in_attention)
                    paged_mod.EARLY_RELEASE, gemv_mod.EARLY_EPILOGUE = "early2" in tokens, "noepi" not in tokens
                    rows_mod.ROWS, rows_mod.ROWS_DEFAULT = ({}, {}) if "norows" in tokens else (rows_table, rows_default)
                    split_mod.set_split_policy(
                        fused_merge="fmerge" in tokens or (split_policy.fused_merge and "nofmerge" not in tokens),
                        early_release="early" in tokens or (split_policy.early_release and "noearly" not in tokens),
                        **{field: next((int(t[len(prefix):]) for t in tokens if t.startswith(prefix)),
                                       getattr(split_policy, field))
                           for prefix, field in (("minpart", "min_partition"), ("pps", "programs_per_sm"),
                                                 ("longpart", "long_partition"))})
                    gemv_mod._TUNED = {**tuned, **tile_overrides(label.split("-")[1], tokens)}
                    tag = (f"{label}-{policy}{'+' + extra if extra else ''}-pdl:{pdl}"
                           + {True: "+small", False: "", None: "+auto"}[small])
                    for row in self.decode_rows(tag, model, tok, self.batches, ctx):
                        row.update(policy=policy, pdl=pdl, rep=rep, prologues=extra, small_kernels_pdl=small)
                        rows.append(row)
            gemv_mod.POLICY, gemv_mod.PDL, gemv_mod.PDL_FP8, gemv_mod.WINS = "table", "prefetch", None, table
            gemv_mod.FOLD_KINDS, gemv_mod.ACT_KINDS, gemv_mod._TUNED = folding, acting, tuned
            rope_kv.IN_ATTENTION = in_attention
            rows_mod.ROWS, rows_mod.ROWS_DEFAULT = rows_table, rows_default
            split_mod.set_split_policy(**dataclasses.asdict(split_policy))
            pdl_mod.ENABLED = None
            del model
            self.free()
        self.save()


def print_table(R):
    c = R.get("ceilings", {})
    print(f"\nceilings: copy {c.get('copy_gbs', 0):.0f} GB/s, bf16 matmul {c.get('matmul_tflops', 0):.0f} TFLOP/s")
    print("\none-token projections, us per call (graph replay past the L2)")
    print(f"{'shape':>12} {'weight':>6} {'before':>6} {'separate':>9} {'fused':>7} {'fused/sep':>9} "
          f"{'GB/s':>6} {'plain':>6} config (plain's)")
    for r in R.get("kernels", []):
        plain = f"{r['plain_us']:>6.1f}" if "plain_us" in r else f"{'':>6}"
        print(f"{r['shape']:>12} {r['weight']:>6} {r['before']:>6} {r['separate_us']:>9.1f} {r['fused_us']:>7.1f} "
              f"{r['fused_over_separate']:>9.2f} {r['weight_gbs']:>6.0f} {plain} {r['fused_config']}"
              + (f" ({r['all_plain'][0][1]})" if r.get("all_plain") else ""))
    if R.get("rows"):
        print("\nseveral rows of x, us per call: the step's path today / gemv_rows' best tile (config)")
        for r in R["rows"]:
            cells = "  ".join(f"m={key[1:]}: {v['base_us']:.1f} / " + (f"{v['rows_us']:.1f} {tuple(v['config'])}"
                                                                   if v["rows_us"] else "-")
                              for key, v in r.items() if key.startswith("m") and key[1:].isdigit())
            print(f"{r['shape']:>12} {r['weight']:>5} one token {r['one_token_us']:6.1f}   {cells}")
    rows = R.get("decode_8b", [])
    if rows:
        by = {}
        for r in rows:
            by.setdefault(r["model"] + (f" x{r['batch']}" if r["batch"] != 1 else ""), []).append(r)
        med = {m: statistics.median(r["step_ms"] for r in rs) for m, rs in by.items()}
        print(f"\nllama3-8b-random decode, context {rows[0]['ctx']} (batch 1 unless xN): step ms (median of "
              f"{len(rows) // len(by)} "
              "interleaved runs; each run the median of its steps)")
        print(f"{'model':>34} {'step ms':>8} {'runs':>24} {'GPU ms':>8} {'floor ms':>8} {'x floor':>7} "
              f"{'/ bf16 off':>10} {'/ bf16 first':>12}")
        # per batch size: against bf16 with the fused GEMV off, and against the first bf16 variant
        first_bf16 = {}
        for m, rs in by.items():
            if m.startswith("8b-bf16"):
                first_bf16.setdefault(rs[0]["batch"], med[m])
        for m, rs in by.items():
            floor, batch = rs[0]["floor_ms"], rs[0]["batch"]
            bf_off = med.get("8b-bf16-off-pdl:off" + (f" x{batch}" if batch != 1 else ""))
            bf_first = first_bf16.get(batch)
            runs = " ".join(f"{r['step_ms']:.3f}" for r in rs)
            gpu = statistics.median(r["gpu_ms"] for r in rs)
            print(f"{m:>34} {med[m]:>8.3f} {runs:>24} {gpu:>8.3f} {floor:>8.3f} {med[m] / floor:>7.2f} "
                  f"{med[m] / bf_off if bf_off else float('nan'):>10.3f} "
                  f"{med[m] / bf_first if bf_first else float('nan'):>12.3f}")


def tile_overrides(kind: str, tokens: set[str]) -> dict:
    """PROLOGUES tokens 'N.K=BN.BK.WARPS.STAGES.SUMS' -> engine.kernels.gemv._TUNED entries for the
    plain (and folded-norm) GEMV of that shape, in this variant only."""
    out = {}
    for t in tokens:
        if "=" in t:
            shape, cfg = t.split("=")
            n, k = map(int, shape.split("."))
            bn, bk, nw, ns, ts = map(int, cfg.split("."))
            out[("16bit" if kind == "bf16" else kind, n, k, "none")] = gemv_mod.GemvConfig(bn, bk, nw, ns, bool(ts))
    return out


def parse_variants(spec: str) -> dict:
    """'bf16:table/prefetch//0,fp8:all/wait/norm/1' -> STEP_VARIANTS' form: per weight kind,
    (gemv.POLICY, gemv.PDL, PROLOGUES, PDL for the small kernels: 0, 1, or None for the model's
    default). PROLOGUES: "" (the defaults) or tokens joined by "+": "norm" (the FP8 norms folded
    into q/k/v and gate/up), "silu" (the FP8 SiLU into down), "fold" or "nofold" (every weight
    kind's norms folded into the o and down GEMVs before them, gemv.FOLD_KINDS, or none's), "act" or
    "noact" (every weight kind's SiLU in its gate/up GEMV's epilogue, gemv.ACT_KINDS, or none's),
    "inattn" or "noinattn" (the decode attention kernel rotating and writing the new K/V itself at
    every batch, or never: the rotary + KV write launch; the default: up to
    engine.kernels.attention_rope_kv.IN_ATTENTION tokens), "fmerge" or
    "nofmerge" (split decode attention merging its partitions in the launch, SplitPolicy.fused_merge),
    "early" or "noearly" (the merge lets the o GEMV be scheduled before it waits, SplitPolicy.early_release),
    "early2" (the decode kernel releases the kernel after it early too, paged_attention.EARLY_RELEASE),
    "norows" (steps of a few tokens keep cuBLAS / the FP8 GEMM: no engine.kernels.gemv_rows),
    "noepi" (the GEMV epilogue's reads after its K loop, not before: gemv.EARLY_EPILOGUE off),
    "minpartN" (split decode attention's partitions at least N keys, SplitPolicy.min_partition),
    "ppsN" (split until N programs per SM, SplitPolicy.programs_per_sm), "longpartN" (partitions at
    least min(N, plan / long_parts) keys, SplitPolicy.long_partition; 0: no such floor),
    "N.K=BN.BK.WARPS.STAGES.SUMS" (that shape's plain GEMV tile, tile_overrides)."""
    out = {"bf16": [], "fp8": []}
    for item in filter(None, spec.split(",")):
        kind, _, rest = item.partition(":")
        fields = rest.split("/")
        small = {"0": False, "1": True, "a": None}
        if kind not in out or len(fields) != 4 or fields[3] not in small:
            raise SystemExit(f"--variants: {item!r} is not KIND:POLICY/PDL/PROLOGUES/SMALL_PDL "
                             "(KIND bf16 or fp8, SMALL_PDL 0, 1 or a: the model's default)")
        out[kind].append((fields[0], fields[1], fields[2], small[fields[3]]))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model and sizes (Triton interpreter)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "out")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: kernels,steps")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of each decode variant")
    parser.add_argument("--variants", default="",
                        help="decode-step variants instead of the built-in set, e.g. "
                             "'bf16:table/prefetch//0,fp8:table/wait/norm/1' (KIND:POLICY/PDL/PROLOGUES/SMALL_PDL)")
    parser.add_argument("--batches", default="1", help="decode-step batch sizes, e.g. 1,64,256")
    parser.add_argument("--ctx", type=int, default=1024, help="context length of the decode steps")
    parser.add_argument("--rows", default="", help="time engine.kernels.gemv_rows at these rows of x, e.g. 2,4,8")
    parser.add_argument("--models", default="8b,32b", help="kernel shapes of these models: 8b,32b")
    parser.add_argument("--configs", choices=("committed", "swept"), default="committed",
                        help="tile configs of the decode steps: engine.kernels.gemv's, or this run's sweep's best")
    args = parser.parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --dry-run)")
    global gemv_mod, fused_mod, pdl_mod, rope_kv, split_mod, paged_mod, rows_mod
    import tandem.engine.kernels.attention_rope_kv as rope_kv  # noqa: PLC0415 (after TRITON_INTERPRET is set)
    import tandem.engine.kernels.attention_split as split_mod  # noqa: PLC0415
    import tandem.engine.kernels.fused as fused_mod  # noqa: PLC0415
    import tandem.engine.kernels.gemv as gemv_mod  # noqa: PLC0415
    import tandem.engine.kernels.gemv_rows as rows_mod  # noqa: PLC0415
    import tandem.engine.kernels.paged_attention as paged_mod  # noqa: PLC0415
    import tandem.engine.kernels.pdl as pdl_mod  # noqa: PLC0415

    torch.manual_seed(0)
    b = GemvBench(args.dry_run, args.out, quick=True)
    b.repeats, b.configs, b.models = args.repeats, args.configs, set(args.models.split(","))
    b.variants = parse_variants(args.variants) if args.variants else None
    b.batches = tuple(int(v) for v in args.batches.split(","))
    b.ctx = args.ctx
    skip = set(filter(None, args.skip.split(",")))
    b.section("ceilings", b.ceilings)
    b.row_counts = tuple(int(v) for v in args.rows.split(",") if v)
    if b.row_counts:
        b.section("rows", b.rows)
    for name, fn in (("kernels", b.kernels), ("steps", b.steps)):
        if name not in skip:
            b.section(name, fn)
    print_table(b.results)


if __name__ == "__main__":
    main()
