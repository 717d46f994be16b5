"""Triton compiles that happen while serving. A compile (or a load from Triton's disk cache) runs
on the thread that launches the kernel, inside an engine step: the whole batch waits a second or
more. Engine warmup launches every variant serving is meant to need; once it has, any further
compile means a kernel was called with a specialization warmup did not cover (an integer argument
that became 1 or a multiple of 16, a pointer that lost its 16-byte alignment, a new constexpr).
This watch logs each such compile with the kernel's signature and our code that launched it, so
the gap can be closed, and counts them for the worker's stats.

One watch per process (Triton's hook is global): `install()` is idempotent; `arm()` is called
when warmup ends."""

from __future__ import annotations

import json
import logging
import os
import threading
import traceback

log = logging.getLogger(__name__)

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CompileWatch:
    def __init__(self):
        self.compiles = 0          # every compile or cache load seen
        self.late = 0              # of those, after arm()
        self.last_late: str | None = None
        self.armed = False
        self._variants: dict[str, list[dict[str, str]]] = {}   # kernel -> variants compiled, in order
        self._installed = False
        self._lock = threading.Lock()

    def install(self) -> bool:
        """Hook Triton's JIT; False where this Triton has no hook to take."""
        with self._lock:
            if self._installed:
                return True
            try:
                import triton  # noqa: PLC0415 (triton loads only where kernels run)
            except ImportError:
                return False
            knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
            if knobs is not None and hasattr(knobs, "jit_cache_hook"):
                previous = knobs.jit_cache_hook
                knobs.jit_cache_hook = self._hook(previous)
            else:                            # Triton before knobs: a class attribute
                from triton.runtime.jit import JITFunction  # noqa: PLC0415 (as above)

                if not hasattr(JITFunction, "cache_hook"):
                    return False
                JITFunction.cache_hook = self._hook(JITFunction.cache_hook)
            self._installed = True
            return True

    def arm(self) -> None:
        self.armed = True

    def _hook(self, previous):
        def hook(*args, **kwargs):
            try:
                self._seen(kwargs.get("repr", "?"), kwargs.get("compile") or {})
            except Exception:  # noqa: BLE001 - a diagnostic must never break a launch
                log.exception("compile watch failed")
            # a truthy answer would make Triton skip the compile: pass the previous hook's on
            return previous(*args, **kwargs) if previous is not None else False
        return hook

    def _seen(self, kernel: str, compile: dict) -> None:
        self.compiles += 1
        name = kernel.split("[", 1)[0]
        variant = specialization(compile)
        earlier = self._variants.setdefault(name, [])
        earlier.append(variant)
        if not self.armed:
            return
        self.late += 1
        ours = [f for f in traceback.extract_stack()[:-2]
                if f.filename.startswith(_REPO) and "site-packages" not in f.filename]
        site = " < ".join(f"{os.path.relpath(f.filename, _REPO)}:{f.lineno} {f.name}" for f in reversed(ours[-4:]))
        self.last_late = f"{name} {difference(variant, earlier[:-1])} from {site}"
        log.warning("Triton compiled a kernel while serving (warmup did not cover this variant; the step "
                    "waits for it): %s", self.last_late)


def specialization(compile: dict) -> dict[str, str]:
    """Argument name -> how this variant specialized it: its type, `%16` where Triton assumed
    16-byte alignment or divisibility by 16, `=v` where it compiled the value in (1, constexprs)."""
    try:
        data = json.loads(compile["specialization_data"])
        index = {tuple(k): v for k, v in zip(data["constant_keys"], data["constant_vals"])}
        divisible = {tuple(k) for k, v in zip(data["attrs_keys"], data["attrs_vals"])
                     if any(a and a[0] == "tt.divisibility" for a in v)}
        out = {}
        for i, (arg, ty) in enumerate(data["signature"].items()):
            mark = str(ty)
            if (i,) in divisible:
                mark += "%16"
            if (i,) in index:
                mark += f"={index[(i,)]}"
            out[arg] = mark
        return out
    except (KeyError, TypeError, ValueError):
        return {}


def difference(variant: dict[str, str], earlier: list[dict[str, str]]) -> str:
    """How `variant` differs from the closest earlier variant of the same kernel."""
    if not variant:
        return "(this Triton gives no specialization data)"
    if not earlier:
        return "(no variant of it compiled before: warmup never launched it)"
    def changed(other):
        return [a for a in variant if other.get(a) != variant[a]]
    closest = min(earlier, key=lambda o: len(changed(o)))
    return "differs from the closest earlier variant in " + (
        ", ".join(f"{a}: {closest.get(a)} -> {variant[a]}" for a in changed(closest)) or "nothing (options?)")


watch = CompileWatch()
