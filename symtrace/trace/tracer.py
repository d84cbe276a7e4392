"""The tracer: runs a module or function on proxies and records what it does as a graph.

``Tracer.trace(root, example_inputs)`` records symbolically without example inputs (like
torch.fx); with them it also runs every operation on the example values, so Python decisions
resolve and become guards. The core here records calls; inputs, decisions and module access
live in :mod:`.inputs`, :mod:`.decisions` and :mod:`.modules`, process-wide patches in
:mod:`.patches`.

Tracing never changes the model: ``self`` inside ``forward`` is a shadow, buffers and inputs
are copied before example values run, writes to parameters are refused, writes to Python
state are replayed by the graph (:mod:`symtrace.side_effects`), and the RNG and grad-mode
state are restored afterwards.
"""
from __future__ import annotations

import collections
import dataclasses
import inspect
import operator
import random
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..errors import AssumedTypeAttributeError, SymtraceError, TraceError
from ..graph.code_text import MAX_NESTING
from ..graph.effects import is_inplace
from ..graph.graph import Graph
from ..graph.graph_module import GraphModule
from ..graph.guard_expr import GUARD_METHODS, Attr, BinOp, Call, GExpr, Item, Method, Root
from ..graph.guards import Guard
from ..graph.node import Node, TensorMeta, iter_nodes
from ..graph.pytree_bridge import is_pytree_container, pytree_children, pytree_context, rebuild_pytree
from ..graph.source import SourceLocation, user_location
from ..graph.tree import tree_depth, tree_map
from ..proxy import NO_VALUE, Attribute, Proxy
from ..shadow import _DELETED, is_shadow, make_shadow
from .live_objects import LiveObjects, live_entry
from ..side_effects import SideEffects
from .cells import ClosureCells
from .decisions import Decisions
from .dynamic import DynamicInput
from .inputs import CallArgs, InputBinding
from .modules import ModuleAccess, OpaqueCallRetrace, _forward_function, custom_call
from .outside import OutsideTensors
from .patches import (_ACTIVE, _REAL_MAX, _REAL_MIN, _DEFAULT_GENERATOR, _ISINSTANCE_PATCH, _TORCH_PATCHES, _TRACED_DEFAULT_GENERATOR,
                      _TracingMode)
from .values import (_BIN_SYMBOLS, _CONCRETE_ATTRS, _CONCRETE_METHODS, _NUMBER_METHODS, _SHAPE_METHODS, _SIMPLE,
                     _contains_proxy, _holds, _literal_expr, _no_torch_function, _unwrap, is_plain_object,
                     rebuild_object)

__all__ = ["Tracer", "GraphAppendingTracer", "CallArgs", "DEFAULT_LEAF_MODULE_PREFIXES"]

#: Modules defined under these packages are recorded as one ``call_module`` node.
DEFAULT_LEAF_MODULE_PREFIXES = ("torch.nn", "torch.ao.nn")
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _kept_whole(c: Any) -> bool:
    """Which containers :meth:`Tracer.create_arg` hands to ``_leaf_arg`` whole instead of walking
    (it is not asked about plain tuples and lists): all but slices and dicts without traced keys
    (a namedtuple, say, becomes a node that builds it)."""
    t = type(c)
    if t is dict:
        return any(type(k) is Proxy for k in c)
    return t is not slice

def _note_proxy_reached_c(e: BaseException) -> None:
    """Explain an error raised by code that received a traced value where it needed a real
    tensor or number (torch's C code says "... Proxy ..."), naming the user's line."""
    if isinstance(e, SymtraceError) or "Proxy" not in str(e) or not hasattr(e, "add_note"):
        return
    tb = e.__traceback__
    while tb.tb_next is not None:  # from the frame that raised, outwards to the user's code
        tb = tb.tb_next
    where = user_location(frame=tb.tb_frame)
    at = f" at {where.describe()}" if where is not None else ""
    e.add_note(f"symtrace: a traced value reached code that needs a real tensor or number{at}. "
               "This call does not dispatch on traced values (e.g. the legacy torch.Tensor(x) "
               "constructor: use torch.as_tensor(x) or x.float()); wrap the code that makes it "
               "in a function decorated with @symtrace.leaf_function to keep it as one call.")


#: the GraphModule attribute holding the object whose method was traced
SELF_OBJECT = "self_object"


class Tracer(InputBinding, Decisions, ModuleAccess, ClosureCells, OutsideTensors):
    """Records a module's or function's ``forward`` as a :class:`Graph`.

    Override points: :meth:`is_leaf_module` (which modules stay one ``call_module`` node),
    :meth:`create_node` (every node goes through it). ``leaf_modules``: extra module types kept
    as leaves. ``record_source``: record the user's file:line on each node (default True).
    """

    #: keep nodes whose results nobody uses (pure ones are otherwise erased after tracing);
    #: feature extraction names them, as torch.fx keeps them
    keep_unused = False

    def __init__(self, leaf_modules: Sequence[type] = (), record_source: bool = True,
                 guard_globals: bool = True, live: bool = False, watch_closures: bool = True,
                 specialise_pinned: bool = False, dynamic_values: frozenset = frozenset()):
        self.leaf_modules = tuple(leaf_modules)
        #: a dynamic dimension a decision pins becomes static instead of raising (``capture``)
        self.specialise_pinned = specialise_pinned
        #: the int inputs (their guard expressions' text) traced as values rather than
        #: specialised: ``capture`` names those whose value guard failed (a cache's length)
        self.dynamic_values = frozenset(dynamic_values)
        #: also guard the identity of model state (for graphs run against the live model)
        self.live = live
        self.record_source = record_source
        self.guard_globals = guard_globals
        #: take over the traced function's closure cells (:mod:`.cells`); off for templates
        #: such as patterns, whose closure values are meant to be baked in
        self.watch_closures = watch_closures

    # --- override points -----------------------------------------------------------------
    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        """Whether ``module`` is recorded as one ``call_module`` node (default: torch's own
        layers, not its containers, plus ``leaf_modules``)."""
        if self.leaf_modules and isinstance(module, self.leaf_modules):
            return True
        if isinstance(module, GraphModule) or isinstance(module, _CONTAINERS):
            return False
        mod = type(module).__module__ or ""
        return mod.startswith(DEFAULT_LEAF_MODULE_PREFIXES)

    def create_node(self, op: str, target: Any, args: tuple = (), kwargs: Optional[dict] = None,
                    name: Optional[str] = None) -> Node:
        meta: Dict[str, Any] = {}
        if self.record_source:
            loc = user_location(2)
            if loc is not None:
                meta["source"] = loc
        if self.module_path:
            meta["module_path"] = self.module_path
        return self.graph.create_node(op, target, args, kwargs, name, meta)

    # --- entry point ---------------------------------------------------------------------
    def _start(self, graph: Graph, root: nn.Module, has_values: bool) -> None:
        """Set up the state of one trace (every field a trace reads or writes)."""
        self.graph = graph
        self.root = root
        self.has_values = has_values
        self.module_path = ""
        self.extra_attrs: Dict[str, Any] = {}
        self.notes: List[Tuple[str, str, Optional[SourceLocation]]] = []
        self._attr_proxies: Dict[str, Any] = {}
        self._state_paths: Dict[str, Any] = {}   # qualified name -> its GExpr (state_path)
        self._object_containers: Dict[int, Any] = {}   # id(state list/dict of objects) -> the program's copy
        self._slotted_seen: Dict[int, Tuple[Any, Any]] = {}   # id(__slots__ state object) -> (it, first path)
        self._replaying = False
        self._tensor_proxies: Dict[int, Tuple[Any, Any]] = {}  # id(module tensor) -> (it, its proxy)
        self._guard_keys: Dict[tuple, Guard] = {}
        self._class_guards: List[Tuple[str, Guard]] = []   # (submodule path, guard on its class)
        self._data_guarded: set = set()
        self._value_modules: Dict[str, nn.Module] = {}
        self._param_storages: Optional[set] = None
        self._n_consts = 0
        self._outside: Dict[int, Tuple[Any, Any]] = {}  # id(outside tensor written) -> (it, its proxy)
        self._outside_reads: Dict[int, Tuple[Any, Any]] = {}
        self._made_here: Dict[int, Any] = {}
        self._globals_seen: set = set()
        self._input_exprs: Dict[int, Tuple[Any, Any]] = {}
        self._input_objects: Dict[int, tuple] = {}   # id(list/dict/object input) -> (expr, stand-in, it)
        self._input_loc = None
        self.effects = SideEffects()
        # plain objects handed out as themselves (closed in _trace_once)
        self._live_objects = LiveObjects(self._live_read, self._live_write, self._live_whole, self._live_absent)
        self._dynamic_spec = None
        #: input name -> its symbolic dimensions (:mod:`.dynamic`)
        self.dynamic_inputs: Dict[str, DynamicInput] = {}
        self._dynamic_names: Dict[str, Dict[int, Any]] = {}
        self._dynamic_examples: Dict[str, Any] = {}
        #: automatic dimensions made static because the program needed their value
        self.pinned: set = set()

    def trace(self, root: Any, example_inputs: Any = None, concrete_args: Optional[dict] = None,
              dynamic_shapes: Any = None) -> Graph:
        """Trace ``root`` (an ``nn.Module`` or a function) into a new graph. ``dynamic_shapes``:
        which input dimensions are symbolic (see :func:`symtrace.symbolic_trace`).

        A submodule class with its own ``__call__`` given only tensors is traced through that
        ``__call__``; where that fails or writes Python state, the trace starts again with
        the class run as one node (:class:`~symtrace.trace.own_call.OpaqueCallRetrace`)."""
        self.opaque_calls = set()
        while True:
            try:
                return self._trace_once(root, example_inputs, concrete_args, dynamic_shapes)
            except OpaqueCallRetrace as retry:
                if retry.cls in self.opaque_calls:   # (cannot happen: such a class is one node)
                    raise TraceError(f"symtrace: retracing with {retry.cls.__name__} as one node did not "
                                     "settle; please report this") from retry
                self.opaque_calls.add(retry.cls)

    def _trace_once(self, root: Any, example_inputs: Any, concrete_args: Optional[dict],
                    dynamic_shapes: Any) -> Graph:
        try:
            return self._trace_body(root, example_inputs, concrete_args, dynamic_shapes)
        finally:   # (whatever failed, and where: no class keeps the hooks of live_objects)
            live = getattr(self, "_live_objects", None)
            if live is not None:
                live.close()

    def _trace_body(self, root: Any, example_inputs: Any, concrete_args: Optional[dict],
                    dynamic_shapes: Any) -> Graph:
        graph = Graph()
        graph.created_by = "symbolic_trace"
        owner = module_of_method(root)
        self._start(graph, root if isinstance(root, nn.Module) else owner if owner is not None else nn.Module(),
                    example_inputs is not None)
        if dynamic_shapes is not None and example_inputs is None:
            raise TraceError("dynamic_shapes needs example_inputs: symbolic sizes are hinted by the examples' "
                             "sizes (pass example_inputs=(...) to symbolic_trace)")
        self._dynamic_spec = dynamic_shapes

        if isinstance(root, nn.Module):
            if custom_call(root):
                raise TraceError(f"{type(root).__name__} defines its own __call__, which a graph of its forward would "
                                 "skip; symtrace traces it only as a submodule (one node that calls it). Trace a "
                                 "module that holds it, or move what __call__ does into forward.")
            fn = _forward_function(root)
            self_arg = self.shadow_of(root, "")
            call = lambda *a, **k: self.trace_forward(self_arg, root, a, k)  # noqa: E731
            if fn is not None:
                sig_fn, skip_self = fn, True
            else:
                sig_fn, skip_self = root.__dict__["forward"], False
                self.note("forward", "forward is an instance attribute; attribute reads of `self` in it "
                          "are not guarded", None)
        elif owner is not None:
            # a method of a module (`model.forward`, as `model.forward = capture(model.forward)`
            # wraps it): traced like the module itself, with `self` its shadow — parameters are
            # get_attr nodes, submodules calls, module state guarded — but without the module's
            # hooks, which a direct method call does not run
            func, self_arg = root.__func__, self.shadow_of(owner, "")
            call = lambda *a, **k: self.trace_method(self_arg, owner, func, a, k)  # noqa: E731
            sig_fn, skip_self = root, False
        elif isinstance(root, types.MethodType) and is_plain_object(root.__self__):
            # a method of a plain object: `self` is a view of the object, which the graph
            # module holds (reads guarded, writes replayed on the object, as for module state)
            func, self.extra_attrs[SELF_OBJECT] = root.__func__, root.__self__
            view = self._plain_object(root.__self__, Attr(Root(), SELF_OBJECT))
            call = lambda *a, **k: func(view, *a, **k)  # noqa: E731
            sig_fn, skip_self = root, False
            self._guard_code_globals(func)
        elif callable(root):
            call, sig_fn, skip_self = root, root, False
            self._guard_code_globals(root)
        else:
            raise TraceError(f"symbolic_trace expects an nn.Module or a function, got {type(root).__name__}")

        code = getattr(inspect.unwrap(sig_fn), "__code__", None)
        self._input_loc = SourceLocation(code.co_filename, code.co_firstlineno, code.co_name) if code else None
        sig = inspect.signature(sig_fn)
        params = list(sig.parameters.values())
        if skip_self and params and not inspect.ismethod(sig_fn):
            params = params[1:]
        args, kwargs = self._make_inputs(params, example_inputs, concrete_args or {})
        self.guard_distinct_inputs()

        restored = classes_restored = False
        rng = torch.get_rng_state()
        py_rng = random.getstate()
        grad = torch._C.is_grad_enabled()
        _ACTIVE.stack.append(self)
        cells_restored = False
        try:
            if self.watch_closures:
                self._watch_cells(fn if isinstance(root, nn.Module) and fn is not None else
                                  root.__func__ if owner is not None else root)
            with _TORCH_PATCHES, _TracingMode(self), _ISINSTANCE_PATCH:
                try:
                    result = call(*args, **kwargs)
                except Exception as e:
                    _note_proxy_reached_c(e)
                    raise
            self._live_objects.check_untouched()
            if self.dynamic_inputs:
                self._check_pinned()
            with _no_torch_function():
                if tree_depth(result, MAX_NESTING + 1) > MAX_NESTING:
                    raise TraceError(f"{self._input_loc.describe() if self._input_loc else 'forward'} returns "
                                     f"containers nested more than {MAX_NESTING} levels deep; a graph's output "
                                     "is written as one Python expression, so flatten it")
                out = self.create_arg(result)
                class_changes, classes_restored = self.effects.restore_classes(), True
                self.guard_class_writes(class_changes)
                self.guard_input_classes()
                changes, restored = self.effects.restore_globals(), True
                self.effects.restore_state_objects(_DELETED)
                cell_changes, cells_restored = self._restore_cells(), True
                self._emit_side_effects(changes, class_changes)
                self._emit_cells(cell_changes, self._record_effect, lambda text: self.note("side effect", text, None))
            self.graph.output(out)
        finally:
            if not classes_restored:
                self.effects.restore_classes()
            if not restored:
                self.effects.restore_globals()
                self.effects.restore_state_objects(_DELETED)
            if not cells_restored:
                self._restore_cells()
            _ACTIVE.stack.pop()
            torch.set_rng_state(rng)
            random.setstate(py_rng)
            torch._C._set_grad_enabled(grad)
        if not self.keep_unused:
            self.graph.eliminate_dead_code(module=self.root)
        self.settle_class_guards(self.graph)
        return self.graph

    def _record_effect(self, helper: Callable, args: tuple) -> None:
        # (a replay may hand over state objects whose attributes the program assigned, e.g. a
        # list refilled with them: their assignments are replayed too, deepest path first)
        self._replaying = True
        try:
            self.graph.create_node("call_function", helper, self.create_arg(args), name=helper.__name__)
        finally:
            self._replaying = False

    def _emit_side_effects(self, global_changes, class_changes=()) -> None:
        """One replay node per write to Python state (see :mod:`symtrace.side_effects`)."""
        self.effects.emit(self._record_effect, self._attr_proxies, _DELETED, global_changes,
                          lambda text: self.note("side effect", text, None), class_changes)

    def record_grad_mode(self, args, kwargs):
        """``torch.no_grad()`` / ``enable_grad()`` / ``set_grad_enabled()`` inside forward: the
        switch is a node; the mode saved for the exit is read at run time (see
        ``_guarded_state_read``), so no guard on the caller's grad mode is needed."""
        return self.call_function(torch._C._set_grad_enabled, args, kwargs)

    # --- recording -----------------------------------------------------------------------
    def create_arg(self, a: Any) -> Any:
        """Turn a Python value used by traced code into a graph argument: plain tuples, lists,
        dicts and slices are copied with what they hold converted (:meth:`_leaf_arg`)."""
        return tree_map(self._leaf_arg, a, _kept_whole)

    def _leaf_arg(self, a: Any) -> Any:
        t = type(a)
        if t is Proxy or t is Attribute:
            if a.tracer is not self:
                raise TraceError(f"the value {a.node.name!r} comes from another trace")
            return a.node
        if t is dict:  # (only a dict with a traced key is not walked)
            raise TraceError("a traced value cannot be a dict key")
        if isinstance(a, _SIMPLE) or a is None or a is Ellipsis or t in (torch.Size, torch.memory_format,
                                                                          torch.layout):
            return a
        if isinstance(a, tuple) and hasattr(a, "_fields"):
            fields = self.create_arg(tuple(a))
            if next(iter_nodes(fields), None) is not None:
                return self.graph.create_node("call_function", t, fields, name=t.__name__)
            return a
        hit = self.effects.stand_ins.get(id(a))
        if hit is not None and hit[0] is a:  # an object input (a dataclass too): the caller's object itself
            return hit[1]
        entry = live_entry(a)
        if entry is not None:   # a module state object handed out as itself (live_objects)
            if entry.written and not getattr(self, "_replaying", False):
                loc = user_location(2)
                raise TraceError(f"forward passes {entry.expr.shown()}, whose attributes it assigned "
                                 f"({', '.join(sorted(entry.written))}), to traced code as a value at "
                                 f"{loc.describe() if loc else 'an unknown line'}; the graph cannot hand over the "
                                 "assigned values. Pass the attributes themselves.")
            return a
        if dataclasses.is_dataclass(a) and not isinstance(a, type):
            kw = {f.name: self.create_arg(getattr(a, f.name)) for f in dataclasses.fields(a) if f.init}
            if next(iter_nodes(kw), None) is not None:
                return self.graph.create_node("call_function", t, (), kw, name=t.__name__)
            return a
        if isinstance(a, torch.Tensor):
            p = self.outside_proxy(a) if self._outside else None
            return p.node if p is not None else self._constant(a)
        if isinstance(a, (dict, list, tuple)) and _contains_proxy(dict(a) if isinstance(a, dict) else list(a)):
            # a subclass such as OrderedDict: rebuild it from a plain container at run time
            plain = self.create_arg(dict(a) if isinstance(a, dict) else list(a))
            if isinstance(a, collections.defaultdict):
                return self.graph.create_node("call_function", t, (a.default_factory, plain), name=t.__name__)
            return self.graph.create_node("call_function", t, (plain,), name=t.__name__)
        if a is _TRACED_DEFAULT_GENERATOR:
            return _DEFAULT_GENERATOR
        if is_shadow(a):
            path = object.__getattribute__(a, "__dict__")["_symtrace_path"]
            raise TraceError(f"the module {path or 'self'!r} is passed as a value to traced code; "
                             "call it instead, or make the caller a leaf")
        if isinstance(a, nn.Module):
            raise TraceError(f"a module object ({type(a).__name__}) cannot be a graph value")
        if is_pytree_container(a):   # registered with torch.utils._pytree: rebuilt by its unflatten
            kids = self.create_arg(list(pytree_children(a)))
            if next(iter_nodes(kids), None) is None:
                return a
            return self.graph.create_node("call_function", rebuild_pytree, (t, kids, pytree_context(a)),
                                          name=t.__name__)
        if is_plain_object(a) and _holds(a, lambda x: type(x) is Proxy or type(x) is Attribute):
            # a plain object the program built around traced values: rebuilt with them at run time
            attrs = self.create_arg(dict(vars(a)))
            return self.graph.create_node("call_function", rebuild_object, (t, attrs), name=t.__name__)
        if _holds(a, lambda x: type(x) is Proxy or type(x) is Attribute):
            loc = user_location(2)
            raise TraceError(
                f"a {type(a).__name__} object holding traced values reaches the graph (as an argument or "
                f"the output) at {loc.describe() if loc else 'an unknown line'}; symtrace can only "
                "record tensors, Python values, and tuples, lists, dicts, namedtuples and dataclasses "
                "of them. Return the tensors themselves (e.g. use_cache=False for transformers caches).")
        return a

    def _constant(self, t: torch.Tensor) -> Node:
        name = f"_tensor_constant{self._n_consts}"
        self._n_consts += 1
        self.extra_attrs[name] = t
        node = self.graph.create_node("get_attr", name)
        node.meta["tensor_meta"] = TensorMeta.of(t)
        return node

    def _record(self, op: str, target: Any, args: tuple, kwargs: dict, module: Optional[nn.Module] = None,
                expr: Optional[GExpr] = None) -> Any:
        nargs = self.create_arg(args)
        nkwargs = self.create_arg(kwargs) if kwargs else None
        node = self.create_node(op, target, nargs, nkwargs)
        if not self.has_values:
            if op == "call_method" and type(args[0]) is Proxy and target[-1:] == "_" and target[:1] != "_":
                return args[0]  # an in-place method returns its receiver
            return Proxy(node, self, NO_VALUE, None, _guess_result(op, target, args, kwargs))
        vargs = _unwrap(args)
        vkwargs = _unwrap(kwargs) if kwargs else {}
        if is_inplace(node):
            self._check_not_parameter(node, vargs)
        try:
            with _no_torch_function():
                if op == "call_function":
                    value = target(*vargs, **vkwargs)
                elif op == "call_method":
                    value = getattr(vargs[0], target)(*vargs[1:], **vkwargs)
                else:
                    value = module(*vargs, **vkwargs)
                if isinstance(value, torch.Tensor):
                    node.meta["tensor_meta"] = TensorMeta.of(value)
        except Exception as e:
            loc = node.meta.get("source")
            if not node.users:
                self.graph.erase_node(node)
            if loc is not None and hasattr(e, "add_note"):
                e.add_note(f"raised while running the example inputs through {loc.describe()}")
            raise
        if op == "call_method" and value is vargs[0] and type(args[0]) is Proxy and target[-1:] == "_" \
                and target[:1] != "_":
            return args[0]  # an in-place method returns its receiver (y = x.add_(1): y is x)
        return Proxy(node, self, value, expr)

    def _check_not_parameter(self, node: Node, vargs: tuple) -> None:
        if not vargs or not isinstance(vargs[0], torch.Tensor):
            return
        if self._param_storages is None:
            self._param_storages = {p.untyped_storage().data_ptr(): n for n, p in self.root.named_parameters()}
        name = self._param_storages.get(vargs[0].untyped_storage().data_ptr())
        if name is not None:
            loc = node.meta.get("source")
            raise TraceError(f"forward updates the parameter {name!r} in place ({node.format_target()}) at "
                             f"{loc.describe() if loc else 'an unknown line'}; symtrace does not record "
                             "in-place updates of parameters. Make it a buffer, or do it outside forward.")

    def call_function(self, fn: Callable, args: tuple, kwargs: Optional[dict] = None) -> Any:
        """Record ``fn(*args, **kwargs)``."""
        kwargs = kwargs or {}
        expr = self._expr_of(fn, args) if self.has_values and not kwargs else None
        if fn is getattr and len(args) == 2 and type(args[0]) is Proxy:
            return self.proxy_getattr(args[0], args[1])
        return self._record("call_function", fn, args, kwargs, expr=expr)

    def torch_function(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """A torch function or Tensor method called with proxies among its arguments."""
        if (args and type(args[0]) is not Proxy and isinstance(args[0], torch.Tensor)) or "out" in kwargs:
            self.take_over_written(func, args, kwargs)
        if self._outside:
            args, kwargs = self.substitute_outside(args, kwargs)
        if getattr(func, "__name__", None) == "__get__":  # Tensor property, e.g. x.shape
            owner = getattr(func, "__self__", None)
            attr = getattr(owner, "__name__", None)
            if attr is not None and args and type(args[0]) is Proxy:
                return self.proxy_getattr(args[0], attr)
        return self.call_function(func, args, kwargs)

    def call_method(self, name: str, obj: Proxy, args: tuple, kwargs: dict) -> Any:
        """Record ``obj.name(*args, **kwargs)``."""
        if self.has_values:
            if name in _CONCRETE_METHODS and isinstance(obj.value, torch.Tensor):
                return self._concrete(self._record("call_method", name, (obj,) + args, kwargs,
                                                   expr=self._method_expr(obj, name, args, kwargs)),
                                      f"{name}() of a traced tensor")
            if name == "tolist":
                p = self._record("call_method", name, (obj,) + args, kwargs)
                self.add_guard(p, "eq", p.value, f".{name}() of a traced tensor")
                return p.value
            expr = self._method_expr(obj, name, args, kwargs)
            return self._record("call_method", name, (obj,) + args, kwargs, expr=expr)
        return self._record("call_method", name, (obj,) + args, kwargs)

    def _method_expr(self, obj: Proxy, name: str, args: tuple, kwargs: dict) -> Optional[GExpr]:
        if obj.expr is None or kwargs or name not in GUARD_METHODS:
            return None
        if isinstance(obj.value, torch.Tensor) and name not in _SHAPE_METHODS and name not in _CONCRETE_METHODS:
            return None
        if not isinstance(obj.value, (torch.Tensor, torch.Size, tuple, int)):
            return None
        parts = [_literal_expr(a) for a in args]
        if None in parts:
            return None
        return Method(obj.expr, name, tuple(parts))

    def _expr_of(self, fn: Callable, args: tuple) -> Optional[GExpr]:
        if fn is operator.getitem and len(args) == 2 and type(args[0]) is Proxy and args[0].expr is not None:
            idx = _literal_expr(args[1]) if type(args[1]) is not Proxy else args[1].expr
            if idx is not None and not isinstance(args[0].value, torch.Tensor):
                return Item(args[0].expr, idx)
            return None
        if fn is len and len(args) == 1 and type(args[0]) is Proxy and args[0].expr is not None:
            return Call("len", (args[0].expr,))
        if (fn is _REAL_MAX or fn is _REAL_MIN) and len(args) >= 2:   # (see patches._extremum)
            parts = [a.expr if type(a) is Proxy else _literal_expr(a) for a in args]
            if any(p is None for p in parts) or any(type(a) is Proxy and isinstance(a.value, torch.Tensor)
                                                    for a in args):
                return None
            return Call(fn.__name__, tuple(parts))
        sym = _BIN_SYMBOLS.get(fn) if len(args) == 2 else None
        if sym is not None:
            parts = []
            for a in args:
                if type(a) is Proxy:
                    if a.expr is None or isinstance(a.value, torch.Tensor):
                        return None
                    parts.append(a.expr)
                else:
                    part = _literal_expr(a)
                    if part is None:
                        return None
                    parts.append(part)
            return BinOp(sym, parts[0], parts[1])
        return None

    # --- attributes of traced values -----------------------------------------------------
    def proxy_getattr(self, proxy: Proxy, name: str) -> Any:
        value = proxy.value
        if value is NO_VALUE:
            if name == "shape":
                node = self.create_node("call_function", getattr, (proxy.node, name))
                return Proxy(node, self, NO_VALUE, None, torch.Size)
            guess = proxy.guess
            if guess is not None and not hasattr(guess, name):  # as the value's class would answer
                loc = user_location(2)
                raise AssumedTypeAttributeError(
                    f"{guess.__name__!r} object has no attribute {name!r}: without example inputs the traced "
                    f"value {proxy.node.name} is taken for a {guess.__name__}; if it is not one, pass "
                    f"example_inputs=... (or use symtrace.capture). At {loc.describe() if loc else 'an unknown line'}")
            return Attribute(proxy, name)
        try:
            attr_value = getattr(value, name)
        except AttributeError:
            loc = user_location(2)
            raise AttributeError(f"{type(value).__name__!r} object has no attribute {name!r} "
                                 f"(traced value {proxy.node.name} at {loc.describe() if loc else '?'})") from None
        if callable(attr_value) and not isinstance(attr_value, (torch.Tensor, torch.dtype)):
            return _Method(proxy, name)
        expr = Attr(proxy.expr, name) if proxy.expr is not None and not name.startswith("__") else None
        p = self._record("call_function", getattr, (proxy, name), {}, expr=expr)
        if isinstance(attr_value, torch.Tensor) or name == "shape" or isinstance(attr_value, torch.Size):
            return p
        if isinstance(attr_value, _SIMPLE) or name in _CONCRETE_ATTRS:
            return self._concrete(p, f"reading .{name} of a traced value")
        return p

    def proxy_setattr(self, proxy: Proxy, name: str, value: Any) -> None:
        loc = user_location(2)
        if name.startswith("_dynamo_"):
            # torch._dynamo.mark_static_address / mark_dynamic tag a tensor for torch.compile;
            # nothing in eager reads the tag, so the graph does not need it
            self.note("compiler-hint", f"the torch.compile hint {name} set on {proxy.node.name} is dropped", loc)
            return
        raise TraceError(f"setting the attribute {name!r} of the traced value {proxy.node.name!r} at "
                         f"{loc.describe() if loc else 'an unknown line'} cannot be recorded in a graph")

    def note(self, kind: str, message: str, source: Optional[SourceLocation]) -> None:
        """Record something the tracer could not capture or guard (shown by ``explain``)."""
        self.notes.append((kind, message, source))


class _Method:
    """A tensor method looked up on a proxy (``x.view``): calling it records a ``call_method``."""

    __slots__ = ("proxy", "name")

    def __init__(self, proxy: Proxy, name: str):
        self.proxy = proxy
        self.name = name

    def __call__(self, *args, **kwargs):
        return self.proxy.tracer.call_method(self.name, self.proxy, args, kwargs)


class GraphAppendingTracer(Tracer):
    """A tracer without a module that appends to an existing graph: lets passes build graph
    code with operator syntax (``Proxy(node, GraphAppendingTracer(graph)) + 1``)."""

    def __init__(self, graph: Graph):
        super().__init__(record_source=False)
        self._start(graph, nn.Module(), has_values=False)


def _guess_result(op: str, target: Any, args: tuple, kwargs: dict) -> Optional[type]:
    """The class a result traced without example inputs is taken for: a Tensor for torch ops
    and modules; for a Python operator or builtin (``x.shape[0] + 1``, ``max(n, 2)``) a Tensor
    only when a tensor takes part, else unknown (None), so text and attributes are not
    answered as a tensor's."""
    if op == "call_method":
        return None if target in _NUMBER_METHODS else torch.Tensor
    if op != "call_function":
        return torch.Tensor
    if target in (len, operator.getitem):
        return None
    if getattr(target, "__module__", None) not in ("_operator", "builtins"):
        return torch.Tensor
    for a in (*args, *kwargs.values()):
        if type(a) is Proxy:
            if a.guess is not None and issubclass(a.guess, torch.Tensor):
                return torch.Tensor
        elif isinstance(a, torch.Tensor):
            return torch.Tensor
    return None



def module_of_method(root: Any) -> Optional[nn.Module]:
    """The module ``root`` is a bound method of (``model.forward``), else None."""
    if isinstance(root, types.MethodType) and isinstance(root.__self__, nn.Module):
        return root.__self__
    return None
