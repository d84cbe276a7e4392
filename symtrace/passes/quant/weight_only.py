"""The weight-only quantization pass: Linear layers -> ``woq_linear`` with int8/int4 weights.

``weight_only(bits=4, group_size=128)`` is a pass (``GraphModule -> GraphModule``, usable in
``symtrace.capture(model, passes=[...])`` and :func:`~symtrace.passes.run_passes`) that
replaces every Linear whose weight it can read by a call of
:func:`~symtrace.passes.quant.kernels.woq_linear` on quantized buffers::

    %q_proj = call_module[q_proj](%x)
        ->
    %q_proj_qweight = get_attr[q_proj.qweight]()      # packed int4 (2048, 1024) uint8
    %q_proj_scale = get_attr[q_proj.scale]()          # float32 (2048, 16)
    %q_proj_q = call_function[symtrace.passes.quant.kernels.woq_linear](%x, %q_proj_qweight,
        %q_proj_scale, None, None, bits=4, group_size=128, in_features=2048, backend='c')

Sites: ``call_module`` of an ``nn.Linear`` (exactly that class, without hooks),
``F.linear(x, w, b)`` whose weight (and bias) are attributes of the module (``get_attr``), and
``torch.addmm(b, x, w)`` with such a weight (``(in, out)``: quantized as ``w.T``, per output
column), a 1-D bias of length ``out`` and no ``beta``/``alpha``: how Hugging Face's ``Conv1D``
(GPT-2's projections) computes ``x @ w + b``. (Not matched: ``b.addmm(x, w)``, ``x @ w + b``.)
The activations stay float unless ``activations="int8"`` (rounded per block of 32 inputs on each
call); the result is float (see :mod:`.woq` for the numbers).

**The LM head** is left in float unless ``lm_head=True`` (quantized like the other layers) or
``lm_head=8`` / ``4`` (at those bits; 8 is per channel). A site is the LM head when its
module's own name is ``lm_head`` (Hugging Face's convention; for ``F.linear`` and ``addmm``,
the weight's owner is named ``lm_head``) or when its result is itself one of the graph's outputs
(a leaf of the returned value, as a decoder's logits are; also through a ``.view``/``.reshape``
that is its only use, as ``Conv1D`` returns it). Note that the second rule also keeps the last
Linear of any model that returns its output directly (an MLP) in float by default.

The input module is not changed: the result is a new :class:`GraphModule` that shares the
untouched parameters and submodules with it and holds the quantized tensors as buffers (at
``<layer>.qweight``, ``.scale``, ``.zero``, ``.bias`` where that path is free). It saves and
loads with ``symtrace.save``/``symtrace.load``; float weights of replaced layers are not
referenced (nor saved).
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ...graph.graph import Graph
from ...graph.graph_module import GraphModule
from ...graph.node import Node, TensorMeta, iter_nodes
from ...transformer import _guard_attr_chains, _plain_attr
from ..module_hooks import runs_forward_hooks
from .kernels import woq_linear
from .registry import backend_available, default_backend, get_backend
from .woq import check_activations, check_scheme, quantize_weight_only

__all__ = ["weight_only", "WeightOnly"]

_LINEAR_FUNCS = (F.linear, torch._C._nn.linear)
_FIELDS = ("qweight", "scale", "zero", "bias")


class WeightOnly:
    """The pass :func:`weight_only` returns (see the module docstring); ``pass_name`` says
    what it does in pass reports and in the printed graph."""

    def __init__(self, bits: int = 8, group_size: Optional[int] = None, symmetric: bool = True,
                 lm_head: Union[bool, int] = False, backend: str = "auto", activations: str = "float"):
        check_scheme(bits, group_size)
        check_activations(activations)
        if backend != "auto":
            get_backend(backend)  # an unknown name fails here, not at the first call
        if not (lm_head is True or lm_head is False or lm_head in (4, 8)):
            raise ValueError(f"lm_head must be True, False, 8 or 4 (the LM head's bits), got {lm_head!r}")
        self.bits, self.group_size, self.symmetric, self.lm_head, self.backend, self.activations = \
            bits, group_size, bool(symmetric), lm_head, backend, activations
        extras = ("" if symmetric else ", symmetric=False") + (f", lm_head={lm_head}" if lm_head is not False else "") \
            + ("" if activations == "float" else f", activations={activations!r}")
        self.pass_name = f"weight_only(bits={bits}, group_size={group_size}{extras})"

    def __repr__(self) -> str:
        return self.pass_name

    def __call__(self, gm: GraphModule) -> GraphModule:
        if not isinstance(gm, GraphModule):
            raise TypeError(f"{self.pass_name} expects a symtrace GraphModule, got {type(gm).__name__}")
        backend = self.backend
        if backend == "auto":
            backend = default_backend()
        elif not backend_available(backend):
            raise RuntimeError(f"{self.pass_name}: backend {backend!r} is not usable here; use backend='auto'")
        g = copy.deepcopy(gm.graph)
        out = g.output_node()
        returned = set(iter_nodes(out.args)) if out is not None else set()
        tensors: Dict[str, torch.Tensor] = {}
        done: Dict[Any, List[str]] = {}  # weight identity -> its buffer names (shared layers quantized once)
        counts: Dict[str, int] = {}
        kept: List[str] = []
        sites = [s for s in (_site(gm, n) for n in list(g.nodes)) if s is not None]
        taken = _names_in_use(gm, g, sites)
        for site in sites:
            node, name, owner, w, b, transposed = site[0], site[2], site[3], site[4], site[5], site[6]
            x = _site(gm, node)[1]  # (read again: an earlier replacement may have rewired it)
            bits, group_size = self.bits, self.group_size
            if owner.rpartition(".")[2] == "lm_head" or _returned(node, returned):
                if self.lm_head is False:
                    kept.append(name)
                    continue
                if self.lm_head is not True:   # the LM head at its own bits (8: per channel)
                    bits, group_size = self.lm_head, (None if self.lm_head == 8 else self.group_size)
            key = (id(w), id(b), transposed, bits, group_size)
            if key not in done:
                q = quantize_weight_only(w.detach().t().contiguous() if transposed else w, bits, group_size, self.symmetric)
                values = (q.qweight, q.scale, q.zero, None if b is None else b.detach().float().clone())
                done[key] = [_place(owner, name, f, v, tensors, taken) for f, v in zip(_FIELDS, values)]
            names = done[key]
            kwargs = dict(bits=bits, group_size=group_size, in_features=w.shape[0 if transposed else 1], backend=backend)
            if self.activations != "float":
                kwargs["activations"] = self.activations
            with g.inserting_before(node):
                args = tuple(None if a is None else g.get_attr(a, meta={"tensor_meta": TensorMeta.of(tensors[a])})
                             for a in names)
                new = g.call_function(woq_linear, (x,) + args, kwargs, name=f"{node.name}_q", meta=dict(node.meta))
            new.meta["quant_layer"] = name
            node.replace_all_uses_with(new)
            inputs = list(iter_nodes((node.args, node.kwargs)))
            g.erase_node(node)
            for a in inputs:  # F.linear's weight/bias reads, when nothing else uses them
                if a.op == "get_attr" and not a.users:
                    g.erase_node(a)
            label = f"woq_linear(int{bits}, {'per-channel' if group_size is None else group_size}" \
                + ("" if self.activations == "float" else f", {self.activations} activations") + ")"
            counts[label] = counts.get(label, 0) + 1
        g.lint()
        g.created_by = self.pass_name
        new_gm = _rebuild(gm, g, tensors)
        new_gm.meta["quant_stage"] = "weight_only"
        new_gm.meta["quant_backend"] = backend
        new_gm.meta["quant_lowering"] = counts
        new_gm.meta["quant_kept_float"] = kept
        new_gm.recompile()
        return new_gm


def weight_only(bits: int = 8, group_size: Optional[int] = None, symmetric: bool = True,
                lm_head: Union[bool, int] = False, backend: str = "auto", activations: str = "float") -> WeightOnly:
    """A pass that makes Linear layers weight-only quantized (float activations, int8/int4
    weights; see :mod:`symtrace.passes.quant.weight_only` for what is replaced and
    :mod:`symtrace.passes.quant.woq` for the numbers).

    ``bits``: 8 or 4. ``group_size``: None (one scale per output channel) or a multiple of 32
    (one scale per that many inputs of a row; int4 is usually used with 32..128).
    ``symmetric``: scales only; ``False`` adds integer zero points per group. ``lm_head``:
    ``False`` (default) keeps the LM head float, ``True`` quantizes it like the other layers,
    ``8`` (or ``4``) quantizes it at those bits (8: per channel) -- as llama.cpp keeps its output
    layer at higher precision: the logits are where int4's error shows most. ``backend``: who computes
    ``woq_linear`` (``"auto"``: the best available; ``"c"`` has the AVX2/AVX-512 kernels).
    ``activations``: ``"float"`` (weight-only: activations are not rounded) or ``"int8"``: each
    call rounds the Linear's input to int8 per block of 32 inputs (a scale per block), which
    lets the ``"c"`` backend's AVX512-VNNI or AVX2 kernels sum int4 x int8 products in integers --
    int4 decode GEMVs about 1.4-1.8x faster with VNNI and 2.1-2.4x with AVX2, prefill 2-3x (AVX2:
    2.5-3.2x), for a rounding of the input (half a step of its block's largest value / 127); see
    :mod:`symtrace.passes.quant.woq`.
    The integer kernels cover int4 and symmetric int8 weights (int8: prefill about 1.7x faster, decode as fast as
    with float activations, both being bound by reading the weight); with int8 zero points the
    input is rounded and the float kernels run (the same numbers, no faster).

    >>> fast = symtrace.capture(model, passes=[weight_only(bits=4, group_size=128)])
    """
    return WeightOnly(bits, group_size, symmetric, lm_head, backend, activations)


def _attr(gm: GraphModule, n: Any) -> Optional[torch.Tensor]:
    if type(n) is not Node or n.op != "get_attr":
        return None
    try:
        v = _walk(gm, n.target)
    except AttributeError:
        return None
    return v if isinstance(v, torch.Tensor) else None


def _walk(root: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        root = getattr(root, part)
    return root


_RESHAPES = {"view", "reshape"}


def _returned(node: Node, returned: set) -> bool:
    """Whether ``node``'s result is returned: itself, or through its only user's
    ``.view``/``.reshape`` (as ``Conv1D`` restores the leading dimensions of its ``addmm``)."""
    while node not in returned:
        users = list(node.users)
        if len(users) != 1 or users[0].op != "call_method" or users[0].target not in _RESHAPES \
                or users[0].args[0] is not node:
            return False
        node = users[0]
    return True


def _site(gm: GraphModule, node: Node) -> Optional[Tuple]:
    """``(node, x, name, owner path, weight, bias, transposed)`` for a Linear this pass can
    replace; ``transposed``: the weight is stored ``(in, out)`` (``torch.addmm``), so the
    layer's ``(out, in)`` weight is its transpose."""
    if node.op == "call_module" and len(node.args) == 1 and not node.kwargs:
        try:
            mod = gm.get_submodule(node.target)
        except AttributeError:
            return None
        if type(mod) is not nn.Linear or runs_forward_hooks(mod) \
                or not mod.weight.is_floating_point():
            return None
        return node, node.args[0], node.target, node.target, mod.weight, mod.bias, False
    if node.op == "call_function" and node.target is torch.addmm and len(node.args) == 3 and not node.kwargs:
        b_node, x, w_node = node.args
        w, b = _attr(gm, w_node), _attr(gm, b_node)
        if w is None or w.dim() != 2 or not w.is_floating_point() or b is None or b.dim() != 1 \
                or b.shape[0] != w.shape[1] or not isinstance(x, Node):
            return None
        return node, x, w_node.target, w_node.target.rpartition(".")[0], w, b, True
    if node.op == "call_function" and node.target in _LINEAR_FUNCS:
        names = ("input", "weight", "bias")
        if set(node.kwargs) - set(names[len(node.args):]):
            return None
        bound = dict(zip(names, node.args), **node.kwargs)
        w_node, b_node = bound.get("weight"), bound.get("bias")
        w, b = _attr(gm, w_node), _attr(gm, b_node)
        if w is None or w.dim() != 2 or not w.is_floating_point() or (b_node is not None and (b is None or b.dim() != 1)):
            return None
        return node, bound["input"], w_node.target, w_node.target.rpartition(".")[0], w, b, False
    return None


def _names_in_use(gm: GraphModule, g: Graph, sites) -> Tuple[set, set]:
    """What the new graph keeps reading: its dotted targets (plus the module's public
    attributes), and every prefix of them. New buffers avoid both."""
    replaced = {s[0] for s in sites}
    targets = {k for k in gm.__dict__ if not k.startswith("_")}
    for n in g.nodes:
        if n.op in ("get_attr", "call_module") and n not in replaced:
            targets.add(n.target)
    for chain in _guard_attr_chains(g.guards):
        targets.add(".".join(chain))
    prefixes = set()
    for t in targets:
        parts = t.split(".")
        prefixes.update(".".join(parts[:i + 1]) for i in range(len(parts)))
    return targets, prefixes


def _place(owner: str, site_name: str, field: str, value: Optional[torch.Tensor], tensors: Dict[str, torch.Tensor],
           taken: Tuple[set, set]) -> Optional[str]:
    """A free name for a new buffer: ``<owner>.<field>`` when nothing kept lives at or under
    the owner's path nor is a leaf above it (so only fresh containers are created), else a flat
    ``<site_name_with_underscores>_<field>`` (numbered if needed)."""
    if value is None:
        return None
    targets, prefixes = taken
    parts = owner.split(".")
    above = {".".join(parts[:i]) for i in range(1, len(parts))}
    name = f"{owner}.{field}"
    if not owner or owner in prefixes or above & targets or name in tensors:
        base = f"{site_name.replace('.', '_')}_{field}"
        name, i = base, 0
        while name in prefixes or name in tensors:
            i += 1
            name = f"{base}_{i}"
    tensors[name] = value
    return name


def _rebuild(gm: GraphModule, g: Graph, tensors: Dict[str, torch.Tensor]) -> GraphModule:
    """A new GraphModule for ``g``: what it reads from ``gm`` shared, ``tensors`` as buffers."""
    attrs: Dict[str, Any] = {}
    for chain in _guard_attr_chains(g.guards):
        path, value = _plain_attr(gm, chain)
        if path:
            attrs.setdefault(path, value)
    stub = Graph()
    for n in g.nodes:
        if n.op in ("get_attr", "call_module") and n.target not in tensors and n.target not in attrs:
            stub.get_attr(n.target)
    new = GraphModule(gm, stub, class_name=getattr(gm, "_class_name", "GraphModule"), attrs=attrs)
    for name, t in tensors.items():
        prefix, _, last = name.rpartition(".")
        parent: nn.Module = new
        for part in prefix.split(".") if prefix else ():
            child = parent._modules.get(part)
            if child is None:
                child = nn.Module()
                parent.add_module(part, child)
            parent = child
        parent.register_buffer(last, t)
    new.graph = g
    new.meta = dict(getattr(gm, "meta", {}) or {})
    if getattr(gm, "guard_root", None) is not None:  # (capture's live model: guards keep reading it)
        new.guard_root = gm.guard_root
    return new
