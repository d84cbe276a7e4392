"""Tensor regions: the parts of a captured graph that compute on tensors only.

A graph captured from a program that passes Python objects around - a Hugging Face decoder
with its KV cache, a model returning a dataclass - mixes tensor computation with object
plumbing: attribute reads of the cache (``cache.layers[0].keys``), the writes that replay its
updates (``set_attributes``), the output object's constructor, replayed side effects. A
backend that lowers tensor programs cannot take such a graph whole, but it can take the
stretches between the plumbing. :func:`split_tensor_regions` outlines them as submodules
``region_<k>`` (by :func:`~symtrace.passes.split.split_module`'s outlining) whose inputs and outputs are
tensors only; everything else stays in the top-level graph, so a lowering can replace each
region and leave the objects to Python.

Which call nodes belong to a region:

* a node whose every input is a tensor (a value with recorded tensor metadata, wherever it was
  computed) or another region node, and which is not a *barrier* (an in-place op, a write to
  an object, anything that may mutate: see :func:`~symtrace.passes.split.effect_kind`);
  observing effects (data guards, closure reads) may be inside;
* a region value that is not a tensor (a size, a dtype, a shape tuple) and that the top level
  or another region also reads is computed a second time there from the region's tensor
  outputs, so only tensors cross;
* a region may not depend on a top-level node that depends on it: the nodes are grouped in
  levels (region ``k`` reads top-level nodes that read only regions before ``k``), so the
  regions run as a sequence of calls; regions that compute no tensor are not outlined.
"""
from __future__ import annotations

import copy
from typing import Dict, List, Optional, Set

from ..graph.graph_module import GraphModule
from ..graph.node import Node, TensorMeta
from .split import CALL_OPS, _outline, _taken_names, _unique_names, effect_kind, ordering_inputs

__all__ = ["tensor_region_of", "split_tensor_regions", "needs_regions"]


def _is_tensor(n: Node) -> bool:
    return isinstance(n.meta.get("tensor_meta"), TensorMeta)


def _eligible(gm: GraphModule) -> Set[Node]:
    """Call nodes that may run inside a region (inputs tensors or region nodes, no barrier)."""
    inside: Set[Node] = set()
    for n in gm.graph.nodes:
        if n.op not in CALL_OPS:
            continue
        if not all(i in inside or _is_tensor(i) or i.op == "get_attr" for i in n.all_input_nodes):
            continue
        if effect_kind(n, gm) == "barrier":
            continue
        inside.add(n)
    return inside


def needs_regions(gm: GraphModule) -> bool:
    """Whether ``gm`` holds object plumbing (an input that is not a tensor, used or not, a node
    that cannot run inside a region), so that a tensor backend must take it region by region."""
    inside = _eligible(gm)
    for n in gm.graph.nodes:
        if n.op == "placeholder" and not _is_tensor(n):
            return True
        if n.op in CALL_OPS and n not in inside:
            return True
    return False


def _recompute_where_read(gm: GraphModule, inside: Set[Node], level: Dict[Node, int]) -> None:
    """A region value that is not a tensor (a size, a shape tuple) read by the top level or by
    a region of another level is computed again where it is read, from the tensors it depends
    on, so that only tensors cross between the top level and regions and between regions."""
    copies: Dict[tuple, Node] = {}

    def crosses(x: Node, where: Optional[int]) -> bool:   # (where: a level, None for the top)
        return x in inside and not _is_tensor(x) and level[x] != where

    def copy_in(n: Node, where: Optional[int], before: Node) -> Node:
        got = copies.get((n, where))
        if got is None:
            with gm.graph.inserting_before(before):
                got = gm.graph.node_copy(n, lambda x: copy_in(x, where, before) if crosses(x, where) else x)
            copies[(n, where)] = got
            if where is not None:
                inside.add(got)
                level[got] = where
        return got

    for u in list(gm.graph.nodes):
        if u.op == "placeholder":
            continue
        where = level[u] if u in inside else None
        for i in u.all_input_nodes:
            if crosses(i, where):
                u.replace_input_with(i, copy_in(i, where, u))


def tensor_region_of(gm: GraphModule) -> Dict[Node, int]:
    """The region index of every call node of ``gm`` that runs in a region (see the module
    docstring). Adds copies of shared non-tensor values to ``gm``'s graph."""
    inside = _eligible(gm)
    extra = ordering_inputs(gm.graph, gm)
    level: Dict[Node, int] = {}
    for n in gm.graph.nodes:
        if n.op not in CALL_OPS:
            level[n] = 0
            continue
        preds: List[Node] = list(n.all_input_nodes) + list(extra.get(n, ()))
        if n in inside:
            level[n] = max((level[p] for p in preds), default=0)
        else:   # a top-level node reading region k comes after it: what reads it, after that
            level[n] = max((level[p] + (p in inside) for p in preds), default=0)
    _recompute_where_read(gm, inside, level)
    regions: Dict[int, List[Node]] = {}
    for n in inside:
        regions.setdefault(level[n], []).append(n)
    out: Dict[Node, int] = {}
    for k in sorted(regions):
        members = regions[k]
        if any(_is_tensor(n) and n.op != "get_attr" for n in members):
            for n in members:
                out[n] = k
    return out


def split_tensor_regions(gm: GraphModule) -> Optional[GraphModule]:
    """``gm`` with each tensor region outlined as a submodule ``region_<k>`` (a GraphModule
    whose inputs and outputs are tensors), or None when no region computes a tensor. ``gm``
    keeps its graph; the result has its signature and entry guards."""
    work = copy.copy(gm)   # its own graph: the top-level copies of shared values go there
    region = tensor_region_of(work)
    if not region:
        return None
    number = {k: i for i, k in enumerate(sorted(set(region.values())))}
    assign = {n: number[k] for n, k in region.items()}
    names = _unique_names(sorted(number.values()), "region_", _taken_names(work))
    return _outline(work, assign, names, created_by="split_tensor_regions", what="tensor region")
