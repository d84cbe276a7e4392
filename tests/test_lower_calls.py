"""How a lowered module runs its C kernels: which loops open an OpenMP region (and with how
many threads), how the wrapper calls the kernels, and what it does per call."""
from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symtrace
from symtrace.lower import codegen_c
from symtrace.lower import compile as lower
from kernel_tests import needs_c_compiler

pytestmark = [needs_c_compiler, pytest.mark.usefixtures("session_kernel_cache")]


def pointwise(x):
    return torch.sigmoid(x) * 2 + 1


def rows(x):
    return torch.softmax(x, -1)


def total(x):
    return (x * 2).sum()


def lowered(fn, *inputs):
    return lower(symtrace.symbolic_trace(fn, example_inputs=inputs), inputs)


# ------------------------------------------------------------------ OpenMP regions

@pytest.mark.parametrize("fn, small, large", [
    (pointwise, (1000,), (4 * codegen_c.PARALLEL_THRESHOLD,)),
    (rows, (10, 100), (400, 1000)),
    (total, (5000,), (4 * codegen_c.PARALLEL_THRESHOLD,)),
], ids=["pointwise", "row", "full"])
def test_only_kernels_above_the_threshold_open_an_openmp_region(fn, small, large):
    """A kernel with at most PARALLEL_THRESHOLD elements of work has no parallel region (an if(0)
    clause would still call into the OpenMP runtime on every call); a larger one runs its
    region on the ``nt`` threads the wrapper passes."""
    torch.manual_seed(0)
    for shape, parallel in ((small, False), (large, True)):
        x = torch.randn(shape)
        lm = lowered(fn, x)
        src = "\n".join(k.source for k in lm.kernels)
        assert ("#pragma omp parallel for" in src) == parallel, src
        if parallel:
            assert "num_threads(nt)" in src and " if(" not in src
        with torch.no_grad():   # (a sum's rounding scales with the magnitudes summed, not with the result)
            assert torch.allclose(lm(x), fn(x), rtol=1e-5, atol=1e-6 * float(fn(x.abs()).abs().max()))


# ------------------------------------------------------------------ kernel calls

def outputs(x):
    return x * 2 + 1, torch.sigmoid(x), x.abs(), x - 3


def chained_sums(x):
    for _ in range(3):
        x = (x + 1) * x.sum()
    return x


def matmul_chain(x, w):
    for _ in range(3):
        x = torch.relu(x @ w + 1)
    return x


def test_kernels_with_no_torch_call_between_run_through_one_entry_point():
    x = torch.randn(8)
    lm = lowered(outputs, x)
    code, src = lm.wrapper_code, lm.source()
    assert len(lm.kernels) == 4
    assert code.count("_run0(") == 1 and "_k0(" not in code and "_run1" not in code, code
    for k in lm.kernels:   # the wrapper still says what each kernel computes
        assert f"#   {k.name} ({k.kind}): " in code
    assert "void run0(void *p0, void *p1, void *p2, void *p3, void *p4, int nt) {" in src
    assert "    k0(p0, p1, nt);\n    k1(p0, p2, nt);\n    k2(p0, p3, nt);\n    k3(p0, p4, nt);\n}" in src
    with torch.no_grad():
        first = lm(x)
        second = lm(x)
    for got, again, ref in zip(first, second, outputs(x)):
        assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6) and torch.equal(got, again)
        assert got.data_ptr() != again.data_ptr()   # outputs are fresh tensors on every call


def test_arena_buffers_are_passed_as_constant_addresses():
    x = torch.randn(5)
    lm = lowered(chained_sums, x)
    code = lm.wrapper_code
    g = lm._first.call.__globals__
    arena = [name[len("_arena_"):] for name in g if name.startswith("_arena_")]
    assert arena and re.search(r"_arena_\w+\.data_ptr\(\)", code) is None, code
    for name in arena:
        assert f"_ptr_{name}" in code and g[f"_ptr_{name}"] == g[f"_arena_{name}"].data_ptr()
    with torch.no_grad():
        assert torch.allclose(lm(x), chained_sums(x), rtol=1e-5)


def test_a_torch_call_between_kernels_keeps_them_separate_calls():
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    lm = lowered(matmul_chain, x, w)
    code = lm.wrapper_code
    assert "_run" not in code and all(f"_{k.name}(" in code for k in lm.kernels), code
    assert "void run" not in lm.source()
    with torch.no_grad():
        assert torch.allclose(lm(x, w), matmul_chain(x, w), rtol=1e-5, atol=1e-6)


def test_entry_point_source_passes_each_kernel_its_parameters_in_order():
    src = codegen_c.entry_point("run3", [("k1", (0, 1)), ("k0", (1, 0, 2))], 3)
    assert src == ("/* k1, k0, in this order */\nvoid run3(void *p0, void *p1, void *p2, int nt) {\n"
                   "    k1(p0, p1, nt);\n    k0(p1, p0, p2, nt);\n}\n")


def test_input_guards_check_the_device_without_building_a_device_object():
    x = torch.randn(3)
    code = lowered(pointwise, x).wrapper_code
    assert "x.is_cpu" in code and ".device" not in code


# ------------------------------------------------------------------ threads

_THREADS = r"""
import json, os, sys, torch
import symtrace
from symtrace.lower import compile as lower, toolchain

def threads():
    return set(os.listdir("/proc/self/task"))

torch.set_num_threads(1)
x = torch.randn(1 << 18)
lm = lower(symtrace.symbolic_trace(lambda t: torch.sigmoid(t) * 2 + 1, example_inputs=(x,)), (x,))
assert "num_threads(nt)" in lm.source()
out = {}
before = threads()
lm(x)
out["one_thread"] = len(threads() - before)        # nt = 1: no worker
torch.set_num_threads(3)
lm(x)
workers = threads() - before
out["three_threads"] = len(workers)                  # nt = 3: two workers
torch.exp(x)                                         # torch's own parallel op, 3 threads
out["after_torch_op"] = len(threads() - before)      # reuses the workers our kernel started
probe = toolchain.load_library("#include <omp.h>\nint st_max_threads(void) { return omp_get_max_threads(); }\n")
out["probe"] = []
for n in (1, 3):
    torch.set_num_threads(n)                         # torch's omp_set_num_threads
    out["probe"].append(probe.st_max_threads())      # read through our toolchain's library
print(json.dumps(out))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_kernels_run_on_torchs_thread_pool_with_torchs_thread_count(tmp_path):
    """One OpenMP pool for torch and our kernels: a kernel's region has torch.get_num_threads()
    threads at call time, the workers it starts are the ones a torch op then uses, and a
    library built by the toolchain reads the thread count torch set (the same runtime). With
    two runtimes each would keep its own workers (and spin against the other's)."""
    import json
    import subprocess
    import sys
    env = dict(os.environ, SYMTRACE_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("OMP_NUM_THREADS", None)
    from symtrace.lower import toolchain
    if not toolchain.openmp_available():
        pytest.skip("the C compiler builds no OpenMP")
    res = subprocess.run([sys.executable, "-c", _THREADS], capture_output=True, text=True, env=env, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"one_thread": 0, "three_threads": 2, "after_torch_op": 2, "probe": [1, 3]}, out


def test_runs_of_kernels_are_cut_where_an_entry_point_would_take_too_many_buffers(monkeypatch):
    from symtrace.lower import wrapper
    monkeypatch.setattr(wrapper, "MAX_ENTRY_ARGS", 3)   # 4 kernels, each reading x, writing its own output
    x = torch.randn(8)
    lm = lowered(outputs, x)
    code, src = lm.wrapper_code, lm.source()
    assert "_run0(x.data_ptr(), buf0.data_ptr(), buf1.data_ptr(), nt)" in code, code
    assert "_run1(x.data_ptr(), buf2.data_ptr(), buf3.data_ptr(), nt)" in code, code
    assert "void run1(void *p0, void *p1, void *p2, int nt)" in src
    with torch.no_grad():
        for got, ref in zip(lm(x), outputs(x)):
            assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)


def test_data_guards_on_values_the_variant_fixes_are_not_checked_per_call():
    # a guard on an intermediate's dtype or size holds whenever the variant's input guards do;
    # a guard on data (a sum's sign) or on a closure variable is still checked on every call
    state = {"scale": 2.0}

    def f(x):
        h = torch.tanh(x) * 3
        if h.dtype == torch.float32 and h.shape[-1] > 2:
            h = h + 1
        if (h.sum() > 0).item():
            h = h * state["scale"]
        return h

    x = torch.rand(4, 8) + 0.5
    gm = symtrace.symbolic_trace(f, example_inputs=(x,))
    guards = [n for n in gm.graph.nodes if "check_data_guard" in str(n.target)]
    assert len(guards) >= 3
    lm = lower(gm, (x,))
    report = lm.report()
    assert report.count("a data guard on a value this variant fixes") == 2
    guard_rows = [line for line in report.splitlines() if line.startswith("guard_")]
    assert len(guard_rows) == 3 and sum("torch" in line.split()[3:4] for line in guard_rows) == 1
    with torch.no_grad():
        torch.testing.assert_close(lm(x), f(x))
        with pytest.raises(symtrace.GuardError):
            lm(-x - 1)


def test_unpacking_a_tuple_of_tensors_checks_nothing_per_call():
    # ``q, k, v = qkv.unbind(0)`` (every timm attention block) records len() of the tuple and a
    # guard on it: both are fixed by shapes, so neither runs through torch on each call
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(32, 96)

        def forward(self, x):
            B, N, C = x.shape
            q, k, v = self.qkv(x).reshape(B, N, 3, 4, 8).permute(2, 0, 3, 1, 4).unbind(0)
            a, b = x.chunk(2, -1)
            y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C)
            return y + torch.cat([b, a], -1)

    m = Attention().eval()
    x = torch.randn(2, 5, 32)
    lm = lower(m, (x,))
    rows = [line for line in lm.report().splitlines() if line.startswith(("len", "guard_len"))]
    assert len(rows) == 4 and all(line.split()[3] == "constant" for line in rows), lm.report()
    assert "len" not in lm.wrapper_code
    with torch.no_grad():
        torch.testing.assert_close(lm(x), m(x))


def test_a_graph_that_switches_grad_mode_leaves_the_callers_grad_mode():
    # `with torch.no_grad()` inside the program records is_grad_enabled() (the mode to restore);
    # compiled under no_grad, it was fixed as False, and every call turned grad mode off
    def f(x):
        with torch.no_grad():
            y = x * 2
        return y.sum(-1)

    x = torch.randn(3, 8)
    lm = symtrace.lower.compile(symtrace.symbolic_trace(f, example_inputs=(x,)), (x,), dynamic=False)
    torch.testing.assert_close(lm(x), f(x))
    assert torch.is_grad_enabled()
    with torch.no_grad():
        lm(x)
        assert not torch.is_grad_enabled()
    assert "is_grad_enabled" in lm.wrapper_code


def test_a_lowered_module_keeps_grad_mode_when_a_guard_fails_and_checks_the_grad_mode_it_assumed():
    def branch(x):
        with torch.no_grad():
            y = x * 2
            if y.sum() > 0:          # a data guard inside no_grad
                return y + 1
            return y - 1

    x = torch.ones(3)
    lm = symtrace.lower.compile(symtrace.symbolic_trace(branch, example_inputs=(x,)), (x,), speed_check=False)
    torch.testing.assert_close(lm(x), branch(x))
    with pytest.raises(symtrace.GuardError):
        lm(-x)
    assert torch.is_grad_enabled()

    def reads_mode(x):
        return x + 1, torch.is_grad_enabled()   # an entry guard on grad mode

    lm = symtrace.lower.compile(symtrace.symbolic_trace(reads_mode, example_inputs=(x,)), (x,), speed_check=False)
    assert lm(x)[1] is True
    with torch.no_grad(), pytest.raises(symtrace.GuardError, match="is_grad_enabled"):
        lm(x)   # (it answered True under no_grad)


def test_a_torch_result_copied_into_the_recorded_layout_stays_on_its_device():
    # On a GPU, the copy _fix makes when a torch call returns other strides than recorded was
    # made on the CPU (the next kernel or torch call then mixed devices: Llama's rotary matmul on
    # an H200). The meta device shows the same without a GPU.
    from symtrace.lower.wrapper import _fix
    t = torch.empty(3, 5, device="meta").t()
    out = _fix(t, (5, 3), (3, 1))
    assert out.device == t.device and out.stride() == (3, 1) and out.shape == (5, 3)
    x = torch.randn(4, 6).t()
    assert torch.equal(_fix(x, (6, 4), (4, 1)), x) and _fix(x, (6, 4), (1, 6)) is x


def test_a_cast_to_the_device_the_value_is_on_is_lowered_as_a_cast():
    # x.to(dtype, device=x.device): a cast (Hugging Face's rotary embedding writes it). A device
    # other than the CPU was refused as a device copy even when the value was on it already:
    # test_lower_triton's test_a_cast_to_the_inputs_device_stays_on_it shows that on a GPU.
    def f(x):
        return (x.to(dtype=torch.float64, device=x.device) * 2).sin()

    x = torch.randn(8, 16)
    lm = lowered(f, x)
    assert any("to" in k.nodes for k in lm.kernels), lm.report()
    # (float64 sin: the C library's and torch's vectorized one (AVX-512 hosts) may differ by an
    # ulp; a cast to float32 instead would be ~1e-8 off, far outside this tolerance)
    torch.testing.assert_close(lm(x), f(x), rtol=1e-14, atol=1e-15)


def test_the_cast_rule_accepts_any_device_the_value_is_already_on():
    # the rule itself, with the recorded devices of a non-CPU device (meta here, cuda on a GPU):
    # to the device the value is on is a cast; to another device is a copy the kernels leave to torch
    import types
    from symtrace.graph.node import TensorMeta
    from symtrace.lower.decomp_registry import METHOD_RULES, Unsupported
    from symtrace.lower.values import LValue

    class Value(LValue):
        shape, dtype = (2, 3), torch.float32
    src = types.SimpleNamespace(op="placeholder", args=())
    node = types.SimpleNamespace(op="call_method", args=(src,))
    on = {"meta": TensorMeta.of(torch.empty(2, 3, device="meta")), "cpu": TensorMeta.of(torch.empty(2, 3))}
    a = Value()
    for result_device, stays in (("meta", True), ("cpu", False)):
        lw = types.SimpleNamespace(meta_of=lambda n, d=result_device: on["meta"] if n is src else on[d],
                                   dtype_of=lambda n: torch.float32)
        if stays:
            assert METHOD_RULES["to"](lw, node, (a,), {"dtype": torch.float32, "device": torch.device("meta")}) is a
        else:
            with pytest.raises(Unsupported, match="device copy"):
                METHOD_RULES["to"](lw, node, (a,), {"dtype": torch.float32, "device": torch.device("cpu")})
