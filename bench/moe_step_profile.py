"""GPU time by part of one decode step of a MoE / latent-attention model, as its CUDA graph replays it.

torch.profiler records the kernels a graph replays, but not which module launched them. So the step
is also run eagerly once with each part of the model inside a `record_function` range (`@part`,
set by patching the instances' forward methods for that run only, each synchronizing the GPU on
entry and exit), each eager kernel takes the innermost range its start falls in, and the replay's kernels take the label of the eager kernel
they line up with (the two kernel sequences, matched by name with difflib). A replay kernel that
matches none is labelled by its name. The table: per part, kernels per step and GPU us per step,
grouped as MLA attention, norms/rope, MoE routing, expert GEMMs, shared experts, LM head, other.

    from moe_step_profile import profile_step, print_profile   # bench scripts (sibling file)
"""

from __future__ import annotations

import difflib
import importlib
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

MARK = "@"
# part -> group of the printed table
GROUPS = {
    "mla q/kv_a proj": "MLA attention", "mla other (absorb bmm; prefill: kv_b expand, SDPA)": "MLA attention",
    "mla attention kernel": "MLA attention", "mla o_proj": "MLA attention",
    "mla latent norm/rope/cache write": "norms/rope", "layer norms": "norms/rope",
    "moe router + routing": "MoE routing", "moe expert GEMMs": "expert GEMMs", "moe glue": "MoE routing",
    "shared experts": "shared experts", "dense MLP": "other", "lm head": "LM head", "embedding": "other",
    "other": "other",
}
_BY_NAME = (("_mla_", "mla attention kernel"), ("_route_kernel", "moe router + routing"),
            ("_align", "moe router + routing"), ("_gate_up", "moe expert GEMMs"), ("_down_", "moe expert GEMMs"),
            ("_sum_slots", "moe expert GEMMs"), ("rms_norm", "layer norms"), ("rotary", "mla latent norm/rope/cache write"))


def _by_name(name: str) -> str:
    return next((part for key, part in _BY_NAME if key in name), "other")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Patches:
    """Instance / module attributes wrapped in a `record_function(@part)` range, undone by restore()."""

    def __init__(self):
        self.undo: list[tuple[object, str, object, bool]] = []

    def wrap(self, obj, attr: str, part: str) -> None:
        orig = getattr(obj, attr)
        had = attr in getattr(obj, "__dict__", {})

        def scoped(*args, **kwargs):
            _sync()  # what was launched before has run before the range opens, and the part's own
            with record_function(MARK + part):  # kernels run before it closes
                out = orig(*args, **kwargs)
                _sync()
                return out
        setattr(obj, attr, scoped)
        self.undo.append((obj, attr, orig, had))

    def restore(self) -> None:
        for obj, attr, orig, had in reversed(self.undo):
            if had or not isinstance(obj, torch.nn.Module):
                setattr(obj, attr, orig)
            else:
                delattr(obj, attr)
        self.undo.clear()


def label_model(model, ops) -> _Patches:
    """Wrap the parts of a DeepSeek / Qwen3-MoE model (and the ops object it runs) in named ranges."""
    p = _Patches()
    p.wrap(model.embed_tokens, "forward", "embedding")
    p.wrap(model.lm_head, "forward", "lm head")
    p.wrap(ops, "rms_norm", "layer norms")
    mla = importlib.import_module("tandem.engine.mla")
    p.wrap(mla, "apply_latent_rope", "mla latent norm/rope/cache write")
    p.wrap(mla, "write_latent_torch", "mla latent norm/rope/cache write")
    for mod, attr, part in (("tandem.engine.kernels.mla_decode", "mla_decode", "mla attention kernel"),
                            ("tandem.engine.kernels.moe", "fused_experts", "moe expert GEMMs"),
                            ("tandem.engine.kernels.moe_route", "route_fused", "moe router + routing")):
        p.wrap(importlib.import_module(mod), attr, part)
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        if hasattr(a, "kv_b_proj"):  # latent attention
            p.wrap(a, "forward_fused", "mla other (absorb bmm; prefill: kv_b expand, SDPA)")
            for name in ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa"):
                if hasattr(a, name):
                    p.wrap(getattr(a, name), "forward", "mla q/kv_a proj")
            p.wrap(a.kv_a_layernorm, "forward", "mla latent norm/rope/cache write")
            p.wrap(a.o_proj, "forward", "mla o_proj")
        if hasattr(m, "w13"):  # SparseMoE
            p.wrap(m, "forward_fused", "moe glue")
            p.wrap(m.gate, "logits", "moe router + routing")
            if m.shared_experts is not None:
                p.wrap(m.shared_experts, "forward_fused", "shared experts")
        else:
            p.wrap(m, "forward_fused", "dense MLP")
            p.wrap(m, "down_residual", "dense MLP")  # DecoderLayer's path: gate/up beside the norm
    return p


def _kernels(prof, cuda: bool) -> list:
    """The step's kernels in launch order (on a CPU: the leaf aten ops, which stand in for them)."""
    events = list(prof.events())
    if cuda:
        out = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    else:
        out = [e for e in events if e.name.startswith("aten::")
               and not any(c.name.startswith("aten::") for c in e.cpu_children)]
    return sorted(out, key=lambda e: e.time_range.start)


def _eager_parts(prof, cuda: bool) -> list[tuple[str, str]]:
    """-> [(kernel name, part)] of an eager step profiled with the model labelled: a kernel's part is
    the innermost `@part` range whose time span holds the kernel's start (every range synchronizes
    the GPU on entry and exit, so its kernels run within it)."""
    ranges = sorted((e for e in prof.events() if e.name.startswith(MARK)), key=lambda e: e.time_range.start)
    out = []
    for k in _kernels(prof, cuda):
        t = k.time_range.start
        inside = [r for r in ranges if r.time_range.start <= t <= r.time_range.end]
        part = min(inside, key=lambda r: r.time_range.end - r.time_range.start).name[len(MARK):] if inside else None
        out.append((k.name, part or _by_name(k.name)))
    return out


def _durations(prof, cuda: bool, reps: int) -> list[tuple[str, float]]:
    """-> [(kernel name, us)] of one step: `reps` profiled replays, averaged position by position."""
    ks = _kernels(prof, cuda)
    us = [(k.time_range.end - k.time_range.start) if cuda else k.self_cpu_time_total for k in ks]
    if len(ks) % reps:
        return [(k.name, u / reps) for k, u in zip(ks, us)]  # cannot split: the sum is still right
    n = len(ks) // reps
    return [(ks[i].name, sum(us[i + r * n] for r in range(reps)) / reps) for i in range(n)]


def profile_step(model, run_graph, run_eager, cuda: bool, reps: int = 3) -> dict:
    """run_graph(): one step as served (a graph replay); run_eager(): the same step eagerly.
    -> {"parts": [{part, group, kernels, us}], "total_us", "matched", "kernels"}."""
    acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    patches = label_model(model, model.ops_for(torch.device("cuda" if cuda else "cpu")))
    try:
        run_eager()
        sync()
        with profile(activities=[ProfilerActivity.CPU, *acts] if cuda else acts) as prof:
            run_eager()
            sync()
        eager = _eager_parts(prof, cuda)
    finally:
        patches.restore()
    run_graph()
    sync()
    with profile(activities=acts) as prof:
        for _ in range(reps):
            run_graph()
        sync()
    graph = _durations(prof, cuda, reps)
    parts = [_by_name(name) for name, _ in graph]
    matcher = difflib.SequenceMatcher(None, [n for n, _ in eager], [n for n, _ in graph], autojunk=False)
    matched = 0
    for block in matcher.get_matching_blocks():
        for i in range(block.size):
            parts[block.b + i] = eager[block.a + i][1]
        matched += block.size
    rows: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for part, (_, us) in zip(parts, graph):
        rows[part][0] += 1
        rows[part][1] += us
    table = sorted(({"part": p, "group": GROUPS.get(p, "other"), "kernels": n, "us": u} for p, (n, u) in rows.items()),
                   key=lambda r: (r["group"], -r["us"]))
    top: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for name, us in graph:
        top[name[:80]][0] += 1
        top[name[:80]][1] += us
    return {"parts": table, "total_us": sum(us for _, us in graph), "kernels": len(graph),
            "eager_kernels": len(eager), "matched": matched,
            "top": sorted(([u, n, k] for k, (n, u) in top.items()), reverse=True)[:15]}


def print_profile(title: str, p: dict, step_ms: float | None = None) -> None:
    wall = f", graph replay {step_ms * 1e3:.0f} us" if step_ms else ""
    print(f"\n{title}: {p['kernels']} kernels, {p['total_us']:.0f} us of kernel time per step{wall} "
          f"({p['matched']} of them matched to the labelled eager step's {p['eager_kernels']})")
    print("| group | part | kernels / step | GPU us / step | share |\n|---|---|---:|---:|---:|")
    groups: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for r in p["parts"]:
        groups[r["group"]][0] += r["kernels"]
        groups[r["group"]][1] += r["us"]
        print(f"| {r['group']} | {r['part']} | {r['kernels']} | {r['us']:.1f} | {r['us'] / max(p['total_us'], 1e-9):.1%} |")
    for g, (n, u) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"| **{g}** | all | {n} | {u:.1f} | {u / max(p['total_us'], 1e-9):.1%} |")
    print("top kernels (us / step, launches / step, name):")
    for u, n, k in p["top"]:
        print(f"#   {u:8.1f} {n:4d}x  {k}")
