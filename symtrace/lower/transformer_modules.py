"""torch's transformer modules as calls of their parts (a step of the inference pipeline,
:mod:`.pipeline`).

A traced graph keeps ``nn.TransformerEncoder``, ``nn.TransformerDecoder``, their layers and
``nn.Transformer`` as single module calls (torch's own modules are leaves), so nothing inside
them is lowered. In eval mode, called without masks or causal hints, each becomes what its
``forward`` computes there, written with its submodules::

    TransformerEncoder(src)       ->  norm(layers[-1](... layers[0](src)))
    TransformerEncoderLayer(x)    ->  x = norm1(x + dropout1(self_attn(x, x, x)[0]))
                                      norm2(x + dropout2(linear2(dropout(activation(linear1(x))))))
                                      (``norm_first``: x + block(norm(x)) instead)
    TransformerDecoderLayer(x, m) ->  the same with a cross-attention block over ``m``
    Transformer(src, tgt)         ->  decoder(tgt, encoder(src))

The pipeline's next steps take it from there: the attention calls become linear layers around
SDPA (:mod:`.mha_inference`), eval-mode dropouts disappear, the linear layers are packed and
what is between them is lowered. (Eager's eval-mode fast path, ``_transformer_encoder_layer_fwd``,
computes the same values; results agree within float rounding.)

A call is left alone unless the module is exactly one of these classes, in eval mode (with
every submodule), with no hooks (nor global module hooks) and no method replaced on the
instance, its parts torch's own classes (:data:`_PARTS`: layers, attention; an encoder layer's
linears, norms and dropouts too) and its activation a module or ``F.relu``/``F.gelu`` (see
:func:`_activation_ok` for the encoder layer's fast path); and the call passes no mask and no
causal hint.
"""
from __future__ import annotations

import collections
import inspect
import operator
from typing import Any, Callable, Dict, List, Optional

import torch.nn.functional as F
from torch import nn

from ..graph.graph_module import GraphModule
from ..graph.node import Node, TensorMeta
from ..graph.symbolic_shapes import contiguous_strides
from ..passes.fuse_attention import _meta
from ..passes.module_hooks import runs_forward_hooks

__all__ = ["expand_transformer_modules"]

_METHODS = ("forward", "_sa_block", "_mha_block", "_ff_block")


def expand_transformer_modules(gm: GraphModule) -> List[str]:
    """Expand ``gm``'s eligible transformer module calls in place, containers down to their
    layers (see the module doc); the names of the expanded modules, for the report."""
    done: List[str] = []
    pending = collections.deque(gm.graph.find_nodes(op="call_module"))
    while pending:   # (an expanded container's layer calls are expanded in turn)
        n = pending.popleft()
        try:
            m = gm.get_submodule(n.target)
        except AttributeError:
            continue
        expand = _EXPANDERS.get(type(m))
        if expand is None or not _plain(m):
            continue
        try:
            bound = _SIGNATURES[type(m)].bind(m, *n.args, **n.kwargs).arguments
        except TypeError:
            continue
        if any(v is not None and v is not False for k, v in bound.items() if "mask" in k or "causal" in k):
            continue
        inputs = [bound[k] for k in ("src", "tgt", "memory") if k in bound]
        if not all(isinstance(_meta(x), TensorMeta) for x in inputs):
            continue
        build = _Builder(gm, n)
        with gm.graph.inserting_before(n):
            out = expand(build, m, bound)
        if out is None:   # (nothing was inserted: the expanders decide before they build)
            continue
        n.replace_all_uses_with(out)
        gm.graph.erase_node(n)
        done.append(n.target)
        pending.extend(build.module_calls)
    return done


def _plain(m: nn.Module) -> bool:
    return not any(s.training for s in m.modules()) and not runs_forward_hooks(m) \
        and not any(name in vars(m) for name in _METHODS) and _parts_ok(m)


class _Builder:
    """Inserts calls of the expanded module's submodules, with their results' metadata."""

    def __init__(self, gm: GraphModule, node: Node):
        self.graph = gm.graph
        self.prefix = node.target + "."
        self.keep = {k: v for k, v in node.meta.items() if k in ("source", "module_path")}
        self.module_calls: List[Node] = []

    def _with_meta(self, node: Node, like: Node, last: Optional[int] = None) -> Node:
        node.meta.update(self.keep)
        tm = _meta(like)
        shape = tuple(tm.shape) if last is None else tuple(tm.shape[:-1]) + (last,)
        node.meta["tensor_meta"] = TensorMeta(shape, tm.dtype, tm.device, contiguous_strides(shape))
        return node

    def module(self, name: str, x: Node, *more: Node, last: Optional[int] = None) -> Node:
        node = self.graph.call_module(self.prefix + name, (x,) + more, {})
        self.module_calls.append(node)
        return self._with_meta(node, x, last)

    def add(self, a: Node, b: Node) -> Node:
        return self._with_meta(self.graph.call_function(operator.add, (a, b)), a)

    def attention(self, name: str, x: Node, kv: Node) -> Node:
        call = self.graph.call_module(self.prefix + name, (x, kv, kv), {"need_weights": False})
        call.meta.update(self.keep)
        self.module_calls.append(call)
        return self._with_meta(self.graph.call_function(operator.getitem, (call, 0)), x)

    def activation(self, layer: nn.Module, x: Node) -> Node:
        act = layer.activation
        if isinstance(act, nn.Module):
            return self.module("activation", x)
        return self._with_meta(self.graph.call_function(act, (x,)), x)


def _activation_ok(layer: nn.Module) -> bool:
    """A module or ``F.relu``/``F.gelu``; for an encoder layer, one its fast path computes as
    written. That path (eval mode, no grad) runs relu or erf-GELU as the flag its ``__init__``
    set says (``activation_relu_or_gelu``: 1, 2; 0 turns the path off), whatever
    ``layer.activation`` is now: a tanh GELU, a subclass's forward or an activation assigned
    later would not be what eager computes there, so those layers stay module calls."""
    act = layer.activation
    flag = getattr(layer, "activation_relu_or_gelu", 0) if isinstance(layer, nn.TransformerEncoderLayer) else 0
    if flag == 1:
        return act is F.relu or type(act) is nn.ReLU
    if flag == 2:
        return act is F.gelu or (type(act) is nn.GELU and act.approximate == "none")
    return isinstance(act, nn.Module) or act in (F.relu, F.gelu)


#: the parts each module's expansion calls, and the classes they must be exactly: the
#: expansion calls them as the module's forward does only with these classes' defaults (a
#: custom decoder's own default for ``tgt_is_causal`` would differ from the None eager passes),
#: and an encoder layer's fast path reads its parts' weights without calling them
_PARTS = {
    nn.TransformerEncoderLayer: {"self_attn": nn.MultiheadAttention, "linear1": nn.Linear, "linear2": nn.Linear,
                                 "norm1": nn.LayerNorm, "norm2": nn.LayerNorm, "dropout": nn.Dropout,
                                 "dropout1": nn.Dropout, "dropout2": nn.Dropout},
    nn.TransformerDecoderLayer: {"self_attn": nn.MultiheadAttention, "multihead_attn": nn.MultiheadAttention},
    nn.Transformer: {"encoder": nn.TransformerEncoder, "decoder": nn.TransformerDecoder},
}
_LAYERS = {nn.TransformerEncoder: nn.TransformerEncoderLayer, nn.TransformerDecoder: nn.TransformerDecoderLayer}


def _parts_ok(m: nn.Module) -> bool:
    if any(type(getattr(m, name, None)) is not cls for name, cls in _PARTS.get(type(m), {}).items()):
        return False
    layer = _LAYERS.get(type(m))
    return layer is None or all(type(x) is layer for x in m.layers)


def _feed_forward(b: _Builder, layer: nn.Module, x: Node, dropout: str) -> Node:
    h = b.module("linear1", x, last=layer.linear1.out_features)
    h = b.module("dropout", b.activation(layer, h))
    return b.module(dropout, b.module("linear2", h, last=layer.linear2.out_features))


def _encoder_layer(b: _Builder, layer: nn.TransformerEncoderLayer, a: Dict[str, Any]) -> Optional[Node]:
    if not _activation_ok(layer):
        return None

    def sa(x):
        return b.module("dropout1", b.attention("self_attn", x, x))
    x = a["src"]
    if layer.norm_first:
        x = b.add(x, sa(b.module("norm1", x)))
        return b.add(x, _feed_forward(b, layer, b.module("norm2", x), "dropout2"))
    x = b.module("norm1", b.add(x, sa(x)))
    return b.module("norm2", b.add(x, _feed_forward(b, layer, x, "dropout2")))


def _decoder_layer(b: _Builder, layer: nn.TransformerDecoderLayer, a: Dict[str, Any]) -> Optional[Node]:
    if not _activation_ok(layer):
        return None
    memory = a["memory"]

    def sa(x):
        return b.module("dropout1", b.attention("self_attn", x, x))

    def cross(x):
        return b.module("dropout2", b.attention("multihead_attn", x, memory))
    x = a["tgt"]
    if layer.norm_first:
        x = b.add(x, sa(b.module("norm1", x)))
        x = b.add(x, cross(b.module("norm2", x)))
        return b.add(x, _feed_forward(b, layer, b.module("norm3", x), "dropout3"))
    x = b.module("norm1", b.add(x, sa(x)))
    x = b.module("norm2", b.add(x, cross(x)))
    return b.module("norm3", b.add(x, _feed_forward(b, layer, x, "dropout3")))


def _stack(b: _Builder, m: nn.Module, x: Node, *more: Node) -> Node:
    for i in range(len(m.layers)):
        x = b.module(f"layers.{i}", x, *more)
    return x if m.norm is None else b.module("norm", x)


def _encoder(b: _Builder, m: nn.TransformerEncoder, a: Dict[str, Any]) -> Optional[Node]:
    return _stack(b, m, a["src"])


def _decoder(b: _Builder, m: nn.TransformerDecoder, a: Dict[str, Any]) -> Optional[Node]:
    return _stack(b, m, a["tgt"], a["memory"])


def _transformer(b: _Builder, m: nn.Transformer, a: Dict[str, Any]) -> Optional[Node]:
    memory = b.module("encoder", a["src"])
    return b.module("decoder", a["tgt"], memory)


_EXPANDERS: Dict[type, Callable] = {
    nn.TransformerEncoderLayer: _encoder_layer, nn.TransformerDecoderLayer: _decoder_layer,
    nn.TransformerEncoder: _encoder, nn.TransformerDecoder: _decoder, nn.Transformer: _transformer,
}
_SIGNATURES = {cls: inspect.signature(cls.forward) for cls in _EXPANDERS}
