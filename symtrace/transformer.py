"""``Transformer``: an :class:`~symtrace.graph.interpreter.Interpreter` that rebuilds the
graph node by node, with proxies, into a new :class:`GraphModule`.

By default every node is copied with all of its ``meta`` (placeholders too) and the new graph
keeps the old guards; override a handler to change what gets built.
"""
from __future__ import annotations

import operator
from typing import Any, List, Optional

import torch
from torch import nn

from .graph.graph import Graph
from .graph.graph_module import GraphModule
from .graph.interpreter import _MISSING, Interpreter
from .graph.node import Node, map_aggregate
from .proxy import NO_VALUE, Proxy

__all__ = ["Transformer"]


def _make_tracer(transformer: "Transformer"):
    """A graph-appending tracer on ``transformer.new_graph`` whose nodes inherit the
    provenance (``source``, ``module_path``) of the node being transformed."""
    from .trace import GraphAppendingTracer

    class TransformTracer(GraphAppendingTracer):
        def create_node(self, op, target, args=(), kwargs=None, name=None):
            node = self.graph.create_node(op, target, args, kwargs, name)
            cur = transformer.current_node
            if cur is not None:
                for key in Transformer.provenance_keys:
                    if key in cur.meta and key not in node.meta:
                        node.meta[key] = cur.meta[key]
            return node

    tracer = TransformTracer(transformer.new_graph)
    n = 0  # tensor constants the tracer adds must not clash with the module's own
    while hasattr(transformer.module, f"_tensor_constant{n}"):
        n += 1
    tracer._n_consts = n
    return tracer


class Transformer(Interpreter):
    """Build a new graph from ``module.graph``, node by node: :meth:`transform` returns it as a
    new :class:`GraphModule` (sharing the module's parameters and submodules).

    Handlers receive :class:`~symtrace.proxy.Proxy` values and return Proxies (or plain
    values). By default each node is copied with its name, placeholder default and **all** of
    its ``meta``; the new graph keeps the old one's entry guards, and its ``created_by`` names
    the transformer class. Overrides can write ordinary PyTorch code on the proxies
    (``torch.sigmoid(args[0])``, ``args[0] * 2``, ``x.view(...)``): it is recorded into the new
    graph, and the nodes it creates inherit the ``source`` and ``module_path`` of the node
    being transformed (:attr:`current_node`); copy other meta from it as needed. Calling
    ``super().call_function(other_target, args, kwargs)`` creates one node with all of
    :attr:`current_node`'s meta.

    Example::

        class ReluToSigmoid(Transformer):
            def call_function(self, target, args, kwargs):
                if target is torch.relu:
                    return torch.sigmoid(*args, **kwargs)
                return super().call_function(target, args, kwargs)

        new_gm = ReluToSigmoid(gm).transform()
    """

    _verb = "transforming"
    #: meta keys that nodes recorded by an override inherit from the node being transformed
    provenance_keys = ("source", "module_path")

    def __init__(self, module: nn.Module, graph: Optional[Graph] = None):
        super().__init__(module, graph)
        self.new_graph = Graph()
        self.new_graph.guards = list(self.graph.guards)
        self.new_graph.created_by = type(self).__name__
        self.tracer = _make_tracer(self)

    def transform(self) -> GraphModule:
        """Run every node through its handler; return the new graph as a GraphModule."""
        if len(self.new_graph):
            raise RuntimeError(f"{type(self).__name__}.transform() was already called; "
                               "make a new transformer to transform again")
        self._inputs = {}
        from .trace import proxies_pass_isinstance
        with proxies_pass_isinstance():  # isinstance(args[0], torch.Tensor) holds in handlers
            self._execute({})
        attrs = dict(self.tracer.extra_attrs)
        for chain in _guard_attr_chains(self.new_graph.guards):
            path, value = _plain_attr(self.module, chain)
            if path and path not in attrs:
                attrs[path] = value
        # GraphModule fetches the graph's targets from the root before it installs ``attrs``:
        # build it on a stub graph that names only the module's own targets, then swap graphs.
        stub = Graph()
        for node in self.new_graph.nodes:
            if node.op in ("get_attr", "call_module") and node.target not in attrs:
                if _lookup(self.module, node.target) is _MISSING:
                    raise AttributeError(
                        f"{type(self).__name__} made node {node.name!r} ({node.op}) naming "
                        f"{node.target!r}, which the module does not have; add it to the module first")
                stub.get_attr(node.target)
        name = getattr(self.module, "_class_name", None) or type(self.module).__name__
        gm = GraphModule(self.module, stub, class_name=name, attrs=attrs)
        gm.graph = self.new_graph
        gm.meta.update(getattr(self.module, "meta", None) or {})
        return gm

    # --- handlers ------------------------------------------------------------------------
    def placeholder(self, target: str, args: tuple, kwargs: dict) -> Proxy:
        """A copy of the current placeholder (same name, default and meta)."""
        cur = self.current_node
        node = self.new_graph.create_node("placeholder", target, name=cur.name, meta=dict(cur.meta))
        node.default = cur.default
        return self._proxy(node)

    def get_attr(self, target: str, args: tuple, kwargs: dict) -> Proxy:
        return self._copy("get_attr", target, args, kwargs)

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return self._copy("call_function", target, args, kwargs)

    def call_method(self, target: str, args: tuple, kwargs: dict) -> Any:
        return self._copy("call_method", target, args, kwargs)

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        return self._copy("call_module", target, args, kwargs)

    def output(self, target: str, args: tuple, kwargs: dict) -> Any:
        cur = self.current_node
        return self._proxy(self.new_graph.output(_to_args(args[0]), meta=dict(cur.meta)))

    # --- helpers -------------------------------------------------------------------------
    def _copy(self, op: str, target: Any, args: tuple, kwargs: dict) -> Proxy:
        """Create one node in the new graph with the current node's meta (and its name when
        the op and target are unchanged)."""
        cur = self.current_node
        same = cur is not None and cur.op == op and cur.target is target
        node = self.new_graph.create_node(op, target, _to_args(tuple(args)), _to_args(dict(kwargs)),
                                          name=cur.name if same else None,
                                          meta=dict(cur.meta) if cur is not None else None)
        return self._proxy(node)

    def _proxy(self, node: Node) -> Proxy:
        """A proxy on ``node`` of the new graph, recording into it."""
        if node.meta.get("tensor_meta") is not None:
            guess = torch.Tensor
        elif node.op == "call_function" and node.target in (len, operator.getitem, getattr):
            guess = None
        elif node.op == "output":
            guess = None
        else:
            guess = torch.Tensor
        return Proxy(node, self.tracer, NO_VALUE, None, guess)


def _to_args(a: Any) -> Any:
    """Replace proxies by their nodes inside a nested argument structure."""
    return map_aggregate(a, lambda x: x.node if type(x) is Proxy else x)


def _lookup(root: Any, qualified: str) -> Any:
    obj = root
    for part in qualified.split("."):
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            break
    return obj


def _plain_attr(root: nn.Module, chain: List[str]):
    """Follow ``chain`` from ``root`` through submodules to the first attribute that is not a
    module: ``(dotted path, value)``, or ``(None, None)`` when it is missing."""
    obj = root
    for i, part in enumerate(chain):
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            return None, None
        if not isinstance(obj, nn.Module):
            return ".".join(chain[:i + 1]), obj
    return None, None


def _guard_attr_chains(guards) -> List[List[str]]:
    """The attribute chains entry guards read from ``root`` (e.g. ``root.heads`` -> ``[heads]``,
    ``getattr(root.layer1, '0').downsample`` -> ``[layer1, 0, downsample]``)."""
    chains: List[List[str]] = []
    for g in guards:
        if g.reads_root():
            chains.extend(g.expr.root_chains())
    return chains
