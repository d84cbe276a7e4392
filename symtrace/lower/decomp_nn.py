"""Decomposition rules for nn functions and modules: linear and conv as a torch call plus a fusible
bias epilogue, batch norm, global (adaptive, to size 1) average pooling, and the ``nn.Module``
rules (activations, norms, linear, conv, pooling...)."""
from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import nn

from .ir import compute_type
from .values import LValue, Pointwise, broadcast_to
from .decomp_registry import CALLABLE_RULES, MODULE_RULES, Unsupported, _arg, _float_ty, _reg, _tensor, normalized
from .decomp_pointwise import (_clamp, _gelu, _hardsigmoid, _hardswish, _leaky_relu, _relu, _silu,
                               _unary_rule)
from .decomp_views import _view_of, reshape_value
from .onednn import PackedLinear
from .decomp_reductions import group_norm_value, norm_value, softmax_value


# --------------------------------------------------------------------------- extern + epilogue

def bias_epilogue(lw, node, y: LValue, bias: Optional[LValue], channel_dim: Optional[int]) -> LValue:
    """``y + bias`` with ``bias`` broadcast along ``channel_dim`` (None: the last dim)."""
    if bias is None:
        return y
    n = len(y.shape)
    if channel_dim is None or channel_dim == n - 1:
        bb = broadcast_to(bias, y.shape)
    else:
        view = _view_of(lw, node, bias, (bias.shape[0],) + (1,) * (n - channel_dim - 1),
                        lambda idx: (idx[0],))
        bb = broadcast_to(view, y.shape)
    ty = compute_type(y.dtype)
    out = Pointwise(y.shape, y.dtype, lambda kb, idx: kb.eb.binary("add", kb.read(y, idx), kb.eb.cast(kb.read(bb, idx), ty)),
                    [y, bb], (node.name,), 1)
    # when this would be stored by a kernel of its own, the lowering passes the bias to the
    # torch call that made ``y`` instead (``Lowering._fold_bias``)
    out.bias_fold = (y, bias, channel_dim)
    return out


@_reg([F.linear], [])
def _linear(lw, node, args, kwargs):
    x, w, b = args[0], _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")
    if b is None or not isinstance(b, LValue):
        raise Unsupported("linear without bias runs through torch")
    y = lw.extern(node, F.linear, (x, w), {}, label="linear (bias fused into the next kernel)", bias_arg=2)
    return bias_epilogue(lw, node, y, b, None)


def _packed_linear(lw, node, args, kwargs):
    """A linear layer the inference pipeline packed (:class:`~.onednn.PackedLinear`). Through
    MKL's GEMM its bias joins the next kernel: MKL adds it in a pass of its own over the result.
    Through oneDNN (which adds it as it stores, with any activation) the call stays as it is."""
    fn = node.target
    if not fn.mkl or fn.bias is None or len(args) != 1 or kwargs:
        raise Unsupported(fn.extern_reason)
    bias = lw.param_value(node, fn, "bias")
    y = lw.extern(node, fn.with_bias, (_tensor(args[0]), None), {},
                  label=f"{fn.__name__} (bias fused into the next kernel)", bias_arg=1)
    return bias_epilogue(lw, node, y, bias, None)


CALLABLE_RULES[PackedLinear] = _packed_linear


def _conv_rule(fn):
    def rule(lw, node, args, kwargs):
        x, w = args[0], _arg(args, kwargs, 1, "weight")
        b = _arg(args, kwargs, 2, "bias")
        if b is None or not isinstance(b, LValue):
            raise Unsupported("convolution without bias runs through torch")
        rest = list(args[3:])
        kw = {k: v for k, v in kwargs.items() if k not in ("weight", "bias")}
        y = lw.extern(node, fn, (x, w, None, *rest), kw, label=f"{fn.__name__} (bias fused into the next kernel)",
                      bias_arg=2)
        return bias_epilogue(lw, node, y, b, 1)
    return rule


_reg([F.conv1d], [])(_conv_rule(F.conv1d))
_reg([F.conv2d], [])(_conv_rule(F.conv2d))


def _adaptive_avg_pool(lw, node, x, output_size, rank: int) -> LValue:
    """Adaptive average pooling to size 1 (global pooling): a mean over the pooled dims."""
    from .decomp_reductions import reduce_value
    x = _tensor(x)
    size = tuple(output_size) if isinstance(output_size, (tuple, list)) else (output_size,) * rank
    if len(x.shape) not in (rank + 1, rank + 2) or any(s != 1 for s in size):
        raise Unsupported("adaptive average pooling to a size other than 1")
    if compute_type(x.dtype) not in ("f32", "f64"):
        raise Unsupported("adaptive average pooling of a non-float tensor")
    n = len(x.shape)
    return reduce_value(lw, node, x, "sum", list(range(n - rank, n)), True, lw.dtype_of(node), mean=True)


@_reg([F.adaptive_avg_pool2d], [])
def _adaptive_avg_pool2d(lw, node, args, kwargs):
    return _adaptive_avg_pool(lw, node, args[0], _arg(args, kwargs, 1, "output_size"), 2)


@_reg([F.adaptive_avg_pool1d], [])
def _adaptive_avg_pool1d(lw, node, args, kwargs):
    return _adaptive_avg_pool(lw, node, args[0], _arg(args, kwargs, 1, "output_size"), 1)


# --------------------------------------------------------------------------- modules


def _module_rule(cls):
    def deco(fn):
        if cls is not None:
            MODULE_RULES[cls] = fn
        return fn
    return deco


@_module_rule(nn.ReLU)
def _m_relu(lw, node, m, args, kwargs):
    return _relu(lw, node, args, {})


@_module_rule(nn.GELU)
def _m_gelu(lw, node, m, args, kwargs):
    return _gelu(lw, node, (args[0], m.approximate), {})


@_module_rule(nn.SiLU)
def _m_silu(lw, node, m, args, kwargs):
    return _silu(lw, node, args, {})


@_module_rule(nn.Sigmoid)
def _m_sigmoid(lw, node, m, args, kwargs):
    return _unary_rule("sigmoid")(lw, node, args, {})


@_module_rule(nn.Tanh)
def _m_tanh(lw, node, m, args, kwargs):
    return _unary_rule("tanh")(lw, node, args, {})


@_module_rule(nn.Softmax)
def _m_softmax(lw, node, m, args, kwargs):
    if m.dim is None:
        raise Unsupported("nn.Softmax(dim=None)")
    return softmax_value(lw, node, _tensor(args[0]), m.dim, None, False)


@_module_rule(nn.LogSoftmax)
def _m_log_softmax(lw, node, m, args, kwargs):
    if m.dim is None:
        raise Unsupported("nn.LogSoftmax(dim=None)")
    return softmax_value(lw, node, _tensor(args[0]), m.dim, None, True)


@_module_rule(nn.LayerNorm)
def _m_layer_norm(lw, node, m, args, kwargs):
    w = lw.param_value(node, m, "weight")
    b = lw.param_value(node, m, "bias")
    return norm_value(lw, node, _tensor(args[0]), m.normalized_shape, w, b, m.eps, False)


if hasattr(nn, "RMSNorm"):
    @_module_rule(nn.RMSNorm)
    def _m_rms_norm(lw, node, m, args, kwargs):
        w = lw.param_value(node, m, "weight")
        return norm_value(lw, node, _tensor(args[0]), m.normalized_shape, w, None, m.eps, True)


@_module_rule(nn.GroupNorm)
def _m_group_norm(lw, node, m, args, kwargs):
    w = lw.param_value(node, m, "weight") if m.affine else None
    b = lw.param_value(node, m, "bias") if m.affine else None
    return group_norm_value(lw, node, _tensor(args[0]), m.num_groups, w, b, m.eps)


@_module_rule(nn.Dropout)
def _m_dropout(lw, node, m, args, kwargs):
    if m.training and m.p > 0:
        raise Unsupported("dropout in training mode draws random numbers")
    return _tensor(args[0])


@_module_rule(nn.Identity)
def _m_identity(lw, node, m, args, kwargs):
    return _tensor(args[0])


@_module_rule(nn.LeakyReLU)
def _m_leaky(lw, node, m, args, kwargs):
    return _leaky_relu(lw, node, (args[0], m.negative_slope), {})


@_module_rule(nn.Hardtanh)
def _m_hardtanh(lw, node, m, args, kwargs):
    return _clamp(lw, node, (args[0], m.min_val, m.max_val), {})


MODULE_RULES[nn.ReLU6] = _m_hardtanh


@_module_rule(nn.Hardswish)
def _m_hardswish(lw, node, m, args, kwargs):
    return _hardswish(lw, node, args, {})


@_module_rule(nn.Hardsigmoid)
def _m_hardsigmoid(lw, node, m, args, kwargs):
    return _hardsigmoid(lw, node, args, {})


@_module_rule(nn.Flatten)
def _m_flatten(lw, node, m, args, kwargs):
    return reshape_value(lw, node, _tensor(args[0]), lw.shape_of(node))


@_module_rule(nn.Linear)
def _m_linear(lw, node, m, args, kwargs):
    if m.bias is None:
        raise Unsupported("nn.Linear without bias runs through torch")
    w = lw.param_value(node, m, "weight")
    b = lw.param_value(node, m, "bias")
    y = lw.extern(node, F.linear, (args[0], w), {}, label="linear (bias fused into the next kernel)", bias_arg=2)
    return bias_epilogue(lw, node, y, b, None)


def _m_conv(fn):
    def rule(lw, node, m, args, kwargs):
        if m.bias is None:
            raise Unsupported(f"{type(m).__name__} without bias runs through torch")
        if m.padding_mode != "zeros" or isinstance(m.padding, str) and m.padding not in ("valid", "same"):
            raise Unsupported("non-zero padding mode")
        w = lw.param_value(node, m, "weight")
        b = lw.param_value(node, m, "bias")
        y = lw.extern(node, fn, (args[0], w, None, m.stride, m.padding, m.dilation, m.groups), {},
                      label=f"{fn.__name__} (bias fused into the next kernel)", bias_arg=2)
        return bias_epilogue(lw, node, y, b, 1)
    return rule


MODULE_RULES[nn.Conv1d] = _m_conv(F.conv1d)
MODULE_RULES[nn.Conv2d] = _m_conv(F.conv2d)


def _channel_view(lw, node, t: Optional[LValue], x: LValue) -> Optional[LValue]:
    if t is None:
        return None
    if not isinstance(t, LValue) or len(t.shape) != 1 or len(x.shape) < 2 or t.shape[0] != x.shape[1]:
        raise Unsupported("batch-norm statistics do not match the channel dimension")
    n = len(x.shape)
    view = _view_of(lw, node, t, (t.shape[0],) + (1,) * (n - 2), lambda idx: (idx[0],))
    return broadcast_to(view, x.shape)


def batch_norm_value(lw, node, x: LValue, mean, var, weight, bias, eps) -> LValue:
    """Inference batch norm: ``(x - mean) * rsqrt(var + eps) * weight + bias`` per channel."""
    out = lw.dtype_of(node)
    ty = _float_ty(out)
    x = _tensor(x)
    m, v = _channel_view(lw, node, mean, x), _channel_view(lw, node, var, x)
    if m is None or v is None:
        raise Unsupported("batch norm without running statistics")
    w, b = _channel_view(lw, node, weight, x), _channel_view(lw, node, bias, x)

    def fn(kb, idx):
        eb = kb.eb
        y = eb.binary("sub", eb.cast(kb.read(x, idx), ty), eb.cast(kb.read(m, idx), ty))
        return normalized(kb, y, eb.cast(kb.read(v, idx), ty), eps, ty, w, b, idx)
    inputs = [t for t in (x, m, v, w, b) if t is not None]
    return Pointwise(x.shape, out, fn, inputs, (node.name,), 4)


@_reg([F.batch_norm], [])
def _batch_norm(lw, node, args, kwargs):
    training = _arg(args, kwargs, 5, "training", False)
    if training:
        raise Unsupported("batch norm in training mode updates running statistics")
    return batch_norm_value(lw, node, args[0], _arg(args, kwargs, 1, "running_mean"), _arg(args, kwargs, 2, "running_var"),
                            _arg(args, kwargs, 3, "weight"), _arg(args, kwargs, 4, "bias"), _arg(args, kwargs, 7, "eps", 1e-5))


def _m_batch_norm(lw, node, m, args, kwargs):
    if m.training or m.running_mean is None or m.running_var is None:
        raise Unsupported(f"{type(m).__name__} in training mode (or without running statistics)")
    return batch_norm_value(lw, node, args[0], lw.param_value(node, m, "running_mean"), lw.param_value(node, m, "running_var"),
                            lw.param_value(node, m, "weight"), lw.param_value(node, m, "bias"), m.eps)


for _cls in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
    MODULE_RULES[_cls] = _m_batch_norm


@_module_rule(nn.AdaptiveAvgPool2d)
def _m_adaptive_avg_pool2d(lw, node, m, args, kwargs):
    return _adaptive_avg_pool(lw, node, args[0], m.output_size, 2)


@_module_rule(nn.AdaptiveAvgPool1d)
def _m_adaptive_avg_pool1d(lw, node, m, args, kwargs):
    return _adaptive_avg_pool(lw, node, args[0], m.output_size, 1)
