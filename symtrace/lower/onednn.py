"""Convolutions and linear layers through oneDNN with pre-packed weights and fused post-ops.

:func:`use_onednn` rewrites, in a graph the inference pipeline owns (:mod:`.pipeline`), every
fp32 CPU ``Conv2d``/``F.conv2d`` and ``Linear``/``F.linear``/``torch.addmm(b, x, W)`` whose
weight is a constant into a
call of a :class:`PackedConv` / :class:`PackedLinear` object: the weight is reordered once,
at compile time, into oneDNN's blocked layout for the recorded input size
(``torch.ops.mkldnn._reorder_convolution_weight`` / ``_reorder_linear_weight``), and each call
runs ``torch.ops.mkldnn._convolution_pointwise`` / ``_linear_pointwise`` with the bias and a
following activation (and, for convolutions, a residual add) as oneDNN post-ops; linear layers
reading the same value (q, k, v) are first merged into one (:func:`merge_sibling_linears`)::

    conv -> add(other) -> relu      becomes   PackedConv(x, other)   [add, then relu, in the conv]
    linear -> gelu                  becomes   PackedLinear(x)        [gelu in the matmul]

oneDNN's relu, hardtanh/relu6 and hardsigmoid map NaN to a number and its erf-gelu maps +-Inf
to NaN; on finite values they agree with eager. ``nan_exact`` decides where those are fused:
``"guarded"`` (the pipeline's default) fuses them where the layer's input (and residual) are
finite whenever the graph's inputs are, overflow aside (:class:`~symtrace.passes.finite_values.
FiniteValues`), and the caller checks the inputs on each call; ``True`` never fuses them;
``False`` always does. The other post-ops give eager's answer on NaN and Inf too and are always
fused. A missing op (another torch build, no oneDNN) leaves the graph as it is:
:func:`available` says whether the ops exist.

A convolution called with another input size than the recorded one packs its weight for that
size once and keeps it (the last four sizes): oneDNN's preferred weight layout depends on the
input size, and a weight in another layout is reordered on every call. (Linear layers keep one
pack: for other row counts it measured as fast.)

A linear layer without an activation runs MKL's packed GEMM instead
(``torch.ops.mkl._mkl_linear``, as Inductor does for fp32) where a timing at compile time finds
it faster (:func:`mkl_is_faster`: small layers, where oneDNN's per-call cost shows, and larger
ones up to :data:`MKL_LARGE_MAX_WORK` multiply-adds, where MKL's GEMM itself may be faster).

A residual add whose other operand is the fresh result of an earlier packed convolution that
nothing reads afterwards accumulates into that tensor (oneDNN's sum post-op,
``_convolution_pointwise_``): no new output, one pass less over memory.
"""
from __future__ import annotations

import operator
import os
import statistics
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..graph.graph_module import GraphModule
from ..graph.node import Node
from ..graph.op_schema import OpSchemaInfo
from ..passes.alias import AliasAnalysis
from ..passes.finite_values import FiniteValues, tensor_is_finite
from ..passes.module_hooks import runs_forward_hooks
from .layout_ops import ChannelShuffle

__all__ = ["available", "use_onednn", "merge_sibling_linears", "accumulate_residuals_in_place", "packed_finite",
           "PackedConv", "PackedLinear", "POST_OPS", "mkl_available", "mkl_is_faster"]


def _op(namespace: str, name: str):
    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None


def available() -> bool:
    """Whether this torch build ships the oneDNN ops the rewrite calls."""
    if not torch.backends.mkldnn.is_available():
        return False
    return all(_op("mkldnn", n) is not None for n in
               ("_convolution_pointwise", "_reorder_convolution_weight", "_linear_pointwise",
                "_reorder_linear_weight"))


#: post-op name -> (oneDNN attr, scalars, algorithm, gives eager's answer on NaN/Inf)
POST_OPS: Dict[str, Tuple[str, list, str, bool]] = {
    "relu": ("relu", [], "", False),
    "relu6": ("hardtanh", [0.0, 6.0], "", False),
    "hardsigmoid": ("hardsigmoid", [], "", False),
    "gelu": ("gelu", [], "none", False),
    "gelu_tanh": ("gelu", [], "tanh", True),
    "silu": ("swish", [], "", True),
    "hardswish": ("hardswish", [], "", True),
    "sigmoid": ("sigmoid", [], "", True),
    "tanh": ("tanh", [], "", True),
    "leaky_relu": ("leaky_relu", [0.01], "", True),   # (its slope: the layer's own, see _post_op)
    # slope 0: oneDNN's is max(x, 0), eager's x * 0 is NaN for -inf
    "leaky_relu_zero": ("leaky_relu", [0.0], "", False),
}


def _post_attr(post: str, scalars: Optional[Sequence[float]]) -> Tuple[str, list, str]:
    """oneDNN's (attr, scalars, algorithm) for post-op ``post`` ("none": none); ``scalars``
    replace the table's (a leaky ReLU's slope)."""
    if post == "none":
        return "none", [], ""
    attr, default, algorithm, _ = POST_OPS[post]
    return attr, [float(v) for v in (default if scalars is None else scalars)], algorithm


class _Packs:
    """Weights packed for other input sizes than the recorded one, the last :attr:`KEEP` used
    (each is one more copy of the weight)."""

    KEEP = 4

    def __init__(self):
        self._packs: "OrderedDict[Any, torch.Tensor]" = OrderedDict()

    def get(self, key, pack) -> torch.Tensor:
        w = self._packs.get(key)
        if w is None:
            w = self._packs[key] = pack(key)
            while len(self._packs) > self.KEEP:
                self._packs.popitem(last=False)
        else:
            self._packs.move_to_end(key)
        return w


class PackedConv:
    """``conv2d(x, W, b)`` (+ ``other``) (+ activation) through oneDNN with ``W`` packed once.
    Called as ``conv(x)`` or, with a residual add, ``conv(x, other)``."""

    __module__ = "symtrace.lower.onednn"

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], stride, padding, dilation,
                 groups: int, input_size: Sequence[int], post: str = "none", add: bool = False,
                 weights_finite: Optional[bool] = None, post_scalars: Optional[Sequence[float]] = None):
        w = weight.detach()
        self.weight_shape = tuple(w.shape)
        self.stride, self.padding, self.dilation, self.groups = list(stride), list(padding), list(dilation), groups
        self.packed = torch.ops.mkldnn._reorder_convolution_weight(
            w, self.padding, self.stride, self.dilation, groups, list(input_size))
        self._dense, self._size, self._more = w, tuple(input_size), _Packs()
        self.bias = None if bias is None else bias.detach().clone()
        self.post = post
        self.add = add
        #: the residual add accumulates into ``other`` (which must be a fresh tensor nothing reads later)
        self.inplace = False
        self.weights_finite = _weights_finite(w, bias) if weights_finite is None else weights_finite
        self.attr, self.scalars, self.algorithm = _post_attr(post, post_scalars)
        self.__name__ = f"onednn_conv2d{'_add' if add else ''}{'_' + post if post != 'none' else ''}"

    @property
    def op_schema(self) -> OpSchemaInfo:
        """What the call writes and aliases (the effect model reads it): nothing, a fresh
        result; accumulating in place, it writes ``other`` and returns it."""
        if self.inplace:
            return OpSchemaInfo(self.__name__, write_positions=frozenset({1}), result_aliases=True,
                                arg_names=("x", "other"))
        return OpSchemaInfo(self.__name__, arg_names=("x", "other"))

    def accumulate_in_place(self) -> None:
        """Make the residual add write into ``other`` (see the module doc)."""
        self.inplace = True
        self.__name__ = self.__name__.replace("_add", "_add_inplace", 1)

    def fake_call(self, x: torch.Tensor, other: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The result's metadata on fake tensors (symbolic sizes; see
        :mod:`symtrace.graph.symbolic_shapes`): oneDNN's ops have no fake kernel in every build."""
        if self.inplace:
            return other
        w = x.new_empty(self.weight_shape)
        y = F.conv2d(x, w, None, self.stride, self.padding, self.dilation, self.groups)
        return y.contiguous(memory_format=torch.channels_last)

    def weight_for(self, x: torch.Tensor) -> torch.Tensor:
        """The weight packed for ``x``'s size: oneDNN's preferred layout depends on it, and a
        weight packed for another size is reordered on every call (resnet50's 1x1 convolutions
        at 7x7: 23 ms instead of 0.7). Other sizes are packed once each (:class:`_Packs`)."""
        if x.shape == self._size:
            return self.packed
        return self._more.get(tuple(x.shape), lambda size: torch.ops.mkldnn._reorder_convolution_weight(
            self._dense, self.padding, self.stride, self.dilation, self.groups, list(size)))

    def __call__(self, x: torch.Tensor, other: Optional[torch.Tensor] = None) -> torch.Tensor:
        w = self.weight_for(x)
        if self.inplace:
            return torch.ops.mkldnn._convolution_pointwise_.binary(
                other, x, w, self.bias, self.padding, self.stride, self.dilation, self.groups,
                "add", None, None if self.attr == "none" else self.attr, self.scalars, self.algorithm or None)
        if self.add:
            return torch.ops.mkldnn._convolution_pointwise.binary(
                x, other, w, self.bias, self.padding, self.stride, self.dilation, self.groups,
                "add", None, None if self.attr == "none" else self.attr, self.scalars, self.algorithm or None)
        return torch.ops.mkldnn._convolution_pointwise(
            x, w, self.bias, self.padding, self.stride, self.dilation, self.groups,
            self.attr, self.scalars, self.algorithm)

    def __repr__(self):
        return f"<{self.__name__}>"


class PackedLinear:
    """``linear(x, W, b)`` (+ activation) with ``W`` packed once for ``batch`` rows: through
    oneDNN, or, without an activation, through MKL's packed GEMM where that measured faster for
    this shape (:func:`mkl_is_faster`)."""

    __module__ = "symtrace.lower.onednn"

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], batch: int, post: str = "none",
                 weights_finite: Optional[bool] = None, post_scalars: Optional[Sequence[float]] = None):
        w = weight.detach()
        if not (w.is_contiguous() or w.t().is_contiguous()):   # (a transposed weight packs as it is:
            w = w.contiguous()                                  # HF's Conv1D, without a copy)
        self.out_features, self.in_features, self.batch = int(weight.shape[0]), int(weight.shape[1]), batch
        self.bias = None if bias is None else bias.detach().clone()
        self.weights_finite = _weights_finite(w, bias) if weights_finite is None else weights_finite
        self.post = post
        self.attr, self.scalars, self.algorithm = _post_attr(post, post_scalars)
        self.mkl = post == "none" and mkl_is_faster(batch, self.in_features, self.out_features)
        if self.mkl:   # (MKL's op takes the plain weight too, for other row counts: a view, no copy)
            self.weight = w
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(w.contiguous(), batch)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, batch)
        self.__name__ = "mkl_linear" if self.mkl else f"onednn_linear{'_' + post if post != 'none' else ''}"

    @property
    def op_schema(self) -> OpSchemaInfo:
        """It writes nothing and returns a fresh tensor (the effect model reads it)."""
        return OpSchemaInfo(self.__name__, arg_names=("x",))

    def fake_call(self, x: torch.Tensor) -> torch.Tensor:
        """The result's metadata on fake tensors (see :meth:`PackedConv.fake_call`)."""
        return x.new_empty(tuple(x.shape[:-1]) + (self.out_features,))

    @property
    def extern_reason(self) -> str:
        """What a lowering's report says of a call it runs through torch."""
        return f"{self.__name__}: packed weights, a torch call"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_bias(x, self.bias)

    def with_bias(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The layer with ``bias`` in place of its own (None: none)."""
        # (one pack for every row count: unlike a convolution's, a weight packed for other rows
        # measured as fast or faster, and repacking per sequence length would cost a weight copy)
        if self.mkl:
            rows = x.reshape(-1, self.in_features)
            y = torch.ops.mkl._mkl_linear(rows, self.packed, self.weight, bias, self.batch)
            return y.view(tuple(x.shape[:-1]) + (self.out_features,))
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, self.attr, self.scalars, self.algorithm)

    def __repr__(self):
        return f"<{self.__name__}>"


#: small layers (at most this many multiply-adds, rows x in x out, and :data:`MKL_MAX_WEIGHTS`
#: weights), where oneDNN's per-call cost shows: timed with 13 calls each, MKL chosen where its
#: time is at most :data:`MKL_MARGIN` times oneDNN's. In a model oneDNN's call cost more than the
#: timing shows: levit_128s's (1, 49, 512) -> 256 layers took 100 us a call there, MKL's about
#: 15-60; with near ties going to oneDNN (a margin of 0.75, for its fused activation) the model
#: ran at 0.90x Inductor with freezing, with near ties going to MKL at 0.98x
MKL_MAX_WORK = 1 << 25
MKL_MAX_WEIGHTS = 1 << 20
MKL_MARGIN = 1.05
#: larger layers, up to this many multiply-adds and :data:`MKL_LARGE_MAX_WEIGHTS` weights: timed
#: with 5 calls each, MKL chosen where its time is at most :data:`MKL_LARGE_MARGIN` times
#: oneDNN's. On an AMD EPYC (AVX2) the two tied at BERT's sizes; on an Intel Xeon with AVX-512, MKL's
#: GEMM took 0.88x of oneDNN's (BERT-base, sequence 128). The timing reuses one weight, which
#: stays in the cache; in a model each layer's weight arrives from memory, and there MKL did
#: better still: ViT-B/16's 49 linears took 90-95 ms through MKL, 107-114 ms through oneDNN
#: (fused GELU included), where the timing had them within 6% and flipped between compiles. So
#: a near tie goes to MKL. Larger still (an LM head over a long sequence): oneDNN, untimed
#: (timing it would lengthen the compile by seconds)
MKL_LARGE_MAX_WORK = 1 << 31
MKL_LARGE_MAX_WEIGHTS = 1 << 24
MKL_LARGE_MARGIN = 1.05
_MKL_CHOICE: Dict[tuple, bool] = {}


def mkl_available() -> bool:
    """Whether this torch build has MKL's packed linear ops (x86 CPU wheels)."""
    return bool(getattr(torch._C, "has_mkl", False)) and _op("mkl", "_mkl_linear") is not None \
        and _op("mkl", "_mkl_reorder_linear_weight") is not None


def mkl_is_faster(batch: int, k: int, n: int) -> bool:
    """Whether MKL's packed GEMM beats oneDNN's ``_linear_pointwise`` for ``batch`` x ``k`` ->
    ``n`` (no activation), measured once per shape and thread count on random data, medians of
    interleaved calls (milliseconds of a compile; up to a few tenths of a second for the largest
    layers timed). ``$SYMTRACE_MKL_LINEAR``: ``0`` never chooses MKL, ``1`` always does for small
    layers (where available), untimed, and never for larger ones; the tests set ``0`` so that what
    they check does not depend on a timing."""
    mode = os.environ.get("SYMTRACE_MKL_LINEAR", "auto").strip().lower()
    small = batch * k * n <= MKL_MAX_WORK and k * n <= MKL_MAX_WEIGHTS
    if mode in ("0", "false", "no", "off") or not mkl_available() or batch * k * n > MKL_LARGE_MAX_WORK \
            or k * n > MKL_LARGE_MAX_WEIGHTS or min(batch, k, n) < 1:
        return False
    if mode in ("1", "true", "yes", "on"):
        return small
    key = (batch, k, n, torch.get_num_threads())
    if key not in _MKL_CHOICE:
        g = torch.Generator().manual_seed(0)
        x, w, b = torch.randn(batch, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        p_dnn = torch.ops.mkldnn._reorder_linear_weight(w, batch)
        p_mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, batch)
        calls = (lambda: torch.ops.mkldnn._linear_pointwise(x, p_dnn, b, "none", [], ""),
                 lambda: torch.ops.mkl._mkl_linear(x, p_mkl, w, b, batch))
        times: Tuple[list, list] = ([], [])
        warm, rounds = (3, 16) if small else (1, 6)
        with torch.no_grad():
            for i in range(rounds):
                for j, call in enumerate(calls):
                    t = time.perf_counter()
                    call()
                    if i >= warm:
                        times[j].append(time.perf_counter() - t)
        margin = MKL_MARGIN if small else MKL_LARGE_MARGIN   # (MKL's time at most margin x oneDNN's)
        _MKL_CHOICE[key] = statistics.median(times[1]) <= margin * statistics.median(times[0])
    return _MKL_CHOICE[key]


def _weights_finite(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    return tensor_is_finite(weight) and (bias is None or tensor_is_finite(bias))


# --------------------------------------------------------------------------- matching

def _submodule(gm: GraphModule, node: Node) -> Optional[nn.Module]:
    if node.op != "call_module":
        return None
    try:
        return gm.get_submodule(node.target)
    except AttributeError:
        return None


def _attr(gm: GraphModule, a: Any) -> Optional[torch.Tensor]:
    """The tensor of a ``get_attr`` argument (None: not a constant attribute)."""
    if type(a) is not Node or a.op != "get_attr":
        return None
    obj: Any = gm
    try:
        for part in a.target.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        return None
    return obj if isinstance(obj, torch.Tensor) else None


def _meta(node: Any):
    m = node.meta.get("tensor_meta") if type(node) is Node else None
    return m if m is not None and hasattr(m, "shape") else None


def _pair(v, n=2) -> List[int]:
    return list(v) if isinstance(v, (tuple, list)) else [int(v)] * n


class _Layer:
    """A conv or linear node with constant weights: what the packed call needs."""

    def __init__(self, node, kind, x, weight, bias, stride=None, padding=None, dilation=None, groups=1):
        self.node, self.kind, self.x = node, kind, x
        self.weight, self.bias = weight, bias
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups


def _conv_layer(gm: GraphModule, node: Node) -> Optional[_Layer]:
    mod = _submodule(gm, node)
    if mod is not None:
        if type(mod) is not nn.Conv2d or runs_forward_hooks(mod) or len(node.args) != 1 \
                or node.kwargs or mod.padding_mode != "zeros":
            return None
        padding = mod.padding
        if isinstance(padding, str):
            if padding != "valid":
                return None  # 'same' pads asymmetrically for even kernels
            padding = (0, 0)
        return _Layer(node, "conv", node.args[0], mod.weight, mod.bias, mod.stride, padding, mod.dilation, mod.groups)
    if node.op != "call_function" or node.target is not F.conv2d:
        return None
    bound = _bind_weights(gm, node, ("input", "weight", "bias", "stride", "padding", "dilation", "groups"))
    if bound is None:
        return None
    a, w, bt = bound
    if isinstance(a.get("padding", 0), str):
        return None
    if any(isinstance(a.get(k), Node) for k in ("stride", "padding", "dilation", "groups")):
        return None
    return _Layer(node, "conv", a["input"], w, bt, _pair(a.get("stride", 1)), _pair(a.get("padding", 0)),
                  _pair(a.get("dilation", 1)), int(a.get("groups", 1)))


def _linear_layer(gm: GraphModule, node: Node) -> Optional[_Layer]:
    mod = _submodule(gm, node)
    if mod is not None:
        if type(mod) is not nn.Linear or runs_forward_hooks(mod) or len(node.args) != 1 \
                or node.kwargs:
            return None
        return _Layer(node, "linear", node.args[0], mod.weight, mod.bias)
    if node.op == "call_function" and node.target is torch.addmm:
        return _addmm_layer(gm, node)
    if node.op != "call_function" or node.target is not F.linear:
        return None
    bound = _bind_weights(gm, node, ("input", "weight", "bias"))
    if bound is None:
        return None
    a, w, bt = bound
    return _Layer(node, "linear", a["input"], w, bt)


def _bind_weights(gm: GraphModule, node: Node, names: tuple):
    """``node``'s arguments by name, with its weight (and bias, if any) resolved to the module's
    tensors; None when an argument is unknown or weight/bias are not module state."""
    if len(node.args) > len(names) or any(k not in names for k in node.kwargs):
        return None
    a = dict(zip(names, node.args))
    a.update(node.kwargs)
    w = _attr(gm, a.get("weight"))
    b = a.get("bias")
    bt = _attr(gm, b) if b is not None else None
    if w is None or (b is not None and bt is None):
        return None
    return a, w, bt


def _addmm_layer(gm: GraphModule, node: Node) -> Optional[_Layer]:
    """``torch.addmm(b, x, W)`` with constant ``b`` (1-D) and ``W`` (Hugging Face's Conv1D):
    a linear layer with weight ``W.t()``."""
    if len(node.args) != 3 or node.kwargs:
        return None
    b, x, w = node.args
    wt, bt = _attr(gm, w), _attr(gm, b)
    if wt is None or bt is None or wt.dim() != 2 or bt.dim() != 1 or bt.shape[0] != wt.shape[1]:
        return None
    return _Layer(node, "linear", x, wt.t(), bt)


def _post_op(gm: GraphModule, node: Node) -> Optional[Tuple[str, Optional[List[float]]]]:
    """The :data:`POST_OPS` name of a one-input activation node and its scalars (None: the
    table's), or None."""
    mod = _submodule(gm, node)
    if mod is not None:
        if runs_forward_hooks(mod) or len(node.args) != 1 or node.kwargs:
            return None
        t = type(mod)
        if t is nn.GELU:
            return ("gelu_tanh" if mod.approximate == "tanh" else "gelu"), None
        if t is nn.Hardtanh and (mod.min_val, mod.max_val) == (0.0, 6.0) or t is nn.ReLU6:
            return "relu6", None
        if t is nn.LeakyReLU:
            return _leaky(mod.negative_slope)
        name = {nn.ReLU: "relu", nn.SiLU: "silu", nn.Hardswish: "hardswish", nn.Hardsigmoid: "hardsigmoid",
                nn.Sigmoid: "sigmoid", nn.Tanh: "tanh"}.get(t)
        return None if name is None else (name, None)
    if node.op == "call_method" and not node.kwargs and len(node.args) == 1:
        name = {"relu": "relu", "sigmoid": "sigmoid", "tanh": "tanh"}.get(node.target)
        return None if name is None else (name, None)
    if node.op != "call_function" or not node.args:
        return None
    kw = dict(node.kwargs)
    kw.pop("inplace", None)
    t = node.target
    if t is F.leaky_relu and len(node.args) <= 3:
        slope = node.args[1] if len(node.args) > 1 else kw.pop("negative_slope", 0.01)
        return None if kw else _leaky(slope)   # (a third argument: the inplace flag)
    if len(node.args) != 1:
        return None
    if t is F.gelu:
        approx = kw.pop("approximate", "none")
        return None if kw else ("gelu_tanh", None) if approx == "tanh" else ("gelu", None) if approx == "none" \
            else None
    if kw:
        return None
    table = {F.relu: "relu", torch.relu: "relu", F.silu: "silu", F.hardswish: "hardswish",
             F.hardsigmoid: "hardsigmoid", torch.sigmoid: "sigmoid", torch.tanh: "tanh", F.relu6: "relu6"}
    try:
        name = table.get(t)
    except TypeError:
        return None
    return None if name is None else (name, None)


def _leaky(slope) -> Optional[Tuple[str, Optional[List[float]]]]:
    """A leaky ReLU's post-op, for a slope that is a plain number (not a graph value)."""
    if type(slope) not in (int, float) or slope != slope:
        return None
    return ("leaky_relu", [float(slope)]) if slope != 0 else ("leaky_relu_zero", None)


def _residual(node: Node, y: Node) -> Optional[Node]:
    """The other operand when ``node`` is ``y + other`` (either order, no alpha), else None."""
    if node.op == "call_function" and node.target in (operator.add, torch.add, operator.iadd) \
            and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
    elif node.op == "call_method" and node.target in ("add", "__add__") and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
    else:
        return None
    if a is y and type(b) is Node and b is not y:
        return b
    if b is y and type(a) is Node and a is not y and node.target is not operator.iadd:
        return a
    return None


def _only_user(node: Node) -> Optional[Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _fp32_cpu(*nodes_or_tensors) -> bool:
    for x in nodes_or_tensors:
        m = x if isinstance(x, torch.Tensor) else _meta(x)
        if m is None or m.dtype != torch.float32 or getattr(m, "device", torch.device("cpu")).type != "cpu":
            return False
    return True


# --------------------------------------------------------------------------- the rewrite

def _linear_ok(gm: GraphModule, node: Node) -> Optional[_Layer]:
    """The layer of a linear node the rewrite may pack (fp32 CPU, constant weight), else None."""
    layer = _linear_layer(gm, node)
    if layer is None or not _fp32_cpu(layer.x, node, layer.weight):
        return None
    xm = _meta(layer.x)
    if len(xm.shape) < 2 or layer.weight.dim() != 2 or (layer.bias is not None and not _fp32_cpu(layer.bias)):
        return None
    return layer


def merge_sibling_linears(gm: GraphModule) -> List[str]:
    """Linear layers reading the same value (attention's q, k, v projections; a gated MLP's
    gate and up projections) become one packed linear over the concatenated weights, whose
    result is split into views: one larger matrix product instead of several."""
    if not available():
        return []
    graph = gm.graph
    notes = []
    for x in list(graph.nodes):
        group = []
        for u in x.users:
            layer = _linear_ok(gm, u)
            if layer is not None and layer.x is x:
                group.append(layer)
        if len(group) < 2:
            continue
        pos = graph.positions()
        group.sort(key=lambda lay: pos[lay.node])
        sizes = [lay.weight.shape[0] for lay in group]
        weight = torch.cat([lay.weight.detach() for lay in group], 0)
        if any(lay.bias is not None for lay in group):
            bias = torch.cat([lay.bias.detach() if lay.bias is not None else
                              torch.zeros(n, dtype=weight.dtype) for lay, n in zip(group, sizes)])
        else:
            bias = None
        batch = 1
        for n in _meta(x).shape[:-1]:
            batch *= n
        fn = PackedLinear(weight, bias, max(batch, 1))
        fn.__name__ += "_merged"
        with graph.inserting_before(group[0].node):
            merged = graph.call_function(fn, (x,))
            parts = graph.call_function(torch.split, (merged, sizes, -1))
            items = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(group))]
        for lay, item in zip(group, items):
            item.meta.update({k: v for k, v in lay.node.meta.items() if k in ("source", "module_path")})
            lay.node.replace_all_uses_with(item)
            graph.erase_node(lay.node)
        notes.append(f"{' + '.join(lay.node.name for lay in group)}: one {fn.__name__}")
    return notes


def use_onednn(gm: GraphModule, nan_exact: Any = True, conv: bool = True, linear: bool = True,
               merge_linears: bool = True, finite: Optional[FiniteValues] = None) -> List[str]:
    """Rewrite ``gm`` (in place; the pipeline's own copy) as described in the module doc.
    Returns one note per rewritten layer (for the report). With ``nan_exact="guarded"``,
    ``finite`` (made here when not given) says which layer inputs are finite whenever the
    graph's are; its ``inputs_relied_on`` lists the inputs a caller must then check per call."""
    if not available():
        return []
    if nan_exact not in (True, False, "guarded"):
        raise ValueError(f"nan_exact must be True, False or 'guarded', got {nan_exact!r}")
    notes: List[str] = merge_sibling_linears(gm) if linear and merge_linears else []
    graph = gm.graph
    if nan_exact == "guarded" and finite is None:
        finite = FiniteValues(gm, extra=packed_finite)
    alias = AliasAnalysis(graph, gm)
    for node in list(graph.nodes):
        if node._erased:
            continue
        layer = (_conv_layer(gm, node) if conv else None) or (_linear_ok(gm, node) if linear else None)
        if layer is None or not _fp32_cpu(layer.x, node, layer.weight):
            continue
        xm = _meta(layer.x)
        if layer.kind == "conv" and (len(xm.shape) != 4 or layer.weight.dim() != 4):
            continue
        if layer.bias is not None and not _fp32_cpu(layer.bias):
            continue
        last, other, post = node, None, "none"
        # the packed call replaces the chain at its end: nothing may write what it reads (x, read
        # by the layer; other, read by the add) between that read and the end
        user = _only_user(last)
        if user is not None and alias.written_across(layer.x, (node, user)):
            user = None
        if layer.kind == "conv" and user is not None:
            o = _residual(user, last)
            om = _meta(o) if o is not None else None
            if om is not None and tuple(om.shape) == tuple(_meta(node).shape) and _fp32_cpu(o):
                last, other = user, o
                user = _only_user(last)
                if user is not None and (alias.written_across(layer.x, (node, user))
                                         or alias.written_across(o, (last, user))):
                    user = None
        guarded = False
        weights_finite = _weights_finite(layer.weight, layer.bias)
        batch = 1
        for s in xm.shape[:-1]:
            batch *= s
        if layer.kind == "linear" and mkl_is_faster(max(batch, 1), layer.weight.shape[1], layer.weight.shape[0]):
            user = None   # (its activation, if any, is left to the kernels: MKL fuses none)
        scalars = None
        if user is not None:
            found = _post_op(gm, user)
            p, scalars = found if found is not None else (None, None)
            if p is not None and other is not None and p != "relu":
                p = None   # oneDNN fuses no activation but ReLU after a residual add
            if p is not None and not POST_OPS[p][3] and nan_exact == "guarded":
                # fused only if the value it sees is finite whenever the graph's inputs are
                guarded = weights_finite and finite.holds(layer.x) and (other is None or finite.holds(other))
            if p is not None and (POST_OPS[p][3] or nan_exact is False or guarded):
                last, post = user, p
        if layer.kind == "conv":
            fn: Any = PackedConv(layer.weight, layer.bias, layer.stride, layer.padding, layer.dilation,
                                 layer.groups, xm.shape, post, other is not None, weights_finite, scalars)
            args: Tuple[Any, ...] = (layer.x,) if other is None else (layer.x, other)
        else:
            fn = PackedLinear(layer.weight, layer.bias, max(batch, 1), post, weights_finite, scalars)
            args = (layer.x,)
        with graph.inserting_before(last):
            new = graph.call_function(fn, args)
        new.meta.update({k: v for k, v in last.meta.items() if k in ("tensor_meta", "source", "module_path")})
        if finite is not None:
            finite.same_as(new, last)
        alias.same_as(new, last)
        last.replace_all_uses_with(new)
        cur = last
        while cur is not node:   # erase the chain from its end: add/activation, then the layer
            prev = cur.args[0] if cur.args[0] is not other and type(cur.args[0]) is Node else cur.args[1]
            graph.erase_node(cur)
            cur = prev
        graph.erase_node(node)
        notes.append(f"{node.name}: {fn.__name__}" + (" (activation fused for finite inputs)" if guarded else ""))
    return notes


def packed_finite(node: Node) -> Optional[bool]:
    """:class:`FiniteValues`' answer for a packed layer (finite weights: finite when its inputs are)."""
    if node.op == "call_function" and isinstance(node.target, (PackedConv, PackedLinear)):
        return node.target.weights_finite
    if node.op == "call_function" and isinstance(node.target, ChannelShuffle):
        return True   # (a permutation of its input's channels)
    return None


def accumulate_residuals_in_place(gm: GraphModule) -> List[str]:
    """Packed convolutions with a residual add whose ``other`` is a fresh packed-convolution
    result read before only by packed layers (which run where they stand) and by nothing after:
    the add accumulates into ``other`` (see the module doc)."""
    if _op("mkldnn", "_convolution_pointwise_") is None:
        return []
    graph = gm.graph
    pos = graph.positions()
    notes = []
    for node in graph.nodes:
        fn = node.target
        if node.op != "call_function" or not isinstance(fn, PackedConv) or not fn.add or fn.inplace:
            continue
        other = node.args[1]
        if type(other) is not Node or other.op != "call_function" or not isinstance(other.target, PackedConv) \
                or other is node.args[0]:
            continue
        readers = [u for u in other.users if u is not node]
        if any(u.op != "call_function" or not isinstance(u.target, (PackedConv, PackedLinear))
               or pos[u] > pos[node] or (isinstance(u.target, PackedConv) and u.target.add and u.args[1] is other)
               for u in readers):
            continue
        fn.accumulate_in_place()
        notes.append(f"{node.name}: residual add accumulates into {other.name}")
    return notes
