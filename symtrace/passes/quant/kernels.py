"""The int8 functions quantized graphs call (:func:`~symtrace.passes.quant.lower` puts them in;
``symtrace.save`` stores them by these names).

The fused conv/linear ones (``int8_conv2d``, ``int8_linear``, ``int8_dynamic_linear``) dispatch
to the :class:`~.backend.Int8Backend` their ``backend`` argument names, found through
:mod:`.registry` (a fixed table of module paths, resolved on first use; nothing registers itself
at import): ``"portable"``, ``"onednn"`` and ``"c"`` are kernel code in :mod:`symtrace.lower`
(``int8_portable``, ``int8_onednn``, ``int8_cpu``). The others (``int8_add``, ``int8_cat``,
pooling, ``int8_relu``, ``int8_lut``) compute as the reference does, in torch.

:meth:`Int8Backend.linear_edges` is Linear with a graph's edges folded in (a float input
quantized first, the result dequantized): :func:`~symtrace.passes.quant.lower` emits it for
the first/last Linear of a graph, so an MLP is one call per layer.

Weights are plain int8 tensors (buffers of the graph module); backends cache packed forms per
weight tensor and never save them.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch
import torch.nn.functional as F

from .backend import Int8Backend, dynamic_qparams
from .qparams import dequantize_per_tensor, quantize_per_tensor
from .woq import check_activations
from ...graph.op_schema import OpSchemaInfo, register_schema
from .registry import available_backends, backend_available, default_backend, get_backend, register_backend

__all__ = ["Int8Backend", "register_backend", "get_backend", "backend_available", "default_backend",
           "available_backends", "dynamic_qparams", "int8_conv2d", "int8_linear", "int8_dynamic_linear", "int8_add",
           "int8_cat", "int8_avg_pool2d", "int8_adaptive_avg_pool2d", "int8_relu", "int8_lut", "int8_max_pool2d",
           "woq_linear"]


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


def woq_linear(x, qweight, scale, zero, bias, *, bits, group_size, in_features, backend="portable",
               activations="float"):
    """Weight-only quantized Linear (:func:`~symtrace.passes.quant.weight_only` puts it in):
    float ``x`` (..., in_features), an int8 (``bits=8``) or packed int4 (``bits=4``) weight with
    float32 ``scale`` (N, G) and ``zero`` points (N, G) or None, per ``group_size`` inputs (None:
    per output channel) -- layout and meaning in :mod:`~symtrace.passes.quant.woq` -- and a float
    ``bias``; returns ``x @ dequantized_weight.T + bias``. ``backend`` names who computes it:
    ``"c"`` has AVX2/AVX-512 kernels for float32 CPU inputs, the others compute the reference.
    ``activations="int8"``: ``x`` is first rounded to int8 per block of 32 inputs
    (:func:`~symtrace.passes.quant.woq.round_activations`), which lets the ``"c"`` backend's
    AVX512-VNNI or AVX2 kernels sum in integers."""
    if x.shape[-1:] != (in_features,):
        raise ValueError(f"woq_linear: the input has shape {tuple(x.shape)}, but the layer takes {in_features} "
                         f"input features")
    check_activations(activations)
    return get_backend(backend).woq_linear(x, qweight, scale, zero, bias, bits, group_size, in_features, activations)


def _woq_linear_fake(x, qweight, scale, zero, bias, *, bits, group_size, in_features, backend="portable",
                     activations="float"):
    """:func:`woq_linear`'s result on fake tensors (symbolic sizes): ``(..., out_features)`` in
    ``x``'s dtype (see ``fake_call`` in :mod:`symtrace.graph.symbolic_shapes`)."""
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


woq_linear.fake_call = _woq_linear_fake
# it writes none of its arguments and returns a new tensor (alias analysis, CSE, the pipeline)
register_schema(woq_linear, OpSchemaInfo("woq_linear", arg_names=("x", "qweight", "scale", "zero", "bias")))


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
