"""symtrace/lower/layout_ops.py's ShuffleCat: ``channel_shuffle(cat(parts, 1), g)`` in one pass
of a C kernel, bit for bit against torch across dtypes (by element size), group counts, channel
slices of wider tensors, batch and spatial sizes (0 included), NaN and Inf; other layouts and
grad run torch's two calls."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from symtrace.lower.layout_ops import SHUFFLE_KERNEL, ShuffleCat

needs_kernel = pytest.mark.skipif(not SHUFFLE_KERNEL.available(), reason=f"kernel unusable: {SHUFFLE_KERNEL.reason}")

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.bool]


def _same_bits(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    if a.dtype.is_floating_point:   # NaN payloads and -0.0 too: compare the bytes
        a, b = (torch.empty(t.shape, dtype=t.dtype).copy_(t).view(-1).view(torch.uint8) for t in (a, b))
    assert torch.equal(a, b)


def _part(shape, dtype, gen, layout, special):
    n, c, h, w = shape
    if layout == "sliced":   # a channel slice of a wider channels-last tensor (ShuffleNet's x1)
        wide = torch.randn(n, 2 * c + 1, h, w, generator=gen).contiguous(memory_format=torch.channels_last)
        t = wide[:, 1:1 + c]
    else:
        t = torch.randn(n, c, h, w, generator=gen)
        if layout == "channels_last":
            t = t.contiguous(memory_format=torch.channels_last)
    if special and t.numel():
        flat = t.permute(0, 2, 3, 1)
        flat[..., 0] = float("nan")
        flat[..., -1] = float("-inf")
    return t.to(dtype) if dtype is not torch.bool else t > 0


@needs_kernel
@settings(max_examples=80, deadline=None)
@given(g=st.integers(2, 4), n=st.integers(0, 2), c=st.integers(1, 20), h=st.integers(1, 6), w=st.integers(1, 6),
       dtype=st.sampled_from(DTYPES), layout=st.sampled_from(["channels_last", "sliced", "nchw"]),
       special=st.booleans(), seed=st.integers(0, 2**16))
def test_matches_torch_cat_then_channel_shuffle(g, n, c, h, w, dtype, layout, special, seed):
    gen = torch.Generator().manual_seed(seed)
    parts = [_part((n, c, h, w), dtype, gen, layout if i % 2 == 0 else "channels_last", special) for i in range(g)]
    want = torch.channel_shuffle(torch.cat(parts, 1), g)
    got = ShuffleCat(g)(*parts)
    _same_bits(got, want)


@needs_kernel
def test_the_kernel_writes_a_channels_last_result_and_other_cases_run_torch(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(2, 6, 4, 5, generator=gen).contiguous(memory_format=torch.channels_last) for _ in range(2)]
    calls = []
    real = SHUFFLE_KERNEL.run
    monkeypatch.setattr(SHUFFLE_KERNEL, "run", lambda p: calls.append(len(p)) or real(p))
    out = ShuffleCat(2)(*parts)
    assert calls == [2] and out.is_contiguous(memory_format=torch.channels_last)
    ShuffleCat(2)(*[p.contiguous() for p in parts])          # NCHW: channels not contiguous
    ShuffleCat(3)(*parts)                                      # (torch.channel_shuffle's own error)
    leaf = parts[0].clone().requires_grad_()
    y = ShuffleCat(2)(leaf, parts[1])                          # grad: torch's calls, differentiable
    assert calls == [2] and y.grad_fn is not None
    y.sum().backward()
    assert torch.equal(leaf.grad, torch.ones_like(leaf))
    with pytest.raises(RuntimeError):
        ShuffleCat(2)(parts[0], parts[1][:, :5])                 # torch's error for unequal parts
