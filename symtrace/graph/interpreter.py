"""Run a graph node by node: :class:`Interpreter` (its graph-rebuilding subclass,
``Transformer``, lives in :mod:`symtrace.transformer`).

Both walk the graph in order and dispatch every node to a handler named after its opcode
(``placeholder``, ``get_attr``, ``call_function``, ``call_method``, ``call_module``,
``output``); each handler gets ``(target, args, kwargs)`` with the node's inputs already
replaced by their values. Override handlers (or :meth:`Interpreter.run_node`) to observe or
change what runs: shape propagation, profiling, op swapping, graph rewriting.

An exception raised while handling a node keeps its type and traceback and gets a note naming
the node (``%name = op[target]``) and the user's source line that created it.
"""
from __future__ import annotations

import inspect
from types import FunctionType
from typing import Any, Dict, List, Optional

from torch import nn

from .graph import Graph
from .guards import check_entry_guards, needs_live_root
from .node import _NO_DEFAULT, Node, map_arg
from .replay import ROOT_HELPERS

__all__ = ["Interpreter"]

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
        if type(target) is FunctionType and target in ROOT_HELPERS:  # a replayed side effect
            return target(getattr(self.module, "guard_root", None) or self.module, *args, **kwargs)
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
        live_root = getattr(self.module, "guard_root", None)
        guards = [g for g in self.graph.guards if live_root is not None or not needs_live_root(g)]
        env = {n.name: self._inputs.get(n.target.lstrip("*"), _MISSING)
               for n in self.graph.nodes if n.op == "placeholder"}
        env["root"] = live_root or self.module
        check_entry_guards(guards, env, self.__dict__.setdefault("_guard_cache", {}))

    def _annotate(self, e: BaseException, node: Node) -> None:
        loc = node.meta.get("source")
        where = f" (traced from {loc.describe()})" if loc is not None else ""
        note = f"while {self._verb} node %{node.name} = {node.op}[{node.format_target()}] in " \
               f"{type(self).__name__}{where}"
        if note not in getattr(e, "__notes__", ()):
            e.add_note(note)
