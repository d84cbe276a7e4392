"""Triton lowering (target="cuda"): kernels run in Triton's interpreter on CPU tensors.

TRITON_INTERPRET must be set before triton is first imported (conftest should set it for the
whole session); the interpreter also needs numpy. Without triton the whole file is skipped.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import re  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

triton = pytest.importorskip("triton", reason="triton (and, for the interpreter, numpy) not installed")

import symtrace  # noqa: E402
from symtrace.lower import compile as lower  # noqa: E402
from symtrace.lower import codegen_triton, triton_backend, wrapper  # noqa: E402

INTERPRET = codegen_triton.interpreting()
# the interpreter evaluates masked-off lanes too (numpy warns about log(0) there)
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.usefixtures("session_kernel_cache")]
from symtrace.lower.triton_prelude import interpreter_defect  # noqa: E402
# size-generic kernels loop over a run-time size, which some Triton interpreters cannot run
_runtime_size_loops = pytest.mark.skipif(interpreter_defect() is not None, reason=str(interpreter_defect()))


def device() -> str:
    return "cpu" if INTERPRET else "cuda"


def run_both(fn, *inputs):
    gm = symtrace.symbolic_trace(fn, example_inputs=inputs)
    lm = lower(gm, inputs, target="cuda")
    with torch.no_grad():
        got = lm(*[x.clone() for x in inputs])
        ref = fn(*[x.clone() for x in inputs])
        ref64 = fn(*[x.double() if x.is_floating_point() else x for x in inputs])
    return lm, got, ref, ref64


def assert_close(got, eager, ref64, dtype):
    """``got`` is near the float64 reference, or at least as near as eager (x2)."""
    assert got.shape == eager.shape and got.dtype == eager.dtype and got.device == eager.device
    g, e, r = got.double().cpu(), eager.double().cpu(), ref64.double().cpu()
    assert torch.equal(torch.isnan(g), torch.isnan(e))
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
    fin = torch.isfinite(r)
    err, eerr = (g - r).abs()[fin], (e - r).abs()[fin]
    ok = (err <= tol + tol * r.abs()[fin]) | (err <= 2 * eerr)
    assert bool(ok.all()), f"max err {err.max().item():.3g}, eager {eerr.max().item():.3g}"


def chain(x, y):
    return torch.relu(x * y + 1).sigmoid() * torch.tanh(x) - torch.exp(-x * x)


def softmax(x):
    return torch.softmax(x, dim=-1)


def layernorm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def bias_gelu(x, b):
    return F.gelu(x + b)


def total(x):
    return (x * 2).sum()


def rnd(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=device()).to(dtype)


CASES = {
    "chain": (chain, lambda dt: (rnd(4, 37, dtype=dt), rnd(4, 37, dtype=dt)), "pointwise"),
    "softmax": (softmax, lambda dt: (rnd(6, 50, dtype=dt),), "row"),
    "layernorm": (layernorm, lambda dt: (rnd(5, 24, dtype=dt), rnd(24, dtype=dt), rnd(24, dtype=dt)), "row"),
    "bias_gelu": (bias_gelu, lambda dt: (rnd(8, 20, dtype=dt), rnd(20, dtype=dt)), "pointwise"),
    "sum": (total, lambda dt: (rnd(40, 70, dtype=dt),), "full"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_against_eager(case, dtype):
    torch.manual_seed(0)
    fn, make, kind = CASES[case]
    lm, got, ref, ref64 = run_both(fn, *make(dtype))
    assert [k.kind for k in lm.kernels] == [kind]
    assert_close(got, ref, ref64, dtype)


def test_transposed_input():
    torch.manual_seed(1)
    x, y = rnd(24, 10).t(), rnd(10, 24)
    lm, got, ref, ref64 = run_both(chain, x, y)
    assert_close(got, ref, ref64, torch.float32)
    lm, got, ref, ref64 = run_both(softmax, x)
    assert_close(got, ref, ref64, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_cat_parts_are_stored_into_their_slices(dtype):
    # RoPE's rotate_half: each half of the cat stored by its own kernel, no torch.cat
    def rope(q, cos, sin):
        return q * cos + torch.cat((-q[..., 32:], q[..., :32]), dim=-1) * sin

    torch.manual_seed(2)
    q = rnd(1, 6, 3, 64, dtype=dtype).transpose(1, 2)
    lm, got, ref, ref64 = run_both(rope, q, rnd(1, 1, 1, 64, dtype=dtype), rnd(1, 1, 1, 64, dtype=dtype))
    assert_close(got, ref, ref64, dtype)
    assert sum(1 for k in lm.kernels if "cat" in k.nodes) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_pooling_windows_past_the_edge_are_masked_loads(dtype):
    def pools(x):
        return (F.max_pool2d(x, 3, 2, 1, ceil_mode=True).relu(),
                F.avg_pool2d(x, 3, 1, 1, count_include_pad=False) - x)

    torch.manual_seed(3)
    x = rnd(2, 4, 9, 7, dtype=dtype)
    x[0, 1, 0, 0] = float("nan")
    x[1, 2, 8, 6] = float("inf")
    lm, got, ref, ref64 = run_both(pools, x)
    for g, e, r in zip(got, ref, ref64):
        assert_close(g, e, r, dtype)
    rows = [r for r in lm.report().splitlines() if r.startswith(("max_pool2d ", "avg_pool2d "))]
    assert len(rows) == 2 and all("kernel" in r for r in rows), lm.report()
    assert "mask=" in lm.source()


def test_zero_size_inputs():
    lm, got, ref, _ = run_both(chain, rnd(0, 5), rnd(0, 5))
    assert got.shape == (0, 5)
    lm, got, ref, _ = run_both(total, rnd(0, 3))
    assert got.item() == 0.0 and ref.item() == 0.0


def test_long_rows_loop_over_blocks():
    """Rows longer than PERSISTENT_MAX are reduced block by block."""
    n = codegen_triton.PERSISTENT_MAX + 100
    lm, got, ref, ref64 = run_both(softmax, rnd(2, n))
    assert "for start in range(0, %d, %d)" % (n, codegen_triton.LOOP_BLOCK) in lm.source()
    assert_close(got, ref, ref64, torch.float32)


def test_max_propagates_nan():
    x = rnd(4, 30)
    x[1, 7] = float("nan")
    lm, got, ref, _ = run_both(lambda t: torch.amax(t, dim=-1) + 1, x)
    assert torch.isnan(got[1]) and not torch.isnan(got[[0, 2, 3]]).any()
    assert torch.allclose(got, ref, equal_nan=True, rtol=0, atol=0)


def test_full_reduction_is_deterministic_with_many_partials():
    x = rnd(3 * codegen_triton.FULL_BLOCK + 5)
    lm, got, ref, ref64 = run_both(total, x)
    assert "k0_part" in lm.source()
    with torch.no_grad():
        again = lm(x)
    assert torch.equal(got, again)
    assert abs(got.item() - ref64.item()) < 1e-4 * (1 + abs(ref64.item()))


def test_bool_and_int_values():
    def f(x):
        return (x > 0).sum(), torch.where(x > 0, x, torch.zeros_like(x)).to(torch.int32)
    x = rnd(7, 9)
    lm, got, ref, _ = run_both(f, x)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_math_functions_and_special_values():
    """torch.round (half to even), pow's special cases, tanh/log1p/expm1 near 0, NaN/Inf."""
    vals = [-2.0, -2.0, 0.0, 0.0, 2.0, 1.5, -1.0, float("nan"), 1.0, 0.5 / 3, -2.5 / 3, 1e-4, -3e-5, float("inf")]
    exps = [3.0, 0.5, -1.0, 0.0, 0.5, 2.0, float("inf"), 0.0, float("nan"), 1.0, 2.0, 2.0, 3.0, 2.0]
    x, y = torch.tensor(vals, device=device()), torch.tensor(exps, device=device())

    def f(x, y):
        return (torch.round(x * 3), torch.pow(x, y), torch.tanh(x), torch.log1p(x.abs()), torch.expm1(x),
                torch.sign(x), torch.relu(x), torch.maximum(x, y))
    lm, got, ref, ref64 = run_both(f, x, y)
    for g, r, r64 in zip(got, ref, ref64):
        assert_close(g, r, r64, torch.float32)


def test_libdevice_source_is_valid_python():
    lm, _, _, _ = run_both(chain, rnd(3, 4), rnd(3, 4))
    src = codegen_triton.module_source([k.kernel for k in lm.kernels], portable=False)
    compile(src, "<triton>", "exec")
    assert "from triton.language.extra import libdevice" in src and "libdevice.tanh(x)" in src


def test_generated_source_golden():
    torch.manual_seed(0)
    lm, _, _, _ = run_both(softmax, rnd(6, 50))
    src = lm.source()
    assert src.startswith("# generated by symtrace.lower (Triton backend)")
    (k,) = lm.kernels
    lines = [s.strip() for s in k.source.splitlines()]
    assert lines[0].startswith("# row kernel; nodes:")
    assert lines[1:3] == ["@triton.jit", "def k0(b0, b1):"]
    assert "pid = tl.program_id(0)" in lines
    assert "r_acc0 = 0 + tl.arange(0, 64)" in lines and "r_acc0_m = r_acc0 < 50" in lines
    assert "acc0 = tl.max(acc0_blk, axis=0)" in lines
    assert "acc0 = tl.where(tl.sum(acc0_nan, axis=0) > 0, st_nan(), acc0)" in lines
    assert any(s.startswith("acc1 = tl.sum(") for s in lines)
    assert any(s.startswith("tl.store(b1 + (50 * o0 + i0)") and s.endswith("mask=i0_m)") for s in lines)
    assert "_k0(x, buf0, nt)" in lm.wrapper_code and "data_ptr" not in lm.wrapper_code


def test_pointwise_index_recovery_for_strided_kernel():
    # (y read transposed; the output is contiguous, as eager's: a transposed x would make eager's
    # output transposed too, and the kernel would then run in memory order, one flat loop)
    x, y = rnd(10, 24), rnd(24, 10).t()
    lm, _, _, _ = run_both(chain, x, y)
    (k,) = lm.kernels
    assert "i0 = offs % 24" in k.source and "o0 = rest" in k.source
    assert "mask = offs < 240" in k.source


def test_wrapper_passes_tensors_to_triton_launchers_and_guards_the_device():
    x = torch.randn(4, 6, device=device())
    gm = symtrace.symbolic_trace(softmax, example_inputs=(x,))
    lm = lower(gm, (x,), target="cuda")
    (variant,) = lm._variants.values()
    assert ".data_ptr()" not in variant.wrapper_code
    assert re.search(r"_k0\(x, \w+, nt\)", variant.wrapper_code), variant.wrapper_code
    assert f"x.is_{device()}" in variant.wrapper_code
    on_gpu = wrapper.generate(variant.lowering, "cuda", pointers=False).source
    assert "x.is_cuda" in on_gpu and "is_cpu" not in on_gpu and "'cpu'" not in on_gpu
    assert "x.device.type == 'xpu'" in wrapper.generate(variant.lowering, "xpu", pointers=False).source
    for_c = wrapper.generate(variant.lowering).source  # the C kernels' form: data pointers
    assert re.search(r"_k0\(x\.data_ptr\(\), \w+\.data_ptr\(\), nt\)", for_c), for_c


def test_needs_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    gm = symtrace.symbolic_trace(softmax, example_inputs=(torch.randn(2, 3),))
    with pytest.raises(ImportError, match="pip install triton"):
        lower(gm, (torch.randn(2, 3),), target="cuda")


def test_cpu_tensors_need_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gm = symtrace.symbolic_trace(softmax, example_inputs=(torch.randn(2, 3),))
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        lower(gm, (torch.randn(2, 3),), target="cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu():
    torch.manual_seed(0)
    for fn, make, _ in CASES.values():
        inputs = tuple(t.cuda() for t in make(torch.float32))
        gm = symtrace.symbolic_trace(fn, example_inputs=inputs)
        lm = lower(gm, inputs, target="cuda")
        with torch.no_grad():
            got, ref = lm(*inputs), fn(*inputs)
            ref64 = fn(*[t.double() for t in inputs])
        assert_close(got, ref, ref64, torch.float32)
        tuned = lower(gm, inputs, target="cuda", autotune=True)  # real timings on the GPU
        with torch.no_grad():
            assert_close(tuned(*inputs), ref, ref64, torch.float32)
        (variant,) = tuned._variants.values()
        assert all(t.warps in t.timings for t in variant.tuning.values() if t.timings)


# --- autotuning --------------------------------------------------------------------------------
from symtrace.lower import triton_tuning  # noqa: E402


@pytest.fixture
def fake_timer(monkeypatch):
    """Tuning with made-up timings: more warps are faster; counts the timings taken."""
    calls = []

    def measure(run, sync, reps=5, **kwargs):
        run()  # (still launches: the configuration must work)
        calls.append(run)
        return 1.0 / (1 + len(calls))
    monkeypatch.setattr(triton_tuning, "measure", measure)
    triton_tuning.clear_tuning_cache()
    yield calls
    triton_tuning.clear_tuning_cache()


def test_autotune_times_each_configuration_and_keeps_the_fastest(fake_timer):
    x, y = torch.randn(40, 24, device=device()), torch.randn(40, 24, device=device())
    gm = symtrace.symbolic_trace(chain, example_inputs=(x, y))
    lm = lower(gm, (x, y), target="cuda", autotune=True)
    torch.testing.assert_close(lm(x, y), chain(x, y))
    (variant,) = lm._variants.values()
    (name,) = [k.name for k in variant.lowering.kernels]
    t = variant.tuning[name]
    table = codegen_triton.launch_plan(variant.lowering.kernels[0]).warps
    assert sorted(t.timings) == triton_tuning.warp_choices(table) and len(t.timings) == 3
    assert t.warps == max(t.timings) and not t.note  # the made-up timer favours the last one tried
    n = len(fake_timer)
    lm2 = lower(symtrace.symbolic_trace(chain, example_inputs=(x, y)), (x, y), target="cuda", autotune=True)
    torch.testing.assert_close(lm2(x, y), chain(x, y))
    assert len(fake_timer) == n  # the same kernel on the same device: the cached choice
    (v2,) = lm2._variants.values()
    assert v2.tuning[name].warps == t.warps


def test_autotune_full_reduction_and_row_kernels_stay_exact(fake_timer):
    x = torch.randn(37, 53, device=device())
    for fn in (lambda a: a.sum(), softmax):
        gm = symtrace.symbolic_trace(fn, example_inputs=(x,))
        lm = lower(gm, (x,), target="cuda", autotune=True)
        torch.testing.assert_close(lm(x), fn(x))
        (variant,) = lm._variants.values()
        assert all(t.timings for t in variant.tuning.values()) and variant.tuning


def test_autotune_times_only_kernels_that_can_run_twice():
    import dataclasses

    x, y = torch.randn(8, 8, device=device()), torch.randn(8, 8, device=device())
    lm = lower(symtrace.symbolic_trace(chain, example_inputs=(x, y)), (x, y), target="cuda")
    (variant,) = lm._variants.values()
    (k,) = variant.lowering.kernels
    assert triton_tuning.rerunnable(k)  # reads x and y, writes a fresh output
    read = next(b for b in k.buffers() if b.role == "input")
    # (the lowering runs in-place ops through torch today; tuning must still not re-run a
    # kernel that writes what it reads, or memory the caller owns)
    writes_its_input = dataclasses.replace(k, stores=[dataclasses.replace(k.stores[0], buffer=read)])
    assert not triton_tuning.rerunnable(writes_its_input)
    tuning = {}
    launch = triton_backend._launcher(variant.module, writes_its_input, ("triton", "key"), tuning)
    assert "writes memory" in tuning[k.name].note and not tuning[k.name].timings
    assert callable(launch)


def test_autotune_needs_the_cuda_target():
    gm = symtrace.symbolic_trace(softmax, example_inputs=(torch.randn(2, 3),))
    with pytest.raises(ValueError, match="autotune=True applies to target='cuda'"):
        lower(gm, (torch.randn(2, 3),), autotune=True)


def test_measure_falls_back_to_timed_runs_off_cuda(monkeypatch):
    """CPU / interpreter: timed runs; a CUDA device: triton.testing.do_bench (milliseconds)."""
    runs = []
    assert triton_tuning.measure(lambda: runs.append(1), lambda: None, reps=3, device=torch.device("cpu")) >= 0
    assert len(runs) == 4  # one untimed, three timed
    seen = []

    def bench(fn, warmup, rep, return_mode):
        fn()
        seen.append(return_mode)
        return 2.0
    monkeypatch.setattr(triton_tuning, "_do_bench", lambda: bench)
    assert triton_tuning.measure(lambda: runs.append(1), lambda: None, device=torch.device("cuda")) == 0.002
    assert seen == ["median"]


# ------------------------------------------------------------------ size-generic Triton kernels
def _dyn_fn(x, w, b):
    return torch.softmax(F.layer_norm(x, (x.shape[-1],), w, b) * 0.5, dim=-1), x.sum(), torch.relu(x + 1)


@_runtime_size_loops
def test_size_generic_triton_kernels_serve_every_length():
    dev = device()
    w, b = torch.randn(32, device=dev), torch.randn(32, device=dev)
    lm = lower(_dyn_fn, (torch.randn(2, 5, 32, device=dev), w, b), target="cuda")
    with torch.no_grad():
        for t in (5, 6, 13, 2, 131):
            x = torch.randn(2, t, 32, device=dev)
            for got, ref in zip(lm(x, w, b), _dyn_fn(x, w, b)):
                torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert lm.compiles == 2 and lm._generic[0].symbols == ("s0",)
    src = lm._generic[0].triton_source
    assert "def k0(b0, b1, b2, b3, s0):" in src and "64*s0" in src   # sizes are arguments, not literals


def _row_sum(x):
    return x.sum(-1) + x.amax(-1)


@_runtime_size_loops
def test_size_generic_triton_rows_of_symbolic_length():
    dev = device()
    lm = lower(_row_sum, (torch.randn(3, 10, device=dev),), target="cuda")
    with torch.no_grad():
        for t in (11, 3000, 9000, 2):   # a symbolic row of unbounded length: looped blocks for all
            x = torch.randn(3, t, device=dev)
            torch.testing.assert_close(lm(x), _row_sum(x), rtol=1e-4, atol=1e-3)
    assert lm.compiles == 2 and "for start in range(0, (s0), 2048):" in lm._generic[0].triton_source


def test_cuda_target_folds_batch_norm_and_checks_weights():
    """target="cuda" runs the pipeline's device-independent steps (batch norm and constant
    folding); the folded weights are snapshots checked on each call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 4, 1), torch.nn.BatchNorm2d(4), torch.nn.SiLU())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    model = model.eval().to(device())
    x = torch.randn(2, 3, 6, 6, device=device())
    lm = lower(model, (x,), target="cuda")
    assert any("batch norm(s) folded" in n for n in lm.pipeline_notes)
    assert not any(n.op == "call_module" and isinstance(lm.gm.get_submodule(n.target), torch.nn.BatchNorm2d)
                   for n in lm.gm.graph.nodes)
    with torch.no_grad():
        torch.testing.assert_close(lm(x), model(x), rtol=1e-4, atol=1e-5)
        model[1].running_mean.add_(1.0)           # the folded snapshot is stale: torch runs the model
        with pytest.warns(UserWarning, match="changed since lowering"):
            got = lm(x)
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-5)
    plain = lower(model, (x,), target="cuda", inference=False)
    assert not plain.pipeline_notes


class _Rotary(torch.nn.Module):
    """The shape of Hugging Face's rotary embedding (transformers 5.x): a buffer expanded over
    the batch, cast with ``.to(dtype=..., device=x.device)`` and multiplied by the positions."""

    def __init__(self, dim=16):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, x, position_ids):
        inv = self.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1).to(dtype=torch.float32,
                                                                                   device=x.device)
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return x * emb.cos() + x.flip(-1) * emb.sin()


def test_a_cast_to_the_inputs_device_stays_on_it():
    """On a GPU, ``.to(device=x.device)`` was refused as a device copy and the torch result's
    layout fix-up copied it to the CPU: Llama failed with a device mismatch (H200)."""
    model = _Rotary().to(device())
    x = torch.randn(2, 8, 16, device=device())
    pos = torch.arange(8, device=device()).expand(2, 8)
    lm = lower(model, (x, pos), target="cuda")
    with torch.no_grad():
        got, ref = lm(x, pos), model(x, pos)
    assert got.device == ref.device
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    how = re.search(r"^to +call_method +to +(\S+)", lm.report(), re.M)
    assert how and how.group(1) != "torch", lm.report()   # (a view here: the dtype is float32 already)


def test_speed_check_runs_a_losing_triton_module_through_torch(monkeypatch):
    """target="cuda" has the speed check too (H200: BERT and GPT-2 at batch 1 lost to eager
    on launch overhead); it is off by default in the interpreter, whose kernels are slow."""
    from symtrace.lower import speed_guard
    f = lambda a: torch.relu(a) * 2 + 1   # noqa: E731
    x = torch.randn(64, device=device())
    gm = symtrace.symbolic_trace(f, example_inputs=(x,))
    clocks = []
    monkeypatch.setattr(speed_guard, "MAX_CALL_S", 1e9)
    monkeypatch.setattr(speed_guard, "_sample", lambda fn, args, n, clock: (
        clocks.append(clock), fn(*args), 2e-3 if isinstance(fn, symtrace.lower.LoweredModule) else 1e-3)[2])
    monkeypatch.delenv("SYMTRACE_SPEED_CHECK", raising=False)
    lm = lower(gm, (x,), target="cuda")
    assert lm.torch_reason is None and not clocks if INTERPRET else lm.torch_reason is not None
    lm = lower(gm, (x,), target="cuda", speed_check=True)
    assert "not used: measured at compile time" in lm.report() and clocks
    assert (clocks[0] is speed_guard.time.perf_counter) == INTERPRET   # on a GPU: synchronised
    torch.testing.assert_close(lm(x), f(x))


def test_a_failing_inference_pipeline_lowers_the_graph_as_written(monkeypatch):
    """As on the CPU target: a pipeline step that raises costs the pipeline, with a warning,
    not the compile."""
    from symtrace.lower import pipeline

    def broken(*args, **kwargs):
        raise RuntimeError("a step failed")
    monkeypatch.setattr(pipeline, "prepare", broken)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval().to(device())
    x = torch.randn(4, 8, device=device())
    with pytest.warns(UserWarning, match="inference pipeline failed"):
        lm = lower(model, (x,), target="cuda")
    assert not lm.pipeline_notes
    with torch.no_grad():
        torch.testing.assert_close(lm(x), model(x))


def test_the_state_check_covers_the_pipelines_own_tensors():
    # values the pipeline folded live in its copy of the graph; a change to one (through Python
    # state it was stored into, say) must send calls through the graph, as on the CPU target
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return x @ (self.w * 2)

    x = torch.randn(3, 4, device=device())
    with torch.no_grad():
        lm = lower(M().eval().to(device()), (x,), target="cuda")
        folded = [b for name, b in lm.gm.named_buffers() if name.startswith("_folded")]
        assert folded and lm._state_check()
        folded[0].add_(1)
        assert not lm._state_check()


def test_a_fold_that_reaches_the_caller_is_undone_on_the_triton_target_too(monkeypatch):
    # (the re-lowering keeps the Triton lowering's own state: its device type)
    from symtrace.lower import constant_tensors as CT
    monkeypatch.setattr(CT.ConstantTensors, "_private", lambda self, node: True)

    def f(x):
        ids = torch.arange(x.shape[1], device=x.device) * 1.0
        return x + ids, ids

    x = torch.randn(2, 4, device=device())
    lm = lower(f, (x,), target="cuda", speed_check=False)
    _, ids = lm(x)
    ids.add_(100)
    torch.testing.assert_close(lm(x)[1], torch.arange(4.0, device=device()))


def test_a_list_of_tensors_is_flattened_for_the_triton_kernels():
    def f(xs):
        return torch.sigmoid(xs[0] * 2) + xs[1]
    dev = device()
    xs = [torch.randn(8, 16, device=dev), torch.randn(8, 16, device=dev)]
    lm = lower(f, (xs,), target="cuda", speed_check=False)
    xs2 = [torch.randn(8, 16, device=dev), torch.randn(8, 16, device=dev)]
    torch.testing.assert_close(lm(xs2), f(xs2))
    assert lm.kernels and lm.torch_calls == 0
