"""tests/interpreter_patching.py, which every test installs (tests/conftest.py): a kernel whose
nested helpers skip the repeated patching still computes what plain torch does, the language is
patched once a launch (and once more for a helper that sees a language module the launch had not
patched), and `triton.language` is itself again after the launch."""

import torch

from tests.engine.test_kernels import TOL  # noqa: F401 (sets TRITON_INTERPRET before triton loads)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from tests import interpreter_patching  # noqa: E402


@triton.jit
def _scaled(x, s):
    return x * s


@triton.jit
def _clamped(x):
    return tl.minimum(_scaled(x, 1.0), 4.0)


@triton.jit
def _kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, _clamped(_scaled(x, 3.0)) + tl.sum(_scaled(x, 0.0), axis=0), mask=ok)


def test_nested_helpers_compute_what_torch_does_and_the_language_is_patched_once_a_launch():
    assert interpreter_patching.install()          # conftest installed it already: this is a no-op
    wrapper = interpreter._patch_lang
    upstream, calls = wrapper.upstream, []
    wrapper.upstream = lambda fn: calls.append(fn.__name__) or upstream(fn)
    load = tl.load
    try:
        x = torch.linspace(-2.0, 2.0, 300)
        out = torch.empty_like(x)
        _kernel[(triton.cdiv(300, 64),)](x, out, 300, BLOCK=64)    # 5 programs, 4 helper calls each
        _kernel[(1,)](x, out, 64, BLOCK=64)
    finally:
        wrapper.upstream = upstream
    torch.testing.assert_close(out[:64], torch.clamp(x[:64] * 3.0, max=4.0))
    torch.testing.assert_close(out[64:], torch.clamp(x[64:] * 3.0, max=4.0))
    # per launch: the kernel's module (tl), then once tl.sum's (triton.language.standard sees only
    # tl.core, which the kernel's launch had not patched); the helpers' 24 calls patched nothing
    assert calls == ["_kernel", "sum", "_kernel", "sum"]
    assert tl.load is load                         # restored after each launch
