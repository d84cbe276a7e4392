"""Weight-only int8/int4 quantization: the numbers and layout (passes/quant/woq.py), the C
kernels against dequantize-then-matmul for every instruction set this CPU runs (shapes with
tails, M of 0 and 1, N and K of 1, NaN/Inf, non-contiguous inputs, thread counts), and the
``weight_only`` pass (what it replaces, the LM head rule, the input left alone, capture,
save/load)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

import symtrace
from symtrace.lower.woq_cpu import KERNELS
from symtrace.passes import quant as Q
from symtrace.passes.quant.kernels import woq_linear
from symtrace.passes.quant.woq import (check_stored, dequantize_weight, pack_int4, quantize_weight_only, unpack_int4,
                                       woq_reference)

ISAS = KERNELS.isas()
INTEGER_ISAS = [i for i in ISAS if i != "portable"]   # where activations="int8" sums in integers
needs_kernels = pytest.mark.skipif(not ISAS, reason=f"the woq C kernels are not usable here: {KERNELS.reason}")
SCHEMES = [(8, None, True), (8, 32, False), (8, 64, True), (4, 32, True), (4, 64, False), (4, 128, True),
           (4, None, True), (4, None, False)]


def _bound(x, q, bias):
    """float32 error bound of a K-term dot product (float64 ``|x| @ |W|.T``)."""
    w = dequantize_weight(q.qweight, q.scale, q.zero, q.bits, q.group_size, q.in_features).double()
    k = q.in_features
    b = 0 if bias is None else bias.double().abs()
    return (k + 4) * 2.0 ** -23 * (x.double().abs() @ w.abs().T + b) + 1e-30


# --- the numbers --------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 9), k=st.integers(1, 200), scheme=st.sampled_from(SCHEMES), seed=st.integers(0, 2**16))
def test_quantization_error_is_at_most_half_a_step(n, k, scheme, seed):
    bits, gs, sym = scheme
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 3
    q = quantize_weight_only(w, bits, gs, sym)
    deq = dequantize_weight(q.qweight, q.scale, q.zero, bits, gs, k)
    idx = torch.arange(k) // (gs or k)
    step = q.scale[:, idx]
    assert torch.all((deq - w).abs() <= step * 0.5 * (1 + 1e-5) + 1e-7)
    check_stored(q.qweight, q.scale, q.zero, None, bits, gs, k)
    if bits == 4:
        assert q.qweight.shape == (n, 16 * -(-k // 32)) and q.qweight.dtype is torch.uint8
    else:
        assert q.qweight.shape == (n, k) and q.qweight.dtype is torch.int8


def test_int4_layout_and_padding():
    q = torch.arange(40, dtype=torch.uint8).remainder(16).reshape(1, 40)
    packed = pack_int4(q, pad=8)
    assert packed.shape == (1, 32)
    assert packed[0, 0] == (0 | (16 % 16) << 4)  # input 0 low nibble, input 16 high nibble
    assert packed[0, 5] == (5 | (21 % 16) << 4)
    assert packed[0, 16 + 8] == (40 % 16 | 8 << 4)  # input 40 low; input 56 is past K: the pad, 8
    assert torch.equal(unpack_int4(packed, 40), q)
    # padding nibbles past K hold the pad value
    assert torch.all(unpack_int4(packed, 64)[0, 40:] == 8)


def test_zero_weights_and_asymmetric_zero_is_exact():
    w = torch.zeros(3, 64)
    w[1] = torch.linspace(0.5, 2.0, 64)  # all positive: the range is widened to include 0
    for bits in (8, 4):
        q = quantize_weight_only(w, bits, 32, symmetric=False)
        deq = dequantize_weight(q.qweight, q.scale, q.zero, bits, 32, 64)
        assert torch.equal(deq[0], torch.zeros(64)) and torch.equal(deq[2], torch.zeros(64))
        assert (deq[1] - w[1]).abs().max() <= q.scale[1].max() / 2 + 1e-7


def test_bad_schemes_and_weights_are_refused():
    with pytest.raises(ValueError, match="bits=8 or bits=4"):
        Q.weight_only(bits=3)
    with pytest.raises(ValueError, match="multiple of 32"):
        Q.weight_only(bits=4, group_size=48)
    w = torch.randn(4, 8)
    w[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinity"):
        quantize_weight_only(w, 8)


# --- the kernels ----------------------------------------------------------------------------------
def test_kernels_pass_their_self_check_on_x86_with_a_compiler():
    # a kernel that disagrees with the reference makes the library unusable (every call then
    # runs the reference): on the machines CI runs, that must show as a failure, not as skips
    import platform
    import shutil
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("not an x86 machine with a C compiler")
    assert KERNELS.available(), KERNELS.reason


@needs_kernels
@settings(max_examples=60, deadline=None)
@given(m=st.sampled_from([0, 1, 2, 3, 5, 17]), k=st.integers(1, 300), n=st.integers(1, 70),
       scheme=st.sampled_from(SCHEMES), bias=st.booleans(), isa=st.sampled_from(ISAS or ["portable"]),
       lead3=st.booleans(), seed=st.integers(0, 2**16))
def test_kernels_match_dequantize_then_matmul(m, k, n, scheme, bias, isa, lead3, seed):
    bits, gs, sym = scheme
    gen = torch.Generator().manual_seed(seed)
    q = quantize_weight_only(torch.randn(n, k, generator=gen), bits, gs, sym)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(m, k, generator=gen) * 2
    if lead3:
        x = x.reshape(1, m, k)
    got = KERNELS.linear(x, q.qweight, q.scale, q.zero, b, bits, gs, k, isa=isa)
    want = woq_reference(x.double(), q.qweight, q.scale, q.zero, b, bits, gs, k)
    assert got.shape == want.shape and got.dtype is torch.float32
    assert torch.all((got.double() - want).abs() <= _bound(x, q, b))


@pytest.mark.skipif("avx512" not in ISAS, reason="the row-blocked weights serve the AVX-512 kernels")
@settings(max_examples=40, deadline=None)
@given(m=st.sampled_from([1, 2, 17]), chunks=st.integers(1, 8), n=st.integers(1, 70),
       scheme=st.sampled_from(SCHEMES), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_row_blocked_weights_give_the_same_results(m, chunks, n, scheme, bias, seed):
    # K a multiple of 32: the AVX-512 kernels read a copy of the weight in blocks of 4 rows
    # (one memory stream per GEMV); N need not be a multiple of 4
    from symtrace.lower.int8_cache import forget_weights
    bits, gs, sym = scheme
    k = 32 * chunks
    if gs is not None and k % gs:
        gs = 32
    gen = torch.Generator().manual_seed(seed)
    q = quantize_weight_only(torch.randn(n, k, generator=gen), bits, gs, sym)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(m, k, generator=gen) * 2
    forget_weights()
    got = KERNELS.linear(x, q.qweight, q.scale, q.zero, b, bits, gs, k, isa="avx512")
    want = woq_reference(x.double(), q.qweight, q.scale, q.zero, b, bits, gs, k)
    assert torch.all((got.double() - want).abs() <= _bound(x, q, b))
    from symtrace.lower.woq_cpu import _make_plan
    assert (_make_plan(q.qweight, q.scale, q.zero, b, bits, gs, k).blocked_address() != 0) == (n >= 4)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("scheme", [(8, None, True), (8, 32, False), (4, 32, True), (4, None, False)])
@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.parametrize("k", [75, 64])
def test_nan_and_inf_propagate_as_in_the_matmul(isa, scheme, m, k):
    bits, gs, sym = scheme
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(21, k, generator=gen)
    w[3] = 0.0  # a zero row: inf * 0 is NaN
    q = quantize_weight_only(w, bits, gs, sym)
    x = torch.randn(m, k, generator=gen)
    x[0, 5] = float("inf")
    x[m - 1, k - 1] = float("-inf")  # in the K tail (k = 75; 64: row-blocked weights)
    if m > 1:
        x[1, 40] = float("nan")
    got = KERNELS.linear(x, q.qweight, q.scale, q.zero, None, bits, gs, k, isa=isa)
    want = woq_reference(x, q.qweight, q.scale, q.zero, None, bits, gs, k)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isposinf(), want.isposinf()) and torch.equal(got.isneginf(), want.isneginf())
    fin = want.isfinite()
    assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [8, 4])
def test_non_contiguous_and_broadcast_inputs(isa, bits):
    gen = torch.Generator().manual_seed(2)
    q = quantize_weight_only(torch.randn(19, 67, generator=gen), bits, 32)
    big = torch.randn(8, 140, generator=gen)
    for x in (big[:, ::2][:, :67], big.T[:67].T[:5], torch.randn(67, generator=gen).expand(4, 67),
              big[3, :67], big[:1, 1:68]):
        got = KERNELS.linear(x, q.qweight, q.scale, q.zero, None, bits, 32, 67, isa=isa)
        want = woq_reference(x.contiguous(), q.qweight, q.scale, q.zero, None, bits, 32, 67)
        assert got.shape == want.shape
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("m", [1, 9])
def test_results_do_not_depend_on_the_thread_count(m):
    q = quantize_weight_only(torch.randn(300, 520), 4, 64)
    x = torch.randn(m, 520)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KERNELS.linear(x, q.qweight, q.scale, q.zero, None, 4, 64, 520)
        torch.set_num_threads(2)
        two = KERNELS.linear(x, q.qweight, q.scale, q.zero, None, 4, 64, 520)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


@needs_kernels
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 900), k=st.sampled_from([64, 160, 512]), scheme=st.sampled_from([(8, None), (4, 32), (4, 128)]),
       threads=st.sampled_from([2, 3, 5]), isa=st.sampled_from(ISAS or ["portable"]), seed=st.integers(0, 2**16))
def test_a_gemv_shared_among_threads_computes_every_row_once_as_one_thread_does(n, k, scheme, threads, isa, seed):
    # a decode GEMV's threads take pieces of 4 x 16 rows from each other's parts once done with
    # their own (st_take): every row must be written, with the one-thread bits, whatever the
    # number of parts (an odd one, more than the cores) and wherever the last piece ends
    bits, gs = scheme
    gen = torch.Generator().manual_seed(seed)
    q = quantize_weight_only(torch.randn(n, k, generator=gen), bits, gs)
    x = torch.randn(1, k, generator=gen)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KERNELS.linear(x, q.qweight, q.scale, q.zero, None, bits, gs, k, isa=isa)
        torch.set_num_threads(threads)
        many = KERNELS.linear(x, q.qweight, q.scale, q.zero, None, bits, gs, k, isa=isa)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, many)


@needs_kernels
def test_zero_sizes():
    for n, k in ((5, 0), (0, 7)):
        q = quantize_weight_only(torch.randn(n, k), 4, 32)
        b = torch.randn(n)
        for m in (0, 1, 3):
            got = KERNELS.linear(torch.randn(m, k), q.qweight, q.scale, q.zero, b, 4, 32, k)
            assert torch.equal(got, F.linear(torch.randn(m, k), torch.zeros(n, k), b))


def test_woq_linear_errors_name_the_problem():
    q = quantize_weight_only(torch.randn(6, 40), 4, 32)
    with pytest.raises(ValueError, match="takes 40 input features"):
        woq_linear(torch.randn(2, 39), q.qweight, q.scale, None, None, bits=4, group_size=32, in_features=40,
                   backend="c")
    with pytest.raises(ValueError, match="scale is"):
        woq_linear(torch.randn(2, 40), q.qweight, q.scale[:, :1], None, None, bits=4, group_size=32,
                   in_features=40, backend="c")
    with pytest.raises(ValueError, match="unknown int8 backend"):
        Q.weight_only(backend="nope")


def test_other_dtypes_use_the_reference():
    q = quantize_weight_only(torch.randn(6, 40), 8, None)
    x = torch.randn(3, 40, dtype=torch.float64)
    got = woq_linear(x, q.qweight, q.scale, None, None, bits=8, group_size=None, in_features=40, backend="c")
    assert got.dtype is torch.float64
    assert torch.equal(got, woq_reference(x, q.qweight, q.scale, None, None, 8, None, 40))


# --- the Triton kernels (in the interpreter on CPU tensors; compiled where a GPU is present) -----
def _triton():
    pytest.importorskip("triton", reason="triton (and, for the interpreter, numpy) not installed")
    from symtrace.lower import woq_triton
    from symtrace.lower.triton_prelude import interpreter_defect, interpreting
    if interpreter_defect():
        pytest.skip(interpreter_defect())
    dev = "cpu" if interpreting() else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a GPU")
    return woq_triton, dev


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("scheme", [(8, None, True), (8, 32, False), (4, 64, True), (4, None, False)])
@pytest.mark.parametrize("m,k,n", [(1, 70, 37), (3, 33, 5), (12, 100, 40), (1, 1, 1), (0, 5, 3), (9, 0, 2)])
def test_triton_kernels_match_dequantize_then_matmul(scheme, m, k, n):
    woq_triton, dev = _triton()
    bits, gs, sym = scheme
    gen = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    q = quantize_weight_only(torch.randn(n, k, generator=gen), bits, gs, sym)
    b = torch.randn(n, generator=gen)
    x = torch.randn(m, k, generator=gen)
    if m and k > 2:
        x[0, 1] = float("inf")
        x[m - 1, k - 1] = float("nan")
    on = (lambda t: None if t is None else t.to(dev))
    got = woq_triton.linear(on(x), on(q.qweight), on(q.scale), on(q.zero), on(b), bits, gs, k).cpu()
    want = woq_reference(x, q.qweight, q.scale, q.zero, b, bits, gs, k)
    assert got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    fin = want.isfinite()
    xf = torch.where(x.isfinite(), x, 0.0)
    assert torch.all((got[fin].double() - want[fin].double()).abs() <= _bound(xf, q, b)[fin] + 1e-6)


def test_triton_non_contiguous_input():
    woq_triton, dev = _triton()
    q = quantize_weight_only(torch.randn(20, 64), 4, 32)
    big = torch.randn(10, 128)
    for x in (big[:, ::2], big[:1, ::2]):
        got = woq_triton.linear(x.to(dev), q.qweight.to(dev), q.scale.to(dev), None, None, 4, 32, 64).cpu()
        assert torch.allclose(got, woq_reference(x, q.qweight, q.scale, None, None, 4, 32, 64), rtol=1e-5,
                              atol=1e-5)


def test_a_triton_interpreter_that_cannot_loop_over_sizes_is_named(monkeypatch):
    # Triton 3.6's interpreter with numpy >= 2.4 fails deep inside a kernel on a run-time size
    # (triton-lang/triton#9171): woq_linear says so and how to fix it instead
    pytest.importorskip("triton", reason="triton not installed")
    import numpy
    import triton
    from symtrace.lower import triton_prelude, woq_triton
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(numpy, "__version__", "2.4.1")
    for version, broken in (("3.6.0", True), ("3.6.0+git1234", True), ("3.7.0", False), ("4.0.1", False)):
        monkeypatch.setattr(triton, "__version__", version)
        assert (triton_prelude.interpreter_defect() is not None) == broken, version
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.3.5")
    assert triton_prelude.interpreter_defect() is None
    monkeypatch.setattr(numpy, "__version__", "2.4.0")
    q = quantize_weight_only(torch.randn(20, 64), 4, 32)
    with pytest.raises(RuntimeError, match=r"triton#9171.*Triton >= 3.7 or numpy < 2.4"):
        woq_triton.linear(torch.randn(2, 64), q.qweight, q.scale, None, None, 4, 32, 64)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert triton_prelude.interpreter_defect() is None   # compiled kernels are not affected


# --- the pass -------------------------------------------------------------------------------------
class _Decoderish(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(70, 48)
        self.down = nn.Linear(48, 33, bias=False)
        self.proj = nn.Parameter(torch.randn(33, 33) * 0.1)
        self.lm_head = nn.Linear(33, 20)
        self.side = nn.Linear(33, 5)

    def forward(self, x):
        h = self.down(torch.relu(self.up(x)))
        h = h + F.linear(h, self.proj)
        return {"logits": self.lm_head(h), "other": self.side(h) * 2, "direct": F.linear(h, self.proj)}


def _eager_reference(model, gm_q, x):
    """The model with each quantized layer's weight replaced by its dequantized value."""
    ref = {}
    for n in gm_q.graph.find_nodes(op="call_function", target=woq_linear):
        qw, sc, zp, _ = (None if a is None else gm_q.get_buffer(a.target) for a in n.args[1:5])
        ref[n.meta["quant_layer"]] = dequantize_weight(qw, sc, zp, n.kwargs["bits"], n.kwargs["group_size"],
                                                       n.kwargs["in_features"])
    m2 = _Decoderish()
    m2.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, w in ref.items():
            if name == "proj":
                m2.proj.copy_(w)
            else:
                m2.get_submodule(name).weight.copy_(w)
    return m2(x), set(ref)


@pytest.mark.parametrize("bits,gs,sym", [(8, None, True), (4, 32, True), (4, 64, False)])
def test_pass_replaces_linears_and_keeps_the_lm_head(bits, gs, sym, capsys):
    torch.manual_seed(0)
    model = _Decoderish().eval()
    x = torch.randn(3, 70)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    before = str(gm.graph)
    q = Q.weight_only(bits=bits, group_size=gs, symmetric=sym)(gm)
    assert str(gm.graph) == before  # the input is left alone
    assert torch.equal(gm(x)["logits"], model(x)["logits"])
    sites = {n.meta["quant_layer"] for n in q.graph.find_nodes(op="call_function", target=woq_linear)}
    assert sites == {"up", "down", "side", "proj"}  # F.linear on a parameter too (its inner use)
    assert set(q.meta["quant_kept_float"]) == {"lm_head", "proj"}  # by name; returned directly
    assert not hasattr(q, "up") or not hasattr(q.up, "weight")  # the float weight is not referenced
    want, _ = _eager_reference(model, q, x)
    got = q(x)
    for key in ("logits", "other"):  # ("direct" reads proj in float, the reference cannot say so)
        assert torch.allclose(got[key], want[key], rtol=1e-5, atol=1e-5), key
    q.graph.lint()
    q.print_tabular()
    table = capsys.readouterr().out
    assert f"weight_only(bits={bits}" in table and "up.qweight" in table and "kernels.woq_linear" in table


def test_lm_head_true_quantizes_the_head_and_returned_linears():
    model = _Decoderish().eval()
    x = torch.randn(2, 70)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    q = Q.weight_only(bits=4, group_size=32, lm_head=True)(gm)
    assert q.meta["quant_kept_float"] == []
    assert q.meta["quant_lowering"] == {"woq_linear(int4, 32)": 6}
    want, names = _eager_reference(model, q, x)
    assert "lm_head" in names
    got = q(x)
    assert all(torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-5) for k in want)


def test_lm_head_at_its_own_bits():
    # lm_head=8 with int4 layers: the LM head (and Linears returned directly) int8 per channel, as
    # llama.cpp keeps its output layer; on a trained Llama this took teacher-forced top-1 agreement
    # with fp32 from ~88-93% (int4 head) to ~98-99% (examples/llm)
    torch.manual_seed(0)
    model = _Decoderish().eval()
    x = torch.randn(2, 70)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    q = Q.weight_only(bits=4, group_size=32, lm_head=8)(gm)
    assert q.meta["quant_kept_float"] == []
    assert q.meta["quant_lowering"] == {"woq_linear(int4, 32)": 4, "woq_linear(int8, per-channel)": 2}
    by_layer = {n.meta["quant_layer"]: n.kwargs for n in q.graph.find_nodes(op="call_function", target=woq_linear)}
    assert by_layer["lm_head"]["bits"] == 8 and by_layer["lm_head"]["group_size"] is None
    assert by_layer["up"]["bits"] == 4
    assert [n.kwargs["bits"] for n in q.graph.find_nodes(op="call_function", target=woq_linear)
            if n.meta["quant_layer"] == "proj"] == [4, 8]   # (used inside at int4, returned at int8)
    from symtrace.graph.interpreter import Interpreter
    head = next(n for n in q.graph.find_nodes(op="call_function", target=woq_linear)
                if n.meta["quant_layer"] == "lm_head")
    seen = {}

    class Watch(Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            seen[n] = out
            return out

    got = Watch(q).run(x)["logits"]   # the head, int8 per channel, on the hidden state it got
    w = dequantize_weight(q.get_buffer("lm_head.qweight"), q.get_buffer("lm_head.scale"), None, 8, None, 33)
    torch.testing.assert_close(got, F.linear(seen[head.args[0]], w, model.lm_head.bias), rtol=1e-5, atol=1e-5)
    assert "lm_head=8" in repr(Q.weight_only(bits=4, group_size=32, lm_head=8))
    for bad in (2, "yes", 16):
        with pytest.raises(ValueError, match="lm_head must be"):
            Q.weight_only(bits=4, group_size=32, lm_head=bad)


def test_capture_with_the_pass_and_save_load(tmp_path):
    torch.manual_seed(1)
    model = _Decoderish().eval()
    x = torch.randn(4, 70)
    cap = symtrace.capture(model, passes=[Q.weight_only(bits=4, group_size=32)])
    out = cap(x)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    q = Q.weight_only(bits=4, group_size=32)(gm)
    assert torch.equal(q(x)["logits"], out["logits"])
    path = tmp_path / "woq.symtrace"
    symtrace.save(q, path)
    loaded = symtrace.load(path)
    got = loaded(x)
    assert all(torch.equal(got[k], q(x)[k]) for k in got)
    names = set(dict(loaded.named_buffers())) | set(dict(loaded.named_parameters()))
    assert {"up.qweight", "up.scale", "up.bias", "down.qweight"} <= names
    assert "up.weight" not in names and "down.weight" not in names  # float weights are not saved
    assert loaded.meta["quant_stage"] == "weight_only"


class _Conv1DLike(nn.Module):
    """Hugging Face's Conv1D (GPT-2's projections): ``x @ w + b`` by ``torch.addmm``, the
    weight stored (in, out)."""

    def __init__(self, nx, nf):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) / nx ** 0.5)
        self.bias = nn.Parameter(torch.randn(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(x.shape[:-1] + (self.nf,))


@pytest.mark.parametrize("bits, gs", [(8, None), (4, 32)])
def test_addmm_layers_are_quantized_as_their_transpose(bits, gs):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc, self.c_proj = _Conv1DLike(64, 96), _Conv1DLike(96, 64)
            self.other = nn.Parameter(torch.randn(64, 64))

        def forward(self, x):
            h = self.c_proj(torch.relu(self.c_fc(x)))
            # not sites: beta/alpha given; a weight that is computed, not an attribute
            return torch.addmm(h.view(-1, 64), x.view(-1, 64), self.other, beta=0.5) + \
                torch.addmm(self.c_proj.bias, h.view(-1, 64), self.other * 2)

    torch.manual_seed(0)
    m = Block().eval()
    x = torch.randn(2, 3, 64)
    q = Q.weight_only(bits=bits, group_size=gs)(symtrace.symbolic_trace(m, example_inputs=(x,)))
    calls = list(q.graph.find_nodes(op="call_function", target=woq_linear))
    assert sorted(n.meta["quant_layer"] for n in calls) == ["c_fc.weight", "c_proj.weight"]
    assert len(list(q.graph.find_nodes(op="call_function", target=torch.addmm))) == 2
    assert not {"c_fc.weight", "c_proj.weight"} & set(q.state_dict())   # (float weights not kept)
    assert all(n.kwargs["in_features"] == k for n, k in zip(sorted(calls, key=lambda n: n.meta["quant_layer"]), (64, 96)))

    def deq(layer):   # the (out, in) weight the pass quantized, dequantized
        node = next(n for n in calls if n.meta["quant_layer"] == f"{layer}.weight")
        qw, scale, zero = (None if a is None else q.get_buffer(a.target) for a in node.args[1:4])
        return dequantize_weight(qw, scale, zero, bits, gs, getattr(m, layer).weight.shape[0])

    w_fc, w_proj = deq("c_fc"), deq("c_proj")
    assert w_fc.shape == (96, 64) and w_proj.shape == (64, 96)
    assert (w_fc - m.c_fc.weight.detach().t()).abs().max() <= (m.c_fc.weight.abs().max() / (127 if bits == 8 else 7))
    with torch.no_grad():
        h = F.linear(torch.relu(F.linear(x, w_fc, m.c_fc.bias)), w_proj, m.c_proj.bias)
        want = torch.addmm(h.view(-1, 64), x.view(-1, 64), m.other, beta=0.5) + \
            torch.addmm(m.c_proj.bias, h.view(-1, 64), m.other * 2)
        torch.testing.assert_close(q(x), want, rtol=1e-4, atol=1e-4)


def test_an_addmm_layer_whose_result_is_returned_is_the_lm_head():
    # Conv1D restores the leading dimensions with .view: the result returned through it counts
    # as returned (left in float by default, as an nn.Linear output layer is)
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.out = _Conv1DLike(16, 16), _Conv1DLike(16, 5)

        def forward(self, x):
            return self.out(torch.relu(self.body(x)))

    x = torch.randn(2, 3, 16)
    gm = symtrace.symbolic_trace(Head().eval(), example_inputs=(x,))
    q = Q.weight_only(bits=8)(gm)
    assert q.meta["quant_kept_float"] == ["out.weight"]
    assert [n.meta["quant_layer"] for n in q.graph.find_nodes(op="call_function", target=woq_linear)] == ["body.weight"]
    q = Q.weight_only(bits=8, lm_head=True)(gm)
    assert len(list(q.graph.find_nodes(op="call_function", target=woq_linear))) == 2


def test_a_linear_returned_through_its_only_view_is_the_lm_head_but_not_one_used_elsewhere():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 6), nn.Linear(16, 6)

        def forward(self, x):
            h = self.a(x)
            y = self.c(h)   # viewed and returned, but also added: not only the view uses it
            return self.b(h).view(-1, 3), y.reshape(-1) + y.sum()

    gm = symtrace.symbolic_trace(Net().eval(), example_inputs=(torch.randn(4, 16),))
    q = Q.weight_only(bits=8)(gm)
    assert q.meta["quant_kept_float"] == ["b"]
    assert sorted(n.meta["quant_layer"] for n in q.graph.find_nodes(op="call_function", target=woq_linear)) == ["a", "c"]


def test_gpt2s_conv1d_projections_are_quantized_and_generate():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=64, bos_token_id=0,
                                  eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    m = copy.copy(model)
    m.forward = symtrace.capture(model.forward, passes=[Q.weight_only(bits=8, lm_head=True)])
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        got = m(input_ids=ids, use_cache=False).logits
        # c_attn, attn.c_proj, c_fc, mlp.c_proj per layer (Conv1D) and the head
        assert m.forward.graphs[0].meta["quant_lowering"] == {"woq_linear(int8, per-channel)": 9}
        assert not list(m.forward.graphs[0].graph.find_nodes(op="call_function", target=torch.addmm))
        assert (got - ref).abs().max() <= 0.02 * ref.abs().max()
        tokens = m.generate(ids, max_new_tokens=4, do_sample=False)   # (a cache: prefill and decode)
    assert tokens.shape == (1, 12)


def test_portable_backend_is_the_reference_exactly():
    model = _Decoderish().eval()
    x = torch.randn(2, 70)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    q = Q.weight_only(bits=8, backend="portable")(gm)
    node = next(iter(q.graph.find_nodes(op="call_function", target=woq_linear)))
    assert node.kwargs["backend"] == "portable"
    qw, sc = q.get_buffer(node.args[1].target), q.get_buffer(node.args[2].target)
    b = q.get_buffer(node.args[4].target)
    assert torch.equal(woq_linear(x, qw, sc, None, b, bits=8, group_size=None, in_features=70, backend="portable"),
                       woq_reference(x, qw, sc, None, b, 8, None, 70))


def test_shared_layer_is_quantized_once():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 32)

        def forward(self, x):
            return self.fc(torch.relu(self.fc(x))) + 1

    m = Twice().eval()
    x = torch.randn(2, 32)
    q = Q.weight_only(bits=8)(symtrace.symbolic_trace(m, example_inputs=(x,)))
    calls = list(q.graph.find_nodes(op="call_function", target=woq_linear))
    assert len(calls) == 2
    assert {calls[0].args[1].target} == {calls[1].args[1].target} == {"fc.qweight"}


@needs_kernels
def test_c_backend_runs_the_kernels_not_the_reference(monkeypatch):
    from symtrace.passes.quant.backend import Int8Backend

    def no_reference(*a, **k):
        raise AssertionError("the c backend fell back to the reference")

    monkeypatch.setattr(Int8Backend, "woq_linear", no_reference)
    q = quantize_weight_only(torch.randn(8, 64), 4, 32)
    x = torch.randn(2, 64)
    got = woq_linear(x, q.qweight, q.scale, None, None, bits=4, group_size=32, in_features=64, backend="c")
    assert torch.allclose(got, woq_reference(x, q.qweight, q.scale, None, None, 4, 32, 64), rtol=1e-5, atol=1e-5)


def test_pass_in_a_pipeline_reports_its_name():
    from symtrace.passes import PassContext, run_passes
    model = _Decoderish().eval()
    x = torch.randn(2, 70)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    ctx = PassContext(lint=True, time=True)
    out = run_passes(gm, [Q.weight_only(bits=4, group_size=64)], ctx)
    assert out.graph.created_by == "weight_only(bits=4, group_size=64)"
    assert out.meta["quant_lowering"] == {"woq_linear(int4, 64)": 4}
    assert [name for name, _ in ctx.timings] == ["weight_only(bits=4, group_size=64)"]


def test_guards_on_module_state_still_hold_after_the_pass():
    class Flagged(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 16)
            self.out = nn.Linear(16, 4)
            self.double = True

        def forward(self, x):
            h = self.fc(x)
            if self.double:  # an entry guard on root.double
                h = h * 2
            return self.out(h) + 1

    m = Flagged().eval()
    x = torch.randn(3, 32)
    gm = symtrace.symbolic_trace(m, example_inputs=(x,))
    assert any(g.reads_root() for g in gm.graph.guards)
    q = Q.weight_only(bits=8)(gm)
    assert q.guard_root is None and q.double is True
    q(x)
    live = symtrace.symbolic_trace(m, example_inputs=(x,))
    live.guard_root = m
    q2 = Q.weight_only(bits=8)(live)
    assert q2.guard_root is m
    m.double = False
    with pytest.raises(symtrace.GuardError):
        q2(x)


@needs_kernels
def test_weights_made_in_inference_mode():
    with torch.inference_mode():
        q = quantize_weight_only(torch.randn(8, 64), 4, 32)
        x = torch.randn(2, 64)
        got = woq_linear(x, q.qweight, q.scale, None, None, bits=4, group_size=32, in_features=64, backend="c")
    assert torch.allclose(got, woq_reference(x, q.qweight, q.scale, None, None, 4, 32, 64), rtol=1e-5, atol=1e-5)


# --- activations="int8": x rounded per block of 32, integer products (VNNI or AVX2) -------------
@settings(max_examples=40, deadline=None)
@given(lead=st.sampled_from([(), (1,), (3,), (2, 2)]), k=st.integers(1, 150), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-3, 1.0, 1e4]))
def test_round_activations_is_within_half_a_step_per_block(lead, k, seed, scale):
    from symtrace.passes.quant.woq import ACT_BLOCK, round_activations
    x = torch.randn(*lead, k, generator=torch.Generator().manual_seed(seed)) * scale
    if k > 40:
        x[..., 32:min(64, k)] = 0.0  # an all-zero block stays zero
    r = round_activations(x)
    assert r.shape == x.shape and r.dtype is x.dtype
    for b0 in range(0, k, ACT_BLOCK):
        blk, rb = x[..., b0:b0 + ACT_BLOCK], r[..., b0:b0 + ACT_BLOCK]
        amax = blk.abs().amax(-1, keepdim=True)
        assert torch.all((rb - blk).abs() <= amax / 254 * (1 + 1e-5) + 1e-30)
        assert torch.all(((rb * 127 / torch.where(amax > 0, amax, 1)).round() - rb * 127 / torch.where(amax > 0, amax, 1))
                         .abs() < 1e-3)  # 127 steps per block's largest value
    if k > 40:
        assert torch.equal(r[..., 32:min(64, k)], torch.zeros_like(r[..., 32:min(64, k)]))


def test_round_activations_scales_by_one_correctly_rounded_division():
    # 127 / amax is one float32 division (as the C kernels compute it), not 127 * (1 / amax):
    # here x * inv lands exactly on 39.5 and rounds half to even to 40 (the reciprocal form gave
    # 39.49999 -> 39, and the kernels disagreed with the reference by a whole step)
    from symtrace.passes.quant.woq import round_activations
    amax, v = -6.813835144042969, 2.1192636489868164
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 13] = amax, v
    inv = torch.tensor(127.0) / torch.tensor(abs(amax))   # a tensor-tensor division: IEEE
    assert (torch.tensor(v) * inv).item() == 39.5
    q = round_activations(x)[0] * (127 / torch.tensor(abs(amax)))
    assert q[13].round().item() == 40.0 and q[0].round().item() == -127.0
    if INTEGER_ISAS:
        w = quantize_weight_only(torch.randn(4, 32, generator=torch.Generator().manual_seed(1)), 8, None)
        got = KERNELS.linear(x, w.qweight, w.scale, None, None, 8, None, 32, activations="int8")
        want = woq_reference(x.double(), w.qweight, w.scale, None, None, 8, None, 32, "int8")
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("amax", [1e-38, 1e-40, 3e-37, 1e-20])
def test_round_activations_of_a_block_too_small_for_127_over_amax(amax):
    # 127 / amax overflows float32 below about 3.7e-37: such a block is scaled up first (exactly),
    # so it rounds like any other (and a zero in it stays zero rather than 0 * inf = NaN)
    from symtrace.passes.quant.woq import round_activations
    x = torch.full((1, 64), amax)
    x[0, 1], x[0, 2], x[0, 40] = 0.0, -amax / 3, amax / 2
    r = round_activations(x)
    ulp = 127 * 2.0 ** -149   # the scale amax / 127 is subnormal for the smallest blocks
    assert torch.isfinite(r).all() and r[0, 1] == 0 and (r[0, 0] - amax).abs() <= amax * 1e-5 + ulp
    assert (r[0, 2] + amax / 3).abs() <= amax / 254 * 1.01 + ulp and r[0, 2] < 0
    if INTEGER_ISAS:   # the C rounding agrees
        q = quantize_weight_only(torch.randn(4, 64, generator=torch.Generator().manual_seed(2)), 8, None)
        got = KERNELS.linear(x, q.qweight, q.scale, None, None, 8, None, 64, activations="int8")
        want = woq_reference(x.double(), q.qweight, q.scale, None, None, 8, None, 64, "int8")
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0.0)


@needs_kernels
def test_int8_activations_on_a_layer_with_no_inputs():
    q = quantize_weight_only(torch.randn(5, 0), 8, None)
    got = KERNELS.linear(torch.randn(3, 0), q.qweight, q.scale, None, None, 8, None, 0, activations="int8")
    assert torch.equal(got, torch.zeros(3, 5))


def test_round_activations_leaves_blocks_with_nan_or_inf_alone():
    from symtrace.passes.quant.woq import round_activations
    x = torch.randn(2, 70)
    x[0, 3] = float("nan")
    x[1, 66] = float("-inf")
    r = round_activations(x)
    assert torch.equal(r[0, :32].isnan(), x[0, :32].isnan()) and torch.equal(r[0, 4:32], x[0, 4:32])
    assert torch.equal(r[1, 64:], x[1, 64:])
    assert not torch.equal(r[0, 32:64], x[0, 32:64]) and torch.isfinite(r[0, 32:]).all()
    with pytest.raises(ValueError, match="activations must be"):
        Q.weight_only(bits=4, group_size=32, activations="int4")
    q = quantize_weight_only(torch.randn(3, 70), 4, 32)
    with pytest.raises(ValueError, match="activations must be"):
        woq_linear(x, q.qweight, q.scale, None, None, bits=4, group_size=32, in_features=70, activations="fp8")


@needs_kernels
@settings(max_examples=50, deadline=None)
@given(m=st.sampled_from([1, 2, 3, 5, 7, 9]), k=st.sampled_from([32, 64, 96, 128, 256, 512, 70, 200]), n=st.integers(1, 70),
       scheme=st.sampled_from(SCHEMES), bias=st.booleans(), isa=st.sampled_from(ISAS or ["portable"]),
       strided=st.booleans(), seed=st.integers(0, 2**16))
def test_int8_activation_kernels_match_the_rounded_reference(m, k, n, scheme, bias, isa, strided, seed):
    # int4 or symmetric int8 weights, K a multiple of 32, N >= 4, isa AVX2 or above: the integer
    # kernels (x rows 4, 2, 1 at a time with AVX2, 8, 4, 1 with VNNI; int8 weights 4, 1); elsewhere x
    # rounded in torch and the float kernels
    from symtrace.lower.int8_cache import forget_weights
    from symtrace.passes.quant.woq import round_activations
    bits, gs, sym = scheme
    if gs is not None and gs > k:
        gs = 32
    gen = torch.Generator().manual_seed(seed)
    q = quantize_weight_only(torch.randn(n, k, generator=gen), bits, gs, sym)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(m, k + 8, generator=gen)[:, 3:3 + k] * 3 if strided else torch.randn(m, k, generator=gen) * 3
    forget_weights()
    got = KERNELS.linear(x, q.qweight, q.scale, q.zero, b, bits, gs, k, isa=isa, activations="int8")
    want = woq_reference(x.double(), q.qweight, q.scale, q.zero, b, bits, gs, k, "int8")
    assert got.shape == want.shape and got.dtype is torch.float32
    assert torch.all((got.double() - want).abs() <= 2 * _bound(round_activations(x), q, b))


@pytest.mark.skipif(not INTEGER_ISAS, reason="the integer kernels need AVX2 or AVX-512")
@pytest.mark.parametrize("isa", INTEGER_ISAS)
def test_the_integer_kernels_serve_decode_and_prefill_and_step_aside_for_nan(isa):
    from symtrace.lower.woq_cpu import _make_plan
    from symtrace.lower.woq_csrc import ISAS as LEVELS
    level = {v: k for k, v in LEVELS.items()}[isa]
    q = quantize_weight_only(torch.randn(40, 256), 4, 128)
    plan = _make_plan(q.qweight, q.scale, None, None, 4, 128, 256)
    x = torch.randn(1, 256)
    assert KERNELS._call_a8(plan, x, level) is not None  # the integer path ran
    xs = torch.randn(7, 256)
    got = KERNELS._call_a8(plan, xs, level)   # prefill: the same kernels, x rows several at a time
    assert got is not None
    torch.testing.assert_close(got, woq_reference(xs, q.qweight, q.scale, None, None, 4, 128, 256, "int8"),
                               rtol=1e-5, atol=1e-4)
    q8 = quantize_weight_only(torch.randn(40, 256), 8, None)   # symmetric int8: the integer kernels too
    plan8 = _make_plan(q8.qweight, q8.scale, None, None, 8, None, 256)
    torch.testing.assert_close(KERNELS._call_a8(plan8, xs, level),
                               woq_reference(xs, q8.qweight, q8.scale, None, None, 8, None, 256, "int8"),
                               rtol=1e-5, atol=1e-4)
    a8 = quantize_weight_only(torch.randn(40, 256), 8, 32, symmetric=False)   # zero points: float kernels
    assert KERNELS._call_a8(_make_plan(a8.qweight, a8.scale, a8.zero, None, 8, 32, 256), xs, level) is None
    x[0, 7] = float("nan")
    x[0, 100] = float("inf")
    assert KERNELS._call_a8(plan, x, level) is None  # NaN/inf: rounded in torch, float kernels
    got = KERNELS.linear(x, q.qweight, q.scale, None, None, 4, 128, 256, isa=isa, activations="int8")
    want = woq_reference(x, q.qweight, q.scale, None, None, 4, 128, 256, "int8")
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().all()


def _gemv_both_orders(bits, n, k, gs, sym, bias, threads, seed, isa="avx2"):
    """(several-stream result, one-stream result, reference, error bound) of one GEMV with int8
    activations (AVX2 or AVX512-VNNI kernels)."""
    from symtrace.lower.int8_cache import forget_weights
    gen = torch.Generator().manual_seed(seed)
    q = quantize_weight_only(torch.randn(n, k, generator=gen), bits, gs, sym)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(1, k, generator=gen) * 3
    old = torch.get_num_threads()
    forget_weights()
    try:
        torch.set_num_threads(threads)
        got = KERNELS.linear(x, q.qweight, q.scale, q.zero, b, bits, gs, k, isa=isa, activations="int8")
        with KERNELS.one_stream():
            one = KERNELS.linear(x, q.qweight, q.scale, q.zero, b, bits, gs, k, isa=isa, activations="int8")
    finally:
        torch.set_num_threads(old)
    return got, one, woq_reference(x.double(), q.qweight, q.scale, q.zero, b, bits, gs, k, "int8"), _bound(x, q, b)


needs_avx2_integer = pytest.mark.skipif("avx2" not in INTEGER_ISAS, reason="the several-stream GEMV is AVX2 code")
#: the integer instruction sets with a several-stream GEMV (AVX2: 4 streams; AVX512-VNNI: 2)
STREAM_ISAS = [i for i in ("avx2", "avx512vnni") if i in INTEGER_ISAS]


@needs_avx2_integer
@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([4, 8]), n=st.integers(4, 700), k=st.sampled_from([32, 64, 256, 1024, 160]),
       gs=st.sampled_from([32, 64, 128, None]), sym=st.booleans(), bias=st.booleans(), threads=st.sampled_from([1, 2, 3]),
       seed=st.integers(0, 2**16), isa=st.sampled_from(STREAM_ISAS or ["avx2"]))
def test_a_gemv_read_as_several_streams_gives_the_one_stream_bits(bits, n, k, gs, sym, bias, threads, seed, isa):
    # decode (one row of x): st_a2_streams_1 / st_a8_streams_1 (int4) and their symmetric int8
    # twins read 4 (AVX2) or 2 (VNNI) spans of 4-row blocks per thread side by side; every row
    # must be what the one-stream order computes, bit for bit, including the rows past the last
    # whole span (N not a multiple of 4 x spans, or of 4), with int4 zero points, groups and bias
    if gs is not None and gs > k:
        gs = 32
    if bits == 8:
        sym = True   # (the integer kernels take symmetric int8 only)
    got, one, want, bound = _gemv_both_orders(bits, n, k, gs, sym, bias, threads, seed, isa)
    assert torch.equal(got, one)
    assert torch.all((got.double() - want).abs() <= 2 * bound)


@needs_avx2_integer
@pytest.mark.parametrize("isa", STREAM_ISAS or ["avx2"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("bits, gs", [(4, 128), (8, None)])
def test_a_decoder_sized_gemv_takes_the_several_stream_path_and_matches(threads, bits, gs, isa):
    # N = 1003: 31 blocks in each of 8 spans with 2 threads (62 in 4 with one, 20 in 12 with
    # three), 11 rows after them (11 and 43); the threads take ST_A2_UNIT blocks of each of a
    # part's spans at a time, from their own part first, then from the others';
    # K = 2048, int4 in groups of 128 (a Llama layer's) or int8 per channel (its LM head's)
    with KERNELS.one_stream() as flag:   # (the two orders give the same bits: check the switch itself)
        assert flag.value == 1
    assert flag.value == 0
    got, one, want, bound = _gemv_both_orders(bits, 1003, 2048, gs, True, True, threads, 11, isa)
    assert torch.equal(got, one)
    assert torch.all((got.double() - want).abs() <= 2 * bound)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS or ["portable"])
def test_a_symmetric_int8_weight_holding_minus_128_is_not_sign_flipped(isa):
    # the integer kernels move x's sign onto the weight; -(-128) is not a byte, so such a weight
    # (a stored file, a user's own quantizer) must take the float kernels and still be right
    from symtrace.lower.int8_cache import forget_weights
    gen = torch.Generator().manual_seed(5)
    q = quantize_weight_only(torch.randn(8, 64, generator=gen), 8, None)
    qweight = q.qweight.clone()
    qweight[:, ::3] = -128
    x = -torch.rand(2, 64, generator=gen) - 0.5   # every input negative: every product flips sign
    forget_weights()
    got = KERNELS.linear(x, qweight, q.scale, None, None, 8, None, 64, isa=isa, activations="int8")
    want = woq_reference(x.double(), qweight, q.scale, None, None, 8, None, 64, "int8")
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_pass_with_int8_activations_saves_and_loads(tmp_path):
    from symtrace.passes.quant.woq import round_activations
    torch.manual_seed(3)
    model = _Decoderish().eval()
    x = torch.randn(1, 70)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    p = Q.weight_only(bits=4, group_size=32, activations="int8")
    assert "activations='int8'" in p.pass_name
    q = p(gm)
    calls = list(q.graph.find_nodes(op="call_function", target=woq_linear))
    assert calls and all(n.kwargs["activations"] == "int8" for n in calls)
    assert q.meta["quant_lowering"] == {"woq_linear(int4, 32, int8 activations)": 4}
    plain = Q.weight_only(bits=4, group_size=32)(gm)
    assert all("activations" not in n.kwargs for n in plain.graph.find_nodes(op="call_function", target=woq_linear))
    # each replaced layer sees its input rounded: compare layer by layer with the reference
    up = next(n for n in calls if n.meta["quant_layer"] == "up")
    qw, sc = q.get_buffer(up.args[1].target), q.get_buffer(up.args[2].target)
    b = q.get_buffer(up.args[4].target)
    got_up = woq_linear(x, qw, sc, None, b, bits=4, group_size=32, in_features=70, backend="c", activations="int8")
    want_up = F.linear(round_activations(x), dequantize_weight(qw, sc, None, 4, 32, 70), b)
    assert torch.allclose(got_up, want_up, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got_up, F.linear(x, dequantize_weight(qw, sc, None, 4, 32, 70), b), rtol=1e-6, atol=1e-6)
    path = tmp_path / "woq_a8.symtrace"
    symtrace.save(q, path)
    loaded = symtrace.load(path)
    assert all(n.kwargs["activations"] == "int8"
               for n in loaded.graph.find_nodes(op="call_function", target=woq_linear))
    out, out_loaded = q(x), loaded(x)
    assert all(torch.equal(out[k], out_loaded[k]) for k in out)


# --- lowering: sibling woq_linear calls merged (symtrace/lower/woq_merge.py) --------------------
class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(64, 64, bias=False)
        self.k = nn.Linear(64, 32, bias=True)
        self.v = nn.Linear(64, 32, bias=False)
        self.o = nn.Linear(32, 16)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        return self.o(k * v) + q[..., :16]


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_lowering_merges_sibling_weight_only_linears(activations, monkeypatch):
    from symtrace import lower
    monkeypatch.setenv("SYMTRACE_C_CALLS", "0")   # (the calls counted through their Python call sites)
    torch.manual_seed(4)
    m = _Attention().eval()
    x = torch.randn(1, 3, 64)
    q = Q.weight_only(bits=4, group_size=32, activations=activations, lm_head=True)(
        symtrace.symbolic_trace(m, example_inputs=(x,)))
    assert len(list(q.graph.find_nodes(op="call_function", target=woq_linear))) == 4
    low = lower.compile(q, (x,))
    want = q(x)
    for xx in (x, torch.randn(1, 3, 64)):
        torch.testing.assert_close(low(xx), q(xx), rtol=1e-5, atol=1e-5)
    merged = [n for n in low.pipeline_notes if "sibling weight-only linears merged" in n]
    assert len(merged) == 1 and "q_q + k_q + v_q" in merged[0], low.pipeline_notes
    from symtrace.lower.woq_cpu import WoqSite
    seen = []
    real = WoqSite.__call__

    def counting(site, *args):
        seen.append(site)
        return real(site, *args)

    WoqSite.__call__ = counting
    try:
        low(x)
    finally:
        WoqSite.__call__ = real
    assert len(seen) == 2   # q, k and v in one call, then o (each through its call site)
    # the caller's graph keeps its four calls; the weights of the separate layers are unchanged
    assert len(list(q.graph.find_nodes(op="call_function", target=woq_linear))) == 4
    torch.testing.assert_close(q(x), want)


def test_siblings_with_other_schemes_stay_apart():
    from symtrace.lower.woq_merge import merge_sibling_woq
    from symtrace.lower.pipeline import private_copy
    m = _Attention().eval()
    x = torch.randn(2, 64)
    gm = symtrace.symbolic_trace(m, example_inputs=(x,))
    q8 = Q.weight_only(bits=8)(gm)
    calls = {n.meta["quant_layer"]: n for n in q8.graph.find_nodes(op="call_function", target=woq_linear)}
    calls["k"].kwargs = dict(calls["k"].kwargs, activations="int8")   # k now computes otherwise than q and v
    q8.recompile()
    new = private_copy(q8)
    notes = merge_sibling_woq(new)
    assert len(notes) == 1 and "k_q" not in notes[0]
    new.recompile()
    torch.testing.assert_close(new(x), q8(x), rtol=1e-5, atol=1e-5)


def test_woq_linear_is_declared_pure_and_fresh():
    # (without a schema it counted as aliasing its weights: the inference pipeline saw them
    # "written" and never ran on weight-only graphs)
    from symtrace.graph.effects import is_impure, may_alias_inputs
    from symtrace.lower.pipeline import why_not
    m = _Attention().eval()
    q = Q.weight_only(bits=4, group_size=32)(symtrace.symbolic_trace(m, example_inputs=(torch.randn(2, 64),)))
    node = next(iter(q.graph.find_nodes(op="call_function", target=woq_linear)))
    assert not is_impure(node, q) and not may_alias_inputs(node)
    assert why_not(q) is None


@needs_kernels
def test_a_call_site_entered_again_midway_with_another_shape_keeps_each_calls_shapes():
    # (the site remembers the last input shape and its output shape; another thread calling it
    # with another shape between this call's look at that memory and its use of it must not
    # mix one input with the other's output: here that other call is made at that point, in
    # this thread, so the test does not depend on thread timing)
    import linecache
    import sys
    from symtrace.lower.woq_cpu import WoqSite
    g = torch.Generator().manual_seed(0)
    q = quantize_weight_only(torch.randn(40, 96, generator=g), 4, 32, True)
    kw = dict(bits=4, group_size=32, in_features=96, backend="c", activations="float")
    site = WoqSite(**kw)
    big, small = torch.randn(64, 96, generator=g), torch.randn(1, 96, generator=g)
    want_big, want_small = (woq_linear(x, q.qweight, q.scale, q.zero, None, **kw) for x in (big, small))
    code, entered = WoqSite.__call__.__code__, []

    def tracer(frame, event, arg):
        if frame.f_code is not code:
            return None

        def lines(frame, event, arg):
            text = linecache.getline(code.co_filename, frame.f_lineno)
            if event == "line" and "x.numel()" in text and not entered:   # (the dense fast path)
                entered.append(True)
                sys.settrace(None)
                torch.testing.assert_close(site(small, q.qweight, q.scale, q.zero, None), want_small, rtol=0, atol=0)
            return lines
        return lines
    site(big, q.qweight, q.scale, q.zero, None)
    site(big, q.qweight, q.scale, q.zero, None)   # (bound, its shapes remembered)
    sys.settrace(tracer)
    try:
        got = site(big, q.qweight, q.scale, q.zero, None)
    finally:
        sys.settrace(None)
    assert entered   # (the other call was made inside this one)
    assert got.shape == want_big.shape and torch.equal(got, want_big)


@needs_kernels
@pytest.mark.parametrize("bits, gs, sym, act", [(8, None, True, "float"), (4, 32, True, "int8"), (4, 64, False, "float"),
                                                (8, None, True, "int8"), (8, 32, False, "int8")])
def test_a_wrapper_call_site_binds_its_weight_once_and_follows_changes(bits, gs, sym, act):
    # the lowered wrapper's route to the kernels (woq_cpu.WoqSite) must answer as woq_linear
    # does, whatever changes between calls: other tensors, in-place writes, odd inputs
    from symtrace.lower.woq_cpu import WoqSite
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=g)
    q = quantize_weight_only(w, bits, gs, sym)
    bias = torch.randn(40, generator=g)
    kw = dict(bits=bits, group_size=gs, in_features=96, backend="c", activations=act)
    site = WoqSite(**kw)

    def check(x, qweight=q.qweight, scale=q.scale, zero=q.zero, b=bias):
        got = site(x, qweight, scale, zero, b)
        want = woq_linear(x, qweight, scale, zero, b, **kw)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)

    x = torch.randn(1, 1, 96, generator=g)
    check(x)
    check(x)                                          # bound: the fast path
    assert site._bound is not None or act == "int8" and bits == 8 and not sym
    check(torch.randn(3, 96, generator=g))            # prefill rows
    check(torch.randn(96, 1, 1, generator=g).permute(1, 2, 0))   # the step's shape, other strides
    check(torch.randn(1, 1, 192, generator=g)[..., ::2])         # ... not dense
    check(x)                                          # the step again after other shapes
    negative = torch._neg_view(-x)                    # a negative view (its memory holds -x)
    torch.testing.assert_close(site(negative, q.qweight, q.scale, q.zero, bias),
                               woq_linear(x, q.qweight, q.scale, q.zero, bias, **kw), rtol=0, atol=0)
    check(torch.randn(96, 2, generator=g).t())        # non-contiguous
    check(torch.randn(0, 96))                         # no rows
    check(torch.full((1, 96), float("nan")))          # NaN (the integer kernels refuse it: the graph's answer)
    check(x.double())                                 # another dtype: the reference
    scale2 = q.scale * 2
    check(x, scale=scale2)                            # another tensor
    q.scale.mul_(3)                                   # written in place
    check(x)
    check(x, b=None)
    with pytest.raises(ValueError, match="input features"):
        site(torch.randn(1, 95), q.qweight, q.scale, q.zero, bias)
