"""Alias analysis: which nodes' values may share memory, and where each such group is written.
CSE, constant folding and shape propagation use it to stay sound around in-place ops; what a
single node writes comes from the effect model (:mod:`symtrace.graph.effects`).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn

from ..graph.effects import aliased_inputs, is_impure, written_inputs
from ..graph.node import Node

__all__ = ["AliasAnalysis"]


class AliasAnalysis:
    """Groups of nodes whose values may share memory, and where each group is written.

    A node joins its inputs' group when its result may alias them (views, modules, unknown
    callables, in-place ops returning ``self``). All placeholders form one group (a caller may
    pass one tensor twice). ``get_attr`` nodes are grouped by the storage of the tensor they
    name when ``module`` is given (tied weights share a group), else all together. A
    ``call_module`` that updates state also writes the groups of its parameters and buffers.

    Build it once per pass, before editing the graph (linear time).
    """

    _INPUTS = ("<inputs>",)
    _ATTRS = ("<attributes>",)

    def __init__(self, graph, module: Optional[nn.Module] = None):
        self._parent: Dict[Any, Any] = {}
        self._storages: Dict[Any, Any] = {}
        self.module = module
        #: node -> its index in graph order
        self.positions: Dict[Node, int] = {}
        #: node -> the nodes (or state groups) it may write
        self.writes: Dict[Node, List[Any]] = {}
        #: the impure nodes (:func:`is_impure`), computed once
        self.impure: set = set()
        for i, n in enumerate(graph.nodes):
            self.positions[n] = i
            op = n.op
            if op == "placeholder":
                self._union(n, self._INPUTS)
                self.impure.add(n)
            elif op == "get_attr":
                self._union(n, self._attr_key(n.target))
            elif op == "output":
                self.impure.add(n)
            else:
                written: List[Any] = list(written_inputs(n, module))
                if op == "call_module":
                    if is_impure(n, module):
                        self.impure.add(n)
                        written.extend(self._state_keys(n))
                elif written or is_impure(n, module):
                    self.impure.add(n)
                if written:
                    self.writes[n] = written
                for inp in aliased_inputs(n, module):
                    self._union(n, inp)
        #: group -> positions of the nodes writing it
        self.written_at: Dict[Any, List[int]] = {}
        for n, ws in self.writes.items():
            for w in ws:
                self.written_at.setdefault(self.find(w), []).append(self.positions[n])

    def find(self, x: Any) -> Any:
        """The representative of ``x``'s group (a node or a state key)."""
        parent = self._parent
        root = parent.setdefault(x, x)
        if root is x and parent[x] is x:
            return x
        while parent[root] is not root:
            root = parent[root]
        while x is not root:  # path compression
            nxt = parent[x]
            parent[x] = root
            x = nxt
        return root

    def _union(self, a: Any, b: Any) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self._parent[ra] = rb

    def _storage_key(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return self._ATTRS
        try:
            key = ("<storage>", str(t.device), t.untyped_storage().data_ptr())
        except Exception:  # storage-less tensors (fake, sparse...)
            return self._ATTRS
        return self._storages.setdefault(key, key)

    def _attr_key(self, target: str) -> Any:
        if self.module is None:
            return self._ATTRS
        obj: Any = self.module
        try:
            for part in target.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            return self._ATTRS
        return self._storage_key(obj)

    def _state_keys(self, node: Node) -> List[Any]:
        try:
            sub = self.module.get_submodule(node.target)
        except AttributeError:  # (also: no module)
            return [self._ATTRS]
        return [self._storage_key(t) for t in list(sub.parameters()) + list(sub.buffers())]

    def same_as(self, new: Node, old: Node) -> None:
        """``new`` (a node made after the analysis) replaces ``old``: it joins ``old``'s group."""
        self._union(new, old)

    def is_written(self, node: Node) -> bool:
        """Whether some node may write ``node``'s value, or memory it shares."""
        return self.find(node) in self.written_at

    def written_across(self, node: Node, span) -> bool:
        """Whether ``node``'s group may be written by a node at a position from the first to
        the last of the nodes ``span`` (ends included); True when one of them was made after
        the analysis (no position: assume the worst)."""
        pos = [self.positions.get(n) for n in span]
        if not pos or any(p is None for p in pos):
            return True
        return self.written_between(node, min(pos) - 1, max(pos) + 1)

    def written_between(self, node: Node, start: int, stop: int) -> bool:
        """Whether ``node``'s group is written by a node at a position in ``(start, stop)``."""
        return any(start < p < stop for p in self.written_at.get(self.find(node), ()))
