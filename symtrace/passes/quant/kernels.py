"""int8 kernels behind one interface, and the functions lowered graphs call.

A lowered graph calls the module-level functions below (``int8_conv2d``, ``int8_linear``,
``int8_dynamic_linear``, ``int8_add``, ...); the fused conv/linear ones dispatch to a named
:class:`Int8Backend`:

* ``"onednn"`` -- torch's oneDNN int8 ops (``torch.ops.onednn.qconv_pointwise``,
  ``qconv2d_pointwise.binary``, ``qlinear_pointwise``, with ``qconv_prepack``/``qlinear_prepack``),
  which use VNNI/AMX where the CPU has them. They take plain ``uint8``/``int8`` tensors. They
  are internal ops without a compatibility promise, so the backend checks itself against the
  portable one once (:func:`backend_available`) and is skipped when absent or wrong.
* ``"portable"`` -- pure-integer arithmetic with ``torch._int_mm`` (exact int8 x int8 -> int32;
  an exact float64 matmul where that op is missing): im2col for convolutions, then one float32
  requantization (scale, bias, residual, ReLU, round). Works on any torch >= 2.11 build.

Backends are found by name in :mod:`.registry` (a fixed table of module paths, resolved on
first use; nothing registers itself at import): ``"c"`` is ``symtrace.lower.int8_cpu``'s
symtrace-generated C Linear kernels, exact against the portable backend. Others can be added
with :func:`register_backend` (with a priority that :func:`default_backend` follows).

:meth:`Int8Backend.linear_edges` is Linear with a graph's edges folded in (a float input
quantized first, the result dequantized): :func:`~symtrace.passes.quant.lower` emits it for
the first/last Linear of a graph, so an MLP is one call per layer. Its default composes
``quantize_per_tensor``/:meth:`linear`/``dequantize_per_tensor``; the ``"c"`` backend does it
in one kernel call with the same results.

Weights are plain int8 tensors (buffers of the graph module); packed forms are cached per
weight tensor (keyed by identity and version, :func:`weight_cached`) and never saved.
"""
from __future__ import annotations

import math
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .qparams import dequantize_per_tensor, quantize_per_tensor
from .registry import available_backends, backend_available, default_backend, get_backend, register_backend

__all__ = ["Int8Backend", "OneDNNBackend", "PortableBackend", "register_backend", "get_backend",
           "backend_available", "default_backend", "available_backends", "weight_cached", "requant_terms",
           "dynamic_qparams", "int8_conv2d", "int8_linear",
           "int8_dynamic_linear", "int8_add", "int8_cat", "int8_avg_pool2d", "int8_adaptive_avg_pool2d",
           "int8_relu", "int8_lut", "int8_max_pool2d"]


# --- packed-weight cache ------------------------------------------------------------------
_CACHE: Dict[Tuple, Tuple[Any, int, Any]] = {}
_LOCK = threading.Lock()


def weight_cached(w: torch.Tensor, key: Tuple, make: Callable[[], Any]) -> Any:
    """``make()`` cached per (weight tensor, ``key``); recomputed when the weight is written.
    Backends use it for packed weights and per-site constants (``key`` must be hashable and
    should start with the backend's name)."""
    k = (id(w),) + key
    hit = _CACHE.get(k)
    if hit is not None and hit[0]() is w and hit[1] == w._version:
        return hit[2]
    value = make()
    with _LOCK:
        if len(_CACHE) > 4096:  # e.g. many input shapes: start over rather than grow
            _CACHE.clear()
        ref = weakref.ref(w, lambda _r, k=k, cache=_CACHE: cache.pop(k, None))
        _CACHE[k] = (ref, w._version, value)
    return value


def _qdtype(qmin: int) -> torch.dtype:
    return torch.int8 if qmin < 0 else torch.uint8


def _requant_out(y: torch.Tensor, out_scale: float, out_zp: int, qmin: int, qmax: int, dtype) -> torch.Tensor:
    return quantize_per_tensor(y, out_scale, out_zp, qmin, qmax, dtype)


# --- the interface ------------------------------------------------------------------------
class Int8Backend:
    """Fused int8 convolution and linear. Inputs are uint8 activations (``x_scale``,
    ``x_zp``), int8 symmetric per-output-channel weights (``w_scale``, zero point 0), a float
    bias; ``post`` is ``"none"`` or ``"relu"``; ``accum`` (conv only) is a uint8 tensor added
    before ``post`` (a residual). ``out_dtype`` None means quantized output with
    ``out_scale``/``out_zp``; ``torch.float32`` means a float result."""

    name = "base"

    def available(self) -> bool:
        return True

    def conv2d(self, x, w, w_scale, bias, stride, padding, dilation, groups, x_scale, x_zp, out_scale, out_zp,
               qmin, qmax, post, accum=None, accum_scale=1.0, accum_zp=0, accum_inplace=False):
        raise NotImplementedError

    def linear(self, x, w, w_scale, bias, x_scale, x_zp, out_scale, out_zp, qmin, qmax, post, out_float=False):
        raise NotImplementedError

    def linear_edges(self, x, w, w_scale, bias, x_scale, x_zp, x_range, out_scale, out_zp, qmin, qmax, post,
                     dequantize_out):
        """:meth:`linear` with a graph's edges folded in: ``x_range=(lo, hi)`` means ``x`` is
        float and is quantized first (``quantize_per_tensor(x, x_scale, x_zp, lo, hi)``, int8 when
        ``lo < 0``, else uint8); ``dequantize_out`` returns ``dequantize_per_tensor(y, out_scale,
        out_zp)`` (float32). Backends with a fused kernel override it; their results must equal
        this composition."""
        if x_range is not None:
            x = quantize_per_tensor(x, x_scale, x_zp, x_range[0], x_range[1], _qdtype(x_range[0]))
        y = self.linear(x, w, w_scale, bias, x_scale, x_zp, out_scale, out_zp, qmin, qmax, post)
        return dequantize_per_tensor(y, out_scale, out_zp) if dequantize_out else y

    def dynamic_linear(self, x, w, w_scale, bias, post):
        """float ``x`` -> quantized per call (uint8, its own min/max) -> int8 GEMM -> float."""
        xq, s, z = _dynamic_quantize(x)
        return self.linear(xq, w, w_scale, bias, s, z, 1.0, 0, 0, 255, post, out_float=True)


def dynamic_qparams(mn: float, mx: float) -> Tuple[float, int]:
    """uint8 ``(scale, zero_point)`` for values in ``[mn, mx]`` (widened to include 0), as
    dynamic int8 Linear chooses them per call (float64 math, round half to even)."""
    lo, hi = min(mn, 0.0), max(mx, 0.0)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"dynamic int8 linear: the input holds inf/nan (min {mn}, max {mx}); "
                         "it cannot be quantized")
    scale = max((hi - lo) / 255.0, 1e-8)
    return scale, int(min(max(round(-lo / scale), 0), 255))


def _dynamic_quantize(x: torch.Tensor):
    if x.numel() == 0:  # nothing to quantize (batch 0): any parameters do
        return x.to(torch.uint8), 1.0, 0
    mn, mx = torch.aminmax(x.detach())
    scale, zp = dynamic_qparams(float(mn), float(mx))
    return quantize_per_tensor(x, scale, zp, 0, 255, torch.uint8), scale, zp


# --- portable ------------------------------------------------------------------------------
def _int_matmul(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """``a @ b_t.T`` for int8 ``a`` (M, K) and ``b_t`` (N, K): exact int32."""
    # K == 1: torch._int_mm (CPU, 2.13) misreads the (1, N) view of an (N, 1) weight (both of its
    # strides are 1) and returns garbage; the float64 product is exact and cheap there.
    if hasattr(torch, "_int_mm") and a.device.type in ("cpu", "cuda") and a.shape[1] > 1:
        try:
            return torch._int_mm(a, b_t.t())
        except RuntimeError:
            pass
    return (a.to(torch.float64) @ b_t.t().to(torch.float64)).to(torch.int32)


_FLIP = torch.tensor(128, dtype=torch.uint8)


class _Site:
    """What one fused call needs besides its input, computed once per (weight, parameters):
    ``q = clamp(round(acc * mult + base [+ accum * amult]), lo, hi)`` with
    ``acc = int_mm(x - 128, W) + corr`` (the zero-point correction), all in float64 -- the
    reference's precision -- so the result is the reference's, barring float64 rounding ties."""

    __slots__ = ("mats", "corr", "mult", "base", "amult", "lo", "hi")

    def __init__(self, w, w_scale, bias, groups, x_dtype, x_zp, x_scale, out_scale, out_zp, qmin, qmax, post,
                 accum_scale, accum_zp, out_float):
        o = w.shape[0]
        self.mats = [w[g * o // groups:(g + 1) * o // groups].reshape(o // groups, -1).contiguous()
                     for g in range(groups)]
        rowsum = torch.cat([m.to(torch.int32).sum(1) for m in self.mats])
        shift = (128 if x_dtype is torch.uint8 else 0) - x_zp
        self.corr = (rowsum * shift).to(torch.int32) if shift else None
        self.amult = None
        self.mult, self.base, lo, hi = requant_terms(w_scale, bias, o, x_scale, out_scale, out_zp, qmin, qmax, post,
                                                     out_float)
        if out_float:
            self.lo = self.hi = None
            return
        if accum_scale is not None:
            inv = 1.0 / out_scale
            self.amult = torch.tensor(accum_scale * inv, dtype=torch.float64)
            self.base = self.base - accum_zp * (accum_scale * inv)
        self.lo = torch.tensor(lo, dtype=torch.float64)
        self.hi = torch.tensor(hi, dtype=torch.float64)


def requant_terms(w_scale: torch.Tensor, bias: Optional[torch.Tensor], out_channels: int, x_scale: float,
                  out_scale: float, out_zp: int, qmin: int, qmax: int, post: str, out_float: bool):
    """The float64 epilogue every exact backend applies to the int32 accumulator ``acc``
    (already corrected for the input zero point): ``y = base + acc * mult`` (per output channel),
    then, for a quantized output, round half to even and clamp to ``[lo, hi]`` (ReLU folded into
    ``lo``); for a float output, ReLU if ``post == "relu"``. Returns ``(mult, base, lo, hi)``
    (``lo``/``hi`` None for a float output)."""
    s = w_scale.to(torch.float64) * x_scale
    b = bias.detach().to(torch.float64) if bias is not None else torch.zeros(out_channels, dtype=torch.float64)
    if out_float:
        return s, b, None, None
    inv = 1.0 / out_scale  # the reference quantizes with x * (1 / scale)
    return s * inv, b * inv + out_zp, float(max(qmin, out_zp) if post == "relu" else qmin), float(qmax)


class PortableBackend(Int8Backend):
    """Integer GEMM (``torch._int_mm``) + one float64 requantization; no oneDNN, no quantized
    dtypes. Exact against the float64 reference (see :func:`~symtrace.passes.quant.to_reference`)."""

    name = "portable"

    @staticmethod
    def _site(w, w_scale, bias, groups, x, x_zp, x_scale, out_scale, out_zp, qmin, qmax, post, accum_scale,
              accum_zp, out_float) -> _Site:
        key = ("site", groups, x.dtype, x_zp, x_scale, out_scale, out_zp, qmin, qmax, post, accum_scale, accum_zp,
               out_float, id(w_scale), w_scale._version, id(bias), -1 if bias is None else bias._version)
        return weight_cached(w, key, lambda: _Site(w, w_scale, bias, groups, x.dtype, x_zp, x_scale, out_scale, out_zp,
                                             qmin, qmax, post, accum_scale, accum_zp, out_float))

    @staticmethod
    def _shift(x: torch.Tensor) -> torch.Tensor:
        """uint8 ``q`` -> int8 ``q - 128`` (a bit flip); int8 passes through."""
        if x.dtype is torch.uint8:
            return torch.bitwise_xor(x, _FLIP).view(torch.int8)
        return x

    @staticmethod
    def _finish(site: _Site, acc: torch.Tensor, accum: Optional[torch.Tensor], post: str, qmin: int,
                out_float: bool) -> torch.Tensor:
        if site.corr is not None:
            acc = acc.add_(site.corr)
        # multiply, then add, as two rounded float64 steps: torch.addcmul may fuse them (FMA) in
        # some lanes and not others, and the C backend must be able to give the same bits
        y = acc.to(torch.float64).mul_(site.mult).add_(site.base)
        if accum is not None:
            y.add_(accum.to(torch.float64).mul_(site.amult))
        if out_float:
            return (y.relu_() if post == "relu" else y).to(torch.float32)
        return y.round_().clamp_(site.lo, site.hi).to(_qdtype(qmin))

    def conv2d(self, x, w, w_scale, bias, stride, padding, dilation, groups, x_scale, x_zp, out_scale, out_zp,
               qmin, qmax, post, accum=None, accum_scale=1.0, accum_zp=0, accum_inplace=False):
        n, c, h, wd = x.shape
        o, _, kh, kw = w.shape
        sh, sw = stride
        ph, pw = padding
        dh, dw = dilation
        site = self._site(w, w_scale, bias, groups, x, x_zp, x_scale, out_scale, out_zp, qmin, qmax, post,
                          accum_scale if accum is not None else None, accum_zp, False)
        x8 = self._shift(x).permute(0, 2, 3, 1)  # N, H, W, C (a view; contiguous for channels_last)
        pad_value = (x_zp - 128) if x.dtype is torch.uint8 else x_zp
        if ph or pw:
            x8 = F.pad(x8, (0, 0, pw, pw, ph, ph), value=pad_value)
        eh, ew = dh * (kh - 1) + 1, dw * (kw - 1) + 1
        if kh == kw == 1 and sh == sw == 1:
            patches = x8
        else:
            patches = x8.unfold(1, eh, sh).unfold(2, ew, sw)  # N, Ho, Wo, C, eh, ew
            if dh > 1 or dw > 1:
                patches = patches[..., ::dh, ::dw]
        ho, wo = patches.shape[1], patches.shape[2]
        m = n * ho * wo
        cg = c // groups
        outs = []
        for g, wmat in enumerate(site.mats):
            pg = patches[:, :, :, g * cg:(g + 1) * cg] if groups > 1 else patches
            outs.append(_int_matmul(pg.reshape(m, -1), wmat))
        acc = outs[0] if len(outs) == 1 else torch.cat(outs, 1)  # (M, O) int32
        acc_in = accum.permute(0, 2, 3, 1).reshape(m, o) if accum is not None else None
        q = self._finish(site, acc, acc_in, post, qmin, False)
        return q.view(n, ho, wo, o).permute(0, 3, 1, 2)  # NCHW, channels_last memory

    def dynamic_linear(self, x, w, w_scale, bias, post):
        xq, xs, xz = _dynamic_quantize(x)
        lead = x.shape[:-1]

        def make():
            rowsum = w.to(torch.int32).sum(1)
            b = bias.detach().to(torch.float64) if bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
            return w.contiguous(), rowsum, w_scale.to(torch.float64), b
        wmat, rowsum, ws, b = weight_cached(w, ("dynamic", id(w_scale), id(bias)), make)
        acc = _int_matmul(self._shift(xq).reshape(-1, x.shape[-1]), wmat)
        if xz != 128:
            acc = acc.add_(rowsum * (128 - xz))
        y = acc.to(torch.float64).mul_(ws * xs).add_(b)  # two rounded steps (see _finish)
        return (y.relu_() if post == "relu" else y).to(torch.float32).reshape(*lead, w.shape[0])

    def linear(self, x, w, w_scale, bias, x_scale, x_zp, out_scale, out_zp, qmin, qmax, post, out_float=False):
        lead = x.shape[:-1]
        site = self._site(w, w_scale, bias, 1, x, x_zp, x_scale, out_scale, out_zp, qmin, qmax, post, None, 0,
                          out_float)
        acc = _int_matmul(self._shift(x).reshape(-1, x.shape[-1]), site.mats[0])
        return self._finish(site, acc, None, post, qmin, out_float).reshape(*lead, w.shape[0])


# --- oneDNN --------------------------------------------------------------------------------
def _onednn_ops_present() -> bool:
    ops = getattr(torch.ops, "onednn", None)
    try:
        return (ops is not None and hasattr(ops, "qconv2d_pointwise") and hasattr(ops, "qconv_prepack")
                and hasattr(ops, "qlinear_pointwise") and hasattr(ops, "qlinear_prepack")
                and torch.backends.mkldnn.is_available())
    except (AttributeError, RuntimeError):
        return False


def _qconv_unary():
    """``onednn.qconv_pointwise`` (newer builds, any rank) or ``qconv2d_pointwise`` (same
    arguments, 2-D only)."""
    ops = torch.ops.onednn
    return ops.qconv_pointwise if hasattr(ops, "qconv_pointwise") else ops.qconv2d_pointwise


def _onednn_operands(x, w, w_scale, bias) -> bool:
    """Whether the oneDNN ops may read these operands: CPU tensors, one weight scale per output
    channel, a dense float32 bias of that length. oneDNN trusts the sizes and dtypes it is given
    (a short scale or a float16 bias would be read past its end), so anything else -- a damaged
    or hostile saved graph, say -- goes to the portable backend, whose torch ops check them."""
    o = w.shape[0]
    return (x.device.type == "cpu" and w.device.type == "cpu" and isinstance(w_scale, torch.Tensor)
            and w_scale.device.type == "cpu" and w_scale.numel() == o
            and (bias is None or (isinstance(bias, torch.Tensor) and bias.device.type == "cpu"
                                  and bias.dtype is torch.float32 and bias.dim() == 1 and bias.numel() == o
                                  and bias.is_contiguous())))


def _pair_of(v, least: int) -> bool:
    return isinstance(v, (tuple, list)) and len(v) == 2 and all(type(i) is int and i >= least for i in v)


def _conv_params_ok(x, w, stride, padding, dilation, groups) -> bool:
    """Convolution parameters oneDNN accepts without crashing (it divides by the stride)."""
    return (_pair_of(stride, 1) and _pair_of(padding, 0) and _pair_of(dilation, 1) and type(groups) is int
            and groups >= 1 and w.shape[0] % groups == 0 and x.shape[1] == w.shape[1] * groups)


class OneDNNBackend(Int8Backend):
    """torch's oneDNN int8 ops (x86 CPUs; AMX/VNNI when present)."""

    name = "onednn"

    def __init__(self):
        self._ok: Optional[bool] = None
        self.invert_scale = False  # older builds took 1/output_scale

    def available(self) -> bool:
        if self._ok is None:
            self._ok = _onednn_ops_present() and _selftest(self)
        return self._ok

    def _out_scale(self, s: float) -> float:
        return 1.0 / s if self.invert_scale else s

    def conv2d(self, x, w, w_scale, bias, stride, padding, dilation, groups, x_scale, x_zp, out_scale, out_zp,
               qmin, qmax, post, accum=None, accum_scale=1.0, accum_zp=0, accum_inplace=False):
        if x.dtype is not torch.uint8 or w.dtype is not torch.int8 or qmin < 0 or x.dim() != 4 or w.dim() != 4 \
                or not _onednn_operands(x, w, w_scale, bias) or (accum is not None and accum.dtype is not torch.uint8) \
                or not _conv_params_ok(x, w, stride, padding, dilation, groups):
            return _PORTABLE.conv2d(x, w, w_scale, bias, stride, padding, dilation, groups, x_scale, x_zp,
                                    out_scale, out_zp, qmin, qmax, post, accum, accum_scale, accum_zp)
        if not (x.is_contiguous(memory_format=torch.channels_last) or x.is_contiguous()):
            x = x.contiguous(memory_format=torch.channels_last)
        shape = tuple(x.shape)  # packing for the input shape lets oneDNN pick its best kernel

        def make():
            ws = w_scale.to(torch.float32).contiguous()
            packed = torch.ops.onednn.qconv_prepack(w.contiguous(), ws, float(x_scale), int(x_zp), list(stride), list(padding),
                                                    list(dilation), groups, list(shape))
            return packed, ws, torch.zeros(w.shape[0], dtype=torch.int32)
        packed, ws, wz = weight_cached(w, ("conv", shape, tuple(stride), tuple(padding), tuple(dilation), groups,
                                     x_scale, x_zp, id(w_scale), w_scale._version), make)
        osc = self._out_scale(out_scale)
        if accum is None:
            y = _qconv_unary()(
                x, x_scale, x_zp, packed, ws, wz, bias, stride, padding, dilation, groups, osc, out_zp, None,
                post, [None] if post == "relu" else [], "" if post == "relu" else None)
        else:
            if not (accum_inplace and accum.is_contiguous(memory_format=torch.channels_last)):
                accum = accum.clone(memory_format=torch.channels_last)  # the op writes its result into it
            y = torch.ops.onednn.qconv2d_pointwise.binary(
                x, x_scale, x_zp, packed, ws, wz, accum, bias, stride, padding, dilation, groups, osc, out_zp,
                None, accum_scale, accum_zp, "sum", 1.0, post, [], "")
        if qmin != 0 or qmax != 255:
            y = y.clamp_(qmin, qmax)
        return y

    def linear(self, x, w, w_scale, bias, x_scale, x_zp, out_scale, out_zp, qmin, qmax, post, out_float=False):
        if x.dtype is not torch.uint8 or w.dtype is not torch.int8 or qmin < 0 or w.dim() != 2 or x.dim() < 1 \
                or x.shape[-1] != w.shape[1] or not _onednn_operands(x, w, w_scale, bias):
            return _PORTABLE.linear(x, w, w_scale, bias, x_scale, x_zp, out_scale, out_zp, qmin, qmax, post, out_float)
        x = x.contiguous()
        shape = tuple(x.shape)

        def make():
            return (torch.ops.onednn.qlinear_prepack(w.contiguous(), list(shape)), w_scale.to(torch.float32).contiguous(),
                    torch.zeros(w.shape[0], dtype=torch.int32))
        packed, ws, wz = weight_cached(w, ("linear", shape, id(w_scale), w_scale._version), make)
        if out_float:
            return torch.ops.onednn.qlinear_pointwise(x, x_scale, x_zp, packed, ws, wz, bias, 1.0, 0, torch.float32,
                                                      post, [], "")
        y = torch.ops.onednn.qlinear_pointwise(x, x_scale, x_zp, packed, ws, wz, bias, self._out_scale(out_scale),
                                               out_zp, None, post, [], "")
        if qmin != 0 or qmax != 255:
            y = y.clamp_(qmin, qmax)
        return y


_PORTABLE = PortableBackend()
_ONEDNN = OneDNNBackend()


def _selftest(b: OneDNNBackend) -> bool:
    """Run one small conv (with a residual) and linear through oneDNN and compare with the
    portable backend; also detects builds that take the inverse output scale."""
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, (1, 4, 5, 5), generator=g, dtype=torch.int64).to(torch.uint8)
        w = torch.randint(-127, 128, (6, 4, 3, 3), generator=g, dtype=torch.int64).to(torch.int8)
        ws = torch.rand(6, generator=g) * 0.01 + 0.001
        bias = torch.randn(6, generator=g)
        acc = torch.randint(0, 256, (1, 6, 5, 5), generator=g, dtype=torch.int64).to(torch.uint8)
        args = ((1, 1), (1, 1), (1, 1), 1, 0.05, 120, 0.4, 100, 0, 255)
        want = _PORTABLE.conv2d(x, w, ws, bias, *args, "relu", acc, 0.3, 110)
        want_plain = _PORTABLE.conv2d(x, w, ws, bias, *args, "none")
        xl = torch.randint(0, 256, (3, 16), generator=g, dtype=torch.int64).to(torch.uint8)
        wl = torch.randint(-127, 128, (5, 16), generator=g, dtype=torch.int64).to(torch.int8)
        wls = torch.rand(5, generator=g) * 0.01 + 0.001
        want_l = _PORTABLE.linear(xl, wl, wls, None, 0.05, 120, 0.1, 128, 0, 255, "none")
        for invert in (False, True):
            b.invert_scale = invert
            got = b.conv2d(x, w, ws, bias, *args, "relu", acc.clone(), 0.3, 110)
            got_plain = b.conv2d(x, w, ws, bias, *args, "none")
            got_l = b.linear(xl, wl, wls, None, 0.05, 120, 0.1, 128, 0, 255, "none")
            if all((p.to(torch.int32) - q.to(torch.int32)).abs().max().item() <= 1
                   for p, q in ((got, want), (got_plain, want_plain), (got_l, want_l))):
                _CACHE.clear()
                return True
        _CACHE.clear()
        return False
    except Exception:  # an op that exists but fails on this build: not usable
        _CACHE.clear()
        return False


# --- graph-facing functions ----------------------------------------------------------------
def int8_conv2d(x, w, w_scale, bias, *, stride, padding, dilation, groups, x_scale, x_zp, out_scale, out_zp,
                qmin=0, qmax=255, post="none", accum=None, accum_scale=1.0, accum_zp=0, accum_inplace=False,
                backend="portable"):
    """Fused int8 conv2d (+ residual ``accum``) (+ ReLU) with quantized output."""
    return get_backend(backend).conv2d(x, w, w_scale, bias, stride, padding, dilation, groups, x_scale, x_zp,
                                     out_scale, out_zp, qmin, qmax, post, accum, accum_scale, accum_zp,
                                     accum_inplace)


def int8_linear(x, w, w_scale, bias, *, x_scale, x_zp, out_scale, out_zp, qmin=0, qmax=255, post="none",
                backend="portable", x_range=None, dequantize_out=False):
    """Fused int8 linear (+ ReLU) with quantized output. ``x_range=(qmin, qmax)``: ``x`` is
    float, quantized with ``x_scale``/``x_zp`` to that range first; ``dequantize_out``: the
    result is dequantized to float32 (see :meth:`Int8Backend.linear_edges`)."""
    if x_range is None and not dequantize_out:
        return get_backend(backend).linear(x, w, w_scale, bias, x_scale, x_zp, out_scale, out_zp, qmin, qmax, post)
    return get_backend(backend).linear_edges(x, w, w_scale, bias, x_scale, x_zp, x_range, out_scale, out_zp, qmin,
                                              qmax, post, dequantize_out)


def int8_dynamic_linear(x, w, w_scale, bias, *, post="none", backend="portable"):
    """float in, float out: activations quantized per call, int8 weights."""
    return get_backend(backend).dynamic_linear(x, w, w_scale, bias, post)


def int8_add(a, a_scale, a_zp, b, b_scale, b_zp, *, out_scale, out_zp, qmin, qmax, dtype, relu=False):
    """``a + b`` (+ ReLU) of two quantized tensors, requantized (float math, as the reference)."""
    y = dequantize_per_tensor(a, a_scale, a_zp, torch.float64) + dequantize_per_tensor(b, b_scale, b_zp, torch.float64)
    if relu:
        y = torch.relu(y)
    return quantize_per_tensor(y, out_scale, out_zp, qmin, qmax, dtype)


def int8_cat(tensors: Sequence[torch.Tensor], params: Sequence[Tuple[float, int]], dim: int = 0, *,
             out_scale, out_zp, qmin, qmax, dtype):
    """``torch.cat`` of quantized tensors; inputs with other parameters are requantized first."""
    parts = [t if (s == out_scale and z == out_zp) else
             quantize_per_tensor(dequantize_per_tensor(t, s, z, torch.float64), out_scale, out_zp, qmin, qmax, dtype)
             for t, (s, z) in zip(tensors, params)]
    return torch.cat(parts, dim)


def int8_avg_pool2d(x, scale, zero_point, kernel_size, stride=None, padding=0, ceil_mode=False,
                    count_include_pad=True, divisor_override=None, *, qmin, qmax):
    """Average pooling of a quantized tensor, same parameters in and out. Computed exactly as
    the reference does (dequantize, pool in float64, quantize): averages of integers hit
    rounding ties often, and only identical arithmetic breaks them identically."""
    y = F.avg_pool2d(dequantize_per_tensor(x, scale, zero_point, torch.float64), kernel_size, stride, padding,
                     ceil_mode, count_include_pad, divisor_override)
    return quantize_per_tensor(y, scale, zero_point, qmin, qmax, x.dtype)


def int8_adaptive_avg_pool2d(x, scale, zero_point, output_size, *, qmin, qmax):
    """Adaptive average pooling of a quantized tensor (see :func:`int8_avg_pool2d`)."""
    y = F.adaptive_avg_pool2d(dequantize_per_tensor(x, scale, zero_point, torch.float64), output_size)
    return quantize_per_tensor(y, scale, zero_point, qmin, qmax, x.dtype)


def _pair(v) -> Tuple[int, int]:
    if isinstance(v, (tuple, list)):
        return (int(v[0]), int(v[1])) if len(v) == 2 else (int(v[0]), int(v[0]))
    return int(v), int(v)


def int8_max_pool2d(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    """Max pooling of an integer tensor (parameters unchanged). Channels-last inputs are pooled
    as NHWC windows (torch's own uint8 channels-last max-pool rejects all but tiny inputs)."""
    if return_indices:
        raise ValueError("int8_max_pool2d does not return indices")
    if x.dim() != 4 or not x.is_contiguous(memory_format=torch.channels_last) or x.is_contiguous() or ceil_mode:
        return F.max_pool2d(x.contiguous(), kernel_size, stride, padding, dilation, ceil_mode)
    kh, kw = _pair(kernel_size)
    sh, sw = _pair(stride if stride not in (None, (), []) else kernel_size)
    ph, pw = _pair(padding)
    dh, dw = _pair(dilation)
    t = x.permute(0, 2, 3, 1)  # N, H, W, C (contiguous)
    if ph or pw:
        lowest = torch.iinfo(x.dtype).min
        t = F.pad(t, (0, 0, pw, pw, ph, ph), value=lowest)
    hp, wp = t.shape[1], t.shape[2]
    ho = (hp - dh * (kh - 1) - 1) // sh + 1
    wo = (wp - dw * (kw - 1) - 1) // sw + 1
    out = None
    for i in range(kh):  # elementwise max over the window offsets: strided slices, no unfold
        for j in range(kw):
            r0, c0 = i * dh, j * dw
            sl = t[:, r0:r0 + sh * (ho - 1) + 1:sh, c0:c0 + sw * (wo - 1) + 1:sw]
            out = sl.clone() if out is None else torch.maximum(out, sl, out=out)
    return out.permute(0, 3, 1, 2)


def int8_relu(x, zero_point):
    """ReLU of a quantized tensor: ``max(q, zero_point)`` (real 0 is the zero point)."""
    return torch.clamp_min(x, zero_point) if zero_point > 0 or x.dtype is torch.int8 else x


def int8_lut(x, table):
    """An elementwise function of a quantized tensor by table lookup (``table[q - qmin]``)."""
    idx = x.to(torch.int64)
    if x.dtype is torch.int8:
        idx = idx + 128
    return table[idx]
