"""The tracer: runs a module or function on proxies and records what it does as a graph.

``symbolic_trace(model)`` records symbolically, like torch.fx. ``symbolic_trace(model,
example_inputs=...)`` also runs every operation on the example values, so Python-level
decisions resolve; each decision becomes a guard (see :mod:`symtrace.graph.guards`).

Tracing never changes the model: ``self`` inside ``forward`` is a shadow (see
:mod:`symtrace.shadow`), buffers and inputs are cloned before example values run, writes to
parameters are refused, and the RNG and grad-mode state are restored afterwards.
"""
from __future__ import annotations

import builtins
import contextlib
import copy
import dataclasses
import dis
import enum
import inspect
import operator
import os
import random
import sys
import threading
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .errors import SymtraceError, TraceError
from .graph._gc import gc_paused
from .graph.code_text import MAX_NESTING, nesting_depth
from .graph.effects import is_inplace, register_side_effect
from .graph.graph import Graph
from .graph.graph_module import GraphModule, class_name_from
from .graph.guard_expr import (GUARD_METHODS, Attr, BinOp, Call, Const, GExpr, Global, Input, Item,
                               Method, Root, TorchState, root_path)
from .graph.guards import Guard, check_data_guard
from .graph.node import Node, TensorMeta
from .graph.source import SourceLocation, _is_internal, user_location
from .proxy import NO_VALUE, Attribute, Proxy, claimed_class
from .shadow import _DELETED, ObjectView, is_shadow, make_shadow, real_module
from .side_effects import MUTABLE_CONTAINERS, SideEffects, stored_globals

__all__ = ["Tracer", "CallArgs", "symbolic_trace", "leaf_function", "GraphAppendingTracer", "DEFAULT_LEAF_MODULE_PREFIXES"]

#: Modules defined under these packages are recorded as one ``call_module`` node.
DEFAULT_LEAF_MODULE_PREFIXES = ("torch.nn", "torch.ao.nn")
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)

_TENSOR_METHODS = frozenset(n for n in dir(torch.Tensor) if callable(getattr(torch.Tensor, n, None)))
# tensor properties whose value is Python data, not a tensor: read concretely, with a guard
_CONCRETE_ATTRS = frozenset({"dtype", "device", "layout", "is_cuda", "is_sparse", "is_quantized",
                             "is_meta", "is_mkldnn", "is_nested", "requires_grad", "is_leaf", "ndim",
                             "is_floating_point", "is_complex"})
_CONCRETE_METHODS = frozenset({"dim", "ndimension", "is_contiguous", "is_floating_point", "is_complex",
                               "element_size", "get_device", "is_pinned", "storage_offset",
                               "stride", "has_names", "is_signed", "data_ptr", "nelement"})
_SHAPE_METHODS = frozenset({"size", "numel"})
#: tensor methods whose result is Python data, not a tensor
_NUMBER_METHODS = _CONCRETE_METHODS | _SHAPE_METHODS | {"item", "tolist", "__len__", "nelement"}
_SIMPLE = (bool, int, float, str, type(None), torch.dtype, torch.device, enum.Enum, complex)
_BIN_SYMBOLS = {operator.add: "+", operator.sub: "-", operator.mul: "*", operator.floordiv: "//",
                operator.truediv: "/", operator.mod: "%", operator.pow: "**", operator.eq: "==",
                operator.ne: "!=", operator.lt: "<", operator.le: "<=", operator.gt: ">",
                operator.ge: ">=", operator.and_: "&", operator.or_: "|"}
# torch functions patched while tracing (restored afterwards): factories whose traced sizes
# torch's argument parser would force to ints, and global-state reads that become guards
_FACTORIES = ("zeros", "ones", "empty", "rand", "randn", "full", "randint", "eye")
_STATE_READS = ("is_grad_enabled", "get_default_dtype")
_NOT_WRITTEN = object()
_NN_MODULE_INTERNALS = frozenset(vars(nn.Module()).keys()) - {"training"}


def _layout_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of input ``t`` with the same sizes, strides and autograd standing, so that layout
    questions (``is_contiguous()``, ``stride()``) answer as for ``t`` itself while tracing."""
    leaf = t.is_leaf
    src = t.detach() if leaf else t
    if t.layout is not torch.strided or t.is_contiguous() or t.numel() == 0 or type(t) is not torch.Tensor \
            and type(t) is not nn.Parameter:
        copy = src.clone()
    else:
        span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
        copy = torch.as_strided(src, (span,), (1,), t.storage_offset()).clone().as_strided(t.shape, t.stride(), 0)
        if leaf:
            copy = copy.detach()
    return copy.requires_grad_(t.requires_grad) if leaf else copy


def _is_simple(v: Any, depth: int = 0) -> bool:
    if type(v) is Proxy or type(v) is Attribute:  # isinstance would see the value's class
        return False
    if isinstance(v, _SIMPLE):
        return not (isinstance(v, float) and v != v)
    if depth < 3 and type(v) in (tuple, list, frozenset) and len(v) <= 64:
        return all(_is_simple(x, depth + 1) for x in v)
    if depth < 3 and type(v) is dict and len(v) <= 64:
        return all(isinstance(k, (str, int)) and _is_simple(x, depth + 1) for k, x in v.items())
    return False


def _literal_expr(v: Any) -> Optional[GExpr]:
    """The guard expression of a traced value or simple constant, or None."""
    if type(v) is Proxy or type(v) is Attribute:
        return v.expr if type(v) is Proxy else None
    t = type(v)
    if t in (bool, int, str, type(None)) or (t is float and v == v and abs(v) != float("inf")) \
            or isinstance(v, torch.dtype):
        return Const(v)
    if t is slice or t is tuple:
        parts = [_literal_expr(x) for x in ((v.start, v.stop, v.step) if t is slice else v)]
        if any(type(p) is not Const for p in parts):
            return None
        values = [p.value for p in parts]
        return Const(slice(*values) if t is slice else tuple(values))
    return None


def _guard_kind(expr: GExpr) -> str:
    base = expr
    while type(base) in (Attr, Item, Method):
        base = base.obj
    if type(base) is Root:
        return "training" if type(expr) is Attr and expr.name == "training" else "module"
    if type(base) is Global:
        return "global"
    nodes = list(expr.walk())
    if any(type(e) is TorchState and e.fn == "is_grad_enabled" for e in nodes):
        return "grad_mode"
    attrs = {e.name for e in nodes if type(e) is Attr}
    methods = {e.name for e in nodes if type(e) is Method}
    calls = {e.fn for e in nodes if type(e) is Call}
    for kind, present in (("dtype", "dtype" in attrs), ("device", "device" in attrs),
                          ("ndim", "ndim" in attrs or "dim" in methods),
                          ("shape", "shape" in attrs or bool(methods & {"size", "numel"}) or "len" in calls)):
        if present:
            return kind
    return "value"


@contextlib.contextmanager
def _no_torch_function():
    with torch._C.DisableTorchFunction():
        yield


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


def leaf_function(fn: Callable) -> Callable:
    """Decorator: record calls to ``fn`` as one ``call_function`` node instead of tracing into
    it (torch.fx's ``wrap``). Outside tracing the function runs as usual.

    >>> @symtrace.leaf_function
    ... def my_op(x, k): ...
    """
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        tracer = _active_tracer()
        if tracer is not None and _contains_proxy((args, kwargs)):
            return tracer.call_function(fn, args, kwargs)
        return fn(*args, **kwargs)

    wrapper.__symtrace_leaf__ = fn
    return wrapper


class _ActiveTracers(threading.local):
    """The tracers running in this thread, innermost last (another thread's eager
    ``torch.randn`` must not be recorded into this thread's trace)."""

    def __init__(self):
        self.stack: List["Tracer"] = []


_ACTIVE = _ActiveTracers()


def _active_tracer() -> Optional["Tracer"]:
    stack = _ACTIVE.stack
    return stack[-1] if stack else None


_REAL_ISINSTANCE = builtins.isinstance


def _tracing_isinstance(obj: Any, cls: Any, /) -> bool:
    """``isinstance`` while tracing: a proxy is also an instance of the class of the value it
    stands for, so ``isinstance(x, torch.Tensor)`` holds for a traced tensor. (The proxy's
    ``__class__`` cannot say so for tensors: torch's C code asks the same question and would
    then read the proxy as a C tensor.)"""
    if _REAL_ISINSTANCE(obj, cls):
        return True
    t = type(obj)
    if t is Proxy or t is Attribute:
        claimed = claimed_class(obj)
        if claimed is not None:
            return issubclass(claimed, cls)
    return False


_REAL_CALLABLE = builtins.callable


def _tracing_callable(obj: Any, /) -> bool:
    """``callable`` while tracing: a proxy is callable when the value it stands for is (a
    tensor is not; a proxy without a value is taken for a tensor unless guessed otherwise)."""
    t = type(obj)
    if t is Proxy or t is Attribute:
        if t is Attribute:  # x.name on a symbolic value: a method of its class, or data
            owner = claimed_class(obj.owner) or torch.Tensor
            return _REAL_CALLABLE(getattr(owner, obj.attr, None))
        claimed = claimed_class(obj)
        return claimed is not None and not issubclass(claimed, torch.Tensor) and _REAL_CALLABLE(obj.value)
    return _REAL_CALLABLE(obj)


def _install_builtin_patches() -> None:
    builtins.isinstance = _tracing_isinstance
    builtins.callable = _tracing_callable


def _restore_builtin_patches() -> None:
    builtins.isinstance = _REAL_ISINSTANCE
    builtins.callable = _REAL_CALLABLE


class _SharedPatch:
    """A process-wide patch shared by nested and concurrent users (a ``with`` block each):
    installed when the first enters, restored when the last leaves."""

    def __init__(self, install: Callable[[], None], restore: Callable[[], None]):
        self.install, self.restore = install, restore
        self.users = 0
        self.lock = threading.Lock()

    def __enter__(self) -> None:
        with self.lock:
            if not self.users:
                self.install()
            self.users += 1

    def __exit__(self, *exc) -> None:
        with self.lock:
            self.users -= 1
            if not self.users:
                self.restore()


_UNPATCHED: Dict[str, Callable] = {}


#: Python's ``random`` functions: drawn at run time as graph nodes, not baked in as constants
_PY_RANDOM = ("random", "uniform", "randint", "randrange", "choice", "gauss", "normalvariate", "getrandbits")
for _n in _PY_RANDOM:
    register_side_effect(getattr(random, _n))
_UNPATCHED_RANDOM: Dict[str, Callable] = {}


#: torch functions that take no part in ``__torch_function__``: recorded when given traced values
_NON_DISPATCHING = ("from_numpy",)
#: dtype questions: answered for a traced dtype's example value, refused without one
_DTYPE_INFO = ("finfo", "iinfo")


def _install_torch_patches() -> None:
    _UNPATCHED.update({n: getattr(torch, n) for n in _FACTORIES + _STATE_READS + _NON_DISPATCHING + _DTYPE_INFO})
    for n, f in _UNPATCHED.items():
        patch = _traced_factory(f) if n in _FACTORIES else _traced_call(f) if n in _NON_DISPATCHING \
            else _dtype_info(f) if n in _DTYPE_INFO else _guarded_state_read(f)
        setattr(torch, n, patch)
    torch.autograd.Function.apply = _traced_function_apply
    _UNPATCHED_RANDOM.update({n: getattr(random, n) for n in _PY_RANDOM})
    for n, f in _UNPATCHED_RANDOM.items():
        setattr(random, n, _traced_py_random(f))


def _restore_torch_patches() -> None:
    for n, f in _UNPATCHED.items():
        setattr(torch, n, f)
    _UNPATCHED.clear()
    torch.autograd.Function.apply = _ORIGINAL_FUNCTION_APPLY
    for n, f in _UNPATCHED_RANDOM.items():
        setattr(random, n, f)
    _UNPATCHED_RANDOM.clear()


#: While any thread traces, torch's factories and global-state reads and
#: ``torch.autograd.Function.apply`` are wrapped to record into the calling thread's tracer
#: (threads that are not tracing see them behave as usual).
_TORCH_PATCHES = _SharedPatch(_install_torch_patches, _restore_torch_patches)
_ISINSTANCE_PATCH = _SharedPatch(_install_builtin_patches, _restore_builtin_patches)


def proxies_pass_isinstance() -> _SharedPatch:
    """A context manager: within it, Python's ``isinstance`` and ``callable`` answer for
    proxies as for the values they stand for (``builtins`` are swapped and restored; nested
    and concurrent blocks share one swap). Tracing and
    :class:`~symtrace.transformer.Transformer` run their user code inside it. ``type(x)`` is
    not swapped: for a traced tensor it is the proxy's class, as in torch.fx."""
    return _ISINSTANCE_PATCH


def _contains_proxy(a: Any) -> bool:
    t = type(a)
    if t is Proxy or t is Attribute:
        return True
    if t in (tuple, list):
        return any(_contains_proxy(x) for x in a)
    if t is dict:
        return any(_contains_proxy(x) for x in a.values())
    if t is slice:
        return _contains_proxy((a.start, a.stop, a.step))
    return False


def _unwrap(a: Any) -> Any:
    t = type(a)
    if t is Proxy or t is Attribute:
        return a.value
    if t is tuple:
        return tuple([_unwrap(x) for x in a])
    if t is list:
        return [_unwrap(x) for x in a]
    if t is dict:
        return {k: _unwrap(v) for k, v in a.items()}
    if t is slice:
        return slice(_unwrap(a.start), _unwrap(a.stop), _unwrap(a.step))
    if isinstance(a, tuple) and hasattr(a, "_fields"):
        return t(*[_unwrap(x) for x in a])
    if is_shadow(a):
        return real_module(a)
    return a


class _TracingMode(TorchFunctionMode):
    """Sees every torch call while tracing, so factories and random ops without traced
    arguments (``torch.randn(3)``) and grad-mode switches become nodes instead of constants."""

    def __init__(self, tracer: "Tracer"):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracer = self.tracer
        if Proxy in types or _contains_proxy(args) or _contains_proxy(kwargs):
            return tracer.torch_function(func, args, kwargs)
        if func is torch._C._set_grad_enabled:
            return tracer.record_grad_mode(args, kwargs)
        if not types and _returns_tensor_or_random(func):
            return tracer.call_function(func, args, kwargs)
        if types and _is_random_name(func):
            return tracer.call_function(func, args, kwargs)
        return func(*args, **kwargs)


def _is_random_name(func) -> bool:
    name = getattr(func, "__name__", "")
    return any(w in name for w in ("rand", "normal", "bernoulli", "multinomial", "poisson", "dropout")) \
        and not name.startswith("__")


_NON_TENSOR_FUNCS = {"get_default_dtype", "is_tensor", "is_storage", "numel", "result_type", "can_cast",
                     "promote_types", "is_grad_enabled", "is_inference_mode_enabled", "is_autocast_enabled"}


def _returns_tensor_or_random(func) -> bool:
    name = getattr(func, "__name__", "")
    if name.startswith("_") or name in _NON_TENSOR_FUNCS:
        return False
    return getattr(func, "__module__", "") in ("torch", "torch._C._VariableFunctions", "torch.functional",
                                                 "torch.random", "torch._refs", None) or hasattr(torch, name)


class CallArgs:
    """Example inputs given as both positional and keyword arguments: ``CallArgs(args, kwargs)``."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple = (), kwargs: Optional[dict] = None):
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})


class Tracer:
    """Records a module's or function's ``forward`` as a :class:`Graph`.

    Override points: :meth:`is_leaf_module` (which modules stay one ``call_module`` node),
    :meth:`create_node` (every node goes through it). ``leaf_modules``: extra module types kept
    as leaves. ``record_source``: record the user's file:line on each node (default True).
    """

    def __init__(self, leaf_modules: Sequence[type] = (), record_source: bool = True,
                 guard_globals: bool = True, live: bool = False):
        self.leaf_modules = tuple(leaf_modules)
        #: also guard the identity of model state (for graphs run against the live model)
        self.live = live
        self.record_source = record_source
        self.guard_globals = guard_globals

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
    def trace(self, root: Any, example_inputs: Any = None, concrete_args: Optional[dict] = None) -> Graph:
        """Trace ``root`` (an ``nn.Module`` or a function) into a new graph."""
        self.graph = Graph()
        self.graph.created_by = "symbolic_trace"
        self.module_path = ""
        self.has_values = example_inputs is not None
        self.root = root if isinstance(root, nn.Module) else nn.Module()
        self.extra_attrs: Dict[str, Any] = {}
        self.notes: List[Tuple[str, str, Optional[SourceLocation]]] = []
        self._attr_proxies: Dict[str, Any] = {}
        self._guard_keys: Dict[tuple, Guard] = {}
        self._data_guarded: set = set()
        self._value_modules: Dict[str, nn.Module] = {}
        self._param_storages: Optional[set] = None
        self._n_consts = 0
        self._globals_seen: set = set()
        self._grad_guarded = False
        self._input_exprs: Dict[int, Tuple[str, Any]] = {}
        self._input_loc = None
        self.effects = SideEffects()

        if isinstance(root, nn.Module):
            fn = _forward_function(root)
            self_arg = make_shadow(root, "", self)
            call = lambda *a, **k: self.trace_forward(self_arg, root, a, k)  # noqa: E731
            if fn is not None:
                sig_fn, skip_self = fn, True
            else:
                sig_fn, skip_self = root.__dict__["forward"], False
                self.note("forward", "forward is an instance attribute; attribute reads of `self` in it "
                          "are not guarded", None)
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

        restored = False
        rng = torch.get_rng_state()
        py_rng = random.getstate()
        grad = torch._C.is_grad_enabled()
        _ACTIVE.stack.append(self)
        try:
            with _TORCH_PATCHES, _TracingMode(self), _ISINSTANCE_PATCH:
                try:
                    result = call(*args, **kwargs)
                except Exception as e:
                    _note_proxy_reached_c(e)
                    raise
            with _no_torch_function():
                if nesting_depth(result) > MAX_NESTING:
                    raise TraceError(f"{self._input_loc.describe() if self._input_loc else 'forward'} returns "
                                     f"containers nested more than {MAX_NESTING} levels deep; a graph's output "
                                     "is written as one Python expression, so flatten it")
                out = self.create_arg(result)
                changes, restored = self.effects.restore_globals(), True
                self._emit_side_effects(changes)
            self.graph.output(out)
        finally:
            if not restored:
                self.effects.restore_globals()
            _ACTIVE.stack.pop()
            torch.set_rng_state(rng)
            random.setstate(py_rng)
            torch._C._set_grad_enabled(grad)
        self.graph.eliminate_dead_code(module=self.root)
        return self.graph

    def _emit_side_effects(self, global_changes) -> None:
        """One replay node per write to Python state (see :mod:`symtrace.side_effects`)."""
        def record(helper, args):
            self.graph.create_node("call_function", helper, self.create_arg(args), name=helper.__name__)

        def note(text):
            self.note("side effect", text, None)

        self.effects.emit(record, self._attr_proxies, _DELETED, global_changes, note)

    # --- inputs --------------------------------------------------------------------------
    def _make_inputs(self, params, example_inputs, concrete_args) -> Tuple[list, dict]:
        if self.has_values:
            if isinstance(example_inputs, CallArgs):
                ex_args, ex_kwargs = example_inputs.args, example_inputs.kwargs
            elif isinstance(example_inputs, dict):
                ex_args, ex_kwargs = (), dict(example_inputs)
            elif isinstance(example_inputs, (tuple, list)):
                ex_args, ex_kwargs = tuple(example_inputs), {}
            else:
                ex_args, ex_kwargs = (example_inputs,), {}
            ex_sig = inspect.Signature(params)
            try:
                bound = ex_sig.bind(*ex_args, **ex_kwargs)
            except TypeError as e:
                raise TraceError(f"example_inputs do not fit the signature {ex_sig}: {e}") from None
            values = bound.arguments
            # call forward the way the example inputs were given: positionally, by keyword, or
            # not at all (then forward's own default applies, and the placeholder guards it)
            n_pos = len(ex_args)
            positional = {p.name for p in params[:n_pos]
                          if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)}
            passed = positional | set(ex_kwargs)
        else:
            values = {}
            positional = {p.name for p in params if p.default is p.empty and p.kind is not p.KEYWORD_ONLY}
            passed = positional | set(concrete_args)
        args: list = []
        kwargs: dict = {}
        for p in params:
            name = p.name
            default = p.default
            if p.kind is p.VAR_POSITIONAL:
                node = self.graph.placeholder("*" + name)
                if self.has_values:
                    args.extend(self._input_value(node, tuple(values.get(name, ())), Input(name)))
                else:
                    where = self._input_loc.describe() if self._input_loc else "forward"
                    raise TraceError(
                        f"{where} takes *{name}; without example inputs the number of arguments is "
                        "unknown. Pass example_inputs=(...) to symbolic_trace.")
                continue
            if p.kind is p.VAR_KEYWORD:
                node = self.graph.placeholder("**" + name)
                if self.has_values:
                    kwargs.update(self._input_value(node, dict(values.get(name, {})), Input(name)))
                else:
                    kwargs.update({})
                    self.note("input", f"**{name} is traced as empty without example inputs", None)
                    self.add_entry_guard(Call("len", (Input(name),)), 0, "eq", "the empty **kwargs traced", kind="value")
                continue
            node = self.graph.placeholder(name, default if default is not p.empty else _no_default())
            if name in concrete_args:
                value = concrete_args[name]
                v = self._input_value(node, value, Input(node.name)) if self.has_values or isinstance(value, torch.Tensor) \
                    else self._specialise_input(Input(node.name), value)
            elif self.has_values:
                if name in values:
                    value = values[name]
                elif default is not p.empty:
                    value = default
                else:
                    raise TraceError(f"example_inputs give no value for the argument {name!r}")
                v = self._input_value(node, value, Input(node.name))
            elif default is not p.empty and not isinstance(default, torch.Tensor):
                # symbolic mode: an argument with a Python default (often `mask=None`) is traced
                # at its default, guarded, rather than assumed to be a tensor
                v = self._specialise_input(Input(node.name), default)
            else:
                v = Proxy(node, self, NO_VALUE, None, torch.Tensor)
                self.add_entry_guard(Input(node.name), torch.Tensor, "isinstance",
                                     "tracing without example inputs, which assumes a Tensor", kind="type", source=self._input_loc)
            if name in positional:
                args.append(v)
            elif name in passed:
                kwargs[name] = v
        return args, kwargs

    def _specialise_input(self, expr: GExpr, value: Any) -> Any:
        if value is None:
            self.add_entry_guard(expr, None, "is", "an input that was None when traced", kind="value", source=self._input_loc)
        elif isinstance(value, bool):
            self.add_entry_guard(expr, value, "is", "a bool input", kind="value", source=self._input_loc)
        elif _is_simple(value):
            self.add_entry_guard(expr, type(value), "type", "a Python value input", kind="type", source=self._input_loc)
            self.add_entry_guard(expr, value, "eq", "a Python value input", kind="value", source=self._input_loc)
        elif _holds(value, lambda x: isinstance(x, torch.Tensor)):
            raise TraceError(
                f"the input {expr} is a {type(value).__name__} holding tensors, which symtrace cannot "
                "see through; pass the tensors as arguments (or in tuples, lists, dicts, namedtuples "
                "or dataclasses).")
        else:
            self.add_entry_guard(expr, value, "is", "an opaque input object", kind="value",
                                 source=self._input_loc)
            self.note("input", f"input {expr} ({type(value).__name__}) is guarded by identity only", None)
        return value

    def _input_value(self, node: Node, value: Any, expr: GExpr) -> Any:
        """The traced stand-in for one input value (tensors become proxies; containers are
        rebuilt with proxies inside; Python values are specialised with guards)."""
        if type(value) in (tuple, list, dict) and nesting_depth(value) > MAX_NESTING:
            raise TraceError(f"the input {expr} nests containers more than {MAX_NESTING} levels deep; symtrace "
                             "binds each level to a graph node and guards it, so pass flatter inputs (or the "
                             "tensors themselves)")
        if isinstance(value, torch.Tensor):
            first = self._input_exprs.get(id(value))
            if first is not None:  # the same tensor passed twice: keep the aliasing
                self.add_entry_guard(BinOp("is", expr, first[0]), True, "is", "the same tensor passed for two inputs",
                                     kind="value", source=self._input_loc)
                node.meta["tensor_meta"] = TensorMeta.of(value)
                return Proxy(node, self, first[1], expr)
            self.add_entry_guard(expr, torch.Tensor, "isinstance", "a Tensor input", kind="type", source=self._input_loc)
            self.add_entry_guard(Attr(expr, "dtype"), value.dtype, "is", "the input's dtype", kind="dtype", source=self._input_loc)
            self.add_entry_guard(Attr(expr, "device"), value.device, "eq", "the input's device", kind="device", source=self._input_loc)
            self.add_entry_guard(Attr(expr, "ndim"), value.ndim, "eq", "the input's rank", kind="ndim", source=self._input_loc)
            with _no_torch_function():
                v = _layout_copy(value)
            node.meta["tensor_meta"] = TensorMeta.of(value)
            self._input_exprs[id(value)] = (expr, v)
            return Proxy(node, self, v, expr)
        t = type(value)
        if t in (tuple, list) or (isinstance(value, tuple) and hasattr(value, "_fields")):
            self.add_entry_guard(expr, t, "type", "a container input", kind="type", source=self._input_loc)
            self.add_entry_guard(Call("len", (expr,)), len(value), "eq", "a container input's length", kind="shape", source=self._input_loc)
            items = []
            for i, item in enumerate(value):
                items.append(self._input_item(node, i, item, Item(expr, Const(i))))
            return t(*items) if hasattr(value, "_fields") else t(items)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            self.add_entry_guard(expr, t, "type", "a dataclass input", kind="type", source=self._input_loc)
            fields = {}
            for f in dataclasses.fields(value):
                item = getattr(value, f.name)
                if isinstance(item, torch.Tensor) or type(item) in (tuple, list, dict):
                    fnode = self.graph.create_node("call_function", getattr, (node, f.name),
                                                   name=f"{node.name}_{f.name}")
                    fields[f.name] = self._input_value(fnode, item, Attr(expr, f.name))
                else:
                    fields[f.name] = self._specialise_input(Attr(expr, f.name), item)
            return dataclasses.replace(value, **{k: v for k, v in fields.items()
                                                 if next(f for f in dataclasses.fields(value) if f.name == k).init})
        if t is dict:
            self.add_entry_guard(expr, dict, "type", "a dict input", kind="type", source=self._input_loc)
            self.add_entry_guard(Call("list", (expr,)), list(value), "eq", "a dict input's keys", kind="value", source=self._input_loc)
            bad = [k for k in value if _literal_expr(k) is None or type(k) is Proxy]
            if bad:
                raise TraceError(f"the dict input {expr} has the key {bad[0]!r} ({type(bad[0]).__name__}); symtrace "
                                 "guards dict inputs whose keys are strings, numbers, bools, None or tuples of them")
            return {k: self._input_item(node, k, item, Item(expr, _literal_expr(k))) for k, item in value.items()}
        return self._specialise_input(expr, value)

    def _input_item(self, parent: Node, key: Any, value: Any, expr: GExpr) -> Any:
        if isinstance(value, torch.Tensor) or type(value) in (tuple, list, dict) or (
                isinstance(value, tuple) and hasattr(value, "_fields")):
            with self.graph.inserting_before(None):
                item = self.graph.create_node("call_function", operator.getitem, (parent, key),
                                              name=f"{parent.name}_{key}" if isinstance(key, (int, str)) else None)
            return self._input_value(item, value, expr)
        return self._specialise_input(expr, value)

    # --- guards --------------------------------------------------------------------------
    def add_entry_guard(self, expr: GExpr, expected: Any, check: str, reason: str,
                        kind: Optional[str] = None, source: Optional[SourceLocation] = None) -> None:
        key = (expr, check, repr(expected))
        known = self._guard_keys.get(key)
        if known is not None:
            if source is not None and known.source == self._input_loc and source != self._input_loc:
                known.source, known.reason = source, reason  # a decision in the user's code relies on it
            return
        guard = Guard(kind or _guard_kind(expr), expr, expected, check, source, reason)
        self._guard_keys[key] = guard
        self.graph.guards.append(guard)

    def add_guard(self, proxy: Proxy, check: str, expected: Any, reason: str) -> None:
        """Record that tracing relied on ``proxy`` having this value: at entry when it depends only
        on input metadata and module state, else as a data-guard node right after it."""
        loc = user_location(2)
        entry_check = {"bool": "bool", "int": "eq", "float": "eq", "eq": "eq", "is": "is"}.get(check)
        if proxy.expr is not None and entry_check is not None:
            self.add_entry_guard(proxy.expr, expected, entry_check, reason, source=loc)
            return
        key = (proxy.node, check)
        if key in self._data_guarded:
            return
        self._data_guarded.add(key)
        text = loc.line() if loc is not None else ""
        desc = f"{proxy.node.name}" + (f" (from `{text}`)" if text else "")
        guard = Guard("data", desc, expected, check, loc, reason)
        node = self.graph.create_node("call_function", check_data_guard, (proxy.node, guard),
                                      name=f"guard_{proxy.node.name}",
                                      meta={"source": loc} if loc is not None else {})
        del node

    def force(self, proxy: Proxy, kind: str) -> Any:
        """A Python-level decision needs the concrete value of ``proxy``: return it and guard it."""
        reason = {"bool": "bool() of a traced value (an `if`, `while`, `and`/`or` or `assert`)",
                  "int": "int() or indexing with a traced value",
                  "float": "float() of a traced value"}[kind]
        value = proxy.value
        if value is NO_VALUE:
            loc = user_location(2)
            where = loc.describe() if loc is not None else "an unknown line"
            raise TraceError(
                f"{reason} needs a concrete value at {where}, but the tracer has only a symbol "
                f"({proxy.node.name}) there. Pass example inputs (symbolic_trace(model, "
                "example_inputs=(...))) so the decision is taken and guarded, use concrete_args "
                "for a Python argument, or make the code a leaf (symtrace.leaf_function).")
        with _no_torch_function():
            result = {"bool": bool, "int": operator.index if not isinstance(value, (float, torch.Tensor)) else int,
                      "float": float}[kind](value)
        self.add_guard(proxy, kind, result, reason)
        return result

    def proxy_text(self, proxy: Proxy, to_text: Callable[[Any], str]) -> str:
        """``str()``/``format()`` of a traced value. A Python value (a size, an ``.item()``)
        is specialised and guarded, since the text may steer the program (dict keys, names);
        a tensor's text is only for printing and is not guarded (noted for ``explain``)."""
        value = proxy.value
        if value is NO_VALUE:
            guess = proxy.guess
            name = proxy.attr if type(proxy) is Attribute else proxy.node.name
            if guess is None or not issubclass(guess, torch.Tensor):  # a size, dtype, number...: text steers
                loc = user_location(3)
                raise TraceError(
                    f"str() or format() of the traced value {name} needs its concrete value at "
                    f"{loc.describe() if loc is not None else 'an unknown line'}, but without example "
                    "inputs the tracer has only a symbol. Pass example_inputs=(...) to symbolic_trace, "
                    "so the text is computed and guarded.")
            self.note("text", f"str() of the traced tensor {name} gives a placeholder text without example "
                      "inputs", user_location(3))
            return f"Proxy({name})"
        if isinstance(value, torch.Tensor):
            self.note("text", f"str() of the traced tensor {proxy.node.name} shows the example value "
                      "(not guarded)", user_location(3))
        else:
            self.add_guard(proxy, "eq", value, "str() or format() of a traced value")
        with _no_torch_function():
            return to_text(value)

    def proxy_hash(self, proxy: Proxy) -> int:
        """``hash()`` of a traced value: identity for tensors (as for real tensors); a Python
        value is specialised and guarded, so ``n in {2, 4}`` and dict lookups work."""
        value = proxy.value
        if value is NO_VALUE:
            guess = proxy.guess
            if guess is None or not issubclass(guess, torch.Tensor):  # a size or number: equality matters
                loc = user_location(3)
                raise TraceError(
                    f"hashing the traced value {proxy.node.name} (a set or dict lookup) needs its concrete "
                    f"value at {loc.describe() if loc is not None else 'an unknown line'}, but without "
                    "example inputs the tracer has only a symbol. Pass example_inputs=(...) to "
                    "symbolic_trace.")
            return object.__hash__(proxy)
        if isinstance(value, torch.Tensor):
            return object.__hash__(proxy)
        self.add_guard(proxy, "eq", value, "hashing a traced value (a set or dict lookup)")
        return hash(value)

    def proxy_len(self, proxy: Proxy) -> int:
        if proxy.value is NO_VALUE:
            return self.force(self.call_function(len, (proxy,)), "int")
        return self.force(self.call_function(len, (proxy,)), "int")

    def proxy_iter(self, proxy: Proxy):
        if proxy.value is NO_VALUE:
            n = _unpack_count(sys._getframe(2))
            if n is None:
                loc = user_location(2)
                raise TraceError(
                    f"iterating over the traced value {proxy.node.name!r} at "
                    f"{loc.describe() if loc else 'an unknown line'} needs its length, which is unknown "
                    "without example inputs. Pass example_inputs=... to symbolic_trace.")
            self.add_guard(self.call_function(len, (proxy,)), "eq", n, "unpacking a traced value")
            return iter([self.call_function(operator.getitem, (proxy, i)) for i in range(n)])
        n = self.force(self.call_function(len, (proxy,)), "int")
        value = proxy.value
        if isinstance(value, dict):
            return iter(list(value.keys()))
        return iter([self.call_function(operator.getitem, (proxy, i)) for i in range(n)])

    def record_grad_mode(self, args, kwargs):
        """``torch.no_grad()`` / ``enable_grad()`` / ``set_grad_enabled()`` inside forward: the
        switch is a node; the mode saved for the exit is read at run time (see
        ``_guarded_state_read``), so no guard on the caller's grad mode is needed."""
        return self.call_function(torch._C._set_grad_enabled, args, kwargs)

    # --- recording -----------------------------------------------------------------------
    def create_arg(self, a: Any) -> Any:
        """Turn a Python value used by traced code into a graph argument."""
        t = type(a)
        if t is Proxy or t is Attribute:
            if a.tracer is not self:
                raise TraceError(f"the value {a.node.name!r} comes from another trace")
            return a.node
        if t is tuple:
            return tuple([self.create_arg(x) for x in a])
        if t is list:
            return [self.create_arg(x) for x in a]
        if t is dict:
            out = {}
            for k, v in a.items():
                if type(k) is Proxy:
                    raise TraceError("a traced value cannot be a dict key")
                out[k] = self.create_arg(v)
            return out
        if t is slice:
            return slice(self.create_arg(a.start), self.create_arg(a.stop), self.create_arg(a.step))
        if isinstance(a, _SIMPLE) or a is None or a is Ellipsis or t in (torch.Size, torch.memory_format,
                                                                          torch.layout):
            return a
        if isinstance(a, tuple) and hasattr(a, "_fields"):
            fields = [self.create_arg(x) for x in a]
            if any(isinstance(f, Node) for f in _flatten(fields)):
                return self.graph.create_node("call_function", t, tuple(fields), name=t.__name__)
            return a
        if dataclasses.is_dataclass(a) and not isinstance(a, type):
            kw = {f.name: self.create_arg(getattr(a, f.name)) for f in dataclasses.fields(a) if f.init}
            if any(isinstance(f, Node) for f in _flatten(kw)):
                return self.graph.create_node("call_function", t, (), kw, name=t.__name__)
            return a
        if isinstance(a, torch.Tensor):
            return self._constant(a)
        if isinstance(a, (dict, list, tuple)) and _contains_proxy(dict(a) if isinstance(a, dict) else list(a)):
            # a subclass such as OrderedDict: rebuild it from a plain container at run time
            plain = self.create_arg(dict(a) if isinstance(a, dict) else list(a))
            return self.graph.create_node("call_function", t, (plain,), name=t.__name__)
        if is_shadow(a):
            path = object.__getattribute__(a, "__dict__")["_symtrace_path"]
            raise TraceError(f"the module {path or 'self'!r} is passed as a value to traced code; "
                             "call it instead, or make the caller a leaf")
        if isinstance(a, nn.Module):
            raise TraceError(f"a module object ({type(a).__name__}) cannot be a graph value")
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
            guess = torch.Tensor if op != "call_function" or target not in (len, operator.getitem) else None
            if op == "call_method" and target in _NUMBER_METHODS:
                guess = None
            return Proxy(node, self, NO_VALUE, None, guess)
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

    def _concrete(self, proxy: Proxy, reason: str) -> Any:
        value = proxy.value
        self.add_guard(proxy, "is" if isinstance(value, (torch.dtype, bool)) or value is None else "eq",
                       value, reason)
        return value

    def _expr_of(self, fn: Callable, args: tuple) -> Optional[GExpr]:
        if fn is operator.getitem and len(args) == 2 and type(args[0]) is Proxy and args[0].expr is not None:
            idx = _literal_expr(args[1]) if type(args[1]) is not Proxy else args[1].expr
            if idx is not None and not isinstance(args[0].value, torch.Tensor):
                return Item(args[0].expr, idx)
            return None
        if fn is len and len(args) == 1 and type(args[0]) is Proxy and args[0].expr is not None:
            return Call("len", (args[0].expr,))
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
                raise AttributeError(f"{guess.__name__!r} object has no attribute {name!r} (traced value "
                                     f"{proxy.node.name}, taken for a {guess.__name__} without example inputs)")
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
        raise TraceError(f"setting the attribute {name!r} of the traced value {proxy.node.name!r} at "
                         f"{loc.describe() if loc else 'an unknown line'} cannot be recorded in a graph")

    # --- modules -------------------------------------------------------------------------
    def module_getattr(self, real: nn.Module, path: str, name: str) -> Any:
        """``self.name`` inside a traced forward, where ``self`` is ``real`` at ``path``."""
        qual = f"{path}.{name}" if path else name
        written = self._attr_proxies.get(qual, _NOT_WRITTEN)
        if written is not _NOT_WRITTEN and not isinstance(written, ObjectView):
            if written is _DELETED:
                raise AttributeError(f"'{type(real).__name__}' object has no attribute '{name}'")
            return written
        d = real.__dict__
        if name in _NN_MODULE_INTERNALS:
            if name == "_modules":  # containers iterate this: hand out shadows, not the real children
                return self._shadow_children(real, path)
            if name in ("_parameters", "_buffers"):  # self.parameters() & co.: traced tensors, so
                # what the program reads of them (p.requires_grad, p.dtype) is guarded
                return self._tensor_table(d[name], path, clone=name == "_buffers")
            return d[name]
        params = d["_parameters"]
        if name in params:
            return self._attr_proxy(qual, params[name], clone=False)
        buffers = d["_buffers"]
        if name in buffers:
            return self._attr_proxy(qual, buffers[name], clone=True)
        modules = d["_modules"]
        if name in modules:
            sub = modules[name]
            return None if sub is None else make_shadow(sub, qual, self)
        if name in d:
            return self._plain_attr(real, qual, name, d[name])
        # not on the instance: let the class (or its __getattr__) answer, like nn.Module would
        for klass in type(real).__mro__:
            if "__getattr__" in klass.__dict__ and klass is not nn.Module:
                return klass.__dict__["__getattr__"](real, name)
        raise AttributeError(f"'{type(real).__name__}' object has no attribute '{name}'")

    def _tensor_table(self, table: Dict[str, Any], path: str, clone: bool) -> Dict[str, Any]:
        out = {}
        for name, t in table.items():
            qual = f"{path}.{name}" if path else name
            written = self._attr_proxies.get(qual, _NOT_WRITTEN)
            out[name] = written if written is not _NOT_WRITTEN else \
                None if t is None else self._attr_proxy(qual, t, clone=clone)
        return out

    def _shadow_children(self, real: nn.Module, path: str) -> Dict[str, Any]:
        key = ("_modules", path)
        kids = self._attr_proxies.get(key)
        if kids is None:
            if self.live:
                self.add_entry_guard(Call("list", (Attr(root_path(path), "_modules"),)),
                                     list(real.__dict__["_modules"]), "eq",
                                     "iterating or indexing a module container", kind="structure")
            kids = {name: (None if sub is None else make_shadow(sub, f"{path}.{name}" if path else name, self))
                    for name, sub in real.__dict__["_modules"].items()}
            self._attr_proxies[key] = kids
        return kids

    def _attr_proxy(self, qual: str, value: Any, clone: bool) -> Any:
        p = self._attr_proxies.get(qual)
        if p is not None:
            return p
        if value is None:
            return None
        node = self.graph.create_node("get_attr", qual, meta={"module_path": self.module_path})
        expr = root_path(qual)
        self.add_live_guard(expr, value)
        if isinstance(value, torch.Tensor):
            node.meta["tensor_meta"] = TensorMeta.of(value)
        if self.has_values:
            with _no_torch_function():
                v = value.detach().clone() if clone else value
            p = Proxy(node, self, v, expr)
        else:
            p = Proxy(node, self, NO_VALUE, expr, torch.Tensor)
        self._attr_proxies[qual] = p
        return p

    def add_live_guard(self, expr: GExpr, obj: Any) -> None:
        """An identity guard on model state, checked only where the graph runs against the live
        model (``symtrace.capture``): rebinding ``model.w = ...`` or ``model.act = nn.Tanh()``
        afterwards makes it re-capture. A GraphModule owns its own references instead."""
        if self.live:
            self.add_entry_guard(expr, obj, "is", "the object the graph was captured with", kind="identity")

    def _plain_attr(self, real: nn.Module, qual: str, name: str, value: Any) -> Any:
        p = self._attr_proxies.get(qual)
        if p is not None:
            return p
        if isinstance(value, torch.Tensor):
            return self._attr_proxy(qual, value, clone=True)
        loc = user_location(3)
        if _is_simple(value):
            self.add_entry_guard(root_path(qual), copy.deepcopy(value),
                                 "is" if isinstance(value, bool) or value is None else "eq",
                                 f"reading self.{name}", source=loc)
            if type(value) in MUTABLE_CONTAINERS:  # the program works on a copy; changes are replayed
                self.extra_attrs[qual] = copy.deepcopy(value)
                working = self.effects.container_copy(root_path(qual), value)
                self._attr_proxies[qual] = working
                return working
            self.extra_attrs[qual] = value
            return value
        # functions, classes and other objects: the graph was built with this very object; a
        # GraphModule keeps what it recorded, a live model (capture) is checked by identity
        expr = root_path(qual)
        self.add_live_guard(expr, value)
        if callable(value) or isinstance(value, (type, nn.Module)):
            return value
        if not _viewable(value):
            self.note("module attribute", f"self.{name} (at {qual}, a {type(value).__name__}) is read but "
                      "its contents are not guarded", loc)
            return value
        self.extra_attrs[qual] = value
        view = ObjectView(value, expr, self)
        self._attr_proxies[qual] = view
        return view

    def object_attr(self, view: ObjectView, expr: GExpr, obj: Any, name: str, value: Any) -> Any:
        """``view.name`` for a plain object held by a module: guard what the program reads."""
        attr_expr = Attr(expr, name) if name.isidentifier() and not name.startswith("__") else None
        if inspect.isfunction(getattr(type(obj), name, None)):
            return types.MethodType(getattr(type(obj), name), view)  # methods read through the view
        if attr_expr is None:
            return value
        if _is_simple(value):
            self.add_entry_guard(attr_expr, copy.deepcopy(value), "is" if isinstance(value, bool) or value is None else "eq",
                                 f"reading {str(expr).replace('root', 'self', 1)}.{name}", kind="module",
                                 source=user_location(3))
            if type(value) in MUTABLE_CONTAINERS:  # the program works on a copy; changes are replayed
                working = self.effects.container_copy(attr_expr, value)
                object.__getattribute__(view, "_view_overlay")[name] = working
                return working
            return value
        if callable(value) or isinstance(value, (type, nn.Module, torch.Tensor)) or not _viewable(value):
            self.note("object attribute", f"{attr_expr} (a {type(value).__name__}) is used as it was "
                      "when traced (not guarded)", user_location(3))
            return value
        return ObjectView(value, attr_expr, self)

    def object_setattr(self, expr: GExpr, name: str, value: Any) -> None:
        """``view.name = value`` on a plain object held by a module: replayed after the graph."""
        if not name.isidentifier() or name.startswith("__"):
            loc = user_location(3)
            raise TraceError(f"forward sets the attribute {name!r} of {expr} at "
                             f"{loc.describe() if loc else 'an unknown line'}; symtrace replays only "
                             "writes of plain attribute names")
        self.effects.view_writes.pop((expr, name), None)
        self.effects.view_writes[(expr, name)] = value

    def module_setattr(self, real: nn.Module, path: str, name: str, value: Any) -> None:
        qual = f"{path}.{name}" if path else name
        loc = user_location(3)
        where = loc.describe() if loc is not None else "an unknown line"
        d = real.__dict__
        if name in d["_buffers"]:
            current = self._attr_proxies.get(qual)
            if current is None:
                current = self._attr_proxy(qual, d["_buffers"][name], clone=True)
            if value is current:
                return
            if type(value) is Proxy and value.node.op != "get_attr" and is_inplace(value.node) and \
                    value.node.args and value.node.args[0] is current.node:
                return  # `self.buf += 1`: already recorded as an in-place update
            if isinstance(value, (Proxy, torch.Tensor)):
                self.call_method("copy_", current, (value,), {})
                return
            raise TraceError(f"forward assigns a {type(value).__name__} to the buffer {qual!r} at {where}; "
                             "only tensors can be recorded")
        if name in d["_parameters"] or name in d["_modules"]:
            raise TraceError(f"forward replaces {'the parameter' if name in d['_parameters'] else 'the submodule'} "
                             f"{qual!r} at {where}; a graph cannot record that. Do it outside forward.")
        if isinstance(value, nn.Module) or is_shadow(value):
            raise TraceError(f"forward assigns a module to self.{name} at {where}; a graph cannot record "
                             "that. Do it outside forward.")
        # a Python attribute: later reads in this trace see the new value, the model is not
        # changed now, and the graph assigns the last value when it runs (a replayed side effect)
        self._attr_proxies[qual] = value if value is not _DELETED else _DELETED
        self.effects.attribute_written(qual)

    def call_module(self, shadow: nn.Module, real: nn.Module, path: str, args: tuple, kwargs: dict) -> Any:
        """``self.sub(*args)`` inside a traced forward."""
        saved = self.module_path
        self.module_path = path
        try:
            if self.is_leaf_module(real, path):
                if self.live:
                    self.add_live_guard(root_path(path), real)
                # one node; the module's own hooks run when the node runs
                value_module = self._value_module(real, path) if self.has_values else None
                return self._record("call_module", path, args, kwargs, module=value_module)
            return self.trace_forward(shadow, real, args, kwargs)
        finally:
            self.module_path = saved

    def trace_forward(self, shadow: nn.Module, real: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Trace through ``real.forward`` with ``shadow`` as ``self``, with the module's forward
        pre-hooks and hooks traced around it as ``nn.Module.__call__`` would run them."""
        for hook_id, hook in real._forward_pre_hooks.items():
            if hook_id in real._forward_pre_hooks_with_kwargs:
                res = hook(shadow, args, kwargs)
                if res is not None:
                    args, kwargs = res
            else:
                res = hook(shadow, args)
                if res is not None:
                    args = res if isinstance(res, tuple) else (res,)
        fn = _forward_function(real)
        if fn is not None:
            self._guard_code_globals(fn)
            out = fn(shadow, *args, **kwargs)
        else:
            out = real.__dict__["forward"](*args, **kwargs)
        for hook_id, hook in real._forward_hooks.items():
            if hook_id in real._forward_hooks_with_kwargs:
                res = hook(shadow, args, kwargs, out)
            else:
                res = hook(shadow, args, out)
            if res is not None:
                out = res
        return out

    def _value_module(self, real: nn.Module, path: str) -> nn.Module:
        """The module that computes example values for a leaf: a copy when running it would
        change its state (buffers updated in training mode)."""
        m = self._value_modules.get(path)
        if m is None:
            stateful = real.training and any(True for _ in real.buffers())
            with _no_torch_function():
                m = copy.deepcopy(real) if stateful else real
            self._value_modules[path] = m
        return m

    # --- globals ---------------------------------------------------------------------------
    def _guard_code_globals(self, fn: Callable) -> None:
        """Guard the simple module globals ``fn`` reads, and watch the ones it may change (lists,
        dicts and sets it reads, names it rebinds) so the trace leaves them as they were."""
        fn = inspect.unwrap(fn)
        code = getattr(fn, "__code__", None)
        if code is None or code in self._globals_seen:
            return
        self._globals_seen.add(code)
        g = getattr(fn, "__globals__", {})
        mod = g.get("__name__")
        if mod is None or sys.modules.get(mod) is None or sys.modules[mod].__dict__ is not g:
            return
        self.effects.watch_globals(mod, g, _loaded_globals(code) + stored_globals(code))
        if not self.guard_globals:
            return
        for name in _loaded_globals(code):
            if name in g:
                v = g[name]
                if _is_simple(v) and not isinstance(v, (type, enum.EnumMeta)):
                    if name.startswith("__"):
                        self.note("global", f"the global {name} read by {fn.__qualname__} is not guarded", None)
                        continue
                    self.add_entry_guard(Global(mod, name), copy.deepcopy(v),
                                         "is" if isinstance(v, bool) or v is None else "eq",
                                         f"the global {name} read by {fn.__qualname__}", kind="global",
                                         source=SourceLocation(code.co_filename, code.co_firstlineno, code.co_name))

    def note(self, kind: str, message: str, source: Optional[SourceLocation]) -> None:
        """Record something the tracer could not capture or guard (shown by ``explain``)."""
        self.notes.append((kind, message, source))


_GLOBALS_CACHE: Dict[Any, Tuple[str, ...]] = {}


def _loaded_globals(code) -> Tuple[str, ...]:
    names = _GLOBALS_CACHE.get(code)
    if names is None:
        names = tuple(sorted({ins.argval for ins in dis.get_instructions(code) if ins.opname == "LOAD_GLOBAL"}))
        _GLOBALS_CACHE[code] = names
    return names


def _forward_function(module: nn.Module) -> Optional[Callable]:
    """The plain function behind ``module.forward``, to be called with a shadow as ``self``;
    None when ``forward`` is an instance attribute that is not a method of the module."""
    # (a GraphModule's forward is compiled lazily into the instance)
    fwd = module._compiled_forward() if isinstance(module, GraphModule) else module.__dict__.get("forward")
    if fwd is None:
        cls = type(module)
        static = inspect.getattr_static(cls, "forward", None)
        if isinstance(static, staticmethod):  # called without self, as nn.Module.__call__ would
            fn = static.__func__
            return lambda _self, *args, **kwargs: fn(*args, **kwargs)
        if isinstance(static, classmethod):
            fn = static.__func__
            return lambda _self, *args, **kwargs: fn(cls, *args, **kwargs)
        return cls.forward
    if getattr(fwd, "__self__", None) is module:
        return fwd.__func__
    return None


def _unpack_count(frame) -> Optional[int]:
    """If ``frame`` is executing ``a, b = value``, how many names it unpacks into."""
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None:
        return None
    code = frame.f_code.co_code
    i = frame.f_lasti
    if i + 1 < len(code) and dis.opname[code[i]] == "UNPACK_SEQUENCE":
        return code[i + 1]
    return None


def _viewable(obj: Any) -> bool:
    """Plain objects with attributes (configs, namespaces), not containers or extension types."""
    return isinstance(getattr(obj, "__dict__", None), dict) and not isinstance(
        obj, (list, tuple, dict, set, frozenset, str, bytes))


def _holds(obj: Any, pred: Callable[[Any], bool], budget: int = 2000) -> bool:
    """Whether ``pred`` holds for something reachable from ``obj`` through containers and
    instance attributes (a bounded walk)."""
    stack, seen = [obj], set()
    while stack and budget > 0:
        x = stack.pop()
        budget -= 1
        if pred(x):
            return True
        if id(x) in seen or isinstance(x, (str, bytes, int, float, bool, type(None), type, torch.dtype,
                                            torch.device, nn.Module)) or callable(x):
            continue
        seen.add(id(x))
        if isinstance(x, (list, tuple, set, frozenset)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        else:
            d = getattr(x, "__dict__", None)
            if isinstance(d, dict):
                stack.extend(d.values())
            for slot in getattr(type(x), "__slots__", ()):
                if isinstance(slot, str) and hasattr(x, slot):
                    stack.append(getattr(x, slot))
    return False


def _flatten(a: Any) -> list:
    out = []
    stack = [a]
    while stack:
        x = stack.pop()
        if isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        else:
            out.append(x)
    return out


def _no_default():
    from .graph.node import _NO_DEFAULT
    return _NO_DEFAULT


def _traced_factory(f: Callable) -> Callable:
    """``torch.zeros(n, m)`` with traced sizes: record the call directly, so the sizes stay
    symbolic (torch's argument parser would force them to ints, each a guard)."""
    def factory(*args, **kwargs):
        tracer = _active_tracer()
        if tracer is not None and _contains_proxy((args, kwargs)):
            if args and not isinstance(args[0], (tuple, list, torch.Size)) and f.__name__ not in ("full", "randint", "eye"):
                args = (tuple(args),)
            return tracer.call_function(f, args, kwargs)
        return f(*args, **kwargs)

    factory.__wrapped__ = f
    factory.__name__ = f.__name__
    return factory


def _traced_call(f: Callable) -> Callable:
    """A torch function that does not dispatch ``__torch_function__`` (``torch.from_numpy``):
    recorded as a node when it receives traced values."""
    def call(*args, **kwargs):
        tracer = _active_tracer()
        if tracer is not None and _contains_proxy((args, kwargs)):
            return tracer.call_function(f, args, kwargs)
        return f(*args, **kwargs)

    call.__wrapped__ = f
    call.__name__ = f.__name__
    return call


def _dtype_info(cls: type) -> Callable:
    """``torch.finfo(x.dtype)`` / ``torch.iinfo``: the answer for the traced dtype's example
    value (which reading it guarded); without example inputs the dtype is unknown."""
    def info(*args, **kwargs):
        if _contains_proxy((args, kwargs)):
            values = _unwrap((args, kwargs))
            if NO_VALUE in _flatten(values):
                loc = user_location(2)
                raise TraceError(f"torch.{cls.__name__}() of a traced dtype needs its value at "
                                 f"{loc.describe() if loc else 'an unknown line'}, but without example inputs "
                                 "the dtype is unknown. Pass example_inputs=(...) to symbolic_trace.")
            args, kwargs = values
        return cls(*args, **kwargs)

    info.__wrapped__ = cls
    info.__name__ = cls.__name__
    return info


def _traced_py_random(f: Callable) -> Callable:
    """``random.random()`` & co. called by the traced program: a node drawing from Python's
    generator at run time (its value while tracing is a traced value, so decisions on it are
    guarded), not a number frozen into the graph."""
    def draw(*args, **kwargs):
        tracer = _active_tracer()
        if tracer is not None and not _is_internal(sys._getframe(1).f_code):
            return tracer.call_function(f, args, kwargs)
        return f(*args, **kwargs)

    draw.__wrapped__ = f
    draw.__name__ = f.__name__
    return draw


@classmethod
def _traced_function_apply(cls, *args, **kwargs):
    """``MyFunction.apply(x)`` (a ``torch.autograd.Function``) with traced arguments becomes one
    node, which keeps the custom backward; its C implementation cannot take proxies."""
    tracer = _active_tracer()
    if tracer is not None and _contains_proxy((args, kwargs)):
        return tracer.call_function(apply_autograd_function, (cls,) + args, kwargs)
    return _ORIGINAL_FUNCTION_APPLY.__get__(None, cls)(*args, **kwargs)


def apply_autograd_function(function: type, *args, **kwargs):
    """``function.apply(*args, **kwargs)`` for a ``torch.autograd.Function`` subclass: the
    target of the node a traced ``MyFunction.apply(x)`` becomes."""
    return _ORIGINAL_FUNCTION_APPLY.__get__(None, function)(*args, **kwargs)


_ORIGINAL_FUNCTION_APPLY = torch.autograd.Function.__dict__["apply"]


_GRAD_MODE_FILE = os.path.join("autograd", "grad_mode.py")


def _guarded_state_read(f: Callable) -> Callable:
    """``torch.is_grad_enabled()`` / ``torch.get_default_dtype()`` inside forward: the answer
    is global state, so it becomes an entry guard."""
    def read():
        tracer = _active_tracer()
        caller = sys._getframe(1).f_code
        if (tracer is not None and f.__name__ == "is_grad_enabled" and caller.co_filename.endswith(_GRAD_MODE_FILE)
                and torch._C._is_torch_function_enabled() and torch._C._len_torch_function_stack() > 0):
            # torch.no_grad() & co. save the mode to restore it on exit: read it at run time, so
            # the graph restores whatever mode it was called in
            mode = tracer.call_function(torch._C.is_grad_enabled, ())
            object.__setattr__(mode, "guess", bool)  # torch's argument parser checks the class
            return mode
        value = f()
        if tracer is not None and not _is_internal(caller):
            tracer.add_entry_guard(TorchState(f.__name__), value, "is" if isinstance(value, bool) else "eq",
                                   f"torch.{f.__name__}() read inside forward",
                                   kind="grad_mode" if f.__name__ == "is_grad_enabled" else "value",
                                   source=user_location(2))
        return value

    read.__wrapped__ = f
    read.__name__ = f.__name__
    return read


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
    code with operator syntax (``Proxy(node) + 1``)."""

    def __init__(self, graph: Graph):
        super().__init__(record_source=False)
        self.graph = graph
        self.module_path = ""
        self.has_values = False
        self.root = nn.Module()
        self.extra_attrs = {}
        self.notes = []
        self._n_consts = 0
        self._data_guarded = set()
        self._guard_keys = {}


def symbolic_trace(root: Any, concrete_args: Optional[Dict[str, Any]] = None, *,
                   example_inputs: Any = None, leaf_modules: Sequence[type] = (),
                   tracer: Optional[Tracer] = None, record_source: bool = True,
                   _live: bool = False) -> GraphModule:
    """Record ``root`` (an ``nn.Module`` or a function) as a :class:`GraphModule`.

    ``example_inputs``: a tuple of positional arguments or a dict of keyword arguments. With
    them, Python decisions on traced values resolve and are guarded; without, tracing is
    symbolic (torch.fx-like) and such decisions raise :class:`TraceError`. ``concrete_args``
    specialises named arguments to fixed Python values (guarded). ``leaf_modules``: module
    types recorded as one ``call_module`` node, besides torch's own layers.

    Calling the result with inputs that break a guard raises :class:`GuardError`.
    """
    tr = tracer or Tracer(leaf_modules=leaf_modules, record_source=record_source, live=_live)
    with gc_paused():
        graph = tr.trace(root, example_inputs, concrete_args)
    name = type(root).__name__ if isinstance(root, nn.Module) else getattr(root, "__name__", "function")
    gm = GraphModule(tr.root, graph, class_name=class_name_from(name), attrs=tr.extra_attrs)
    gm.meta["trace_notes"] = tr.notes
    return gm
