"""Weight-only linears and decode attention that a lowered graph's C entry points call between
their kernels (symtrace.lower.c_calls): the same bits as the torch calls they replace, a refused
call run in torch with the rest of the run after it, weights changed after lowering seen,
results a caller keeps never overwritten."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symtrace
from symtrace import lower
from symtrace.lower.attention_cpu import KERNEL as ATTENTION
from symtrace.lower.woq_cpu import KERNELS
from symtrace.passes import quant as Q
from symtrace.passes.quant.kernels import woq_linear

needs_kernels = pytest.mark.skipif(not KERNELS.available(), reason=f"the woq C kernels are not usable here: {KERNELS.reason}")

SCHEMES = [(8, None, True, "float"), (4, 32, True, "float"), (4, 64, False, "float"), (4, 32, True, "int8"),
           (8, None, True, "int8"), (4, 128, True, "int8")]


@pytest.fixture(autouse=True)
def _no_grad():   # (with grad on, a lowered module runs through torch: the kernels are not used)
    with torch.no_grad():
        yield


class _Block(nn.Module):
    """A decoder layer's shape: a norm, a gated MLP with a residual, then a head."""

    def __init__(self, d=128, hidden=256, out=64):
        super().__init__()
        self.norm = nn.Parameter(torch.rand(d) + 0.5)
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d)
        self.head = nn.Linear(d, out, bias=False)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        h = x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))
        return self.head(h * 0.5)


def _lowered(bits, gs, sym, act, x, monkeypatch, c_calls=True):
    monkeypatch.setenv("SYMTRACE_C_CALLS", "1" if c_calls else "0")
    torch.manual_seed(0)
    m = _Block().eval()
    q = Q.weight_only(bits=bits, group_size=gs, symmetric=sym, activations=act, lm_head=True)(
        symtrace.symbolic_trace(m, example_inputs=(x,)))
    assert len(list(q.graph.find_nodes(op="call_function", target=woq_linear))) == 4
    return q, lower.compile(q, (x,))


@needs_kernels
@pytest.mark.parametrize("bits, gs, sym, act", SCHEMES)
@pytest.mark.parametrize("rows", [1, 3])
def test_linears_called_from_c_give_the_torch_calls_bits(bits, gs, sym, act, rows, monkeypatch):
    x = torch.randn(1, rows, 128)
    q, low = _lowered(bits, gs, sym, act, x, monkeypatch)
    _, plain = _lowered(bits, gs, sym, act, x, monkeypatch, c_calls=False)
    code = low.wrapper_code
    if act == "int8" and bits == 8 and not sym:   # (no integer kernels for this weight: torch calls)
        pytest.skip("not bound")
    assert "(woq)" in code and "_in_torch" in code and "WoqSite" not in repr(low._first.call.__globals__.values())
    assert "(woq)" not in plain.wrapper_code
    report = low.report()
    assert "C call" in report and "symtrace's woq kernel" in report and "C call" not in plain.report()
    for xx in (x, torch.randn(1, rows, 128), torch.randn(1, rows, 128) * 1e-30):
        got, want = low(xx), plain(xx)
        assert torch.equal(got, want)
        torch.testing.assert_close(got, q(xx), rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_a_linear_the_kernels_refuse_runs_in_torch_and_the_rest_of_the_run_goes_on(poison, monkeypatch):
    # integer activations refuse NaN and infinities (the C kernel returns non-zero): that call
    # runs in torch into its output, and the kernels and linears after it in the same C entry
    # point still run (the result would be stale or garbage otherwise)
    x = torch.randn(1, 1, 128)
    q, low = _lowered(4, 32, True, "int8", x, monkeypatch)
    calls = low.wrapper_code.count("(woq)")
    assert calls == 3   # (gate and up merged into one)
    for where in (0, 77):
        bad = torch.randn(1, 1, 128)
        bad[0, 0, where] = poison
        torch.testing.assert_close(low(bad), q(bad), rtol=0, atol=0, equal_nan=True)
        good = torch.randn(1, 1, 128)   # (and the next call is as before)
        torch.testing.assert_close(low(good), q(good), rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("change", ["written", "replaced", "pipeline copy written"])
def test_weights_changed_after_lowering_are_used(change, monkeypatch):
    x = torch.randn(1, 1, 128)
    q, low = _lowered(4, 32, True, "int8", x, monkeypatch)
    assert "(woq)" in low.wrapper_code
    before = low(x)
    if change == "written":
        q.down.scale.mul_(2)
    elif change == "replaced":
        q.head.qweight = q.head.qweight.clone().flip(0)
    else:   # (the merged gate/up weight lives only in the lowered module's own copy)
        merged = next(t for name, t in low.gm.named_buffers() if "merged_qweight" in name)
        merged.copy_(merged.flip(0))
    with pytest.warns(UserWarning, match="changed since lowering"):
        got = low(x)
    torch.testing.assert_close(got, q(x), rtol=1e-5, atol=1e-5)   # (the caller's graph, in torch)
    assert torch.equal(got, before) == (change == "pipeline copy written")


class _Sliced(nn.Module):
    """Linears reading part of another linear's result (a merged q/k's second half)."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(128, 64, bias=False), nn.Linear(128, 64, bias=False)
        self.o = nn.Linear(64, 32, bias=False)

    def forward(self, x):
        a, b = self.q(x), self.k(x)
        return self.o(b) + a[..., :32]


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3])
def test_a_linear_reading_a_view_of_another_result(rows, monkeypatch):
    # one row: the input starts 64 floats into the merged result (an offset); three rows: its
    # rows are 128 apart, not dense, so the call stays a torch call
    g = torch.Generator().manual_seed(2)
    x, x2 = torch.randn(1, rows, 128, generator=g), torch.randn(1, rows, 128, generator=g)
    got = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("SYMTRACE_C_CALLS", flag)
        torch.manual_seed(0)
        q = Q.weight_only(bits=8, lm_head=True)(symtrace.symbolic_trace(_Sliced().eval(), example_inputs=(x,)))
        low = lower.compile(q, (x,))
        assert ("(woq)" in low.wrapper_code) == (flag == "1")
        assert low.wrapper_code.count("(woq)") == (0 if flag == "0" else 2 if rows == 1 else 1)
        got[flag] = [low(xx) for xx in (x, x2)]
        torch.testing.assert_close(got[flag][0], q(x), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(got["1"], got["0"]))


@symtrace.leaf_function
def _pack(t):
    return {"t": t}


@symtrace.leaf_function
def _same(t):
    return t


class _Packed(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.q, self.k = nn.Linear(128, 64, bias=False), nn.Linear(128, 64, bias=False)
        self.how = how

    def forward(self, x):
        a, b = self.q(x), self.k(x)
        c = a + b
        if self.how == "tensor":
            return {"t": _same(a)}, c
        return _pack(c * 2.0 if self.how == "object, kernel" else a), c


@needs_kernels
@pytest.mark.parametrize("how", ["object", "object, kernel", "tensor"])
def test_a_result_returned_through_a_call_is_not_overwritten(how, monkeypatch):
    # (a call's result holds a linear's or a kernel's result, inside an object or as the tensor
    # itself: that memory reaches the caller, so it is not the arena's)
    monkeypatch.setenv("SYMTRACE_C_CALLS", "1")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 1, 128, generator=g)
    torch.manual_seed(0)
    q = Q.weight_only(bits=8, lm_head=True)(symtrace.symbolic_trace(_Packed(how).eval(), example_inputs=(x,)))
    low = lower.compile(q, (x,))
    assert "(woq)" in low.wrapper_code
    first = low(x)
    kept = first[0]["t"].clone()
    second = low(torch.randn(1, 1, 128, generator=g))
    assert torch.equal(first[0]["t"], kept) and first[0]["t"].data_ptr() != second[0]["t"].data_ptr()


@needs_kernels
def test_a_result_the_caller_keeps_is_not_overwritten_by_the_next_call(monkeypatch):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 1, 128, generator=g)
    q, low = _lowered(8, None, True, "float", x, monkeypatch)
    assert "(woq)" in low.wrapper_code
    first = low(x)
    kept = first.clone()
    second = low(torch.randn(1, 1, 128, generator=g))
    assert torch.equal(first, kept) and not torch.equal(first, second)
    assert first.data_ptr() != second.data_ptr()


@needs_kernels
def test_without_the_inference_pipeline_the_linears_stay_torch_calls(monkeypatch):
    # (no state check then guards the weights between calls: the call sites keep checking them)
    monkeypatch.setenv("SYMTRACE_C_CALLS", "1")
    torch.manual_seed(0)
    x = torch.randn(1, 1, 128)
    q = Q.weight_only(bits=4, group_size=32)(symtrace.symbolic_trace(_Block().eval(), example_inputs=(x,)))
    low = lower.compile(q, (x,), inference=False)
    assert "(woq)" not in low.wrapper_code and "_woq" in low.wrapper_code
    torch.testing.assert_close(low(x), q(x), rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.skipif(not ATTENTION.available(), reason=f"no decode-attention kernel here: {ATTENTION.reason}")
def test_a_decoder_with_a_kv_cache_generates_the_same_tokens(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from symtrace.lower import lowering_pass
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 512, (1, 8))
    got = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("SYMTRACE_C_CALLS", flag)
        m = transformers.LlamaForCausalLM(cfg).eval()
        m.load_state_dict(model.state_dict())
        m.forward = symtrace.capture(m.forward, passes=[Q.weight_only(bits=4, group_size=32, activations="int8"),
                                                        lowering_pass()])
        with torch.no_grad():
            got[flag] = m.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
        if flag == "1":
            lowered = [sub for g in m.forward.graphs for sub in g.modules() if isinstance(sub, lower.LoweredModule)]
            codes = [v.wrapper_code for sub in lowered for v in sub._generic + list(sub._variants.values())]
            # (a decode step: every linear, cache append and attention made by one C entry point)
            assert any("(woq)" in c and "(append)" in c and "(attention)" in c and c.count("\n    _e = _run") == 1
                       for c in codes)
    assert torch.equal(got["1"].sequences, got["0"].sequences)
    assert all(torch.equal(a, b) for a, b in zip(got["1"].logits, got["0"].logits))


class _Attend(nn.Module):
    """A decode step's attention over a cache, between two projections' worth of kernels."""

    def forward(self, q, k, v):
        o = F.scaled_dot_product_attention(q * 1.5, k, v, enable_gqa=True)
        return o.transpose(1, 2).reshape(1, 1, -1) * 2


@pytest.mark.skipif(not ATTENTION.available(), reason=f"no decode-attention kernel here: {ATTENTION.reason}")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dynamic", [False, True])
def test_attention_called_from_c_gives_the_torch_calls_bits(d, dynamic, monkeypatch):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 8, 1, d, generator=g), torch.randn(1, 2, 40, d, generator=g),
               torch.randn(1, 2, 40, d, generator=g))
    low = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("SYMTRACE_C_CALLS", flag)
        gm = symtrace.symbolic_trace(_Attend().eval(), example_inputs=(q, k, v))
        low[flag] = lower.compile(gm, (q, k, v), dynamic=dynamic)
    for n in (40, 41, 77):
        k2, v2 = torch.randn(1, 2, n, d, generator=g), torch.randn(1, 2, n, d, generator=g)
        k3 = k2.transpose(1, 2).contiguous().transpose(1, 2)   # (positions outermost, as kv_append lays it out)
        for kk in (k2, k3):
            got, want = low["1"](q, kk, v2), low["0"](q, kk, v2)
            assert torch.equal(got, want)
            torch.testing.assert_close(got, _Attend()(q, kk, v2), rtol=1e-5, atol=1e-5)
    codes = [v.wrapper_code for v in list(low["1"]._variants.values()) + low["1"]._generic]
    assert any("(attention)" in c for c in codes) and not any("(attention)" in c
                                                              for v in list(low["0"]._variants.values()) + low["0"]._generic
                                                              for c in [v.wrapper_code])
    if dynamic:
        assert low["1"]._generic and all("(attention)" in v.wrapper_code for v in low["1"]._generic)


class _Step(nn.Module):
    """A decode step's shape: projections around attention over a cache of any length."""

    def __init__(self, scaled=False):
        super().__init__()
        self.q, self.o = nn.Linear(128, 256, bias=False), nn.Linear(256, 128, bias=False)
        self.scaled = scaled

    def forward(self, x, k, v):
        q = self.q(x).view(1, 1, 4, 64).transpose(1, 2)
        if self.scaled:
            q = q * 0.5
        a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return self.o(a.transpose(1, 2).reshape(1, 1, 256))


@needs_kernels
@pytest.mark.skipif(not ATTENTION.available(), reason=f"no decode-attention kernel here: {ATTENTION.reason}")
def test_a_refused_call_in_a_variant_for_every_cache_length_runs_in_torch(monkeypatch):
    # (the size-generic variant's arena moves with the sizes: the refused call's tensors are
    # made for this call's sizes when it is refused)
    monkeypatch.setenv("SYMTRACE_C_CALLS", "1")
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 1, 128, generator=g)
    kv = [torch.randn(1, 2, n, 64, generator=g) for n in (30, 31, 45, 90)]
    torch.manual_seed(0)
    q = Q.weight_only(bits=4, group_size=32, activations="int8", lm_head=True)(
        symtrace.symbolic_trace(_Step().eval(), example_inputs=(x, kv[0], kv[0])))
    low = lower.compile(q, (x, kv[0], kv[0]))   # (a new cache length: a size-generic variant)
    for k in kv:
        torch.testing.assert_close(low(x, k, k), q(x, k, k), rtol=1e-4, atol=1e-4)
    assert low._generic and "(woq)" in low._generic[0].wrapper_code and "(attention)" in low._generic[0].wrapper_code
    bad = x.clone()
    bad[0, 0, 5] = float("nan")
    for k in kv:
        torch.testing.assert_close(low(bad, k, k), q(bad, k, k), rtol=0, atol=0, equal_nan=True)


_APPENDS = {   # (the step, the first new value's shape, each later one's)
    "heads": (lambda p, x: torch.cat([p, x * 3], -2), (1, 2, 3, 64), (1, 2, 1, 64)),
    "batch 2": (lambda p, x: torch.cat([p, x * 3], -2), (2, 2, 3, 8), (2, 2, 1, 8)),
    "transposed new": (lambda p, x: torch.cat([p, (x * 3).transpose(1, 2)], -2), (1, 3, 2, 8), (1, 1, 2, 8)),
    "new at an offset": (lambda p, x: torch.cat([p, (x * 3)[:, :, 1:2]], -2), (1, 2, 4, 8), (1, 2, 3, 8)),
    "dim 1": (lambda p, x: torch.cat([p, x + 1], 1), (1, 3, 8), (1, 1, 8)),
    "dim 0": (lambda p, x: torch.cat([p, x + 1], 0), (3, 8), (1, 8)),
    "last dim": (lambda p, x: torch.cat([p, x + 1], -1), (2, 3), (2, 1)),
    "two positions": (lambda p, x: torch.cat([p, x + 1], -2), (1, 2, 3, 8), (1, 2, 2, 8)),
}


class _Grow(nn.Module):
    def __init__(self, step):
        super().__init__()
        self.step = step

    def forward(self, past, x):
        return self.step(past, x)


@pytest.mark.parametrize("case", list(_APPENDS))
def test_a_cache_appended_by_the_entry_point_is_eagers_over_many_steps(case, monkeypatch):
    # (40 steps: the spare positions run out and the storage grows; the appends after the first
    # few are split: reserved before the kernels run, written by the entry point)
    from symtrace.lower import lowering_pass
    from symtrace.lower.capture_pass import LazyRegion
    monkeypatch.setenv("SYMTRACE_C_CALLS", "1")
    fn, first, later = _APPENDS[case]
    model = _Grow(fn).eval()
    cap = symtrace.capture(model, passes=[lowering_pass()])
    g = torch.Generator().manual_seed(0)
    want = got = torch.tensor([])
    for i in range(41):
        x = torch.randn(*(first if i == 0 else later), generator=g)
        want, got = model(want, x), cap(got, x)
        assert torch.equal(got, want), i
    lows = [m.lowered for gm in cap.graphs for m in gm.modules() if isinstance(m, LazyRegion) and m.lowered is not None]
    lows += [m for gm in cap.graphs for m in gm.modules() if isinstance(m, lower.LoweredModule)]
    assert any("(append)" in v.wrapper_code for low in lows for v in low._generic + list(low._variants.values()))


def test_two_appends_onto_one_cache_in_one_step(monkeypatch):
    # (the second finds the storage's end moved on by the first and copies, as the op does)
    monkeypatch.setenv("SYMTRACE_C_CALLS", "1")
    from symtrace.lower.kv_append import AppendCat

    class Two(nn.Module):
        def forward(self, past, x):
            return torch.cat([past, x * 2], -2), torch.cat([past, x + 1], -2)
    m = Two().eval()
    g = torch.Generator().manual_seed(1)
    past = AppendCat(-2)(torch.tensor([]), torch.randn(1, 2, 5, 64, generator=g))
    x = torch.randn(1, 2, 1, 64, generator=g)
    low = lower.compile(symtrace.symbolic_trace(m, example_inputs=(past, x)), (past, x))
    assert "(append)" in low.wrapper_code
    for _ in range(3):
        a, b = low(past, x)
        wa, wb = m(past, x)
        assert torch.equal(a, wa) and torch.equal(b, wb)
        assert a.data_ptr() != b.data_ptr()


def test_a_reservation_stays_after_a_write_into_the_cache(monkeypatch):
    # (the reservation runs before the kernels around the copy, never before a torch call:
    # here one writes into the cache first)
    monkeypatch.setenv("SYMTRACE_C_CALLS", "1")
    from symtrace.lower.kv_append import AppendCat

    class Scaled(nn.Module):
        def forward(self, past, x):
            past.mul_(2)
            return torch.cat([past, x * 3], dim=-2)
    m = Scaled().eval()
    g = torch.Generator().manual_seed(0)
    p0 = AppendCat(-2)(torch.tensor([]), torch.randn(1, 2, 3, 4, generator=g))
    x = torch.randn(1, 2, 1, 4, generator=g)
    low = lower.compile(symtrace.symbolic_trace(m, example_inputs=(p0.clone(), x)), (p0.clone(), x))
    a, b = p0.clone(), p0.clone()
    assert torch.equal(low(a, x), m(b, x)) and torch.equal(a, b)


@needs_kernels
@pytest.mark.skipif(not ATTENTION.available(), reason=f"no decode-attention kernel here: {ATTENTION.reason}")
def test_buffers_only_a_c_call_reads_are_the_arenas(monkeypatch):
    # (a C call's result shares no memory with its arguments: what fed a linear, attention or an
    # append and is not returned goes back to the arena, allocated once, not on every call)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 1, 128, generator=g)
    kv = torch.randn(1, 2, 30, 64, generator=g)
    monkeypatch.setenv("SYMTRACE_C_CALLS", "1")
    torch.manual_seed(0)
    q = Q.weight_only(bits=8, lm_head=True)(symtrace.symbolic_trace(_Step(scaled=True).eval(), example_inputs=(x, kv, kv)))
    low = lower.compile(q, (x, kv, kv))
    code = low.wrapper_code
    assert "(attention)" in code and "(pointwise)" in code
    assert code.count("_empty(") == 1   # (the result only: the scaled query attention reads is the arena's)
    torch.testing.assert_close(low(x, kv, kv), q(x, kv, kv), rtol=1e-5, atol=1e-5)
