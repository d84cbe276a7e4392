"""symtrace/lower/kv_append.py: a growing cache's ``torch.cat([past, new])`` appended in place
into spare capacity. Values against ``torch.cat`` over chains of appends (dtypes, dimensions,
size-1 dimensions, non-contiguous ``new``, NaN/Inf); earlier results never change; branches,
crops and retries copy; other layouts, grad and mixed dtypes are exactly ``torch.cat``; the
pipeline's rewrite; a Hugging Face decoder's cache grows in place with eager's tokens."""
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

import symtrace
from symtrace.lower.kv_append import AppendCat, append_layout_strides, kv_append

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32]


def _rand(shape, dtype, gen, special=False):
    x = torch.randn(shape, generator=gen) * 3
    if special and x.numel():
        flat = x.view(-1)
        flat[0], flat[-1] = float("nan"), float("inf")
    return x.to(dtype)


def _equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) \
        and torch.equal(torch.nan_to_num(a.float(), nan=0.0), torch.nan_to_num(b.float(), nan=0.0))


@settings(max_examples=60, deadline=None)
@given(rank=st.integers(1, 4), data=st.data(), dtype=st.sampled_from(DTYPES), steps=st.integers(1, 45),
       transposed=st.booleans(), special=st.booleans(), seed=st.integers(0, 2**16))
def test_a_chain_of_appends_equals_torch_cat(rank, data, dtype, steps, transposed, special, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = data.draw(st.lists(st.sampled_from([1, 1, 2, 3, 5]), min_size=rank, max_size=rank))
    dim = data.draw(st.integers(-rank, rank - 1))
    d = dim % rank
    op = AppendCat(dim)
    past = torch.tensor([], dtype=dtype)   # (a DynamicCache's first step cats onto this)
    want = None
    results = []
    for step in range(steps):
        n = data.draw(st.sampled_from([1, 1, 1, 2, 4]))
        size = list(shape)
        size[d] = n
        new = _rand(size, dtype, gen, special)
        if transposed and rank >= 2:   # a non-contiguous new value
            new = _rand(size[::-1], dtype, gen, special).permute(*reversed(range(rank)))
        want = new.clone() if want is None else torch.cat([want, new], dim)
        past = op(past, new)
        assert _equal(past, want)
        assert past.stride() == append_layout_strides(past.shape, d)
        results.append((past, want.clone()))
    for got, was in results:   # appends write only past every earlier result's end
        assert _equal(got, was)
    bases = {id(r._base) for r, _ in results}
    assert len(bases) < len(results) or len(results) == 1   # (appends that fit share storage)


@settings(max_examples=60, deadline=None)
@given(rank=st.integers(1, 4), data=st.data(), steps=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_a_reservation_then_a_write_is_the_append(rank, data, steps, seed):
    # reserve(past, new's shape) and then writing new at past's end (what a C entry point does
    # with c_calls' split append) gives what the op gives: values, layout, storage shared or not
    gen = torch.Generator().manual_seed(seed)
    shape = data.draw(st.lists(st.sampled_from([1, 1, 2, 3]), min_size=rank, max_size=rank))
    dim = data.draw(st.integers(-rank, rank - 1))
    d = dim % rank
    op = AppendCat(dim)
    pasts = [torch.tensor([])] * 2   # (the op's chain and the reserve's chain)
    history = []
    for step in range(steps):
        size = list(shape)
        size[d] = data.draw(st.sampled_from([1, 1, 1, 2, 5]))
        new = _rand(size, torch.float32, gen)
        how = data.draw(st.sampled_from(["next", "next", "next", "retry", "caller's"])) if step else "next"
        if how == "retry" and history:   # (from an earlier, shorter result: the storage's end moved on)
            back = data.draw(st.integers(0, len(history) - 1))
            pasts = list(history[back])
        elif how == "caller's" and pasts[0].dim() == rank:   # (a tensor of the caller's in this layout)
            pasts = [torch.empty_strided(pasts[0].shape, pasts[0].stride()).copy_(pasts[0]) for _ in range(2)]
        want = op(pasts[0], new)
        got = op.reserve(pasts[1], tuple(new.shape), torch.float32)
        assert got is not None and got.shape == want.shape and got.stride() == want.stride()
        start = pasts[1].shape[d] if pasts[1].dim() == rank else 0
        got.narrow(d, start, new.shape[d]).copy_(new)
        assert torch.equal(got, want)
        assert (got._base is not None and got._base is getattr(pasts[1], "_base", None)) == \
            (want._base is not None and want._base is getattr(pasts[0], "_base", None))
        assert (getattr(got._base, "_st_tail", None) is None) == (getattr(want._base, "_st_tail", None) is None)
        history.append((want, got))
        pasts = [want, got]
    for want, got in history:   # (nothing written past an earlier result's end changed it)
        assert torch.equal(got, want)


def test_a_reservation_refuses_where_the_op_gives_torch_cat():
    op = AppendCat(-2)
    assert op.reserve(torch.randn(1, 4, 7, 8), (1, 4, 1, 8), torch.float32) is None   # (contiguous: not this layout)
    past = op(torch.tensor([]), torch.randn(1, 4, 3, 8))
    assert op.reserve(past, (1, 4, 1, 8), torch.float64) is None   # (another dtype)
    assert op.reserve(past, (1, 5, 1, 8), torch.float32) is None   # (other sizes)
    with torch.enable_grad():
        assert op.reserve(past.clone().requires_grad_(), (1, 4, 1, 8), torch.float32) is None


def test_appends_share_storage_until_capacity_then_grow():
    op = AppendCat(-2)
    k = op(torch.tensor([]), torch.randn(1, 4, 10, 8))
    base, cap = k._base, k._base._st_tail.capacity
    assert cap == 10 + 32 and k.stride() == (80 * 4, 8, 32, 1) and not k.is_contiguous()
    ptr = k.data_ptr()
    for i in range(cap - 10):
        k = op(k, torch.randn(1, 4, 1, 8))
        assert k._base is base and k.data_ptr() == ptr
    k = op(k, torch.randn(1, 4, 1, 8))   # full: a fresh storage, one and a half times the need
    assert k._base is not base and k._base._st_tail.capacity == 43 + 32
    batched = op(torch.tensor([]), torch.randn(3, 2, 5, 8))   # batch > 1: positions outermost
    assert batched.stride() == (16, 8, 48, 1)


def test_a_second_append_from_the_same_past_copies_and_leaves_the_first_alone():
    op = AppendCat(2)
    gen = torch.Generator().manual_seed(0)
    past = op(torch.tensor([]), torch.randn(1, 2, 6, 4, generator=gen))
    ref = past.clone()
    x, y = torch.randn(1, 2, 1, 4, generator=gen), torch.randn(1, 2, 1, 4, generator=gen)
    a = op(past, x)
    b = op(past, y)   # beam / retry: the storage's end is past's end + 1, so this one copies
    assert a._base is past._base and b._base is not past._base
    assert torch.equal(a, torch.cat([ref, x], 2)) and torch.equal(b, torch.cat([ref, y], 2))
    assert torch.equal(past, ref)
    cropped = a[:, :, :4]   # DynamicCache.crop: a shorter view of the same storage
    c = op(cropped, y)
    assert c._base is not a._base and torch.equal(c, torch.cat([ref[:, :, :4], y], 2))
    assert torch.equal(a, torch.cat([ref, x], 2))


def test_other_layouts_grad_and_mixed_dtypes_are_exactly_torch_cat():
    op = AppendCat(-2)
    past, new = torch.randn(1, 4, 7, 8), torch.randn(1, 4, 1, 8)   # a contiguous cache of 4 heads
    out = op(past, new)
    assert out._base is None and out.is_contiguous() and torch.equal(out, torch.cat([past, new], -2))
    leaf = torch.randn(1, 4, 1, 8, requires_grad=True)
    out = op(torch.tensor([]), leaf)
    assert out.grad_fn is not None and out.is_contiguous()
    out.sum().backward()
    assert torch.equal(leaf.grad, torch.ones_like(leaf))
    with torch.no_grad():
        assert op(torch.tensor([]), leaf)._base is not None
    half = op(torch.tensor([]), torch.randn(1, 4, 3, 8).half())
    single = torch.randn(1, 4, 1, 8)
    mixed = op(half, single)   # promotion: torch.cat's float32
    assert mixed.dtype is torch.float32 and torch.equal(mixed, torch.cat([half, single], -2))
    empty_new = op(half, torch.randn(1, 4, 0, 8).half())
    assert torch.equal(empty_new, half)
    with pytest.raises(RuntimeError):   # torch.cat's own error for mismatched sizes
        op(half, torch.randn(1, 3, 1, 8).half())


def test_a_steady_decode_step_checks_what_differs_from_the_last_append():
    # the common step (past the newest result, new shaped as the last append) takes a short
    # path; each way a call can differ from it must still give torch.cat's answer
    op = AppendCat(-2)
    gen = torch.Generator().manual_seed(3)
    k = op(torch.tensor([]), torch.randn(1, 4, 5, 8, generator=gen))
    for _ in range(3):
        k = op(k, torch.randn(1, 4, 1, 8, generator=gen))
    ref, base = k.clone(), k._base
    other = op(k.view(torch.int32), torch.randint(-9, 9, (1, 4, 1, 8), dtype=torch.int32, generator=gen))
    assert other.dtype is torch.int32 and torch.equal(other[:, :, :8].view(torch.float32), ref)
    assert torch.equal(k, ref)
    strided = torch.randn(8, 1, 4, 1, generator=gen).permute(1, 2, 3, 0)   # same shape, other strides
    k2 = op(k, strided)
    assert k2._base is base and torch.equal(k2, torch.cat([ref, strided], -2))
    leaf = torch.randn(1, 4, 1, 8, requires_grad=True)
    k3 = op(k2, leaf)   # records for autograd: torch.cat
    assert k3.grad_fn is not None and k3._base is None and torch.equal(k3, torch.cat([k2, leaf], -2))
    with pytest.raises(RuntimeError):
        op(k2, torch.randn(1, 4, 1, 8, device="meta"))   # torch.cat's own error for mixed devices
    k4 = AppendCat(1)(k2, torch.randn(1, 1, 9, 8, generator=gen))   # another dimension: torch.cat
    assert k4.shape == (1, 5, 9, 8) and torch.equal(k4, torch.cat([k2, k4[:, 4:]], 1))
    k5 = op(k2, torch.randn(1, 4, 1, 8, generator=gen))   # the storage's newest result still grows
    assert k5._base is base and torch.equal(k5[:, :, :9], k2)


def test_inference_mode_tensors_append_too():
    op = AppendCat(-2)
    with torch.inference_mode():
        k = op(torch.tensor([]), torch.randn(1, 2, 3, 8))
        k2 = op(k, torch.randn(1, 2, 1, 8))
    assert k2._base is k._base and torch.equal(k2[:, :, :3], k)


def _graph(fn, *args):
    gm = symtrace.symbolic_trace(fn)
    from symtrace.passes.shape_prop import ShapeProp
    ShapeProp(gm).run(*args)
    return gm


def test_the_rewrite_takes_returned_cats_onto_an_input_or_an_empty_tensor_only():
    def step(cache, x):
        grown = torch.cat([cache, x * 2], dim=-2)
        inner = torch.cat([x, x], dim=-2)     # not returned: stays a cat
        other = torch.cat([x + 1, x], dim=-2)  # returned, but onto a computed value: stays
        return grown, inner.sum() + other.sum(), other
    cache, x = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 1, 4)
    gm = _graph(step, cache, x)
    want = gm(cache, x)
    assert kv_append(gm) == ["cat"]
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert sum(isinstance(t, AppendCat) for t in targets) == 1 and targets.count(torch.cat) == 2
    gm.recompile()
    got = gm(cache, x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _tiny_llama(kv_heads=2):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_a_decoders_cache_grows_in_place_with_eagers_tokens(kv_heads):
    pytest.importorskip("transformers", reason="transformers is not installed")
    from transformers import DynamicCache
    from symtrace.lower import lowering_pass
    from symtrace.lower.pipeline import InferenceOptions
    model = _tiny_llama(kv_heads)
    ids = torch.randint(2, 96, (1, 7), generator=torch.Generator().manual_seed(1))

    def decode(forward, steps=12):
        cache, keys, toks = DynamicCache(config=model.config), [], []
        with torch.no_grad():
            out = forward(input_ids=ids, past_key_values=cache, use_cache=True)
            for _ in range(steps):
                tok = out.logits[:, -1:].argmax(-1)
                toks.append(tok)
                keys.append(cache.layers[1].keys)
                out = forward(input_ids=tok, past_key_values=cache, use_cache=True)
        return torch.cat(toks, 1), cache, keys

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want, eager_cache, _ = decode(model.forward)
        captured = symtrace.capture(model.forward, passes=[lowering_pass()])
        got, cache, keys = decode(captured)
        plain = symtrace.capture(model.forward, passes=[lowering_pass(inference=InferenceOptions(kv_append=False))])
        got_plain, plain_cache, _ = decode(plain)
    assert torch.equal(got, want) and torch.equal(got_plain, want)
    assert captured.captures <= 3
    for ours, theirs in zip(cache.layers, eager_cache.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.values, theirs.values, rtol=1e-5, atol=1e-5)
    # every step after the first appended into the storage the prefill allocated (7 + 32 spare)
    assert all(k._base is keys[0]._base for k in keys) and cache.layers[1].keys._base is keys[0]._base
    assert all(torch.equal(k, cache.layers[1].keys[:, :, :k.shape[2]]) for k in keys)
    assert all(layer.keys.is_contiguous() for layer in plain_cache.layers)
    from symtrace.lower.capture_pass import LazyRegion
    regions = [m for gm in captured.graphs for m in gm.modules() if isinstance(m, LazyRegion)]
    notes = [n for r in regions if r.lowered is not None for n in r.lowered.pipeline_notes]
    assert any("append in place" in n for n in notes), notes
    # the decode region serves every length from a static variant and one size-generic one
    assert max(r.lowered.compiles for r in regions if r.lowered is not None) <= 2


def test_fake_call_gives_the_layout_a_real_call_gives_with_a_symbolic_length():
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    op = AppendCat(-2)
    real = op(torch.tensor([]), torch.randn(1, 4, 10, 8))

    def fake(t, dynamic):
        kinds = [DimDynamic.DYNAMIC if i in dynamic else DimDynamic.STATIC for i in range(t.dim())]
        return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=kinds),
                                source=ConstantSource(f"t{id(t)}"))
    past, new = fake(real, (2,)), fake(torch.randn(1, 4, 1, 8), ())
    with mode:
        out = op.fake_call(past, new)
        first = op.fake_call(mode.from_tensor(torch.tensor([])), new)
    length = past.shape[2]
    assert out.shape == (1, 4, length + 1, 8) and out.stride() == (32 * (length + 1), 8, 32, 1)
    grown = op(real, torch.randn(1, 4, 1, 8))
    assert grown.stride() == (32 * 11, 8, 32, 1)   # (the real call, at length 10)
    assert tuple(first.shape) == (1, 4, 1, 8) and tuple(first.stride()) == (32, 8, 32, 1)


# --- found by the read-only review of this module ------------------------------------------------

def test_a_graph_that_writes_into_its_grown_cache_is_not_rewritten():
    def step(cache, x):
        grown = torch.cat([cache, x], dim=-2)
        grown.mul_(0.5)   # (the in-place append would write into the caller's cache)
        return grown
    cache, x = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 1, 4)
    assert kv_append(_graph(step, cache, x)) == []


@pytest.mark.filterwarnings("ignore")
def test_a_captured_step_that_scales_its_grown_cache_leaves_the_callers_cache_alone(monkeypatch):
    # the write is in the plumbing around the lowered region: the region is told so
    from symtrace.lower import lowering_pass
    monkeypatch.setenv("SYMTRACE_SPEED_CHECK", "0")

    class Step(torch.nn.Module):
        def forward(self, past, x):
            k = torch.cat([past, x], dim=-2)
            k.mul_(0.5)
            return k

    model = Step().eval()
    cap = symtrace.capture(model, passes=[lowering_pass()])
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, 2, 3, 4, generator=gen)] + [torch.randn(1, 2, 1, 4, generator=gen) for _ in range(3)]
    want = got = torch.tensor([])
    for x in xs:
        before = got.clone()
        want, new = model(want, x), cap(got, x)
        assert torch.equal(got, before) and torch.equal(new, want)
        got = new


def test_appending_moves_no_version_counter_so_saved_cache_tensors_still_backprop():
    op = AppendCat(-2)
    w = torch.randn(1, 2, 1, 8, requires_grad=True)
    k, losses = op(torch.tensor([]), torch.randn(1, 2, 4, 8)), []
    for _ in range(5):   # autograd saves each step's k (k * w needs it for w's gradient)
        losses.append((k * w).sum())
        k = op(k, torch.randn(1, 2, 1, 8))
    assert k._base is not None and k._base._st_tail.end == 9
    sum(losses).backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()


def test_two_threads_appending_to_one_cache_get_independent_results():
    import sys
    import threading
    op = AppendCat(-2)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # (threads switch often: inside the checks and the reservation)
    try:
        for step in range(300):
            past = op(torch.tensor([]), torch.randn(1, 8, 64, 16))
            if step % 2:   # (a steady step: both calls take the short path)
                past = op(past, torch.randn(1, 8, 1, 16))
            xs = [torch.full((1, 8, 1, 16), float(i + 1)) for i in range(2)]
            out, go = [None, None], threading.Barrier(2)

            def work(i):
                go.wait()
                out[i] = op(past, xs[i])
            threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert all(torch.equal(out[i], torch.cat([past, xs[i]], -2)) for i in range(2))
    finally:
        sys.setswitchinterval(interval)


def test_conjugate_views_and_a_callers_tensor_get_torch_cats_values_and_no_spare_storage():
    op = AppendCat(-2)
    c = torch.randn(1, 2, 3, 4, dtype=torch.complex64)
    new = torch.randn(1, 2, 1, 4, dtype=torch.complex64)
    assert torch.equal(op(c.conj(), new), torch.cat([c.conj(), new], -2))
    x, y = torch.randn(1000, 8), torch.randn(10, 8)   # dim 0: this layout is the contiguous one
    out = AppendCat(0)(x, y)
    assert torch.equal(out, torch.cat([x, y])) and out.is_contiguous()
    assert out.untyped_storage().nbytes() == out.numel() * 4 and getattr(out._base, "_st_tail", None) is None
