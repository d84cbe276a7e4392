"""The ``"portable"`` int8 backend: integer GEMM (``torch._int_mm``, an exact float64 product
where that op is missing) with im2col for convolutions, then one float64 requantization (scale,
bias, residual, ReLU, round). Works on any torch >= 2.11 build and is the exact reference the
other backends are checked against. :func:`requant_terms` is the epilogue they all share.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..passes.quant.backend import Int8Backend, _dynamic_quantize, _qdtype
from .int8_cache import tensor_version, weight_cached

__all__ = ["PortableBackend", "requant_terms", "BACKEND"]


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
               out_float, id(w_scale), tensor_version(w_scale), id(bias), -1 if bias is None else tensor_version(bias))
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


BACKEND = PortableBackend()  # the registry's "portable" (symtrace.passes.quant.registry.BUILTIN_BACKENDS)
