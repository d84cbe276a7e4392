"""``nn.MultiheadAttention`` module calls as the ops they compute (a step of the inference
pipeline, :mod:`.pipeline`).

A traced graph keeps ``nn.MultiheadAttention`` as one module call, which the lowering cannot
see into: its projections run as torch's generic ``addmm`` and its attention as torch's own,
however the rest of the model is lowered. In eval mode, with no attention weights asked for
and no masks, the call is rewritten into::

    qkv = F.linear(x, in_proj_weight, in_proj_bias)          # one projection for self-attention
    q, k, v = qkv.unflatten(-1, (3, H, D)).permute(2, 0, 3, 1, 4)   # (batch, heads, seq, D) each
    o = F.scaled_dot_product_attention(q, k, v)
    out = F.linear(o.transpose(1, 2).flatten(2), out_proj.weight, out_proj.bias)

(sequence-first layouts permute accordingly; cross-attention projects query, key and value
with their slices of the packed weight, or the separate ``q/k/v_proj_weight``). The linears then
take the pipeline's packed-weight paths like any other, and attention runs torch's fused SDPA
kernel. Results match the module's within float rounding (the same products, summed in
another order).

A call is left alone (and keeps the module) unless: the module is exactly
``nn.MultiheadAttention`` in eval mode with no hooks (nor global module hooks) and no patched
``forward``, its weights plain tensors (no parametrization); it has no ``bias_k``/``bias_v``
and no ``add_zero_attn``; the call passes no ``key_padding_mask``,
``attn_mask`` or ``is_causal``; its result is only unpacked for the output (the weights, when
asked for, unused); and query, key and value are 3-D floating-point tensors of recorded shape
(batched; embedding size the module's, and key and value one length).
"""
from __future__ import annotations

import dataclasses
import inspect
import operator
from typing import List

import torch
import torch.nn.functional as F
from torch import nn

from ..graph.graph_module import GraphModule
from ..graph.guards import check_data_guard
from ..graph.node import Node, TensorMeta, map_arg
from ..passes.fuse_attention import _meta
from ..passes.module_hooks import runs_forward_hooks
from .woq_merge import _register as register_constant

__all__ = ["expand_multihead_attention"]

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def expand_multihead_attention(gm: GraphModule) -> List[str]:
    """Rewrite ``gm``'s eligible ``nn.MultiheadAttention`` calls in place (see the module doc);
    the names of the rewritten modules, for the report."""
    done: List[str] = []
    for n in list(gm.graph.find_nodes(op="call_module")):
        plan = _plan(gm, n)
        if plan is not None:
            _rewrite(gm, n, *plan)
            done.append(n.target)
    return done


def _plan(gm: GraphModule, n: Node):
    """``(module, query, key, value)`` when ``n`` can be rewritten, else None."""
    try:
        m = gm.get_submodule(n.target)
    except AttributeError:
        return None
    if type(m) is not nn.MultiheadAttention or m.training or "forward" in vars(m) or runs_forward_hooks(m) \
            or m.bias_k is not None or m.bias_v is not None or m.add_zero_attn \
            or m.embed_dim // m.num_heads * m.num_heads != m.embed_dim or not _plain_weights(m):
        return None
    try:
        bound = _SIGNATURE.bind(m, *n.args, **n.kwargs)
    except TypeError:
        return None
    a = bound.arguments
    if a.get("key_padding_mask") is not None or a.get("attn_mask") is not None or a.get("is_causal", False):
        return None
    q, k, v = a["query"], a["key"], a["value"]
    metas = [_meta(x) for x in (q, k, v)]
    if any(x is None for x in metas):
        return None
    shapes = [tuple(x.shape) for x in metas]
    if any(len(s) != 3 or not all(type(d) is int for d in s) for s in shapes) \
            or not all(x.dtype.is_floating_point and x.dtype == metas[0].dtype for x in metas):
        return None
    e = m.embed_dim
    batch = 0 if m.batch_first else 1
    seq = 1 - batch
    if shapes[0][2] != e or shapes[1][2] != m.kdim or shapes[2][2] != m.vdim or shapes[1][seq] != shapes[2][seq] \
            or not shapes[0][batch] == shapes[1][batch] == shapes[2][batch]:
        return None
    for u in n.users:   # only unpacked: the output (index 0), unused weights (index 1), len() guarded
        if u.op != "call_function" or u.kwargs:
            return None
        if u.target is len and all(_holds_for_a_pair(g, u) for g in u.users):
            continue
        if not (u.target is operator.getitem and len(u.args) == 2 and u.args[1] in (0, 1)
                and (u.args[1] == 0 or not u.users)):
            return None
    return m, q, k, v


def _plain_weights(m: nn.MultiheadAttention) -> bool:
    """The projections' weights are plain tensors the graph can read (not computed by a
    parametrization, such as weight normalization, on each access), and out_proj is torch's."""
    from torch.nn.utils import parametrize
    if parametrize.is_parametrized(m) or parametrize.is_parametrized(m.out_proj) \
            or type(m.out_proj) is not nn.modules.linear.NonDynamicallyQuantizableLinear:
        return False
    names = ("in_proj_weight",) if m._qkv_same_embed_dim else ("q_proj_weight", "k_proj_weight", "v_proj_weight")
    tensors = [getattr(m, name) for name in names] + [m.out_proj.weight]
    return all(isinstance(t, torch.Tensor) for t in tensors) and \
        all(t is None or isinstance(t, torch.Tensor) for t in (m.in_proj_bias, m.out_proj.bias))


def _holds_for_a_pair(guard: Node, length: Node) -> bool:
    """Whether ``guard`` is an unused data guard on ``length`` (the len() of tuple unpacking)
    that holds for the module's result, a pair."""
    if guard.op != "call_function" or guard.target is not check_data_guard or guard.users:
        return False
    args = map_arg(guard.args, lambda a: 2 if a is length else a)
    if any(type(a) is Node for a in args):
        return False
    try:
        check_data_guard(*args, **guard.kwargs)
    except Exception:
        return False
    return True


def _rewrite(gm: GraphModule, n: Node, m: nn.MultiheadAttention, q: Node, k: Node, v: Node) -> None:
    graph = gm.graph
    e, h = m.embed_dim, m.num_heads
    d = e // h   # (as the module's forward computes it: head_dim may be stale)
    prefix = n.target + "."
    keep = {key: val for key, val in n.meta.items() if key in ("source", "module_path")}

    def add(target, args):
        node = graph.call_function(target, args)
        node.meta.update(keep)
        node.meta["tensor_meta"] = _run_meta(target, args)
        return node

    def attr(name):
        node = graph.get_attr(prefix + name)
        node.meta["tensor_meta"] = TensorMeta.of(operator.attrgetter(name)(m))
        return node

    def rows(name, first, last):
        """Rows ``first * E`` to ``last * E`` of the packed parameter ``name`` (None: absent),
        as a get_attr: the parameter itself, or a copy of the rows held by the pipeline's copy of
        the graph module (a constant the packed-weight step can pack; the per-call state check
        sees a change to the parameter it came from)."""
        t = getattr(m, name)
        if t is None:
            return None
        if (first, last) == (0, 3):
            return attr(name)
        part = t.detach()[first * e:last * e].clone()
        node = graph.get_attr(register_constant(gm, f"{n.target.replace('.', '_')}_{name}_{first}_{last}", part))
        node.meta["tensor_meta"] = TensorMeta.of(part)
        return node

    def heads(x, weight, bias, count):
        """``count`` tensors of shape (batch, heads, seq, D) from one projection of ``x``."""
        y = add(F.linear, (x, weight, bias))
        if count == 1:
            y = add(torch.unflatten, (y, -1, (h, d)))
            return [add(torch.permute, (y, (0, 2, 1, 3) if m.batch_first else (1, 2, 0, 3)))]
        y = add(torch.unflatten, (y, -1, (count, h, d)))
        y = add(torch.permute, (y, (2, 0, 3, 1, 4) if m.batch_first else (2, 1, 3, 0, 4)))
        return [add(torch.select, (y, 0, i)) for i in range(count)]

    with graph.inserting_before(n):
        if not m._qkv_same_embed_dim:   # separate weights; the bias is packed
            qkv = [heads(x, attr(f"{which}_proj_weight"), rows("in_proj_bias", i, i + 1), 1)[0]
                   for i, (x, which) in enumerate(((q, "q"), (k, "k"), (v, "v")))]
        elif q is k and k is v:          # self-attention: one projection
            qkv = heads(q, rows("in_proj_weight", 0, 3), rows("in_proj_bias", 0, 3), 3)
        elif k is v:                     # cross-attention over one memory: query, then key and value
            qkv = heads(q, rows("in_proj_weight", 0, 1), rows("in_proj_bias", 0, 1), 1) + \
                heads(k, rows("in_proj_weight", 1, 3), rows("in_proj_bias", 1, 3), 2)
        else:
            qkv = [heads(x, rows("in_proj_weight", i, i + 1), rows("in_proj_bias", i, i + 1), 1)[0]
                   for i, x in enumerate((q, k, v))]
        o = add(F.scaled_dot_product_attention, tuple(qkv))
        o = add(torch.permute, (o, (0, 2, 1, 3) if m.batch_first else (2, 0, 1, 3)))
        o = add(torch.flatten, (o, 2))
        out_bias = None if m.out_proj.bias is None else attr("out_proj.bias")
        out = add(F.linear, (o, attr("out_proj.weight"), out_bias))
    for u in list(n.users):
        if u.target is operator.getitem and u.args[1] == 0:
            u.replace_all_uses_with(out)
        for g in list(u.users):   # (len()'s guards, checked by _plan)
            graph.erase_node(g)
        graph.erase_node(u)
    graph.erase_node(n)


def _run_meta(target, args) -> TensorMeta:
    """The metadata of ``target(*args)``, run on meta tensors made from the arguments' metadata."""
    def fake(x):
        if type(x) is not Node:
            return x
        tm = _meta(x)
        return torch.empty_strided(tm.shape, tm.stride, dtype=tm.dtype, device="meta")
    out = target(*(fake(x) for x in args))
    return dataclasses.replace(TensorMeta.of(out), device=next(_meta(x).device for x in args if type(x) is Node))
