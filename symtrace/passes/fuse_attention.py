"""Rewrite hand-written attention into ``F.scaled_dot_product_attention``: ``fuse_attention``.

Before (as a traced ``q @ k.transpose(-2, -1) * s``, ``softmax``, eval dropout, ``@ v``)::

    %transpose : = call_method[transpose](%k, -2, -1)
    %matmul : = call_function[operator.matmul](%q, %transpose)
    %mul : = call_function[operator.mul](%matmul, 0.25)
    %add : = call_function[operator.add](%mul, %mask)            # optional
    %softmax : = call_method[softmax](%mul, dim=-1)
    %attn_drop : = call_module[attn_drop](%softmax)              # optional, eval mode
    %matmul_1 : = call_function[operator.matmul](%attn_drop, %v)

After::

    %matmul_1 : = call_function[F.scaled_dot_product_attention](%q, %k, %v, attn_mask=%mask, scale=0.25)

Recognised spellings: ``@``/``torch.matmul``/``.matmul``/``torch.bmm``; ``.transpose``/
``torch.transpose``/``swapaxes``/``swapdims`` of the last two dimensions, ``.mT`` and a
``permute`` that swaps them; scaling by ``*``/``/`` a Python number on the scores or on ``q``
or ``k`` before the product (several factors multiply; none: ``scale=1.0``); an additive
``+ mask``; ``softmax`` as a method, ``torch.softmax``, ``F.softmax`` or ``nn.Softmax`` over
the last dimension; dropout as an ``nn.Dropout`` in eval mode (or ``p=0``),
``F.dropout(..., training=False)`` or ``p=0``, ``torch.dropout(x, p, False)``.

A chain is rewritten only when every intermediate node has that one user, no node with side
effects lies between its first node and the final product (the rewrite reads ``q``/``k``/
``mask`` later than the graph did), dropout cannot be random (training mode with ``p > 0``
is never rewritten), and, where nodes carry ``tensor_meta``: ``q``, ``k``, ``v`` have one
floating dtype and device, the same rank (>= 2) and batch dimensions, matching inner sizes;
a mask has the query's dtype (a boolean mask means something else to SDPA), rank >= 2
(SDPA's CPU kernel rejects 1-d masks) and broadcasts to the scores' shape (the mask form
needs this metadata). The new node keeps the final
product's ``meta`` (source line, module path, tensor metadata).

Numerics: the result differs from the unfused math by floating-point rounding, except for a
row whose mask is ``-inf`` everywhere: eager softmax gives NaN there, SDPA gives 0 (pass
``masks=False`` to leave masked attention alone). Eval-mode ``nn.Dropout`` calls are
specialised away, as in a graph lowered for inference: calling ``train()`` on the module
afterwards does not bring the dropout back.

Complexity: one pass over the graph, O(n) plus, per softmax, O(chain) and a walk of the nodes
between the chain's first and last node.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..graph.graph_module import GraphModule
from ..graph.node import Node, TensorMeta
from .infra import graph_pass
from .module_hooks import runs_forward_hooks
from ..graph.effects import is_impure

__all__ = ["fuse_attention", "find_attention", "AttentionMatch"]

_MISSING = object()
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MATMUL_FUNCS = (operator.matmul, torch.matmul, torch.Tensor.matmul, torch.bmm, torch.Tensor.bmm)
_MATMUL_METHODS = ("matmul", "__matmul__", "bmm")
_TRANSPOSE_FUNCS = (torch.transpose, torch.swapaxes, torch.swapdims, torch.Tensor.transpose)
_TRANSPOSE_METHODS = ("transpose", "swapaxes", "swapdims")
_MUL_FUNCS = (operator.mul, torch.mul, torch.Tensor.mul)
_MUL_METHODS = ("mul", "__mul__", "__rmul__")
_DIV_FUNCS = (operator.truediv, torch.div, torch.true_divide, torch.Tensor.div)
_DIV_METHODS = ("div", "true_divide", "__truediv__")
_ADD_FUNCS = (operator.add, torch.add, torch.Tensor.add)
_ADD_METHODS = ("add", "__add__", "__radd__")
_SOFTMAX_FUNCS = (torch.softmax, F.softmax, torch.Tensor.softmax)


@dataclasses.dataclass(eq=False)
class AttentionMatch:
    """One attention chain: ``output`` (the final product) computes
    ``softmax(q @ k^T * scale [+ mask]) @ v``; ``nodes`` are the chain's nodes in graph order
    (erased by the rewrite; ``output`` is the last)."""

    output: Node
    q: Node
    k: Node
    v: Node
    scale: float
    mask: Optional[Node]
    nodes: List[Node]


def _arg(node: Node, i: int, name: str, default: Any = _MISSING) -> Any:
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _is(node: Any, funcs: tuple, methods: tuple) -> bool:
    if type(node) is not Node:
        return False
    if node.op == "call_function":
        return any(node.target is f for f in funcs)
    return node.op == "call_method" and node.target in methods


def _meta(node: Any) -> Optional[TensorMeta]:
    m = node.meta.get("tensor_meta") if type(node) is Node else None
    return m if isinstance(m, TensorMeta) else None


def _rank(node: Node) -> Optional[int]:
    m = _meta(node)
    return len(m.shape) if m is not None else None


def _number(v: Any) -> bool:
    """A finite int or float."""
    return type(v) is int or (type(v) is float and v - v == 0.0)


def _only_user(node: Node, user: Node) -> bool:
    return len(node.users) == 1 and user in node.users


def _matmul_operands(node: Any) -> Optional[Tuple[Node, Node]]:
    if not _is(node, _MATMUL_FUNCS, _MATMUL_METHODS) or node.kwargs or len(node.args) != 2:
        return None
    a, b = node.args
    return (a, b) if type(a) is Node and type(b) is Node else None


def _scale_factor(node: Any) -> Optional[Tuple[Node, float]]:
    """``(x, c)`` when ``node`` is ``x * c``, ``c * x`` or ``x / c`` for a Python number ``c``."""
    if type(node) is not Node or len(node.args) != 2:
        return None
    a, b = node.args
    if _is(node, _MUL_FUNCS, _MUL_METHODS) and not node.kwargs:
        if type(a) is Node and _number(b):
            return a, float(b)
        if type(b) is Node and _number(a):
            return b, float(a)
    elif _is(node, _DIV_FUNCS, _DIV_METHODS) and node.kwargs.get("rounding_mode") is None \
            and set(node.kwargs) <= {"rounding_mode"}:
        if type(a) is Node and _number(b) and b != 0:
            return a, 1.0 / float(b)
    return None


def _transposed(node: Any) -> Optional[Node]:
    """``k`` when ``node`` swaps the last two dimensions of ``k``."""
    if type(node) is not Node:
        return None
    if node.op == "call_function" and node.target is getattr and len(node.args) == 2 and node.args[1] == "mT":
        return node.args[0] if type(node.args[0]) is Node else None
    if _is(node, _TRANSPOSE_FUNCS, _TRANSPOSE_METHODS):
        k, d0, d1 = _arg(node, 0, "input"), _arg(node, 1, "dim0"), _arg(node, 2, "dim1")
        if type(k) is not Node or type(d0) is not int or type(d1) is not int or len(node.args) + len(node.kwargs) != 3:
            return None
        n = _rank(k)
        if n is not None:
            d0, d1 = d0 % n if -n <= d0 < n else None, d1 % n if -n <= d1 < n else None
            ok = {d0, d1} == {n - 2, n - 1}
        else:
            ok = {d0, d1} == {-2, -1}
        return k if ok else None
    if node.op == "call_method" and node.target == "permute" and not node.kwargs and node.args:
        k = node.args[0]
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        if type(k) is not Node or not all(type(d) is int for d in dims):
            return None
        n = len(dims)
        if n < 2 or (_rank(k) not in (None, n)):
            return None
        norm = [d % n for d in dims] if all(-n <= d < n for d in dims) else None
        if norm == list(range(n - 2)) + [n - 1, n - 2]:
            return k
    return None


def _softmax_input(node: Any, owner: GraphModule) -> Optional[Node]:
    """The input of a softmax over the last dimension (with no dtype change), else None."""
    mod = _plain_module_call(node, owner, nn.Softmax)
    if mod is not None:
        x, dim, dtype = node.args[0], mod.dim, None
    elif _is(node, _SOFTMAX_FUNCS, ("softmax",)):
        x, dim = _arg(node, 0, "input"), _arg(node, 1, "dim", None)
        dtype = _arg(node, 3, "dtype", None) if node.target is F.softmax else _arg(node, 2, "dtype", None)
        if set(node.kwargs) - {"input", "dim", "dtype", "_stacklevel"}:
            return None
    else:
        return None
    if type(x) is not Node or type(dim) is not int:
        return None
    if dtype is not None and getattr(_meta(x), "dtype", None) != dtype:
        return None
    n = _rank(x)
    if dim != -1 and not (n is not None and dim == n - 1):
        return None
    return x


def _dropout_input(node: Any, owner: GraphModule) -> Optional[Node]:
    """The input of a dropout that is the identity (eval mode or ``p == 0``), else None."""
    mod = _plain_module_call(node, owner, nn.Dropout)
    if mod is not None:
        if mod.training and mod.p != 0:
            return None  # random: never rewritten
        return node.args[0] if type(node.args[0]) is Node else None
    if type(node) is not Node or node.op != "call_function" or node.target not in (F.dropout, torch.dropout):
        return None
    x = _arg(node, 0, "input")
    p = _arg(node, 1, "p", 0.5)
    if node.target is F.dropout:
        training, inplace = _arg(node, 2, "training", True), _arg(node, 3, "inplace", False)
    else:
        training, inplace = _arg(node, 2, "train"), False
    if type(x) is not Node or inplace is not False or type(training) is not bool or not _number(p):
        return None
    return x if (not training or p == 0) else None


def _plain_module_call(node: Any, owner: GraphModule, cls: type) -> Optional[nn.Module]:
    """The module ``node`` calls when it is a ``call_module`` node of exactly ``cls``, without
    hooks, called with one positional argument; else None."""
    if type(node) is not Node or node.op != "call_module":
        return None
    try:
        mod = owner.get_submodule(node.target)
    except AttributeError:
        return None
    if type(mod) is not cls or runs_forward_hooks(mod) or len(node.args) != 1 or node.kwargs:
        return None
    return mod


def _match(out: Node, owner: GraphModule, masks: bool) -> Optional[AttentionMatch]:
    ops = _matmul_operands(out)
    if ops is None:
        return None
    probs, v = ops
    chain = [out]
    node = probs
    x = _dropout_input(node, owner)
    if x is not None:
        if not _only_user(node, chain[-1]):
            return None
        chain.append(node)
        node = x
    x = _softmax_input(node, owner)
    if x is None or not _only_user(node, chain[-1]):
        return None
    chain.append(node)
    node = x
    mask = None
    if _is(node, _ADD_FUNCS, _ADD_METHODS) and len(node.args) == 2 and not node.kwargs \
            and all(type(a) is Node for a in node.args):
        if not masks or not _only_user(node, chain[-1]):
            return None
        a, b = node.args
        scores = a if _scores(a) else b if _scores(b) else None
        if scores is None:
            return None
        mask = b if scores is a else a
        chain.append(node)
        node = scores
    scale = 1.0
    while True:
        f = _scale_factor(node)
        if f is None:
            break
        if not _only_user(node, chain[-1]):
            return None
        chain.append(node)
        node, c = f
        scale *= c
    ops = _matmul_operands(node)
    if ops is None or not _only_user(node, chain[-1]):
        return None
    chain.append(node)
    q, kt = ops
    k = _transposed(kt)
    if k is None or not _only_user(kt, node):
        return None
    chain.append(kt)
    for side in ("q", "k"):  # a constant factor on q or k moves into the scale
        t = q if side == "q" else k
        user = node if side == "q" else kt
        f = _scale_factor(t)
        if f is not None and _only_user(t, user):
            chain.append(t)
            scale *= f[1]
            if side == "q":
                q = f[0]
            else:
                k = f[0]
    if mask is not None and (mask in chain or q is mask or k is mask or v is mask):
        return None
    if not _shapes_ok(q, k, v, mask, out):
        return None
    if any(n in chain for n in (q, k, v)):
        return None
    nodes = _in_order_without_effects(chain, owner)
    if nodes is None:
        return None
    return AttentionMatch(out, q, k, v, scale, mask, nodes)


def _scores(node: Node) -> bool:
    """Whether ``node`` looks like (scaled) ``q @ k^T`` (the non-mask operand of the add)."""
    while True:
        f = _scale_factor(node)
        if f is None:
            break
        node = f[0]
    ops = _matmul_operands(node)
    return ops is not None and _transposed(ops[1]) is not None


def _shapes_ok(q: Node, k: Node, v: Node, mask: Optional[Node], out: Node) -> bool:
    mq, mk, mv = _meta(q), _meta(k), _meta(v)
    if mq is None or mk is None or mv is None:
        return mask is None  # (the mask form needs the dtypes and shapes)
    n = len(mq.shape)
    if n < 2 or len(mk.shape) != n or len(mv.shape) != n:
        return False
    if not (mq.dtype == mk.dtype == mv.dtype) or mq.dtype not in _FLOATS:
        return False
    if not (mq.device == mk.device == mv.device):
        return False
    if not (mq.shape[:-2] == mk.shape[:-2] == mv.shape[:-2]):
        return False
    if mq.shape[-1] != mk.shape[-1] or mk.shape[-2] != mv.shape[-2]:
        return False
    mo = _meta(out)
    if mo is not None and tuple(mo.shape) != tuple(mq.shape[:-1]) + (mv.shape[-1],):
        return False
    if mask is not None:
        mm = _meta(mask)
        if mm is None or mm.dtype != mq.dtype or mm.device != mq.device:
            return False
        scores = tuple(mq.shape[:-1]) + (mk.shape[-2],)
        if not 2 <= len(mm.shape) <= len(scores) or not _broadcasts_to(tuple(mm.shape), scores):
            return False
    return True


def _broadcasts_to(shape: tuple, target: tuple) -> bool:
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def _in_order_without_effects(chain: List[Node], owner: GraphModule) -> Optional[List[Node]]:
    """``chain`` (its output first, the rest its ancestors) in graph order, provided no node
    with side effects lies between its first and last node (the fused call reads the chain's
    inputs at the output's place); else None. One walk back from the output over that span
    (a graph-wide position index would be rebuilt after every rewrite of the sweep)."""
    left = set(chain)
    order = []
    n = chain[0]
    root = owner.graph._root
    while left:
        if n is root:
            return None  # (a chain node after the output: not a valid order)
        if n in left:
            left.discard(n)
            order.append(n)
        elif n.op not in ("placeholder", "get_attr") and is_impure(n, owner):
            return None
        n = n._prev
    order.reverse()
    return order


def find_attention(gm: GraphModule, *, masks: bool = True) -> List[AttentionMatch]:
    """The attention chains :func:`fuse_attention` would rewrite in ``gm`` (graph order, not
    overlapping), without changing anything."""
    if not isinstance(gm, GraphModule):
        raise TypeError(f"find_attention expects a GraphModule, not {type(gm).__name__}")
    found: List[AttentionMatch] = []
    claimed: set = set()
    for node in gm.graph.nodes:
        if _matmul_operands(node) is None:
            continue
        m = _match(node, gm, masks)
        if m is not None and not claimed.intersection(m.nodes):
            found.append(m)
            claimed.update(m.nodes)
    return found


@graph_pass
def fuse_attention(gm: GraphModule, *, masks: bool = True) -> int:
    """Replace each ``softmax(q @ k^T * s [+ mask], dim=-1) [-> eval dropout] @ v`` in ``gm``
    by ``F.scaled_dot_product_attention(q, k, v, [attn_mask=mask,] scale=s)`` (see the
    module doc for the spellings and conditions). ``masks=False`` leaves chains with an
    additive mask alone. Edits ``gm`` in place; returns the number of rewrites."""
    if not isinstance(gm, GraphModule):
        raise TypeError(f"fuse_attention expects a GraphModule, not {type(gm).__name__}")
    graph = gm.graph
    done = 0
    for node in list(graph.nodes):  # match and rewrite in one sweep: a later chain may read an earlier one
        if node._erased or _matmul_operands(node) is None:
            continue
        m = _match(node, gm, masks)
        if m is None:
            continue
        kwargs = {"attn_mask": m.mask} if m.mask is not None else {}
        kwargs["scale"] = m.scale
        with graph.inserting_before(m.output):
            new = graph.call_function(F.scaled_dot_product_attention, (m.q, m.k, m.v), kwargs)
        new.meta.update(m.output.meta)
        m.output.replace_all_uses_with(new)
        for n in reversed(m.nodes):
            graph.erase_node(n)
        done += 1
    return done
