"""Triton's interpreter (TRITON_INTERPRET=1, the CPU tests' way of running the kernels) patches
`triton.language` at each kernel launch and restores it after. Triton 3.x also patches it again on
every call of a nested `@triton.jit` helper inside the kernel, never restored: the same functions
put in place again, ~1.3 ms a call, which was about half of some kernel tests' time (a helper is
called per program of the grid).

`install()` skips that repeat when the launch in progress has already patched every language
module the helper sees; a helper that sees one it has not (say `tl.core` where the kernel only saw
`tl`) is patched as before. What runs is unchanged: the kernel and its helpers execute against the
same patched modules. Called from tests/conftest.py once test modules have imported triton (they
must set TRITON_INTERPRET before the first import)."""

from __future__ import annotations

import inspect
import sys
import threading


def install() -> bool:
    """Wrap the loaded interpreter's launches and `_patch_lang`; False when no interpreter is loaded."""
    interp = sys.modules.get("triton.runtime.interpreter")
    if interp is None or getattr(interp._patch_lang, "_tandem_wrapped", False):
        return interp is not None
    import triton.language as tl

    original, launch = interp._patch_lang, interp.GridExecutor.__call__
    local = threading.local()        # per thread: the language modules each launch in progress patched

    def stack() -> list[set[int]]:
        if not hasattr(local, "launches"):
            local.launches = []
        return local.launches

    class _Nothing:
        def restore(self) -> None:
            pass

    def patch_lang(fn):
        launches = stack()
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if launches and langs and langs <= launches[-1]:
            return _Nothing()        # a nested helper: its modules are patched for this launch already
        scope = patch_lang.upstream(fn)
        if launches:
            launches[-1] |= langs
        return scope

    def run_launch(self, *args, **kwargs):
        launches = stack()
        launches.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    patch_lang.upstream = original
    patch_lang._tandem_wrapped = True
    interp._patch_lang = patch_lang
    interp.GridExecutor.__call__ = run_launch
    return True
