"""Quantization parameters and the quantize/dequantize primitives, on plain integer tensors.

A quantized tensor here is an ordinary ``torch.uint8`` or ``torch.int8`` tensor plus explicit
parameters (:class:`QParams`): ``real = (q - zero_point) * scale``. No quantized dtypes
(``torch.quint8``/``qint8``, deprecated upstream) are used.

The functions below are the ``call_function`` targets of reference graphs
(:func:`~symtrace.passes.quant.to_reference`); they are module-level so graphs that use them
pickle by reference.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Optional, Tuple

import torch

__all__ = ["QParams", "qrange", "choose_qparams", "quantize_per_tensor", "dequantize_per_tensor",
           "quantize_per_channel", "dequantize_per_channel", "requantize_per_tensor", "reference_conv2d",
           "reference_linear", "sqnr"]

_DTYPES = {torch.uint8: (0, 255), torch.int8: (-128, 127)}


def qrange(dtype: torch.dtype, reduce_range: bool = False, narrow: bool = False, bits: int = 8) -> Tuple[int, int]:
    """``(qmin, qmax)`` of an integer dtype; ``reduce_range`` drops one bit (7-bit values, for
    kernels whose int16 intermediates would saturate), ``narrow`` excludes the most negative
    level for int8 (-128, or -8 at 4 bits). ``bits`` (2..8): use only that many bits of the
    8-bit dtype (4-bit weights are int8 values in -8..7; the int8 kernels run them as they are)."""
    try:
        lo, hi = _DTYPES[dtype]
    except KeyError:
        raise TypeError(f"quantized values must be torch.uint8 or torch.int8, not {dtype}") from None
    if type(bits) is not int or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an int from 2 to 8, got {bits!r}")
    n = bits - 1 if reduce_range else bits
    if n != 8:
        lo, hi = (0, (1 << n) - 1) if dtype is torch.uint8 else (-(1 << (n - 1)), (1 << (n - 1)) - 1)
    if narrow and dtype is torch.int8:
        lo = -hi
    return lo, hi


@dataclasses.dataclass(frozen=True)
class QParams:
    """How a real tensor maps to integers: ``q = clamp(round(x / scale) + zero_point, qmin, qmax)``.

    Per-tensor when ``axis`` is None (``scale`` a float, ``zero_point`` an int); per-channel
    along ``axis`` otherwise (``scale``/``zero_point`` 1-D tensors).
    """

    scale: Any
    zero_point: Any
    dtype: torch.dtype
    qmin: int
    qmax: int
    axis: Optional[int] = None

    @property
    def per_channel(self) -> bool:
        return self.axis is not None

    def as_dict(self) -> Dict[str, Any]:
        """The form stored in ``TensorMeta.qparams`` (plain Python values, tensors for per-channel)."""
        d = {"scale": self.scale, "zero_point": self.zero_point, "dtype": self.dtype,
             "qmin": self.qmin, "qmax": self.qmax}
        if self.axis is not None:
            d["axis"] = self.axis
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "QParams":
        return cls(d["scale"], d["zero_point"], d["dtype"], d["qmin"], d["qmax"], d.get("axis"))

    def same_as(self, other: "QParams") -> bool:
        """Equal per-tensor parameters (per-channel ones compare by value)."""
        if self.per_channel or other.per_channel:
            return (self.axis == other.axis and self.dtype == other.dtype
                    and torch.equal(torch.as_tensor(self.scale), torch.as_tensor(other.scale))
                    and torch.equal(torch.as_tensor(self.zero_point), torch.as_tensor(other.zero_point)))
        return (self.scale == other.scale and self.zero_point == other.zero_point
                and self.dtype == other.dtype and self.qmin == other.qmin and self.qmax == other.qmax)

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        if self.per_channel:
            s = torch.as_tensor(self.scale)
            return f"{dt} per-channel(axis={self.axis}) scale {s.min().item():.3g}..{s.max().item():.3g}"
        return f"{dt} scale={self.scale:.4g} zp={self.zero_point}"


def choose_qparams(min_val: Any, max_val: Any, dtype: torch.dtype = torch.uint8, symmetric: bool = False,
                   reduce_range: bool = False, narrow: bool = False, axis: Optional[int] = None,
                   eps: float = 1e-8, bits: int = 8) -> QParams:
    """Parameters covering ``[min_val, max_val]`` (the range is widened to include 0, so that
    zero -- padding, ReLU -- is exact). Symmetric: zero point 0 for int8 (128 for uint8) and
    ``scale = max|x| / (qmax - qmin) * 2``; affine: the range spread over all levels.
    Tensors of minima/maxima give per-channel parameters along ``axis``; ``bits`` narrows the
    integer range (see :func:`qrange`)."""
    qmin, qmax = qrange(dtype, reduce_range, narrow, bits)
    mn = torch.as_tensor(min_val, dtype=torch.float64).clamp(max=0.0)
    mx = torch.as_tensor(max_val, dtype=torch.float64).clamp(min=0.0)
    if not (torch.isfinite(mn).all() and torch.isfinite(mx).all()):
        raise ValueError(f"cannot choose quantization parameters for a range with inf/nan "
                         f"(min {min_val}, max {max_val}): the observed values were not finite")
    if symmetric:
        amax = torch.maximum(-mn, mx)
        scale = (amax / ((qmax - qmin) / 2.0)).clamp(min=eps)
        zp = torch.zeros_like(scale) if dtype is torch.int8 else torch.full_like(scale, (qmin + qmax + 1) // 2)
    else:
        scale = ((mx - mn) / float(qmax - qmin)).clamp(min=eps)
        zp = (qmin - torch.round(mn / scale)).clamp(qmin, qmax)
    scale = scale.to(torch.float32)
    if mn.dim() == 0 and axis is None:
        return QParams(float(scale), int(zp), dtype, qmin, qmax)
    return QParams(scale.reshape(-1), zp.to(torch.int64).reshape(-1), dtype, qmin, qmax,
                   0 if axis is None else axis)


def quantize_per_tensor(x: torch.Tensor, scale: float, zero_point: int, qmin: int, qmax: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """``clamp(round(x / scale) + zero_point, qmin, qmax)`` as ``dtype`` (round half to even;
    computed as ``x * (1 / scale)``, as PT2E's decomposed quantize does)."""
    return (x * (1.0 / scale)).round_().add_(zero_point).clamp_(qmin, qmax).to(dtype)


def dequantize_per_tensor(q: torch.Tensor, scale: float, zero_point: int,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(q - zero_point) * scale`` as ``dtype`` (float32 unless asked otherwise)."""
    t = q.to(dtype)
    t = t - zero_point if t is q else t.sub_(zero_point)  # never write the caller's tensor
    return t.mul_(scale)


def _shape_for(t: torch.Tensor, x: torch.Tensor, axis: int) -> torch.Tensor:
    shape = [1] * x.dim()
    shape[axis] = -1
    return t.reshape(shape)


def quantize_per_channel(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int,
                         qmin: int, qmax: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-channel :func:`quantize_per_tensor`: one scale/zero point per index along ``axis``."""
    s = _shape_for(scale.to(torch.float32), x, axis)
    z = _shape_for(zero_point, x, axis)
    return (x * (1.0 / s)).round_().add_(z).clamp_(qmin, qmax).to(dtype)


def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                           axis: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-channel :func:`dequantize_per_tensor`."""
    s = _shape_for(scale.to(dtype), q, axis)
    z = _shape_for(zero_point, q, axis)
    return (q.to(dtype) - z) * s


def reference_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], stride, padding,
                     dilation, groups: int) -> torch.Tensor:
    """``F.conv2d`` at the precision of ``x`` (the bias, a float32 buffer, is cast to it)."""
    return torch.nn.functional.conv2d(x, weight, None if bias is None else bias.to(x.dtype), stride, padding,
                                      dilation, groups)


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear`` at the precision of ``x``."""
    return torch.nn.functional.linear(x, weight, None if bias is None else bias.to(x.dtype))


def requantize_per_tensor(q: torch.Tensor, scale: float, zero_point: int, out_scale: float,
                          out_zero_point: int, qmin: int, qmax: int, dtype: torch.dtype) -> torch.Tensor:
    """Re-express ``q`` (``scale``/``zero_point``) with other parameters (float64 math, as the
    reference computes ``q(dq(x))``)."""
    return quantize_per_tensor(dequantize_per_tensor(q, scale, zero_point, torch.float64), out_scale,
                               out_zero_point, qmin, qmax, dtype)


def sqnr(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``10 log10(|ref|^2 / |ref - test|^2)``
    (``inf`` when they are equal)."""
    r = reference.detach().to(torch.float64)
    e = (r - test.detach().to(torch.float64)).pow(2).sum().item()
    s = r.pow(2).sum().item()
    if e == 0.0:
        return math.inf
    if s == 0.0:
        return -math.inf
    return 10.0 * math.log10(s / e)
