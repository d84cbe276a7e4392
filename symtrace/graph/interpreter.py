"""Run a graph node by node (:class:`Interpreter`), or rebuild it node by node (:class:`Transformer`).

Both walk the graph in order and dispatch every node to a handler named after its opcode
(``placeholder``, ``get_attr``, ``call_function``, ``call_method``, ``call_module``,
``output``); each handler gets ``(target, args, kwargs)`` with the node's inputs already
replaced by their values. Override handlers (or :meth:`Interpreter.run_node`) to observe or
change what runs: shape propagation, profiling, op swapping, graph rewriting.

An exception raised while handling a node keeps its type and traceback and gets a note naming
the node (``%name = op[target]``) and the user's source line that created it.
"""
from __future__ import annotations

import ast
import inspect
import math
import operator
import sys
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from ..proxy import NO_VALUE, Proxy
from .graph import Graph
from .graph_module import GraphModule
from .guards import entry_guard_test, raise_entry_guard_failure
from .node import _NO_DEFAULT, Node, map_aggregate, map_arg

__all__ = ["Interpreter", "Transformer"]

_MISSING = object()


class Interpreter:
    """Execute ``graph`` (default: ``module.graph``) one node at a time.

    ``module`` supplies what ``get_attr`` and ``call_module`` nodes name (see
    :meth:`fetch_attr`). ``env`` maps each node to its value during a run; with
    ``garbage_collect_values`` a value is dropped right after its last use (and a value nothing
    uses right after it is computed), as the generated ``forward`` does.

    Entry guards (``graph.guards``) are **not** checked by default: the interpreter runs
    whatever inputs it is given. Pass ``check_guards=True`` to test them first, exactly as the
    generated ``forward`` does (raising :class:`~symtrace.errors.GuardError`). Data guards are
    ordinary ``call_function`` nodes and always run.

    Example::

        class Count(Interpreter):
            def call_function(self, target, args, kwargs):
                self.calls += 1
                return super().call_function(target, args, kwargs)
    """

    #: verb used in the note added to exceptions ("while running node ...")
    _verb = "running"

    def __init__(self, module: nn.Module, graph: Optional[Graph] = None,
                 garbage_collect_values: bool = True, check_guards: bool = False):
        if graph is None:
            graph = getattr(module, "graph", None)
            if not isinstance(graph, Graph):
                raise TypeError(f"{type(self).__name__} needs a graph: pass graph=..., or a "
                                f"GraphModule (got a {type(module).__name__} without one)")
        self.module = module
        self.graph = graph
        self.garbage_collect_values = garbage_collect_values
        self.check_guards = check_guards
        #: node -> value, filled while running
        self.env: Dict[Node, Any] = {}
        #: the node being handled (None outside :meth:`run`)
        self.current_node: Optional[Node] = None
        self._inputs: Dict[str, Any] = {}

    # --- running -------------------------------------------------------------------------
    def run(self, *args, initial_env: Optional[Dict[Node, Any]] = None, **kwargs) -> Any:
        """Run the graph on ``args``/``kwargs``, bound to the placeholders by name as the
        generated ``forward`` binds them (defaults, ``*args`` and ``**kwargs`` included).

        ``initial_env`` pre-sets values of some nodes (``{node: value}``): those nodes are not
        run (partial evaluation). Placeholders given there are left out of the binding, so
        ``args`` fill the remaining ones in order. Returns the value of the ``output`` node.
        """
        env = dict(initial_env) if initial_env else {}
        self._inputs = self._bind(args, kwargs, env)
        if self.check_guards and self.graph.guards:
            self._check_entry_guards()
        return self._execute(env)

    def _execute(self, env: Dict[Node, Any]) -> Any:
        self.env = env
        frees = self._free_plan() if self.garbage_collect_values else None
        result = None
        try:
            for node in self.graph.nodes:
                if node not in env:
                    try:
                        env[node] = self.run_node(node)
                    except Exception as e:
                        self._annotate(e, node)
                        raise
                if node.op == "output":
                    result = env[node]
                if frees is not None:
                    for dead in frees.get(node, ()):
                        env.pop(dead, None)
        finally:
            self.current_node = None
        return result

    def _free_plan(self) -> Dict[Node, List[Node]]:
        """node -> the values to drop once it has run (their last use, or themselves)."""
        last_use: Dict[Node, Node] = {}
        for node in self.graph.nodes:
            for inp in node.all_input_nodes:
                last_use[inp] = node
            if not node.users and node.op != "output":
                last_use[node] = node
        frees: Dict[Node, List[Node]] = {}
        for value, user in last_use.items():
            frees.setdefault(user, []).append(value)
        return frees

    def run_node(self, n: Node) -> Any:
        """Run one node: fetch its inputs from :attr:`env`, call the handler for its opcode."""
        self.current_node = n
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        return getattr(self, n.op)(n.target, args, kwargs)

    # --- handlers ------------------------------------------------------------------------
    def placeholder(self, target: str, args: tuple, kwargs: dict) -> Any:
        """The input bound to parameter ``target`` (a tuple for ``*args``, a dict for ``**kwargs``)."""
        value = self._inputs.get(target.lstrip("*"), _MISSING)
        if value is _MISSING:
            raise RuntimeError(f"no input was given for the placeholder {target!r}")
        return value

    def get_attr(self, target: str, args: tuple, kwargs: dict) -> Any:
        """The module attribute (parameter, buffer, constant) named ``target``."""
        return self.fetch_attr(target)

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return target(*args, **kwargs)

    def call_method(self, target: str, args: tuple, kwargs: dict) -> Any:
        obj, *rest = args
        return getattr(obj, target)(*rest, **kwargs)

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        return self.fetch_attr(target)(*args, **kwargs)

    def output(self, target: str, args: tuple, kwargs: dict) -> Any:
        """The graph's result: ``args[0]``."""
        return args[0]

    # --- helpers -------------------------------------------------------------------------
    def fetch_attr(self, qualified: str) -> Any:
        """``module.<qualified>`` for a dotted name such as ``"layer1.0.conv1.weight"``."""
        obj = self.module
        done = []
        for part in qualified.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                owner = ".".join(done) or "the module"
                raise AttributeError(f"cannot fetch {qualified!r}: {owner} has no attribute {part!r}") from None
            done.append(part)
        return obj

    def fetch_args_kwargs_from_env(self, n: Node):
        """``n``'s args and kwargs with every input node replaced by its value in :attr:`env`."""
        return self.map_nodes_to_values(n.args, n), self.map_nodes_to_values(n.kwargs, n)

    def map_nodes_to_values(self, args: Any, n: Node) -> Any:
        """Replace the nodes inside ``args`` (read by ``n``) with their values."""
        env = self.env

        def load(x: Node) -> Any:
            try:
                return env[x]
            except KeyError:
                raise RuntimeError(f"node {n.name!r} reads {x.name!r}, which has no value: it was not "
                                   "run yet, or was freed (garbage_collect_values) after what the "
                                   "interpreter took for its last use") from None
        return map_arg(args, load)

    def _bind(self, args: tuple, kwargs: dict, env: Dict[Node, Any]) -> Dict[str, Any]:
        params = []
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        for p in self.graph.nodes:
            if p.op != "placeholder":
                continue
            target = p.target
            if target.startswith("**"):
                pkind = inspect.Parameter.VAR_KEYWORD
            elif target.startswith("*"):
                pkind = inspect.Parameter.VAR_POSITIONAL
                kind = inspect.Parameter.KEYWORD_ONLY
            else:
                pkind = kind
            if p in env:
                continue
            default = inspect.Parameter.empty if p.default is _NO_DEFAULT else p.default
            params.append(inspect.Parameter(target.lstrip("*"), pkind, default=default))
        try:
            bound = inspect.Signature(params).bind(*args, **kwargs)
        except TypeError as e:
            sig = ", ".join(str(p) for p in params)
            raise TypeError(f"{type(self).__name__}.run({sig}): {e}") from None
        bound.apply_defaults()
        return dict(bound.arguments)

    def _check_entry_guards(self) -> None:
        """Test the entry guards on the bound inputs, as the generated ``forward`` does."""
        guards = self.graph.guards
        cache = self.__dict__.get("_guard_code")
        if cache is None or cache[0] is not guards or cache[1] != len(guards):
            globals_ = {"torch": torch, "operator": operator, "math": math, "sys": sys}
            test = compile(entry_guard_test(guards, globals_), "<symtrace-entry-guards>", "eval")
            cache = self.__dict__["_guard_code"] = (guards, len(guards), test, globals_)
        _, _, test, globals_ = cache
        env = dict(self._inputs)
        env["root"] = getattr(self.module, "guard_root", None) or self.module
        try:
            ok = eval(test, globals_, env)
        except Exception:
            ok = False
        if not ok:
            raise_entry_guard_failure(guards, env, globals_)

    def _annotate(self, e: BaseException, node: Node) -> None:
        loc = node.meta.get("source")
        where = f" (traced from {loc.describe()})" if loc is not None else ""
        note = f"while {self._verb} node %{node.name} = {node.op}[{node.format_target()}] in " \
               f"{type(self).__name__}{where}"
        if note not in getattr(e, "__notes__", ()):
            e.add_note(note)


def _make_tracer(transformer: "Transformer"):
    """A graph-appending tracer on ``transformer.new_graph`` whose nodes inherit the
    provenance (``source``, ``module_path``) of the node being transformed."""
    from ..tracer import GraphAppendingTracer

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
        if "root" not in g.expr:
            continue
        try:
            tree = ast.parse(g.expr, mode="eval")
        except SyntaxError:
            continue
        for sub in ast.walk(tree):
            chain = _root_chain(sub)
            if chain:
                chains.append(chain)
    return chains


def _root_chain(e: ast.AST) -> Optional[List[str]]:
    parts: List[str] = []
    while True:
        if isinstance(e, ast.Attribute):
            parts.append(e.attr)
            e = e.value
        elif (isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id == "getattr"
              and len(e.args) == 2 and isinstance(e.args[1], ast.Constant) and isinstance(e.args[1].value, str)):
            parts.append(e.args[1].value)
            e = e.args[0]
        elif isinstance(e, ast.Name) and e.id == "root":
            return parts[::-1] or None
        else:
            return None
