"""Fold eval-mode batch norm into the convolution or linear layer before it.

``fold_batch_norm(gm)`` rewrites, in place, every

* ``call_module`` ``Conv1d``/``Conv2d``/``Conv3d`` or ``Linear`` followed by a ``BatchNorm1d``/
  ``2d``/``3d`` (as a ``call_module``, ``F.batch_norm`` or ``torch.batch_norm`` node), and
* ``F.conv1d``/``conv2d``/``conv3d`` or ``F.linear`` whose weight (and bias, if any) are
  ``get_attr`` nodes, followed by the same, and
* a linear layer (either form) whose ``(..., C)`` result is flattened or reshaped to ``(M, C)``
  before a ``BatchNorm1d`` (timm's LeViT: ``bn(linear(x).flatten(0, 1)).reshape_as(x)``), where
  the batch norm's channels are the layer's output features,

into the convolution alone, with weights ``W * s`` and bias ``(b - mean) * s + beta`` where
``s = gamma / sqrt(var + eps)``. It returns the number of batch norms folded.

Decisions:

* **Never in place on shared state.** The folded layer is a *new* module installed next to
  the old one (``layer1.0.conv1`` -> ``layer1.0.conv1_bn_folded``; or flattened to the top
  level when the parent is a module of the user's model), or new parameters
  (``<weight>_bn_folded``, ``<weight>_bn_folded_bias``) for the functional form. Only the
  node that fed the batch norm is pointed at it, so a convolution module that is also called
  on another path (without batch norm) keeps computing the same thing, and the user's model -
  whose parameters a traced ``GraphModule`` shares - is never modified.
* **Only when exact.** The producer's result must be read by the batch norm alone (or also by
  metadata reads such as ``x.ndim``, which folding does not change); the batch
  norm must use running statistics (eval mode, ``track_running_stats``) with constant
  ``eps``; the layers must be plain torch layers (no subclasses, no hooks); transposed
  convolutions are skipped; ``Linear`` + ``BatchNorm1d`` is folded only when the tensor
  metadata shows a 2-D result (for 3-D inputs batch norm normalizes another dimension);
  channel counts must match. Grouped and dilated convolutions, convolutions without bias and
  batch norm without affine parameters are handled. Math is done in float64, then cast back.
* **Training mode is an error.** A batch norm in training mode normalizes with batch
  statistics and updates its running statistics, so folding it would change results. Rather
  than skip it silently (leaving the caller to wonder why nothing was folded), the pass raises
  :class:`BatchNormFoldError` naming the node and the user's source line, and changes nothing:
  call ``model.eval()`` before tracing/folding.
* **Clean-up.** The batch-norm node and ``get_attr`` nodes left without users are erased;
  modules and attributes no node refers to any more are removed from the ``GraphModule``
  (only from its own container modules, never from the user's modules, and never when an
  entry guard mentions them).
"""
from __future__ import annotations

import copy
import inspect
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import SymtraceError
from ..graph.graph_module import GraphModule
from ..graph.node import Node
from .module_hooks import runs_forward_hooks

__all__ = ["fold_batch_norm", "BatchNormFoldError"]


class BatchNormFoldError(SymtraceError, ValueError):
    """A batch norm that could be folded is in training mode."""


_CONV_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BN_MODULES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_CONV_FUNCS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}
_F_BN_SIG = inspect.signature(F.batch_norm)


def _sig(*names, **defaults) -> inspect.Signature:
    return inspect.Signature([inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                default=defaults.get(p, inspect.Parameter.empty))
                              for p in names])


_F_CONV_SIG = _sig("input", "weight", "bias", "stride", "padding", "dilation", "groups",
                   bias=None, stride=1, padding=0, dilation=1, groups=1)
_F_LINEAR_SIG = _sig("input", "weight", "bias", bias=None)
_TORCH_BN_SIG = _sig("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps",
                     "cudnn_enabled")


class _BN(NamedTuple):
    node: Node
    input: Any
    mean: Optional[torch.Tensor]
    var: Optional[torch.Tensor]
    gamma: Optional[torch.Tensor]
    beta: Optional[torch.Tensor]
    eps: Any
    training: Any
    module: Optional[nn.Module]
    attr_nodes: Tuple[Node, ...]  # get_attr nodes the batch norm reads


class _Producer(NamedTuple):
    node: Node
    kind: str                      # "module" | "function"
    linear: bool
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    module: Optional[nn.Module]
    weight_node: Optional[Node]
    bias_node: Optional[Node]
    spatial: int                   # number of spatial dims (0 for linear)


def _attr(gm: nn.Module, target: str) -> Any:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _tensor_arg(gm, a) -> Tuple[bool, Optional[torch.Tensor]]:
    """(ok, tensor) for an argument that must be a constant: None or a get_attr tensor."""
    if a is None:
        return True, None
    if type(a) is Node and a.op == "get_attr":
        try:
            t = _attr(gm, a.target)
        except AttributeError:
            return False, None
        return isinstance(t, torch.Tensor), t if isinstance(t, torch.Tensor) else None
    return False, None


def _bind(sig: inspect.Signature, node: Node) -> Optional[Dict[str, Any]]:
    try:
        b = sig.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    b.apply_defaults()
    return dict(b.arguments)


def _bn_of(gm: GraphModule, node: Node) -> Optional[_BN]:
    """Describe a batch-norm node, or None if ``node`` is not one."""
    if node.op == "call_module":
        try:
            mod = gm.get_submodule(node.target)
        except AttributeError:
            return None
        if type(mod) not in _BN_MODULES or len(node.args) != 1 or node.kwargs:
            return None
        if runs_forward_hooks(mod):
            return None
        # in training mode, or without running stats, it normalizes with batch statistics
        training = True if mod.training else ("batch-stats" if mod.running_mean is None else False)
        return _BN(node, node.args[0], mod.running_mean, mod.running_var, mod.weight, mod.bias,
                   mod.eps, training, mod, ())
    if node.op != "call_function":
        return None
    if node.target is F.batch_norm:
        a = _bind(_F_BN_SIG, node)
    elif node.target is torch.batch_norm:
        a = _bind(_TORCH_BN_SIG, node)
    else:
        return None
    if a is None:
        return None
    parts = []
    attr_nodes = []
    for key in ("running_mean", "running_var", "weight", "bias"):
        ok, t = _tensor_arg(gm, a[key])
        if not ok:
            return None
        if type(a[key]) is Node:
            attr_nodes.append(a[key])
        parts.append(t)
    mean, var, gamma, beta = parts
    training = a["training"]
    if training is False and (mean is None or var is None):
        training = "batch-stats"
    return _BN(node, a["input"], mean, var, gamma, beta, a["eps"], training, None, tuple(attr_nodes))


def _producer_of(gm: GraphModule, node: Any) -> Optional[_Producer]:
    if type(node) is not Node:
        return None
    if node.op == "call_module":
        try:
            mod = gm.get_submodule(node.target)
        except AttributeError:
            return None
        t = type(mod)
        if t not in _CONV_MODULES and t is not nn.Linear:
            return None
        if runs_forward_hooks(mod) or len(node.args) != 1 or node.kwargs:
            return None
        lin = t is nn.Linear
        return _Producer(node, "module", lin, mod.weight, mod.bias, mod, None, None,
                         0 if lin else _CONV_MODULES.index(t) + 1)
    if node.op != "call_function":
        return None
    try:
        spatial = _CONV_FUNCS.get(node.target)
    except TypeError:  # unhashable target
        return None
    if spatial is not None:
        a = _bind(_F_CONV_SIG, node)
    elif node.target is F.linear:
        a = _bind(_F_LINEAR_SIG, node)
        spatial = 0
    else:
        return None
    if a is None or type(a["weight"]) is not Node or a["weight"].op != "get_attr":
        return None
    ok_w, w = _tensor_arg(gm, a["weight"])
    ok_b, b = _tensor_arg(gm, a["bias"])
    if not (ok_w and ok_b) or w is None:
        return None
    return _Producer(node, "function", spatial == 0, w, b, None, a["weight"],
                     a["bias"] if type(a["bias"]) is Node else None, spatial)


def _rank_ok(prod: _Producer, bn: _BN) -> bool:
    """Whether batch norm normalizes the producer's output channels (dim 1 of a batched
    result). Unknown ranks are accepted for convolutions (batched use is the norm, and
    BatchNorm2d/3d reject anything else), refused for linear layers."""
    want = prod.spatial + 2
    for n in (prod.node, bn.node):
        tm = n.meta.get("tensor_meta")
        if tm is not None and hasattr(tm, "shape"):
            return len(tm.shape) == want
    return not prod.linear


def fold_weights(weight: torch.Tensor, bias: Optional[torch.Tensor], mean: torch.Tensor, var: torch.Tensor,
                 gamma: Optional[torch.Tensor], beta: Optional[torch.Tensor], eps: float
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(W * s, (b - mean) * s + beta)`` with ``s = gamma / sqrt(var + eps)`` along dim 0,
    computed in float64 and cast back to the weight's (bias's) dtype. Differentiable in
    ``weight``, ``bias``, ``gamma`` and ``beta`` (quantization-aware training folds with it in
    every step; :func:`fold_batch_norm` calls it on detached tensors)."""
    dt = weight.dtype
    c = weight.shape[0]
    b64 = bias.to(torch.float64) if bias is not None else torch.zeros(c, dtype=torch.float64, device=weight.device)
    scale, _ = bn_scale_shift(mean, var, gamma, beta, eps)
    beta64 = beta.to(torch.float64) if beta is not None else torch.zeros_like(scale)
    new_w = (weight.to(torch.float64) * scale.reshape((c,) + (1,) * (weight.dim() - 1))).to(dt)
    new_b = ((b64 - mean.to(torch.float64)) * scale + beta64).to(bias.dtype if bias is not None else dt)
    return new_w, new_b


def bn_scale_shift(mean: torch.Tensor, var: torch.Tensor, gamma: Optional[torch.Tensor],
                   beta: Optional[torch.Tensor], eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """An eval-mode batch norm as ``x * scale + shift`` per channel, in float64:
    ``scale = gamma / sqrt(var + eps)``, ``shift = beta - mean * scale``."""
    var64 = var.to(torch.float64)
    scale = torch.rsqrt(var64 + float(eps))
    if gamma is not None:
        scale = gamma.to(torch.float64) * scale
    shift = -mean.to(torch.float64) * scale
    if beta is not None:
        shift = shift + beta.to(torch.float64)
    return scale, shift


def _fold_math(prod: _Producer, bn: _BN) -> Tuple[torch.Tensor, torch.Tensor]:
    def d(t):
        return None if t is None else t.detach()
    return fold_weights(prod.weight.detach(), d(prod.bias), bn.mean.detach(), bn.var.detach(), d(bn.gamma),
                        d(bn.beta), bn.eps)


def _owned_parent(gm: GraphModule, target: str) -> Optional[nn.Module]:
    """The module that holds ``target`` if it belongs to ``gm`` itself (``gm`` or one of the
    plain containers ``GraphModule`` creates), else None (a module of the user's model)."""
    path, _, _ = target.rpartition(".")
    cur: nn.Module = gm
    for part in path.split(".") if path else ():
        cur = cur._modules.get(part)
        if cur is None or type(cur) is not nn.Module:
            return None
    return cur


def _free_name(gm: GraphModule, target: str) -> str:
    """``target`` if it is free below ``gm`` and its parent is owned by ``gm``, else a free
    flattened top-level name."""
    parent = _owned_parent(gm, target)
    if parent is None:
        target = target.replace(".", "_")
        parent = gm
    path, _, leaf = target.rpartition(".")
    name, i = leaf, 0
    while hasattr(parent, name):
        i += 1
        name = f"{leaf}_{i}"
    return f"{path}.{name}" if path else name


def _install(gm: GraphModule, target: str, value: Any) -> None:
    path, _, leaf = target.rpartition(".")
    parent = gm.get_submodule(path) if path else gm
    if isinstance(value, nn.Parameter):
        parent.register_parameter(leaf, value)
    elif isinstance(value, nn.Module):
        parent.add_module(leaf, value)
    else:
        parent.register_buffer(leaf, value)


def _guard_paths(gm: GraphModule) -> set:
    """The dotted paths below ``root`` that entry guards read, with every prefix of them."""
    paths = set()
    for g in gm.graph.guards:
        if g.reads_root():
            for chain in g.expr.root_chains():
                for i in range(1, len(chain) + 1):
                    paths.add(".".join(chain[:i]))
    return paths


def _drop_unused(gm: GraphModule, targets: List[str]) -> None:
    """Remove attributes/modules no node refers to any more (owned containers only)."""
    used = set()
    for n in gm.graph.nodes:
        if n.op in ("get_attr", "call_module"):
            used.add(n.target)
    guards = _guard_paths(gm)
    for target in dict.fromkeys(targets):
        if target in used or any(u.startswith(target + ".") for u in used):
            continue
        leaf = target.rpartition(".")[2]
        if target in guards:
            continue  # an entry guard reads it
        parent = _owned_parent(gm, target)
        if parent is None or not hasattr(parent, leaf):
            continue
        delattr(parent, leaf)
        # remove containers left empty
        path = target.rpartition(".")[0]
        while path:
            par = _owned_parent(gm, path)
            leafp = path.rpartition(".")[2]
            mod = getattr(par, leafp, None) if par is not None else None
            if (mod is None or type(mod) is not nn.Module or mod._modules or mod._parameters
                    or mod._buffers or any(k != "training" and not k.startswith("_") for k in vars(mod))
                    or any(u.startswith(path + ".") for u in used)
                    or path in guards):
                break
            delattr(par, leafp)
            path = path.rpartition(".")[0]


def _where(node: Node) -> str:
    loc = node.meta.get("source")
    return loc.describe() if loc is not None else "<unknown source line>"


_METADATA_ATTRS = frozenset(("shape", "ndim", "dtype", "device", "is_cuda", "layout"))


def _reads_metadata(user: Node, node: Optional[Node] = None) -> bool:
    """Whether ``user`` reads only a tensor's metadata (``x.ndim``, ``x.shape``, ``x.size()``),
    which folding leaves as it was (timm's ``_assert(x.ndim == 4)`` between conv and norm).
    Given ``node``, also ``y.reshape_as(node)`` / ``y.view_as(node)`` / ``y.expand_as(node)``,
    which read only ``node``'s shape (timm's ``bn(x.flatten(0, 1)).reshape_as(x)``)."""
    if user.op == "call_function" and user.target is getattr:
        return len(user.args) == 2 and user.args[1] in _METADATA_ATTRS
    if (node is not None and user.op == "call_method" and user.target in _SHAPE_ONLY_SECOND
            and len(user.args) == 2 and not user.kwargs and user.args[0] is not node and user.args[1] is node):
        return True
    return user.op == "call_method" and user.target in ("size", "dim")


_SHAPE_ONLY_SECOND = frozenset(("reshape_as", "view_as", "expand_as"))
_FLATTENING_VIEWS = {"method": frozenset(("flatten", "reshape", "view")),
                     "function": (torch.flatten, torch.reshape)}


_FLATTEN_SIG = _sig("input", "start_dim", "end_dim", start_dim=0, end_dim=-1)


def _shape(node: Node) -> Optional[Tuple[int, ...]]:
    tm = node.meta.get("tensor_meta")
    shape = getattr(tm, "shape", None)
    return tuple(shape) if shape is not None else None


def _features_as_channels(gm: GraphModule, view: Any) -> Optional[_Producer]:
    """The linear layer behind ``view`` when ``view`` turns its ``(..., C)`` result into
    ``(M, C)`` for every input the graph accepts: a batch norm of that 2-D tensor normalizes the
    layer's output features, so it folds as if it followed the layer directly (timm's LeViT
    ``bn(linear(x).flatten(0, 1))``). The view must say so itself: ``flatten(0, -2)`` (the
    layer's rank, which the graph guards, from tensor metadata), or ``reshape``/``view`` to two
    dims whose last is the literal ``C``; a size computed from the example (``reshape(n, -1)``)
    is not enough."""
    if type(view) is not Node or not view.args or type(view.args[0]) is not Node:
        return None
    if not ((view.op == "call_method" and view.target in _FLATTENING_VIEWS["method"])
            or (view.op == "call_function" and view.target in _FLATTENING_VIEWS["function"])):
        return None
    prod = _producer_of(gm, view.args[0])
    if prod is None or not prod.linear:
        return None
    src = _shape(prod.node)
    if src is None or len(src) < 2:
        return None
    c = prod.weight.shape[0]
    if view.target in ("flatten", torch.flatten):
        a = _bind(_FLATTEN_SIG, view)
        if a is None or not all(isinstance(a[k], int) for k in ("start_dim", "end_dim")):
            return None
        r = len(src)
        if a["start_dim"] % r != 0 or a["end_dim"] % r != r - 2:
            return None
    else:   # (x.view(a, b), x.view((a, b)), torch.reshape(x, (a, b)))
        shape = view.args[1:]
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = shape[0]
        if view.kwargs or len(shape) != 2 or type(shape[1]) is not int or shape[1] != c:
            return None
    if any(u is not view and not _reads_metadata(u, prod.node) for u in prod.node.users):
        return None
    return prod


def _pairs(gm: GraphModule) -> List[Tuple[_Producer, _BN]]:
    """Every (producer, batch norm) pair that folding would merge, in graph order, with batch
    norms in training mode included (``bn.training is True``)."""
    graph = gm.graph
    bn_nodes = [n for n in graph.find_nodes(op="call_module")
                if isinstance(_safe_submodule(gm, n.target), _BN_MODULES)]
    bn_nodes += graph.find_nodes(op="call_function", target=F.batch_norm)
    bn_nodes += graph.find_nodes(op="call_function", target=torch.batch_norm)
    pos = graph.positions()
    bn_nodes.sort(key=pos.__getitem__)
    out = []
    for n in bn_nodes:
        bn = _bn_of(gm, n)
        if bn is None:
            continue
        prod = _producer_of(gm, bn.input)
        if prod is None:
            prod = _features_as_channels(gm, bn.input)
            if prod is None or any(u is not bn.node and not _reads_metadata(u) for u in bn.input.users):
                continue
        elif any(u is not bn.node and not _reads_metadata(u) for u in prod.node.users):
            continue
        if bn.training is True:
            out.append((prod, bn))
            continue
        if bn.training is not False or not isinstance(bn.eps, (int, float)):
            continue  # batch statistics (no running stats) or a computed flag/eps
        c = prod.weight.shape[0]
        if bn.mean.numel() != c or bn.var.numel() != c or not (bn.input is not prod.node or _rank_ok(prod, bn)):
            continue
        if any(t is not None and t.numel() != c for t in (bn.gamma, bn.beta)):
            continue
        out.append((prod, bn))
    return out


def module_pairs(gm: GraphModule) -> List[Tuple[Node, Node]]:
    """``(layer node, batch-norm node)`` for each ``call_module`` conv/linear ->
    ``call_module`` batch norm pair that :func:`fold_batch_norm` folds once the batch norm is
    in eval mode (for quantization-aware training, which keeps them apart until conversion).
    Training-mode batch norms are included; ones without running statistics are not."""
    out = []
    for prod, bn in _pairs(gm):
        if prod.kind != "module" or bn.module is None:
            continue
        mod = bn.module
        if mod.running_mean is None or not isinstance(bn.eps, (int, float)):
            continue
        c = prod.weight.shape[0]
        if mod.running_mean.numel() != c or not _rank_ok(prod, bn):
            continue
        if any(t is not None and t.numel() != c for t in (mod.weight, mod.bias)):
            continue
        out.append((prod.node, bn.node))
    return out


def fold_batch_norm(gm: GraphModule) -> int:
    """Fold eval-mode batch norms into the convolution/linear layer that feeds them (in place;
    see the module docstring). Returns how many were folded.

    Raises :class:`BatchNormFoldError` (changing nothing) if a batch norm that follows a
    foldable layer is in training mode: call ``model.eval()`` before tracing/folding.
    """
    graph = gm.graph
    plans: List[Tuple[_Producer, _BN]] = []
    refused: List[_BN] = []
    for prod, bn in _pairs(gm):
        (refused if bn.training is True else plans).append((prod, bn))
    refused = [bn for _, bn in refused]
    if refused:
        first = refused[0].node
        others = "" if len(refused) == 1 else f" (and {len(refused) - 1} more: " + ", ".join(
            repr(b.node.name) for b in refused[1:]) + ")"
        raise BatchNormFoldError(
            f"cannot fold batch norm {first.name!r} ({_where(first)}){others}: it is in training "
            "mode, where it normalizes with batch statistics and updates its running statistics, "
            "so folding would change the results. Call model.eval() before tracing/folding.")

    dropped: List[str] = []
    cache: Dict[tuple, str] = {}
    for prod, bn in plans:
        new_w, new_b = _fold_math(prod, bn)
        node = prod.node
        if prod.kind == "module":
            key = (node.target, id(bn.module) if bn.module is not None else bn.node)
            new_target = cache.get(key) if bn.module is not None else None
            if new_target is None:
                new_target = cache[key] = install_refolded_module(gm, prod, new_w, new_b, "_bn_folded")
            dropped.append(node.target)
            node.target = new_target
        else:
            point_at_new_weights(gm, prod, new_w, new_b, "_bn_folded", dropped)
        bn_node = bn.node
        bn_node.replace_all_uses_with(bn.input)   # (the layer, or the view of it the batch norm read)
        graph.erase_node(bn_node)
        if bn.module is not None:
            dropped.append(bn_node.target)
        for a in bn.attr_nodes:
            if not a.users and not a._erased:
                dropped.append(a.target)
                graph.erase_node(a)
    if plans:
        _drop_unused(gm, dropped)
    return len(plans)


def install_refolded_module(gm: GraphModule, prod: _Producer, weight: torch.Tensor, bias: Optional[torch.Tensor],
                            suffix: str) -> str:
    """A copy of ``prod``'s layer module with ``weight`` (and ``bias``; None keeps its own)
    installed as ``<target><suffix>`` (or a free flattened name); returns its target. The
    producer's node is not changed."""
    rg = prod.weight.requires_grad
    layer = copy.deepcopy(prod.module)
    layer.weight = nn.Parameter(weight, requires_grad=rg)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=rg)
    target = _free_name(gm, prod.node.target + suffix)
    _install(gm, target, layer)
    return target


def point_at_new_weights(gm: GraphModule, prod: _Producer, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         suffix: str, dropped: List[str]) -> None:
    """For a functional layer (``F.conv2d(x, w, b)``): new parameters ``<w><suffix>`` and
    (unless ``bias`` is None) ``<w><suffix>_bias``, the call pointed at them, and the old
    ``get_attr`` nodes left without users erased (their targets appended to ``dropped``)."""
    graph = gm.graph
    node = prod.node
    rg = prod.weight.requires_grad
    w_name = _free_name(gm, prod.weight_node.target + suffix)
    _install(gm, w_name, nn.Parameter(weight, requires_grad=rg))
    with graph.inserting_before(node):
        w_node = graph.get_attr(w_name, meta=dict(prod.weight_node.meta))
    args, kwargs = list(node.args), dict(node.kwargs)
    _set_arg(args, kwargs, 1, "weight", w_node)
    old_nodes = [prod.weight_node]
    if bias is not None:
        b_name = _free_name(gm, prod.weight_node.target + suffix + "_bias")
        _install(gm, b_name, nn.Parameter(bias, requires_grad=rg))
        with graph.inserting_before(node):
            b_node = graph.get_attr(b_name)
        _set_arg(args, kwargs, 2, "bias", b_node)
        if prod.bias_node is not None:
            old_nodes.append(prod.bias_node)
    node.args, node.kwargs = tuple(args), kwargs
    for old in old_nodes:
        if not old.users:
            dropped.append(old.target)
            graph.erase_node(old)


def _set_arg(args: list, kwargs: dict, index: int, name: str, value: Any) -> None:
    if len(args) > index:
        args[index] = value
    elif name in kwargs or len(args) < index:
        kwargs[name] = value
    else:
        args.append(value)


def _safe_submodule(gm: nn.Module, target: str) -> Optional[nn.Module]:
    try:
        return gm.get_submodule(target)
    except AttributeError:
        return None
