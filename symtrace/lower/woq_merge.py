"""Sibling weight-only Linear calls merged into one (a step of the inference pipeline, :mod:`.pipeline`).

``woq_linear`` calls that read the same value with the same scheme (attention's q, k and v
projections; a gated MLP's gate and up projections) become one call over the concatenated
quantized weights, whose result is split into views::

    q = woq_linear(x, Wq, ...); k = woq_linear(x, Wk, ...); v = woq_linear(x, Wv, ...)
        ->
    q, k, v = torch.split(woq_linear(x, cat(Wq, Wk, Wv), ...), (Nq, Nk, Nv), -1)

Weights are quantized per output row (and group), so the rows of the merged weight mean what
they meant alone: each output is computed as before (up to the kernel's order of summation,
which may change where a small weight becomes large enough for the row-blocked layout). A
decode step then pays one call's fixed cost (Python, the kernel's threads starting, the weight
stream ramping up) where it paid three, and the small k/v GEMVs stream with the larger one.
The merged tensors are the pipeline's own copies (memory: the merged layers' quantized weights
once more, since the caller's graph keeps the separate ones); its per-call check of the graph's
parameters and buffers sees a changed original. ``InferenceOptions(merge_linears=False)``
turns the merge off.
"""
from __future__ import annotations

import operator
from typing import Dict, List, Optional, Tuple

import torch

from ..graph.graph_module import GraphModule
from ..graph.node import Node
from ..passes.quant.kernels import woq_linear
from .onednn import _attr as attr_tensor

__all__ = ["merge_sibling_woq"]


def merge_sibling_woq(gm: GraphModule) -> List[str]:
    """Merge ``gm``'s sibling ``woq_linear`` calls in place (see the module doc); one note per
    merge, for the report."""
    graph = gm.graph
    notes: List[str] = []
    for x in list(graph.nodes):
        buckets: Dict[tuple, List[Node]] = {}
        for u in x.users:
            if u.op == "call_function" and u.target is woq_linear and len(u.args) == 5 and u.args[0] is x:
                try:
                    key = tuple(sorted(u.kwargs.items()))
                    hash(key)
                except TypeError:
                    continue
                buckets.setdefault(key, []).append(u)
        for group in buckets.values():
            if len(group) < 2:
                continue
            parts = [_stored(gm, u) for u in group]
            if any(p is None for p in parts) or len({p[2] is None for p in parts}) != 1:
                continue
            pos = graph.positions()
            order = sorted(range(len(group)), key=lambda i: pos[group[i]])
            group, parts = [group[i] for i in order], [parts[i] for i in order]
            sizes = [p[0].shape[0] for p in parts]
            merged = [torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                      None if parts[0][2] is None else torch.cat([p[2] for p in parts]), None]
            if any(p[3] is not None for p in parts):
                merged[3] = torch.cat([p[3].detach().float() if p[3] is not None else torch.zeros(n)
                                       for p, n in zip(parts, sizes)])
            names = [None if t is None else _register(gm, f"{group[0].name}_merged_{field}", t)
                     for field, t in zip(("qweight", "scale", "zero", "bias"), merged)]
            with graph.inserting_before(group[0]):
                args = tuple(None if n is None else graph.get_attr(n) for n in names)
                call = graph.call_function(woq_linear, (x,) + args, dict(group[0].kwargs))
                split = graph.call_function(torch.split, (call, sizes, -1))
                items = [graph.call_function(operator.getitem, (split, i)) for i in range(len(group))]
            for u, item in zip(group, items):
                item.meta.update({k: v for k, v in u.meta.items() if k in ("source", "module_path", "quant_layer")})
                u.replace_all_uses_with(item)
                reads = [a for a in u.args[1:5] if isinstance(a, Node)]
                graph.erase_node(u)
                for a in reads:   # the separate weights' reads, when nothing else uses them
                    if a.op == "get_attr" and not a.users:
                        graph.erase_node(a)
            notes.append(f"{' + '.join(u.name for u in group)}: one woq_linear over concatenated weights")
    return notes


def _stored(gm: GraphModule, node: Node) -> Optional[Tuple[torch.Tensor, ...]]:
    """``(qweight, scale, zero, bias)`` a ``woq_linear`` call reads from the module (each a
    ``get_attr``, or None for zero and bias), or None when one is computed."""
    out = []
    for i, a in enumerate(node.args[1:5]):
        if a is None and i >= 2:
            out.append(None)
            continue
        t = attr_tensor(gm, a)
        if t is None:
            return None
        out.append(t.detach())
    return tuple(out)


def _register(gm: GraphModule, base: str, t: torch.Tensor) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    gm.register_buffer(name, t.contiguous())
    return name
