"""Lowering runtime: the record cache (cache hits run no graph op), compile-error fallback,
non-dense example inputs, and the output allocator's huge-page switch."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symtrace
from symtrace.lower import compile as lower
from symtrace.lower import lowering as L
from symtrace.lower import module as M
from symtrace.lower import toolchain as tc

pytestmark = pytest.mark.skipif(
    __import__("shutil").which(os.environ.get("CC", "cc")) is None and __import__("shutil").which("gcc") is None,
    reason="no C compiler")


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMTRACE_CACHE_DIR", str(tmp_path / "cache"))
    L._records.clear()
    yield
    L._records.clear()


def _no_real_record(monkeypatch):
    def refuse(gm, inputs):
        raise AssertionError("the graph was run to record metadata")
    monkeypatch.setattr(L, "_record_real", refuse)


def layernorm_gelu(x, w, b):
    y = F.layer_norm(x, (x.shape[-1],), w, b)
    return F.gelu(y * x.size(0)).split(3, dim=-1)


def _ln_inputs():
    return torch.randn(5, 9), torch.randn(9), torch.randn(9)


# ------------------------------------------------------------------------------ record cache
def test_cached_record_equals_the_real_record():
    ins = _ln_inputs()
    gm = symtrace.symbolic_trace(layernorm_gelu, example_inputs=ins)
    real = L._record_real(gm, ins)
    assert L.record_key(gm, ins) is not None
    first = L.record(gm, ins)
    L._records.clear()  # the next one comes from disk
    second = L.record(gm, ins)
    assert first == real and second == real
    kinds = {"py" if isinstance(v, tuple) and v[0] == "py" else type(v).__name__ for v in real.values()}
    assert kinds == {"py", "TensorMeta", "tuple"}  # shapes/sizes, tensors and the split's tuple survive


def test_second_lowering_runs_no_graph_op(monkeypatch):
    ins = _ln_inputs()
    gm = symtrace.symbolic_trace(layernorm_gelu, example_inputs=ins)
    code = lower(gm, ins).wrapper_code
    L._records.clear()
    _no_real_record(monkeypatch)
    lm = lower(gm, ins)
    assert lm.wrapper_code == code
    with torch.no_grad():
        for got, ref in zip(lm(*ins), layernorm_gelu(*ins)):
            torch.testing.assert_close(got, ref)


def _key(fn, *ins):
    return L.record_key(symtrace.symbolic_trace(fn, example_inputs=ins), ins)


def test_data_dependent_graphs_are_not_cached():
    x = torch.randn(6)
    assert _key(lambda x: x[x > 0] * 2, x) is None                   # boolean mask
    assert _key(lambda x: torch.where(x > 0)[0], x) is None          # one-argument where
    assert _key(lambda x: x * x.sum().item(), x) is None             # .item()
    assert _key(lambda x: torch.cumsum(x, 0), x) is None             # op without a rule
    assert _key(lambda x: x[1:3] + x[torch.tensor([0, 2])], x) is None  # indexing by a tensor
    assert _key(lambda x: x[: x.shape[0] // 2] * 2, x) is not None   # shape arithmetic is fine
    # factories: sized by the inputs' shapes (a decoder's positions) or by a tensor's data
    assert _key(lambda x: x + torch.arange(x.shape[0]), x) is not None
    assert _key(lambda x, n: x + torch.arange(n), x, torch.tensor(6)) is None
    assert _key(lambda x, n: x + torch.zeros(n), x, torch.tensor(6)) is None


def test_modules_enter_the_key_by_type_repr_mode_and_tensors():
    x = torch.randn(4, 8)

    def key(mod):
        return L.record_key(symtrace.symbolic_trace(mod, example_inputs=(x,)), (x,))
    ln = nn.Sequential(nn.LayerNorm(8), nn.ReLU())
    base = key(ln)
    assert base is not None and base == key(nn.Sequential(nn.LayerNorm(8), nn.ReLU()))
    assert key(nn.Sequential(nn.LayerNorm(8, eps=1e-3), nn.ReLU())) != base
    gm = symtrace.symbolic_trace(nn.Sequential(nn.LayerNorm(8), nn.ReLU()), example_inputs=(x,))
    gm.get_submodule("0").weight = nn.Parameter(torch.randn(16)[::2])  # same shape, other strides
    assert L.record_key(gm, (x,)) not in (None, base)
    gm.train(False)
    assert L.record_key(gm, (x,)) is not None and len({L.record_key(gm, (x,)), base}) == 2

    class MyNorm(nn.LayerNorm):  # a subclass may do anything in forward
        def forward(self, x):
            return super().forward(x) * 2
    with pytest.raises(L._NotCacheable):
        L._module_key(MyNorm(8))
    hooked = nn.LayerNorm(8)
    hooked.register_forward_hook(lambda m, i, o: o * 2)
    with pytest.raises(L._NotCacheable):
        L._module_key(hooked)


def test_inputs_enter_the_key():
    def f(x):
        return torch.softmax(x * 2, -1)
    x = torch.randn(4, 8)
    gm = symtrace.symbolic_trace(f, example_inputs=(x,))
    keys = {L.record_key(gm, (x,)), L.record_key(gm, (torch.randn(4, 9),)), L.record_key(gm, (x.double(),)),
            L.record_key(gm, (torch.randn(8, 4).t(),)), L.record_key(gm, (x.requires_grad_(),))}
    assert None not in keys and len(keys) == 5


def test_damaged_record_entry_is_recorded_again(tmp_path):
    ins = _ln_inputs()
    gm = symtrace.symbolic_trace(layernorm_gelu, example_inputs=ins)
    key = L.record_key(gm, ins)
    real = L.record(gm, ins)
    path = tmp_path / "cache" / "records" / key[:2] / f"{key}.json"
    text = path.read_text()
    i = text.index("[5,9]")
    path.write_text(text[:i] + "[6,9]" + text[i + 5:])  # a plausible but wrong shape
    assert tc.read_cache_entry("records", key) is None  # the checksum catches it
    L._records.clear()
    assert L.record(gm, ins) == real
    assert tc.read_cache_entry("records", key) is not None  # rewritten


def test_record_cache_can_be_turned_off(monkeypatch):
    ins = _ln_inputs()
    gm = symtrace.symbolic_trace(layernorm_gelu, example_inputs=ins)
    L.record(gm, ins)
    calls = []
    real = L._record_real
    monkeypatch.setattr(L, "_record_real", lambda gm, inputs: calls.append(1) or real(gm, inputs))
    monkeypatch.setattr(L.Lowering, "record_cache", False)
    lower(gm, ins)
    assert calls == [1]


NEW_PROCESS = r"""
import sys, torch, symtrace
sys.path.insert(0, {root!r})
from symtrace.lower import compile as lower
from symtrace.lower import lowering as L, toolchain as tc
if sys.argv[1] == "second":
    def refuse(gm, inputs):
        raise AssertionError("record ran the graph")
    L._record_real = refuse
def f(x, y):
    return torch.relu(x * y + 1).sigmoid() * torch.tanh(x)
x, y = torch.randn(64, 33), torch.randn(64, 33)
lm = lower(symtrace.symbolic_trace(f, example_inputs=(x, y)), (x, y))
assert torch.allclose(lm(x, y), f(x, y))
print(tc.stats.compiles, tc.stats.disk_hits)
"""


def test_cache_hit_in_a_new_process_compiles_and_records_nothing(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = NEW_PROCESS.format(root=root)
    env = dict(os.environ, SYMTRACE_CACHE_DIR=str(tmp_path / "cache"))
    for which, expect in (("first", "1 0"), ("second", "0 1")):
        p = subprocess.run([sys.executable, "-c", code, which], env=env, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        assert p.stdout.split() == expect.split()


# ------------------------------------------------------------------------ non-dense inputs
@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("make", [lambda: torch.randn(6, 16)[:, 3:11], lambda: torch.randn(6, 1).expand(6, 8),
                                  lambda: torch.randn(8, 6).t()], ids=["sliced", "expanded", "transposed"])
def test_non_dense_example_inputs_use_the_kernels(make, cached, monkeypatch):
    monkeypatch.setattr(L.Lowering, "record_cache", cached)
    x = make()

    def f(x):
        return torch.softmax(x * 2, -1)
    lm = lower(symtrace.symbolic_trace(f, example_inputs=(x,)), (x,))
    assert f"{tuple(x.stride())!r}" in lm.wrapper_code
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(lm(x), f(x))


# ------------------------------------------------------------------- compile-error fallback
def _bad_c(monkeypatch):
    real = M.translation_unit
    monkeypatch.setattr(M, "translation_unit", lambda *a, **k: real(*a, **k) + "\nthis is not C;\n")


def softmax2(x):
    return torch.softmax(x * 2, -1)


def test_compile_error_falls_back_to_torch_with_one_clear_warning(monkeypatch):
    _bad_c(monkeypatch)
    x = torch.randn(4, 8)
    gm = symtrace.symbolic_trace(softmax2, example_inputs=(x,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm = lower(gm, (x,))
        out = [lm(x) for _ in range(3)]
    msgs = [str(w.message) for w in caught if "symtrace.lower" in str(w.message)]
    assert len(msgs) == 1, msgs
    msg = msgs[0]
    assert "C compiler rejected" in msg and "softmax2" in msg and "k0 (mul, softmax)" in msg
    assert "error" in msg and "this" in msg                # the compiler's first error lines
    assert "runs through torch" in msg and ".c" in msg     # what happens, where the source is
    for o in out:
        torch.testing.assert_close(o, softmax2(x))
    assert lm.kernels == [] and "rejected" in lm.report()


def test_compile_error_of_a_later_signature_keeps_the_first_one(monkeypatch):
    x = torch.randn(4, 8)
    lm = lower(symtrace.symbolic_trace(softmax2, example_inputs=(x,)), (x,))
    _bad_c(monkeypatch)
    tc.stats.reset()
    z = torch.randn(3, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            torch.testing.assert_close(lm(z), softmax2(z))
    assert sum("rejected" in str(w.message) for w in caught) == 1
    assert tc.stats.compiles == 1  # not retried on every call
    assert len(lm.kernels) == 1 and lm(x) is not None
    torch.testing.assert_close(lm(x), softmax2(x))


# ------------------------------------------------------------------ huge pages for outputs
def _softmax_module(rows):
    x = torch.randn(rows, 1024)
    return lower(symtrace.symbolic_trace(softmax2, example_inputs=(x,)), (x,)), x


def test_large_outputs_are_allocated_with_huge_pages(monkeypatch):
    from symtrace.lower import wrapper as W
    small, _ = _softmax_module(8)
    assert "_empty_huge" not in small.wrapper_code
    lm, x = _softmax_module(W.HUGE_PAGE_MIN_BYTES // 4096 + 1)   # just over the threshold
    assert "_empty_huge(" in lm.wrapper_code
    calls = []
    monkeypatch.setattr(W, "_madvise", [(lambda start, n, advice: calls.append((start, n, advice)) or 0,
                                         14, 2 << 20)])
    monkeypatch.setattr(W, "HUGE_PAGES", True)
    with torch.no_grad():
        out = lm(x)
    torch.testing.assert_close(out, softmax2(x))
    (start, n, advice), = calls
    ptr, nbytes = out.data_ptr(), out.untyped_storage().nbytes()
    assert advice == 14 and start % (2 << 20) == 0 and n % (2 << 20) == 0
    assert ptr <= start and start + n <= ptr + nbytes and n >= nbytes - 2 * (2 << 20)
    assert type(out) is torch.Tensor and out._base is None  # an ordinary tensor the caller owns
    monkeypatch.setattr(W, "HUGE_PAGES", False)
    lm(x)
    assert len(calls) == 1


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"), reason="no THP")
def test_madvise_is_accepted_by_this_kernel():
    from symtrace.lower import wrapper as W
    t = torch.empty(3 << 20)  # 12 MiB
    assert W.advise_huge_pages(t.data_ptr(), t.untyped_storage().nbytes())
    assert not W.advise_huge_pages(t.data_ptr(), 4096)  # no aligned huge page inside


def test_record_entries_of_the_wrong_kind_are_recorded_again():
    ins = _ln_inputs()
    gm = symtrace.symbolic_trace(layernorm_gelu, example_inputs=ins)
    key = L.record_key(gm, ins)
    real = L.record(gm, ins)
    n = len(gm.graph)
    for wrong in ([{"$tuple": [1, 2]}] * n, [{"$tensor": 0}] * n, [{"$nope": 1}] * n, [None] * (n + 1)):
        L._records[key] = wrong  # valid JSON, not a record of this graph
        assert L._load_record(key, gm) is None
    L._records.clear()
    assert L.record(gm, ins) == real


@pytest.mark.parametrize("dynamic", [False, True])
def test_negative_view_input_gives_eager_values(dynamic):
    """A negative view (``torch._neg_view``) keeps ``x`` in memory and means ``-x``: the kernels
    read memory, so such an input runs through torch, with eager's values."""
    def f(x, y):
        return torch.relu(x * 2 + y)

    x, y = torch.randn(16, 8), torch.randn(16, 8)
    lm = lower(symtrace.symbolic_trace(f, example_inputs=(x, y)), (x, y), dynamic=dynamic)
    for rows in (16, 5) if dynamic else (16,):
        a, b = torch.randn(rows, 8), torch.randn(rows, 8)
        assert torch.equal(lm(a, b), f(a, b))
        neg = torch._neg_view(a)
        assert neg.is_neg()
        assert torch.equal(lm(neg, b), f(neg, b))
        assert torch.equal(lm(b, neg), f(b, neg))
