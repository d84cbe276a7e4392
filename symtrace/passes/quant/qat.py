"""Quantization-aware training: ``prepare_qat`` -> train -> ``convert``.

::

    gm = symtrace.symbolic_trace(model.train(), example_inputs=(x,))
    qat = prepare_qat(gm, QuantConfig())   # fake quantization where int8 will be; BN stays trainable
    opt = torch.optim.SGD(qat.parameters(), lr=0.01)
    ...                                    # train as usual: loss.backward() reaches every weight
    freeze_observers(qat); freeze_bn_stats(qat)   # optional, for the last epochs
    q = convert(qat)                       # BN folded: the same int8 graph post-training gives

Design (and why):

* **Same plan as post-training quantization.** :func:`prepare_qat` does what
  :func:`~symtrace.passes.quant.prepare` does -- canonicalize, pair each conv/linear with the
  batch norm after it (named as :func:`~symtrace.passes.fold_batch_norm` names the folded
  layer), annotate with the backend table, insert an observer after every value that will be
  int8 -- except that the batch norm is not folded away: it moves into a :class:`QATLayer`
  at the folded layer's name. So :func:`convert` only has to swap each ``QATLayer`` for the
  plain layer with folded weights and each :class:`FakeQuantize` for its observer to get
  exactly the graph ``prepare`` gives, and from there it is the post-training path (same
  ops, kernels and file format).
* **Fake quantization** rounds to the int8 grid in the forward pass and passes gradients
  straight through (STE) inside the representable range, zero outside (clipped values do not
  move). Activation ranges come from observers that update in training mode only (the
  default ``MinMaxObserver`` becomes :class:`~symtrace.passes.quant.MovingAverageMinMaxObserver`
  here: ranges drift while the weights train, and an all-time min/max would keep the widest
  early range). Parameters are then computed as in post-training quantization, so
  conversion reproduces the fake-quantized model to within rounding of the int8 kernels. A
  learnable scale (LSQ) would converge to ranges the observers then do not reproduce, needs its
  own learning-rate tuning, and pays off mainly below 8-bit activations; not provided.
* **Weights** are fake-quantized from their *current* values on every call with a fresh
  weight observer of the config (per-channel, per-tensor, ``bits``), as conversion quantizes
  them. A conv/linear followed by batch norm quantizes ``W * gamma / sqrt(running_var + eps)``
  -- the weight conversion will produce -- and, in training mode, divides that scale out of
  the result and lets the batch norm normalize with batch statistics (and update its running
  statistics) as usual. In eval mode, or after :func:`freeze_bn_stats`, it computes the folded
  layer itself: ``conv(x, fq(W_folded)) + b_folded``, what the int8 model computes.
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...graph.graph_module import GraphModule
from ...graph.node import Node
from ..fold_bn import _drop_unused, _free_name, _install, fold_weights, module_pairs
from .canonicalize import canonicalize
from .config import QuantConfig, annotate
from .observers import MinMaxObserver, MovingAverageMinMaxObserver, Observer
from .prepare import OBSERVER_CONTAINER, insert_observers, observers_of
from .qparams import QParams

__all__ = ["prepare_qat", "FakeQuantize", "QATLayer", "fake_quantize", "freeze_observers", "freeze_bn_stats",
           "qat_to_prepared", "is_qat"]

QAT_STAGE = "qat"


def fake_quantize(x: torch.Tensor, qp: QParams) -> torch.Tensor:
    """``dequantize(quantize(x))`` with ``qp``, differentiable by the straight-through estimator:
    the gradient is 1 where ``x`` falls inside the representable range, 0 where it is clipped."""
    if qp.per_channel:
        scale = torch.as_tensor(qp.scale, dtype=torch.float32, device=x.device)
        zp = torch.as_tensor(qp.zero_point, device=x.device).to(torch.int32)
        return torch.fake_quantize_per_channel_affine(x, scale, zp, qp.axis, qp.qmin, qp.qmax)
    return torch.fake_quantize_per_tensor_affine(x, float(qp.scale), int(qp.zero_point), qp.qmin, qp.qmax)


class FakeQuantize(Observer):
    """An activation observer that also rounds: in training mode it updates ``observer``
    (unless frozen: :func:`freeze_observers`), then returns :func:`fake_quantize` of its input
    with the observer's current parameters (the input itself until the observer has seen data).
    It is an :class:`Observer`, so conversion reads its parameters like any other."""

    def __init__(self, observer: Observer):
        nn.Module.__init__(self)
        self.observer = observer
        self.dtype, self.symmetric, self.reduce_range = observer.dtype, observer.symmetric, observer.reduce_range
        self.enabled = True          # observer updates (in training mode)
        self.fake_quant = True       # rounding on

    def forward(self, x):
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel()):
            return x
        if self.training and self.enabled:
            self.observer(x)
        if not self.fake_quant or not self.observer.calibrated:
            return x
        return fake_quantize(x, self.observer.qparams())

    @property
    def calibrated(self) -> bool:
        return self.observer.calibrated

    def range(self):
        return self.observer.range()

    def qparams(self) -> QParams:
        return self.observer.qparams()

    def describe(self):
        return self.observer.describe()

    def extra_repr(self) -> str:
        return f"observer_enabled={self.enabled}, fake_quant={self.fake_quant}"


class QATLayer(nn.Module):
    """A ``Conv2d``/``Linear`` (``layer``) with its weight fake-quantized by a fresh
    ``weight_observer()`` on each call (None: kept in float), and optionally the batch norm
    that follows it (``bn``), kept trainable; see the module docstring for the arithmetic.
    :meth:`folded` gives the plain layer conversion uses."""

    def __init__(self, layer: nn.Module, bn: Optional[nn.Module] = None,
                 weight_observer: Optional[Callable[[], Observer]] = None):
        super().__init__()
        self.layer = layer
        self.add_module("bn", bn)
        self.weight_observer = weight_observer
        self.bn_frozen = False

    def _fq(self, w: torch.Tensor) -> torch.Tensor:
        if self.weight_observer is None:
            return w
        obs = self.weight_observer()
        obs(w.detach())
        return fake_quantize(w, obs.qparams())

    def _run(self, x, w, b):
        if isinstance(self.layer, nn.Linear):
            return F.linear(x, w, b)
        return self.layer._conv_forward(x, w, b)

    def _folded_params(self):
        bn, layer = self.bn, self.layer
        return fold_weights(layer.weight, layer.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias, bn.eps)

    def forward(self, x):
        layer, bn = self.layer, self.bn
        if bn is None:
            return self._run(x, self._fq(layer.weight), layer.bias)
        if not self.training or self.bn_frozen:
            w, b = self._folded_params()
            return self._run(x, self._fq(w), b)
        # batch statistics: quantize the weight folded with the running statistics (what the
        # int8 model will use), divide that scale out again, and let batch norm normalize
        std = torch.sqrt(bn.running_var + bn.eps)
        factor = (bn.weight / std) if bn.weight is not None else 1.0 / std
        c = layer.weight.shape[0]
        w = layer.weight * factor.reshape((c,) + (1,) * (layer.weight.dim() - 1))
        y = self._run(x, self._fq(w), None)
        shape = (1, c) + (1,) * (y.dim() - 2)
        y = y / factor.reshape(shape)
        if layer.bias is not None:
            y = y + layer.bias.reshape(shape)
        return bn(y)

    def folded(self) -> nn.Module:
        """A plain copy of ``layer`` with the batch norm (running statistics) folded in."""
        out = copy.deepcopy(self.layer)
        if self.bn is not None:
            with torch.no_grad():
                w, b = self._folded_params()
            out.weight = nn.Parameter(w.detach().clone(), requires_grad=self.layer.weight.requires_grad)
            out.bias = nn.Parameter(b.detach().clone(), requires_grad=self.layer.weight.requires_grad)
        return out

    def extra_repr(self) -> str:
        w = "float" if self.weight_observer is None else getattr(self.weight_observer, "__name__",
                                                                 repr(self.weight_observer))
        return f"weight={w}, bn_frozen={self.bn_frozen}"


def is_qat(gm: nn.Module) -> bool:
    """Whether ``gm`` came from :func:`prepare_qat` (and is not converted yet)."""
    return isinstance(gm, GraphModule) and gm.meta.get("quant_stage") == QAT_STAGE


def _qat_config(config: QuantConfig) -> QuantConfig:
    """``config`` with the default ``MinMaxObserver`` for activations swapped for the EMA one."""
    def ema(f):
        return MovingAverageMinMaxObserver if f is MinMaxObserver else f
    out = copy.copy(config)
    out.activation = ema(config.activation)
    out.overrides = [(k, {**d, "activation": ema(d["activation"])} if "activation" in d else d)
                     for k, d in config.overrides]
    return out


def prepare_qat(gm: GraphModule, config: Optional[QuantConfig] = None, *, inplace: bool = False) -> GraphModule:
    """Prepare a training-mode graph for quantization-aware training: returns a copy (unless
    ``inplace``) with fake quantization wherever the int8 model will round, and every
    conv/linear + batch norm pair kept apart and trainable (see the module docstring).

    Train it like the model (``loss.backward()``, any ``torch.optim`` optimizer over
    ``parameters()``); ``train()``/``eval()`` switch observer updates and batch statistics.
    Then :func:`~symtrace.passes.quant.convert` folds batch norm and gives the int8 model."""
    if not isinstance(gm, GraphModule):
        raise TypeError(f"prepare_qat expects a symtrace GraphModule (from symtrace.symbolic_trace), "
                        f"got {type(gm).__name__}")
    if not gm.training:
        raise ValueError("prepare_qat needs a model in training mode (batch norm trains with batch statistics "
                         "and observers update while training). Call model.train() before tracing, or use "
                         "prepare(...) for post-training quantization of an eval-mode model.")
    if hasattr(gm, OBSERVER_CONTAINER):
        raise ValueError("this module is already prepared (prepare or prepare_qat it only once)")
    config = _qat_config(config or QuantConfig())
    if not inplace:
        gm = copy.deepcopy(gm)
    canonicalize(gm)
    graph = gm.graph

    # 1. each conv/linear -> batch norm pair: the layer moves to the name fold_batch_norm gives
    #    it, the batch-norm node goes, its module waits to join the layer in a QATLayer
    bns: Dict[Node, nn.Module] = {}
    dropped = []
    for layer_node, bn_node in module_pairs(gm):
        layer = gm.get_submodule(layer_node.target)
        target = _free_name(gm, layer_node.target + "_bn_folded")
        _install(gm, target, layer)
        dropped += [layer_node.target, bn_node.target]
        bns[layer_node] = gm.get_submodule(bn_node.target)
        bn_node.replace_all_uses_with(layer_node)
        graph.erase_node(bn_node)
        layer_node.target = target
    if dropped:
        _drop_unused(gm, dropped)

    # 2. the post-training plan and observers, on this (fold-shaped) graph
    plan = annotate(gm, config)
    insert_observers(gm, config)
    for node, obs in observers_of(gm).items():
        _install_module(gm, node.target, FakeQuantize(obs))

    # 3. fused conv/linear roots get weight fake quantization, BN pairs their batch norm
    wrapped: Dict[str, QATLayer] = {}
    for node in list(graph.nodes):
        if node.op != "call_module" or (node not in plan.fused and node not in bns):
            continue
        if node.target in wrapped:
            continue
        layer = gm.get_submodule(node.target)
        weight = config.settings_for(gm, node)["weight"] if node in plan.fused else None
        q = QATLayer(layer, bns.get(node), weight)
        _install_module(gm, node.target, q)
        wrapped[node.target] = q
    graph.lint()
    graph.created_by = "prepare_qat"
    gm.meta["quant_stage"] = QAT_STAGE
    gm.train()
    gm.recompile()
    return gm


def _install_module(gm: GraphModule, target: str, mod: nn.Module) -> None:
    path, _, leaf = target.rpartition(".")
    parent = gm.get_submodule(path) if path else gm
    setattr(parent, leaf, mod)


def _qat_modules(gm: nn.Module, cls):
    return [m for m in gm.modules() if isinstance(m, cls)]


def freeze_observers(gm: GraphModule, frozen: bool = True) -> int:
    """Stop (``frozen=False``: resume) activation-range updates of a QAT model; fake
    quantization goes on with the ranges reached. Returns how many observers it set."""
    fqs = _qat_modules(gm, FakeQuantize)
    for m in fqs:
        m.enabled = not frozen
    return len(fqs)


def freeze_bn_stats(gm: GraphModule, frozen: bool = True) -> int:
    """Make batch norms of a QAT model use (and keep) their running statistics in training
    too, i.e. train the folded layer the int8 model will run (common for the last epochs).
    Returns how many batch norms it set."""
    layers = [m for m in _qat_modules(gm, QATLayer) if m.bn is not None]
    for m in layers:
        m.bn_frozen = frozen
    return len(layers)


def qat_to_prepared(gm: GraphModule) -> GraphModule:
    """A QAT model -> the post-training ``prepare`` form (a new module, in eval mode): each
    :class:`QATLayer` becomes its plain layer with batch norm folded, each
    :class:`FakeQuantize` its observer. Conversion continues from there."""
    if not is_qat(gm):
        raise ValueError("qat_to_prepared expects a module from prepare_qat(...)")
    out = copy.deepcopy(gm)
    for node in out.graph.nodes:
        if node.op != "call_module":
            continue
        mod = out.get_submodule(node.target)
        if isinstance(mod, QATLayer):
            _install_module(out, node.target, mod.folded())
        elif isinstance(mod, FakeQuantize):
            _install_module(out, node.target, mod.observer)
    out.eval()
    out.meta.pop("quant_stage", None)
    out.graph.created_by = "qat_to_prepared"
    out.recompile()
    return out
