"""What an int8 backend is: the interface the quantization passes call (by name, through
:mod:`.registry`), and the per-call quantization of dynamic Linear that every backend shares.

The backends themselves are kernel code in :mod:`symtrace.lower` (``int8_portable``,
``int8_onednn``, ``int8_cpu``); the passes only name them.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch

from .qparams import dequantize_per_tensor, quantize_per_tensor
from .woq import woq_reference

__all__ = ["Int8Backend", "dynamic_qparams"]


def _qdtype(qmin: int) -> torch.dtype:
    return torch.int8 if qmin < 0 else torch.uint8


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

    def woq_linear(self, x, qweight, scale, zero, bias, bits, group_size, in_features, activations="float"):
        """Weight-only quantized Linear: float ``x``, int8/int4 weight (layout:
        :mod:`~symtrace.passes.quant.woq`), float result. This default is the definition,
        :func:`~symtrace.passes.quant.woq.woq_reference` (``x`` rounded per block when
        ``activations="int8"``, dequantize, then ``F.linear``); backends with kernels override
        it and must agree with it to float rounding."""
        return woq_reference(x, qweight, scale, zero, bias, bits, group_size, in_features, activations)

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
