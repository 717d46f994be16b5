"""The Triton compile watch: hooked where this Triton calls before compiling, counts compiles,
logs those after warmup with our call site, and never stops Triton from compiling."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from tandem.engine.kernels.compile_watch import CompileWatch  # noqa: E402


@pytest.fixture
def hook_point():
    runtime = triton.knobs.runtime
    saved = runtime.jit_cache_hook
    calls = []

    def previous(**kwargs):
        calls.append(kwargs["repr"])
        return None

    runtime.jit_cache_hook = previous
    yield runtime, calls
    runtime.jit_cache_hook = saved


def launch_a_kernel_in_our_code(runtime, name, aligned=True):
    """Stands in for a kernel launch: Triton calls the hook this way on an in-memory cache miss,
    with the variant's specialization serialized as this Triton does it."""
    from triton.runtime.jit import serialize_specialization_data

    class Options:
        pass

    attrs = {(0,): [["tt.divisibility", 16]]} if aligned else {}
    data = serialize_specialization_data(name, {"x_ptr": "*bf16", "n": "i32", "BLOCK": "constexpr"},
                                         {(2,): 64}, attrs, Options(), (), Options())
    return runtime.jit_cache_hook(key=(), repr=f"{name}[num_warps=4](x_ptr: *bf16, n: i32)", fn=None,
                                  compile={"specialization_data": data}, is_manual_warmup=False,
                                  already_compiled=False)


def test_compiles_after_warmup_are_counted_and_logged_with_the_call_site(hook_point, caplog):
    runtime, calls = hook_point
    watch = CompileWatch()
    assert watch.install() and watch.install()        # idempotent: hooked once
    assert not launch_a_kernel_in_our_code(runtime, "_warm_kernel")
    assert (watch.compiles, watch.late) == (1, 0)
    watch.arm()
    with caplog.at_level("WARNING", logger="tandem.engine.kernels.compile_watch"):
        assert not launch_a_kernel_in_our_code(runtime, "_late_kernel")   # falsy: Triton compiles
        assert not launch_a_kernel_in_our_code(runtime, "_warm_kernel", aligned=False)
    assert (watch.compiles, watch.late) == (3, 2)
    assert calls == [f"{k}[num_warps=4](x_ptr: *bf16, n: i32)" for k in ("_warm_kernel", "_late_kernel", "_warm_kernel")]
    never, unaligned = [r.getMessage() for r in caplog.records]
    assert "_late_kernel (no variant of it compiled before: warmup never launched it)" in never
    assert "tests/unit/test_compile_watch.py" in never and "launch_a_kernel_in_our_code" in never
    # the log names the argument whose specialization changed: here the pointer lost its alignment
    assert "_warm_kernel differs from the closest earlier variant in x_ptr: *bf16%16 -> *bf16 from" in unaligned
    assert watch.last_late in unaligned
