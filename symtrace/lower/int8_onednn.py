"""The ``"onednn"`` int8 backend: torch's oneDNN int8 ops (``torch.ops.onednn.qconv_pointwise``,
``qconv2d_pointwise.binary``, ``qlinear_pointwise``, with ``qconv_prepack``/``qlinear_prepack``),
which use VNNI/AMX where the CPU has them, on plain ``uint8``/``int8`` tensors. They are internal
ops without a compatibility promise, so the backend checks itself against the portable one once
(:meth:`OneDNNBackend.available`) and is skipped when absent or wrong; operands it cannot read
safely go to the portable backend.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..passes.quant.backend import Int8Backend
from .int8_cache import forget_weights, tensor_version, weight_cached
from .int8_portable import BACKEND as PORTABLE

__all__ = ["OneDNNBackend", "BACKEND"]


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
            return PORTABLE.conv2d(x, w, w_scale, bias, stride, padding, dilation, groups, x_scale, x_zp,
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
                                     x_scale, x_zp, id(w_scale), tensor_version(w_scale)), make)
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
            return PORTABLE.linear(x, w, w_scale, bias, x_scale, x_zp, out_scale, out_zp, qmin, qmax, post, out_float)
        x = x.contiguous()
        shape = tuple(x.shape)

        def make():
            return (torch.ops.onednn.qlinear_prepack(w.contiguous(), list(shape)), w_scale.to(torch.float32).contiguous(),
                    torch.zeros(w.shape[0], dtype=torch.int32))
        packed, ws, wz = weight_cached(w, ("linear", shape, id(w_scale), tensor_version(w_scale)), make)
        if out_float:
            return torch.ops.onednn.qlinear_pointwise(x, x_scale, x_zp, packed, ws, wz, bias, 1.0, 0, torch.float32,
                                                      post, [], "")
        y = torch.ops.onednn.qlinear_pointwise(x, x_scale, x_zp, packed, ws, wz, bias, self._out_scale(out_scale),
                                               out_zp, None, post, [], "")
        if qmin != 0 or qmax != 255:
            y = y.clamp_(qmin, qmax)
        return y


BACKEND = OneDNNBackend()  # the registry's "onednn" (symtrace.passes.quant.registry.BUILTIN_BACKENDS)


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
        want = PORTABLE.conv2d(x, w, ws, bias, *args, "relu", acc, 0.3, 110)
        want_plain = PORTABLE.conv2d(x, w, ws, bias, *args, "none")
        xl = torch.randint(0, 256, (3, 16), generator=g, dtype=torch.int64).to(torch.uint8)
        wl = torch.randint(-127, 128, (5, 16), generator=g, dtype=torch.int64).to(torch.int8)
        wls = torch.rand(5, generator=g) * 0.01 + 0.001
        want_l = PORTABLE.linear(xl, wl, wls, None, 0.05, 120, 0.1, 128, 0, 255, "none")
        for invert in (False, True):
            b.invert_scale = invert
            got = b.conv2d(x, w, ws, bias, *args, "relu", acc.clone(), 0.3, 110)
            got_plain = b.conv2d(x, w, ws, bias, *args, "none")
            got_l = b.linear(xl, wl, wls, None, 0.05, 120, 0.1, 128, 0, 255, "none")
            if all((p.to(torch.int32) - q.to(torch.int32)).abs().max().item() <= 1
                   for p, q in ((got, want), (got_plain, want_plain), (got_l, want_l))):
                forget_weights()
                return True
        forget_weights()
        return False
    except Exception:  # an op that exists but fails on this build: not usable
        forget_weights()
        return False
