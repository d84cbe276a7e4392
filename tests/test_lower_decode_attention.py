"""symtrace/lower/attention_cpu.py: one-query-row attention over a cache (a decoder's step) by
symtrace's kernel, against eager SDPA and softmax attention's definition: grouped heads, head
sizes, strides of cache slices, boolean and float masks (broadcast, fully masked rows), NaN and
Inf, the fallbacks, and the pipeline's rewrite."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

import symtrace
from symtrace.lower.attention_cpu import KERNEL, DecodeAttention, decode_attention

needs_kernel = pytest.mark.skipif(not KERNEL.available(), reason=f"decode attention kernel unusable: {KERNEL.reason}")


def test_the_kernel_passes_its_self_check_on_an_avx2_machine_with_a_compiler():
    # a kernel that disagrees with torch makes itself unusable (every call then runs torch's
    # SDPA): on the machines CI runs, that must show as a failure, not as skips
    import platform
    import shutil
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None and shutil.which("gcc") is None \
            or not torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        pytest.skip("not an x86 machine with AVX2 and a C compiler")
    assert KERNEL.available(), KERNEL.reason


def _definition(q, k, v, scale):
    """softmax(scale q k^T) @ v in float64, grouped heads repeated."""
    g = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(g, 1)
    v = v.double().repeat_interleave(g, 1)
    s = (q.double() @ k.transpose(-1, -2)) * scale
    return (torch.softmax(s, -1) @ v)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 3), hkv=st.integers(1, 4), groups=st.sampled_from([1, 2, 3, 4, 5, 8]),
       rows=st.sampled_from([1, 1, 2, 3, 4, 8]), n=st.integers(1, 300), d=st.sampled_from([64, 128]),
       scale=st.sampled_from([None, 0.1, 1.0]), sliced=st.booleans(), positions_outer=st.booleans(),
       seed=st.integers(0, 2**16))
def test_matches_eager_sdpa(b, hkv, groups, rows, n, d, scale, sliced, positions_outer, seed):
    gen = torch.Generator().manual_seed(seed)
    h = hkv * groups
    q = torch.randn(b, h, rows, d, generator=gen)
    if sliced:   # query rows of a wider buffer
        q = torch.randn(b, h, rows + 2, d, generator=gen)[:, :, 1:1 + rows]
    if positions_outer:   # kv_append's layout (the AVX2 kernel splits the positions among threads)
        k, v = _positions_outer(b, hkv, n, d, gen, 3 if sliced else 0), _positions_outer(b, hkv, n, d, gen, 2 if sliced else 0)
    elif sliced:   # a cache slice: keys and values of a longer buffer, heads and batch strided
        k = torch.randn(b, hkv, n + 7, d, generator=gen)[:, :, 3:3 + n]
        v = torch.randn(b, hkv, n + 7, d, generator=gen)[:, :, 2:2 + n]
    else:
        k, v = torch.randn(b, hkv, n, d, generator=gen), torch.randn(b, hkv, n, d, generator=gen)
    op = DecodeAttention(scale, enable_gqa=groups > 1)
    got = op(q, k, v)
    want = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=groups > 1)
    assert got.shape == want.shape and got.dtype is torch.float32 and got.is_contiguous()
    # (scale 1 with head size 128 makes scores of size ~40: float32 rounding of a score moves
    # its weight by ~1e-5 relative)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5)
    ref = _definition(q, k, v, scale if scale is not None else 1 / math.sqrt(d))
    assert torch.allclose(got.double(), ref, rtol=1e-4, atol=5e-5)


def _positions_outer(b, hkv, n, d, gen, start=0):
    """A (b, hkv, n, d) cache laid out as kv_append lays it out, positions outermost (from
    position ``start`` of a longer buffer)."""
    return torch.randn(b, n + start + 5, hkv, d, generator=gen).transpose(1, 2)[:, :, start:start + n]


def _same_as_eager(got, want):
    assert got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got.isposinf(), want.isposinf())
    fin = want.isfinite()
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("positions_outer", [False, True])
def test_nan_and_inf_as_eager(where, value, positions_outer):
    gen = torch.Generator().manual_seed(1)
    n = 90 if positions_outer else 20   # (several chunks of positions, shared among the threads)
    q = torch.randn(1, 8, 1, 64, generator=gen)
    if positions_outer:
        k, v = _positions_outer(1, 2, n, 64, gen), _positions_outer(1, 2, n, 64, gen)
    else:
        k, v = torch.randn(1, 2, n, 64, generator=gen), torch.randn(1, 2, n, 64, generator=gen)
    {"q": q, "k": k, "v": v}[where][0, 1, 0 if where == "q" else 5, 3] = value
    got = DecodeAttention(None, True)(q, k, v)
    _same_as_eager(got, F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    # heads that read other key-value heads (or, for q, other query heads) are untouched
    assert torch.isfinite(got[0, :4] if where in "kv" else got[0, 4:]).all()


@needs_kernel
def test_every_score_minus_inf_gives_zeros_as_eager():
    q = torch.ones(1, 2, 1, 64)
    k = torch.full((1, 1, 4, 64), float("-inf"))
    v = torch.randn(1, 1, 4, 64)
    _same_as_eager(DecodeAttention(None, True)(q, k, v), F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 2), hkv=st.integers(1, 3), groups=st.sampled_from([1, 4]), rows=st.sampled_from([1, 2, 4]),
       n=st.integers(1, 140), shape=st.sampled_from(["b1", "bh", "1h", "1l", "11", "bhm"]), boolean=st.booleans(),
       full=st.booleans(), positions_outer=st.booleans(), seed=st.integers(0, 2**16))
def test_masks_as_eager(b, hkv, groups, rows, n, shape, boolean, full, positions_outer, seed):
    # boolean (True: attend) and additive float masks, broadcast from their own shapes; a row
    # masked entirely gives zeros, as torch's SDPA does
    gen = torch.Generator().manual_seed(seed)
    h = hkv * groups
    q = torch.randn(b, h, rows, 64, generator=gen)
    if positions_outer:
        k, v = _positions_outer(b, hkv, n, 64, gen), _positions_outer(b, hkv, n, 64, gen)
    else:
        k, v = torch.randn(b, hkv, n, 64, generator=gen), torch.randn(b, hkv, n, 64, generator=gen)
    dims = {"b1": (b, 1, 1, n), "bh": (b, h, 1, n), "1h": (1, h, 1, n), "1l": (1, n), "11": (1, 1),
            "bhm": (b, h, rows, n)}[shape]
    keep = torch.rand(dims, generator=gen) > 0.4
    if full:   # the first row masked entirely
        keep.view(-1, dims[-1])[0] = False
    mask = keep if boolean else torch.where(keep, torch.randn(dims, generator=gen), torch.tensor(float("-inf")))
    op = DecodeAttention(None, groups > 1)
    _same_as_eager(op(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1))


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 2), threads=st.sampled_from([1, 2, 3]), hkv=st.integers(1, 3), groups=st.sampled_from([1, 4, 5]),
       rows=st.sampled_from([1, 2]), n=st.integers(40, 600), d=st.sampled_from([64, 128]),
       poison=st.sampled_from([None, "k nan", "k inf", "v nan", "v -inf"]), masked=st.sampled_from([None, "bool", "float"]),
       positions_outer=st.booleans(), data=st.data())
def test_positions_shared_among_threads_as_eager(b, threads, hkv, groups, rows, n, d, poison, masked, positions_outer,
                                                 data):
    # on a cache laid out positions outermost, the AVX2 kernel splits the positions among the
    # threads and combines each row's largest score, NaN flag, sum and weighted sums across
    # them (other layouts: tasks by head): a NaN or infinity at any position, a row masked
    # entirely (its weights zeros: 0 x a NaN or infinite value is NaN, as in torch) and any
    # thread count (more than the cores) must give eager's answer
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    h = hkv * groups
    q = torch.randn(b, h, rows, d, generator=gen)
    if positions_outer:
        k, v = _positions_outer(b, hkv, n, d, gen), _positions_outer(b, hkv, n, d, gen)
    else:
        k, v = torch.randn(b, hkv, n, d, generator=gen), torch.randn(b, hkv, n, d, generator=gen)
    if poison:
        where, value = poison.split()
        {"k": k, "v": v}[where][data.draw(st.integers(0, b - 1)), data.draw(st.integers(0, hkv - 1)),
                                data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, d - 1))] = float(value)
    mask = None
    if masked:
        keep = torch.rand(b, h, rows, n, generator=gen) > 0.3
        keep[0, 0, 0] = data.draw(st.booleans())   # (a row masked entirely, or not)
        mask = keep if masked == "bool" else torch.where(keep, torch.randn(keep.shape, generator=gen),
                                                           torch.tensor(float("-inf")))
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = DecodeAttention(None, groups > 1)(q, k, v, mask)
    finally:
        torch.set_num_threads(old)
    _same_as_eager(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1))


@needs_kernel
@pytest.mark.parametrize("layout", ["positions outer", "heads outer"])
def test_the_bits_do_not_depend_on_the_thread_count(layout):
    # positions are shared among threads in fixed chunks whose sums are added in chunk order
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 32, 1, 64, generator=gen)
    if layout == "positions outer":
        k, v = _positions_outer(2, 8, 500, 64, gen), _positions_outer(2, 8, 500, 64, gen)
    else:
        k, v = torch.randn(2, 8, 500, 64, generator=gen), torch.randn(2, 8, 500, 64, generator=gen)
    old = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(DecodeAttention(None, True)(q, k, v))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(outs[0], F.scaled_dot_product_attention(q, k, v, enable_gqa=True), rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("case", ["nine rows", "head 32", "float64", "grad", "empty cache", "no gqa flag",
                                  "negative view"])
def test_what_the_kernel_does_not_take_runs_torch(case, monkeypatch):
    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 4, 1, 64, generator=gen), torch.randn(1, 2, 9, 64, generator=gen), \
        torch.randn(1, 2, 9, 64, generator=gen)
    gqa = True
    if case == "nine rows":
        q = torch.randn(1, 4, 9, 64, generator=gen)
    elif case == "head 32":
        q, k, v = q[..., :32], k[..., :32], v[..., :32]
    elif case == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif case == "grad":
        q.requires_grad_(True)
    elif case == "empty cache":
        k, v = k[:, :, :0], v[:, :, :0]
    elif case == "no gqa flag":
        gqa = False
    elif case == "negative view":   # (its memory holds -k)
        k = torch._neg_view(-k)
    import symtrace.lower.attention_cpu as A

    def no_kernel(*a, **kw):
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(A.KERNEL, "run", no_kernel)
    op = DecodeAttention(None, gqa)
    if case == "no gqa flag":   # torch refuses 4 query heads over 2 key heads without the flag
        with pytest.raises(RuntimeError):
            op(q, k, v)
        return
    got = op(q, k, v)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(got, want, equal_nan=True)


class _Step(nn.Module):
    def __init__(self, mask=False, causal=False):
        super().__init__()
        self.mask, self.causal = mask, causal

    def forward(self, q, k, v):
        m = torch.zeros(q.shape[2], k.shape[2], dtype=torch.bool) if self.mask else None
        if m is not None:
            m[:, : k.shape[2] // 2] = True
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=self.causal and m is None,
                                              enable_gqa=True) * 2


@pytest.mark.parametrize("mask,causal,rewritten", [(False, False, True), (True, False, True), (False, True, False)])
def test_the_pipeline_rewrites_one_row_attention_that_is_not_causal(mask, causal, rewritten):
    from symtrace import lower
    q, k, v = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 10, 64), torch.randn(1, 2, 10, 64)
    m = _Step(mask, causal).eval()
    gm = symtrace.symbolic_trace(m, example_inputs=(q, k, v))
    low = lower.compile(gm, (q, k, v))
    notes = " ".join(getattr(low, "pipeline_notes", []))
    # (without the kernel, an AVX2-only CPU, nothing is rewritten: the report claims no kernel it lacks)
    assert ("decode-step attention" in notes) == (rewritten and KERNEL.available())
    with torch.no_grad():
        for n in (10, 11, 40):
            k2, v2 = torch.randn(1, 2, n, 64), torch.randn(1, 2, n, 64)
            torch.testing.assert_close(low(q, k2, v2), m(q, k2, v2), rtol=1e-5, atol=1e-5)


def test_rewrite_keeps_graphs_with_many_query_rows_alone(monkeypatch):
    # (the decision, on any CPU: the kernel counts as usable here, and nothing runs)
    monkeypatch.setattr(KERNEL, "available", lambda: True)
    q, k, v = torch.randn(1, 4, 9, 64), torch.randn(1, 2, 10, 64), torch.randn(1, 2, 10, 64)
    gm = symtrace.symbolic_trace(_Step().eval(), example_inputs=(q, k, v))
    assert decode_attention(gm) == []
    q = torch.randn(1, 4, 1, 64)
    gm = symtrace.symbolic_trace(_Step().eval(), example_inputs=(q, k, v))
    assert len(decode_attention(gm)) == 1   # (one query row: rewritten)


def test_without_the_kernel_nothing_is_rewritten(monkeypatch):
    monkeypatch.setattr(KERNEL, "available", lambda: False)
    q, k, v = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 10, 64), torch.randn(1, 2, 10, 64)
    gm = symtrace.symbolic_trace(_Step().eval(), example_inputs=(q, k, v))
    assert decode_attention(gm) == []


@needs_kernel
def test_a_nan_in_a_float_mask_as_eager():
    q, k, v = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 9, 64), torch.randn(1, 2, 9, 64)
    mask = torch.zeros(1, 4, 1, 9)
    mask[0, 2, 0, 3] = float("nan")
    _same_as_eager(DecodeAttention(None, True)(q, k, v, mask),
                   F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
