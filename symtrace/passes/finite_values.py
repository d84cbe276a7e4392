"""Which values of a graph are finite whenever its inputs are (unless something overflows).

:class:`FiniteValues` answers, for a node, whether its value can hold NaN or +-Inf only if a
graph input does or an intermediate exceeds its dtype's range (|x| > 3.4e38 in float32):
"finite unless overflow". Constants (parameters, buffers) are checked when asked; graph inputs
are assumed finite, so a user of the answer checks them per call (:attr:`inputs_relied_on`).

What keeps a value finite is decided per op, conservatively: convolutions, linear layers and
matmuls, batch/layer/group norms (``eps > 0``), the usual activations, pooling, softmax,
views, cat, add/sub/mul, division by a non-zero constant, embedding lookups, masked_fill
with a finite value, scaled-dot-product attention without a boolean mask, variance and standard
deviation over more elements than their correction, and the square root of what cannot be
negative (``x.pow(2)``, ``x * x``, ``abs``, ``relu``, a variance, their means and sums; for
``rsqrt``, such a value plus a positive constant: a norm's ``rsqrt(var + eps)``). Anything else
(``exp``, ``log``, other square roots, division by a tensor, an unknown function or module) is
"may be non-finite", and so is everything computed from it. Values that are not floating point (ints,
bools, sizes) are finite. A mean or average pool over zero elements gives NaN: those count
only where the recorded input is non-empty.

Used by the lowering's inference pipeline to fuse activations whose oneDNN forms differ from
eager only on NaN/Inf (:mod:`symtrace.lower.onednn`).
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable, Dict, Optional, Set

import torch
import torch.nn.functional as F
from torch import nn

from ..graph.node import Node, iter_nodes
from ..graph.tree import tree_iter
from .module_hooks import runs_forward_hooks

__all__ = ["FiniteValues", "tensor_is_finite"]

# modules whose result is finite when their input and their parameters are (overflow aside)
_MODULES = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.Identity, nn.Flatten, nn.Unflatten,
    nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Hardswish, nn.Hardsigmoid,
    nn.Sigmoid, nn.Tanh, nn.Mish, nn.ELU, nn.Softmax, nn.LogSoftmax,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.Embedding, nn.ZeroPad2d, nn.ConstantPad2d,
    nn.ChannelShuffle, nn.PixelShuffle,
)
_NORM_MODULES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm)
_MEAN_MODULES = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
                 nn.AdaptiveAvgPool3d)

_FUNCTIONS = {
    F.conv1d, F.conv2d, F.conv3d, F.linear, torch.conv2d, torch.matmul, torch.mm, torch.bmm, torch.addmm,
    operator.matmul, F.relu, torch.relu, F.relu6, F.hardtanh, F.leaky_relu, F.gelu, F.silu, F.mish, F.elu,
    F.hardswish, F.hardsigmoid, torch.sigmoid, F.sigmoid, torch.tanh, F.tanh, F.softmax, torch.softmax,
    F.log_softmax, torch.log_softmax, F.max_pool1d, F.max_pool2d, F.max_pool3d, F.adaptive_max_pool2d,
    F.dropout, F.embedding, F.pad, torch.cat, torch.concat, torch.stack, torch.flatten, torch.reshape,
    torch.permute, torch.transpose, torch.squeeze, torch.unsqueeze, torch.unflatten, torch.split, torch.chunk,
    torch.narrow, torch.unbind, torch.roll, torch.cumsum, torch.zeros, torch.ones,
    torch.select, torch.clone, torch.add, torch.sub, torch.mul, torch.neg, torch.abs, torch.maximum,
    torch.minimum, torch.clamp, torch.where, torch.amax, torch.amin, torch.sum, torch.t,
    operator.add, operator.sub, operator.mul, operator.neg, operator.getitem, operator.iadd, operator.imul,
    torch.zeros_like, torch.ones_like,
    F.layer_norm, F.group_norm, F.batch_norm,
} | ({F.rms_norm} if hasattr(F, "rms_norm") else set())
#: Python operations on sizes: finite when their operands are (true division is not among them)
_INT_OPS = {operator.floordiv, operator.mod, operator.add, operator.sub, operator.mul, operator.neg, len, int,
            max, min, operator.getitem}
_MEAN_FUNCTIONS = {torch.mean, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d,
                   F.adaptive_avg_pool2d, F.adaptive_avg_pool3d}
_METHODS = {
    "view", "reshape", "permute", "transpose", "contiguous", "flatten", "unflatten", "squeeze", "unsqueeze",
    "expand", "expand_as", "split", "chunk", "unbind", "roll", "cumsum", "narrow", "select", "t", "clone", "to",
    "float", "type_as",
    "relu", "sigmoid", "tanh", "softmax", "log_softmax", "add", "add_", "sub", "mul", "mul_", "neg", "abs",
    "clamp", "amax", "amin", "sum", "matmul", "__getitem__", "masked_fill", "size", "dim", "repeat",
}
_MEAN_METHODS = {"mean"}
#: functions whose sign _non_negative reasons about, by their method names
_SIGN_NAMES = {torch.var: "var", torch.std: "std", torch.abs: "abs", torch.relu: "relu", F.relu: "relu",
               torch.square: "square", torch.mean: "mean", torch.sum: "sum", torch.amax: "amax",
               operator.pow: "pow", torch.pow: "pow", operator.mul: "mul", torch.mul: "mul",
               operator.add: "add", torch.add: "add"}
_NON_FLOAT_RESULT = {"size", "dim", "numel"}


def _finite_number(v: Any) -> bool:
    if isinstance(v, bool) or isinstance(v, int):
        return True
    if isinstance(v, float):
        return math.isfinite(v)
    return False


class FiniteValues:
    """``fv.holds(node)``: whether ``node``'s value is finite unless a graph input is not or
    something overflows (see the module doc). ``extra(node)`` may answer for targets this
    module does not know (True: finite when its inputs are; None: ask the default rules).
    Answers are cached; build it for one graph state (editing the graph may call
    :meth:`same_as` to carry an answer to a replacement node)."""

    def __init__(self, gm: nn.Module, extra: Optional[Callable[[Node], Optional[bool]]] = None):
        self.gm = gm
        self.extra = extra
        self._memo: Dict[Node, bool] = {}
        #: the floating-point placeholders some positive answer assumed finite
        self.inputs_relied_on: Set[Node] = set()
        self._assumed: Set[Node] = set()    # placeholders decided finite (checked per call if relied on)
        self._credited: Set[Node] = set()   # nodes whose assumed inputs are in inputs_relied_on

    # ------------------------------------------------------------- public
    def holds(self, node: Any) -> bool:
        answer = self._answer(node)
        if answer and type(node) is Node:
            self._credit(node)
        return answer

    def _answer(self, node: Any) -> bool:
        """``holds`` without crediting inputs (the rules ask it of their operands)."""
        if type(node) is not Node:   # a constant argument
            if isinstance(node, float):
                return math.isfinite(node)
            return tensor_is_finite(node) if isinstance(node, torch.Tensor) else True
        # iterative over the producers (graphs are deep): settle inputs first
        stack = [node]
        while stack:
            n = stack[-1]
            if n in self._memo:
                stack.pop()
                continue
            pending = [a for a in iter_nodes((n.args, n.kwargs)) if a not in self._memo]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            self._memo[n] = self._decide(n)
        return self._memo[node]

    def _credit(self, node: Node) -> None:
        """A positive answer for ``node`` relies on the placeholders among its inputs, to any
        depth, that were assumed finite (a negative answer relies on none)."""
        stack = [node]
        while stack:
            n = stack.pop()
            if n in self._credited:
                continue
            self._credited.add(n)
            if n in self._assumed:
                self.inputs_relied_on.add(n)
            stack.extend(iter_nodes((n.args, n.kwargs)))

    def same_as(self, new: Node, old: Node) -> None:
        """``new`` replaces ``old`` (same value): give it ``old``'s answer if one was worked
        out (else ``new`` is decided from its own inputs when asked)."""
        if old in self._memo:
            self._memo[new] = self._memo[old]

    # ------------------------------------------------------------- rules
    def _inputs_hold(self, n: Node) -> bool:
        return all(self._answer(a) for a in tree_iter((n.args, n.kwargs)))

    def _decide(self, n: Node) -> bool:
        m = n.meta.get("tensor_meta")
        if hasattr(m, "dtype") and not (m.dtype.is_floating_point or m.dtype.is_complex):
            return True   # ints and bools cannot be NaN or Inf
        if n.op == "placeholder":
            if hasattr(m, "dtype"):
                self._assumed.add(n)
                return True
            return False   # a Python number or an unknown object: not checked per call
        if n.op == "get_attr":
            t = self._attr(n.target)
            return isinstance(t, torch.Tensor) and tensor_is_finite(t)
        if n.op == "output":
            return self._inputs_hold(n)
        if self.extra is not None:
            said = self.extra(n)
            if said is not None:
                return bool(said) and self._inputs_hold(n)
        if n.op == "call_module":
            return self._module(n)
        if n.op == "call_method":
            if n.target in _NON_FLOAT_RESULT:
                return True
            if n.target == "masked_fill":
                return self._answer(n.args[0]) and len(n.args) == 3 and _finite_number(n.args[2])
            if n.target in ("div", "__truediv__", "div_"):
                return self._division(n)
            if n.target in _MEAN_METHODS:
                return self._non_empty(n.args[0]) and self._inputs_hold(n)
            if n.target in ("var", "std"):
                return self._variance(n)
            if n.target in ("pow", "__pow__"):
                return self._power(n)
            if n.target in ("sqrt", "rsqrt"):
                return len(n.args) == 1 and not n.kwargs and self._root(n.args[0], n.target == "rsqrt")
            return n.target in _METHODS and self._inputs_hold(n)
        if n.op != "call_function":
            return False
        t = n.target
        if t is getattr:
            return not isinstance(n.args[0], Node) or n.args[1] in ("shape", "dtype", "device", "ndim") \
                or self._answer(n.args[0])
        if t in _INT_OPS and not hasattr(m, "dtype"):   # size arithmetic (c // groups): ints stay finite
            return self._inputs_hold(n)
        if t in (operator.truediv, torch.div, torch.true_divide, operator.itruediv):
            return self._division(n)
        if t in (operator.pow, torch.pow):
            return self._power(n)
        if t in (torch.var, torch.std):
            return self._variance(n)
        if t in (torch.sqrt, torch.rsqrt):
            return len(n.args) == 1 and not n.kwargs and self._root(n.args[0], t is torch.rsqrt)
        if t is F.scaled_dot_product_attention:
            mask = n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)
            mm = mask.meta.get("tensor_meta") if type(mask) is Node else None
            if mask is not None and (mm is None or not hasattr(mm, "dtype") or mm.dtype == torch.bool):
                return False   # a row masked entirely gives NaN
            return self._inputs_hold(n)
        if t is torch.Tensor.masked_fill or t is torch.masked_fill:
            return self._answer(n.args[0]) and len(n.args) == 3 and _finite_number(n.args[2])
        if t in _MEAN_FUNCTIONS:
            return self._non_empty(n.args[0]) and self._inputs_hold(n)
        try:
            known = t in _FUNCTIONS
        except TypeError:   # an unhashable callable
            known = False
        return known and self._inputs_hold(n)

    def _module(self, n: Node) -> bool:
        try:
            mod = self.gm.get_submodule(n.target)
        except AttributeError:
            return False
        if runs_forward_hooks(mod):
            return False
        kind = type(mod)
        if kind in _NORM_MODULES:
            if not (mod.eps > 0) or (isinstance(mod, nn.modules.batchnorm._BatchNorm)
                                     and (mod.training or mod.running_var is None)):
                return False
        elif kind in _MEAN_MODULES:
            if not self._non_empty(n.args[0]):
                return False
        elif kind not in _MODULES:
            return False
        return all(tensor_is_finite(t) for t in list(mod.parameters()) + list(mod.buffers())) and self._inputs_hold(n)

    def _division(self, n: Node) -> bool:
        if len(n.args) != 2 or n.kwargs.get("rounding_mode") is not None:
            return False
        d = n.args[1]
        return self._answer(n.args[0]) and _finite_number(d) and d != 0

    def _variance(self, n: Node) -> bool:
        """``var``/``std`` of finite values over more elements than the correction (else NaN or
        Inf): the reduced count from the recorded input shape."""
        if not self._inputs_hold(n) or not n.args or type(n.args[0]) is not Node:
            return False
        shape = getattr(n.args[0].meta.get("tensor_meta"), "shape", None)
        if shape is None or not all(isinstance(d, int) for d in shape):
            return False
        dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 and not isinstance(n.args[1], bool) else None)
        if "correction" in n.kwargs:
            correction = n.kwargs["correction"]
        else:
            unbiased = n.kwargs.get("unbiased", n.args[1] if len(n.args) > 1 and isinstance(n.args[1], bool) else True)
            correction = 1 if unbiased else 0
        if not isinstance(correction, (int, float)) or isinstance(correction, bool):
            return False
        dims = range(len(shape)) if dim is None else (dim,) if isinstance(dim, int) else dim
        try:
            count = math.prod(shape[d] for d in dims)
        except (TypeError, IndexError):
            return False
        return count > correction

    def _root(self, a: Any, reciprocal: bool) -> bool:
        """``sqrt(a)`` (``rsqrt`` when ``reciprocal``) is finite: ``a`` is finite and cannot be
        negative (``rsqrt``: cannot be below some positive constant)."""
        if not self._answer(a):
            return False
        if not reciprocal:
            return _number_at_least(a, 0) or self._non_negative(a)
        if _number_at_least(a, 0) and a > 0:
            return True
        if type(a) is not Node or a.kwargs or len(a.args) != 2 or not (
                a.op == "call_function" and a.target in (operator.add, torch.add)
                or a.op == "call_method" and a.target == "add"):
            return False
        x, y = a.args
        return (_number_at_least(y, 0) and y > 0 and self._non_negative(x)
                or _number_at_least(x, 0) and x > 0 and self._non_negative(y))

    def _non_negative(self, a: Any, depth: int = 0) -> bool:
        """Whether ``a`` cannot hold a negative number (NaN aside): squares, ``abs``, ``relu``,
        variances, and means, sums and maxima of those."""
        if _number_at_least(a, 0):
            return True
        if type(a) is not Node or depth > 8:
            return False
        t, args = a.target, a.args
        if a.op == "call_method":
            name = t
        elif a.op == "call_function":
            try:
                name = _SIGN_NAMES.get(t)
            except TypeError:   # an unhashable target
                return False
        else:
            return False
        if name in ("var", "std", "abs", "relu", "square"):
            return True
        if name in ("mean", "sum", "amax") and args:
            return self._non_negative(args[0], depth + 1)
        if name == "pow" and len(args) == 2:
            return isinstance(args[1], int) and not isinstance(args[1], bool) and args[1] % 2 == 0
        if name == "mul" and len(args) == 2 and not a.kwargs:
            return args[0] is args[1] or all(self._non_negative(x, depth + 1) for x in args)
        if name == "add" and len(args) == 2 and not a.kwargs:
            return all(self._non_negative(x, depth + 1) for x in args)
        return False

    def _power(self, n: Node) -> bool:
        if len(n.args) != 2:
            return False
        base, e = n.args
        # x ** k for a whole k >= 0 overflows at worst; size ** 0.5 (an int base) is finite too
        if isinstance(e, int) and e >= 0:
            return self._answer(base)
        return type(base) is Node and self._is_size(base) and isinstance(e, float) and e >= 0

    def _is_size(self, n: Node) -> bool:
        """An int read from a tensor's shape (``x.shape[i]``, ``x.size(i)``)."""
        if n.op == "call_method" and n.target == "size":
            return True
        if n.op == "call_function" and n.target is operator.getitem and type(n.args[0]) is Node:
            src = n.args[0]
            return src.op == "call_function" and src.target is getattr and src.args[1] == "shape"
        return False

    def _non_empty(self, a: Any) -> bool:
        m = a.meta.get("tensor_meta") if type(a) is Node else None
        if not hasattr(m, "shape"):
            return False
        return all(isinstance(s, int) and s > 0 for s in m.shape)

    def _attr(self, target: str) -> Any:
        obj: Any = self.gm
        try:
            for part in target.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj


def _number_at_least(v: Any, low: float) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and v >= low


def tensor_is_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN or Inf, in one fast pass: a finite sum means every element is
    finite (a sum that overflows says no, which is the safe answer). ``torch.isfinite(t).all()``
    costs about 1 ms per million elements, seconds over a language model's weights."""
    if t.numel() == 0:
        return True
    if t.is_complex():
        return bool(torch.isfinite(t.detach()).all())
    if not t.is_floating_point():
        return True
    return math.isfinite(t.detach().sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32).item())
