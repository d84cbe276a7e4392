"""Run one corpus program under one tool and classify the outcome.

    result = run_program(program, "capture")   # Result(outcome="ok" | "refused" | "wrong" | "crash", reason=...)

Tools: ``capture`` (``symtrace.capture``), ``strict`` (``symtrace.symbolic_trace`` with the first
input set as example inputs, then called on every input set), ``symbolic`` (``symbolic_trace``
without example inputs), and, for the benchmark, ``fx`` (``torch.fx.symbolic_trace``),
``jit_trace`` (``torch.jit.trace`` on the first input set), ``dynamo_fullgraph`` and ``dynamo``
(``torch.compile(backend="eager", fullgraph=True/False)``).

How a program is checked:

* the model is made once under a fixed seed; eager runs on a deep copy (programs registered
  with ``factory=True`` -- closures with state, per-instance classes -- are made twice), the tool
  on the original, so state never leaks between the two;
* every input set is called on fresh copies of its inputs (strides, ``requires_grad``,
  ``nn.Parameter`` and aliasing kept), first eagerly, then by the tool, from the same RNG state
  (torch and ``random``) and the same module globals (``Program.globals`` are snapshotted before
  the eager call and put back, in place, before the tool's call), so that shared globals
  never make a correct answer look wrong;
* after each call, compared exactly: the output (values NaN-aware, dtype, shape,
  ``requires_grad``, container and dataclass types, Python scalars), the inputs (mutated in
  place), the globals, the module state (``state_dict`` and plain attributes of every
  submodule, training flags; the closure cells of a function; the attributes of the object of a
  bound method), and for ``random`` programs the RNG state after the call. A model the tool calls
  live (capture, Dynamo) is compared whole with the eager copy; a separate graph module
  (strict, symbolic, fx, jit) must hold every piece of module state eager changed, with eager's
  value (and the parameters and buffers it shares with it must be equal);
* then the optional state flip (``"eval"``, ``"train"``, ``{"attr.path": value}`` -- applied to
  the graph module too when it holds that attribute --, a callable changing one model -- skipped
  for a separate graph module --, or a callable changing globals), and every input set again;
* tracing must leave the model and the globals unchanged, and no symtrace ``Proxy`` may be
  left in the model's attributes (walked a few levels into lists, dicts and tuples) or globals.

Outcomes: ``ok`` (eager's answer every time; raising the same exception type as eager counts),
``refused`` (the tool refused loudly: ``TraceError`` at trace time or ``GuardError`` at a call for
symtrace -- capture included, though capture must not; any exception while building an fx/jit
trace; a Dynamo ``Unsupported``-style error), ``wrong`` (a different answer or state with no
error), ``crash`` (any other exception). A program's outcome is the worst over its calls
(wrong > crash > refused > ok), with the reason of the first such call.
"""
from __future__ import annotations

import collections as _collections
import contextlib
import copy
import enum
import functools as _functools
import math
import random
import sys
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from . import Fresh, In, Program

__all__ = ["run_program", "Result", "SYMTRACE_MODES", "TOOLS", "OK", "REFUSED", "WRONG", "CRASH",
           "find_proxies"]

OK, REFUSED, WRONG, CRASH = "ok", "refused", "wrong", "crash"
_RANK = {OK: 0, REFUSED: 1, CRASH: 2, WRONG: 3}
SYMTRACE_MODES = ("capture", "strict", "symbolic")
TOOLS = SYMTRACE_MODES + ("fx", "jit_trace", "dynamo_fullgraph", "dynamo")
SEED = 1234


@dataclass
class Result:
    program: str
    tool: str
    outcome: str
    reason: str = ""
    calls: List[str] = field(default_factory=list)  # per call: outcome (or "refused"/"wrong: ...")
    exc_type: str = ""  # type of the exception behind a refused/crash outcome

    def __str__(self):
        return f"{self.program} [{self.tool}]: {self.outcome}{' -- ' + self.reason if self.reason else ''}"


class _Stop(Exception):
    def __init__(self, outcome: str, reason: str, exc: Optional[BaseException] = None):
        super().__init__(reason)
        self.outcome, self.reason = outcome, reason
        self.exc_type = type(exc).__name__ if exc is not None else ""


# ---------------------------------------------------------------------------------------------
# freezing values for exact comparison
# ---------------------------------------------------------------------------------------------
_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
            torch.memory_format, type(Ellipsis), slice, range)


def _is_proxy(v: Any) -> bool:
    t = type(v)
    return t.__name__ in ("Proxy", "Attribute") and t.__module__.startswith("symtrace")


def _tname(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _freeze(v: Any, depth: int = 0, memo: Optional[dict] = None) -> Any:
    """A snapshot of ``v`` that later mutation does not change, compared with :func:`_diff`."""
    memo = {} if memo is None else memo
    if _is_proxy(v):
        return ("proxy", type(v).__name__)
    if isinstance(v, torch.Tensor):
        if isinstance(v, nn.parameter.UninitializedTensorMixin):
            return ("uninitialized", _tname(type(v)))
        if v.layout != torch.strided:
            return ("tensor-other", _tname(type(v)), str(v.layout), tuple(v.shape))
        return ("tensor", _tname(type(v)), v.detach().clone(), v.requires_grad)
    if isinstance(v, (_SCALARS)) or isinstance(v, enum.Enum):
        return ("value", _tname(type(v)), v)
    if isinstance(v, torch.Size):
        return ("value", "torch.Size", tuple(v))
    if depth > 8:
        return ("deep", _tname(type(v)))
    if id(v) in memo:
        return ("cycle", _tname(type(v)))
    memo[id(v)] = True
    try:
        if isinstance(v, (tuple, list, _collections.deque)):
            return ("seq", _tname(type(v)), [_freeze(x, depth + 1, memo) for x in v])
        if isinstance(v, dict):
            return ("dict", _tname(type(v)), [(_key(k), _freeze(x, depth + 1, memo)) for k, x in v.items()])
        if isinstance(v, (set, frozenset)):  # tensors in a set compare by count only
            return ("set", _tname(type(v)), sorted(repr("<tensor>" if isinstance(x, torch.Tensor) else x) for x in v))
        if isinstance(v, nn.Module):
            return ("module", _tname(type(v)))
        if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
                          _functools.partial)):
            return ("callable", _tname(type(v)), getattr(v, "__qualname__", repr(type(v))))
        if type(v).__module__ == "numpy":
            import numpy as np
            return ("numpy", _tname(type(v)), np.array(v, copy=True))
        try:
            attrs = sorted(vars(v).items())
        except TypeError:
            attrs = None
        if attrs is not None:
            return ("object", _tname(type(v)), [(k, _freeze(x, depth + 1, memo)) for k, x in attrs])
        if hasattr(v, "__iter__") and hasattr(v, "__next__"):
            return ("iterator", _tname(type(v)))
        text = repr(v)
        return ("opaque", _tname(type(v)), "" if " at 0x" in text else text[:200])
    finally:
        del memo[id(v)]


def _key(k: Any) -> Any:
    if isinstance(k, torch.Tensor):
        return ("tensor-key", id(k))
    if isinstance(k, torch.Size):
        return ("size", tuple(k))
    return k


def _diff(a: Any, b: Any, path: str) -> Optional[str]:
    """None if the frozen values ``a`` (the tool's) and ``b`` (eager's) are the same, else why not."""
    if a[0] == "proxy" or b[0] == "proxy":
        return f"{path}: a symtrace {a[1] if a[0] == 'proxy' else b[1]} object"
    if a[0] != b[0] or a[1] != b[1]:
        return f"{path}: {_show(a)} instead of {_show(b)}"
    if a[0] == "set" and a[2] != b[2]:
        return f"{path}: {{{', '.join(a[2])}}} instead of {{{', '.join(b[2])}}}"
    kind = a[0]
    if kind == "tensor":
        x, y = a[2], b[2]
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"{path}: tensor {x.dtype}{list(x.shape)} instead of {y.dtype}{list(y.shape)}"
        if not _tensor_equal(x, y):
            return f"{path}: different values {_preview(x)} instead of {_preview(y)}"
        if a[3] != b[3]:
            return f"{path}: requires_grad {a[3]} instead of {b[3]}"
        return None
    if kind == "value":
        x, y = a[2], b[2]
        if isinstance(y, float) and math.isnan(y):
            return None if isinstance(x, float) and math.isnan(x) else f"{path}: {x!r} instead of nan"
        try:
            same = bool(x == y)
        except Exception:  # noqa: BLE001
            same = False
        return None if same else f"{path}: {x!r} instead of {y!r}"
    if kind == "seq":
        if len(a[2]) != len(b[2]):
            return f"{path}: length {len(a[2])} instead of {len(b[2])}"
        for i, (x, y) in enumerate(zip(a[2], b[2])):
            d = _diff(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    if kind == "dict":
        ka, kb = [k for k, _ in a[2]], [k for k, _ in b[2]]
        if ka != kb:
            return f"{path}: keys {ka!r} instead of {kb!r}"
        for (k, x), (_, y) in zip(a[2], b[2]):
            d = _diff(x, y, f"{path}[{k!r}]")
            if d:
                return d
        return None
    if kind == "object":
        ka, kb = [k for k, _ in a[2]], [k for k, _ in b[2]]
        if ka != kb:
            return f"{path}: attributes {ka} instead of {kb}"
        for (k, x), (_, y) in zip(a[2], b[2]):
            d = _diff(x, y, f"{path}.{k}")
            if d:
                return d
        return None
    if kind == "numpy":
        import numpy as np
        x, y = a[2], b[2]
        if x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x, y, equal_nan=x.dtype.kind in "fc"):
            return f"{path}: numpy {x!r} instead of {y!r}"
        return None
    return None if a == b else f"{path}: {_show(a)} instead of {_show(b)}"


def _tensor_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.is_complex():
        return _tensor_equal(torch.view_as_real(x), torch.view_as_real(y))
    if x.dtype.is_floating_point:
        return bool(((x == y) | (torch.isnan(x) & torch.isnan(y))).all())
    return torch.equal(x, y)


def _preview(x: torch.Tensor) -> str:
    flat = x.reshape(-1)[:4].tolist()
    return f"{flat}{'...' if x.numel() > 4 else ''}"


def _show(f: Any) -> str:
    if f[0] == "tensor":
        cls = "" if f[1] == "torch.Tensor" else f" ({f[1]})"
        return f"tensor {f[2].dtype}{list(f[2].shape)}{cls}"
    if f[0] == "value":
        return f"{f[2]!r} ({f[1].rsplit('.', 1)[-1]})"
    return f"{f[0]} {f[1]}"


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------
def _clone(a: Any, memo: dict) -> Any:
    """Fresh copies of nested inputs: strides, requires_grad, Parameter and aliasing kept."""
    if isinstance(a, Fresh):
        return a.make()
    if isinstance(a, torch.Tensor):
        if id(a) not in memo:
            d = a.detach()
            if d.layout == torch.strided:
                c = torch.empty_strided(d.size(), d.stride(), dtype=d.dtype, device=d.device)
                c.copy_(d)
            else:
                c = d.clone()
            if isinstance(a, nn.Parameter):
                c = nn.Parameter(c, requires_grad=a.requires_grad)
            elif a.requires_grad:
                c.requires_grad_()
            memo[id(a)] = c
        return memo[id(a)]
    if isinstance(a, tuple) and hasattr(a, "_fields"):
        return type(a)(*[_clone(x, memo) for x in a])
    if isinstance(a, (tuple, list)):
        return type(a)(_clone(x, memo) for x in a)
    if isinstance(a, dict):
        out = copy.copy(a)  # keeps the dict type (OrderedDict, defaultdict, ...)
        out.clear()
        for k, v in a.items():
            out[k] = _clone(v, memo)
        return out
    if _plain_object(a):  # a user object (config, holder of tensors): its own copy per call
        if id(a) not in memo:
            c = copy.copy(a)
            memo[id(a)] = c
            vars(c).update({k: _clone(v, memo) for k, v in vars(a).items()})
        return memo[id(a)]
    return a


def _plain_object(a: Any) -> bool:
    t = type(a)
    return (hasattr(a, "__dict__") and not isinstance(a, (type, types.FunctionType, types.MethodType,
                                                            types.ModuleType, nn.Module, _functools.partial))
            and not t.__module__.startswith(("torch", "builtins", "numpy", "collections", "functools")))


def _fresh(inp: In) -> Tuple[tuple, dict]:
    memo: dict = {}
    return _clone(inp.args, memo), _clone(inp.kwargs, memo)


def _example(fn: Any, inp: In) -> Any:
    """symtrace's ``example_inputs``: the positional tuple, or a dict of named arguments when
    there are keyword arguments (symtrace's own CallArgs when *args/**kwargs take some)."""
    import inspect
    args, kwargs = _fresh(inp)
    if not kwargs:
        return args
    target = fn.forward if isinstance(fn, nn.Module) else fn
    sig = inspect.signature(target)
    bound = sig.bind(*args, **kwargs)
    varargs = [p.name for p in sig.parameters.values()
               if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and bound.arguments.get(p.name)]
    if varargs:
        call_args = _symtrace_call_args()
        if call_args is not None:
            return call_args(args, kwargs)
    return dict(bound.arguments)


def _symtrace_call_args():
    import importlib
    for mod in ("symtrace.trace.inputs", "symtrace.trace", "symtrace.tracer"):
        try:
            return getattr(importlib.import_module(mod), "CallArgs")
        except (ImportError, AttributeError):
            continue
    return None


# ---------------------------------------------------------------------------------------------
# globals and module state
# ---------------------------------------------------------------------------------------------
class _Globals:
    """The module globals a program declares: snapshot, in-place restore, frozen view."""

    def __init__(self, prog: Program):
        self.g = sys.modules[prog.module].__dict__ if prog.globals else {}
        self.names = prog.globals

    def save(self) -> dict:
        out = {}
        for n in self.names:
            v = self.g.get(n, _MISSING)
            out[n] = (v, _shallow(v))
        return out

    def restore(self, saved: dict) -> None:
        for n, (v, contents) in saved.items():
            if v is _MISSING:
                self.g.pop(n, None)
                continue
            self.g[n] = v
            _put_back(v, contents)

    def frozen(self) -> dict:
        return {n: _freeze(self.g.get(n, _MISSING_F)) for n in self.names}

    def values(self) -> List[Any]:
        return [self.g.get(n) for n in self.names]


_MISSING = object()
_MISSING_F = "<missing>"


_MODULE_DICTS = ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks")


def _shallow(v: Any) -> Any:
    if isinstance(v, type):  # a class: its attributes
        return ("class", dict(vars(v)))
    if isinstance(v, nn.Module):  # its attributes, and the order of its parameters, submodules, hooks
        return dict(vars(v)), {k: list(getattr(v, k).items()) for k in _MODULE_DICTS}
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, (list, _collections.deque)):
        return list(v)
    if isinstance(v, dict):
        return list(v.items())
    if isinstance(v, set):
        return set(v)
    if hasattr(v, "__dict__") and not isinstance(v, (type, types.FunctionType, types.ModuleType)):
        return dict(vars(v))
    return None


def _put_back(v: Any, contents: Any) -> None:
    if contents is None:
        return
    if isinstance(v, type):
        saved = contents[1]
        for k in [k for k in vars(v) if k not in saved]:
            delattr(v, k)
        for k, x in saved.items():
            if vars(v).get(k, _MISSING) is not x and k not in ("__dict__", "__weakref__", "__doc__"):
                setattr(v, k, x)
        return
    if isinstance(v, nn.Module):
        attrs, dicts = contents
        vars(v).clear()
        vars(v).update(attrs)
        for k, items in dicts.items():
            getattr(v, k).clear()
            getattr(v, k).update(items)
        return
    if isinstance(v, torch.Tensor):
        with torch.no_grad():
            v.copy_(contents)
    elif isinstance(v, (list, _collections.deque)):
        v.clear()
        v.extend(contents)
    elif isinstance(v, dict):
        v.clear()
        v.update(contents)
    elif isinstance(v, set):
        v.clear()
        v.update(contents)
    else:
        vars(v).clear()
        vars(v).update(contents)


_MODULE_INTERNALS = frozenset(vars(nn.Module()).keys())
# bookkeeping a tool may add to the user's model without changing what it computes
_TOOL_ATTRS = frozenset({"_is_torch_compile"})  # torch.compile marks a module it wraps


def _holder_objects(fn: Any) -> List[Tuple[str, Any]]:
    """(path, object) of the state a program owns: a module's submodules, or the object of a bound method."""
    if isinstance(fn, nn.Module):
        return list(fn.named_modules(remove_duplicate=False))
    if isinstance(fn, types.MethodType) and not isinstance(fn.__self__, (type, types.ModuleType)):
        return [("", fn.__self__)]
    return []


def _cells(fn: Any, prefix: str, out: Dict[str, Any], seen: set, depth: int = 3) -> None:
    """The closure cells of a function (and of the functions in them), frozen."""
    if id(fn) in seen or depth <= 0:
        return
    seen.add(id(fn))
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not closure:
        return
    for name, cell in zip(code.co_freevars, closure):
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            v = _MISSING_F
        key = f"{prefix}{name}"
        if isinstance(v, types.FunctionType):
            _cells(v, f"{key}.", out, seen, depth - 1)
        else:
            out[f"cell:{key}"] = _freeze(v)


def _state(fn: Any, keys: Optional[set] = None) -> Dict[str, Any]:
    """Frozen state: state_dict entries, plain attributes of every submodule, training flags
    (only ``keys``, if given, plus the state_dict); closure cells of a function."""
    out: Dict[str, Any] = {}
    if isinstance(fn, types.FunctionType):
        _cells(fn, "", out, set())
    if isinstance(fn, nn.Module):
        for k, v in fn.state_dict(keep_vars=True).items():
            out[f"sd:{k}"] = _freeze(v)
    for path, obj in _holder_objects(fn):
        if isinstance(obj, nn.Module):
            out[f"training:{path}"] = ("value", "builtins.bool", obj.training)
            items = [(k, v) for k, v in vars(obj).items()
                     if k not in _MODULE_INTERNALS and not isinstance(v, nn.Module)]
        else:
            items = list(vars(obj).items())
        for k, v in items:
            key = f"attr:{path}{'.' if path else ''}{k}"
            if isinstance(v, nn.Parameter) or k in _TOOL_ATTRS or (keys is not None and key not in keys):
                continue
            out[key] = _freeze(v)
    return out


def _state_diff(tool: Dict[str, Any], eager: Dict[str, Any], eager_before: Optional[Dict[str, Any]],
                what: str, ref: str = "eager") -> Optional[str]:
    """Compare the tool's state with eager's (``ref``): all of it (``eager_before`` None: the tool
    runs the model itself), or what eager changed plus the shared state_dict entries (a separate
    graph module)."""
    if eager_before is None:
        keys = list(eager) + [k for k in tool if k not in eager]
    else:
        changed = [k for k in eager if k not in eager_before or _diff(eager[k], eager_before[k], k)]
        removed = [k for k in eager_before if k not in eager]
        keys = changed + removed + [k for k in tool if k.startswith("sd:") and k in eager and k not in changed]
    for k in keys:
        if k not in eager:
            if eager_before is not None and k in tool:
                return f"{what}: {k[k.index(':') + 1:]} still present, {ref} deleted it"
            if eager_before is None:
                return f"{what}: {k[k.index(':') + 1:]} added (not in {ref})"
            continue
        if k not in tool:
            if eager_before is None:
                return f"{what}: {k[k.index(':') + 1:]} is missing (present in {ref})"
            return f"{what}: {k[k.index(':') + 1:]} not updated ({ref} changed it)"
        d = _diff(tool[k], eager[k], k[k.index(':') + 1:])
        if d:
            return f"{what}: {d}"
    return None


def find_proxies(objs: List[Tuple[str, Any]], depth: int = 4) -> Optional[str]:
    """The path of the first symtrace Proxy found in ``vars()`` of the objects (into lists,
    dicts and tuples, ``depth`` levels), or None."""
    seen = set()

    def walk(v: Any, path: str, d: int) -> Optional[str]:
        if _is_proxy(v):
            return path
        if d <= 0 or id(v) in seen:
            return None
        if isinstance(v, (list, tuple, set, frozenset, _collections.deque)):
            seen.add(id(v))
            for i, x in enumerate(v):
                p = walk(x, f"{path}[{i}]", d - 1)
                if p:
                    return p
        elif isinstance(v, dict):
            seen.add(id(v))
            for k, x in list(v.items()):
                p = walk(k, f"{path} key {k!r}", d - 1) if _is_proxy(k) else walk(x, f"{path}[{k!r}]", d - 1)
                if p:
                    return p
        return None

    for name, obj in objs:
        if _is_proxy(obj):
            return name
        if isinstance(obj, nn.Module):
            for mname, m in obj.named_modules(remove_duplicate=True):
                for k, v in vars(m).items():
                    p = walk(v, f"{name}{'.' + mname if mname else ''}.{k}", depth)
                    if p:
                        return p
        else:
            attrs = vars(obj).items() if hasattr(obj, "__dict__") and not isinstance(obj, types.ModuleType) else []
            for k, v in attrs:
                p = walk(v, f"{name}.{k}", depth)
                if p:
                    return p
            p = walk(obj, name, depth)
            if p:
                return p
    return None


# ---------------------------------------------------------------------------------------------
# tools
# ---------------------------------------------------------------------------------------------
def _symtrace():
    import symtrace
    return symtrace


class _Tool:
    name = ""
    separate = True  # the tool runs a separate object (graph module), not the model itself

    def build(self, model: Any, prog: Program) -> Any:
        raise NotImplementedError

    def refusal(self, e: BaseException, at_build: bool) -> bool:
        return False


class _Capture(_Tool):
    name, separate = "capture", False

    def build(self, model, prog):
        return _symtrace().capture(model)

    def refusal(self, e, at_build):
        st = _symtrace()
        return isinstance(e, (st.TraceError, st.GuardError))


class _Strict(_Tool):
    name = "strict"

    def build(self, model, prog):
        inp = prog.inputs[0]
        with _grad(inp):
            return _symtrace().symbolic_trace(model, example_inputs=_example(model, inp))

    def refusal(self, e, at_build):
        st = _symtrace()
        return isinstance(e, st.TraceError) if at_build else isinstance(e, st.GuardError)


class _Symbolic(_Strict):
    name = "symbolic"

    def build(self, model, prog):
        return _symtrace().symbolic_trace(model)


class _Fx(_Tool):
    name = "fx"

    def build(self, model, prog):
        return torch.fx.symbolic_trace(model)

    def refusal(self, e, at_build):
        return at_build  # torch.fx refuses loudly while tracing (TraceError, TypeError on a Proxy, ...)


class _JitTrace(_Tool):
    name = "jit_trace"

    def build(self, model, prog):
        inp = prog.inputs[0]
        args, kwargs = _fresh(inp)
        with _grad(inp), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if kwargs:
                return torch.jit.trace(model, example_kwarg_inputs=_example(model, inp), check_trace=False,
                                       strict=False)
            return torch.jit.trace(model, args, check_trace=False, strict=False)

    def refusal(self, e, at_build):
        return at_build


class _Dynamo(_Tool):
    separate = False

    def __init__(self, fullgraph: bool):
        self.fullgraph = fullgraph
        self.name = "dynamo_fullgraph" if fullgraph else "dynamo"

    def build(self, model, prog):
        import torch._dynamo
        torch._dynamo.reset()
        return torch.compile(model, backend="eager", fullgraph=self.fullgraph)

    def refusal(self, e, at_build):
        import torch._dynamo.exc as exc
        return isinstance(e, (exc.Unsupported, exc.UserError, exc.UncapturedHigherOrderOpError)) or (
            isinstance(e, exc.TorchDynamoException) and not isinstance(e, exc.TorchRuntimeError))


class _Eager(_Tool):
    """The program itself, run a second time: the harness must judge it ``ok`` (a self-check of
    the corpus and of the comparisons: deterministic programs, globals reset, RNG carried)."""
    name, separate = "eager", False

    def build(self, model, prog):
        return model


_TOOLS: Dict[str, Callable[[], _Tool]] = {
    "eager": _Eager,
    "capture": _Capture, "strict": _Strict, "symbolic": _Symbolic, "fx": _Fx, "jit_trace": _JitTrace,
    "dynamo_fullgraph": lambda: _Dynamo(True), "dynamo": lambda: _Dynamo(False),
}


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------
def _grad(inp: In):
    return contextlib.nullcontext() if inp.grad else torch.no_grad()


def _make(prog: Program) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(0)
        return prog.make()


def _eager_copy(model: Any, prog: Program) -> Any:
    if isinstance(model, nn.Module) and not prog.remake:
        try:
            return copy.deepcopy(model)
        except Exception:  # noqa: BLE001 - an odd module: make it again under the same seed
            return _make(prog)
    return _make(prog)


class _Rng:
    def __init__(self):
        self.torch = torch.default_generator.get_state()
        self.py = random.getstate()

    def set(self) -> None:
        torch.default_generator.set_state(self.torch)
        random.setstate(self.py)

    def same(self, other: "_Rng") -> bool:
        return torch.equal(self.torch, other.torch) and self.py == other.py


def _same_exception(got: BaseException, ref: BaseException) -> bool:
    e: Optional[BaseException] = got
    for _ in range(4):  # symtrace may wrap the original (NodeRunError with __cause__)
        if e is None:
            return False
        if type(e) is type(ref) or isinstance(e, type(ref)):
            return True
        e = e.__cause__
    return False


def _call(fn: Any, inp: In):
    args, kwargs = _fresh(inp)
    with _grad(inp):
        out = fn(*args, **kwargs)
    return out, (args, kwargs)


def _takes_model(flip: Callable) -> bool:
    import inspect
    return len(inspect.signature(flip).parameters) >= 1


def _apply_flip(flip: Any, obj: Any, is_graph: bool) -> bool:
    """Apply an attribute/mode flip to ``obj``; False if ``obj`` (a graph module) does not hold
    the attribute (the flip round is then skipped for that tool). Modules a flip makes are
    made under a fixed seed (the eager copy and the tool's model get the same weights)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(1)
        return _apply_flip_seeded(flip, obj, is_graph)


def _apply_flip_seeded(flip: Any, obj: Any, is_graph: bool) -> bool:
    if flip == "eval":
        obj.eval()
    elif flip == "train":
        obj.train()
    elif callable(flip):  # a change of one model (its hooks, its parameters)
        if is_graph:
            return False  # a separate graph module holds none of that: skipped
        flip(obj)
    elif isinstance(flip, dict):
        for path, value in flip.items():
            *parents, last = path.split(".")
            owner = obj
            for p in parents:
                if not hasattr(owner, p):
                    return False
                owner = getattr(owner, p)
            if is_graph and not hasattr(owner, last):
                return False
            setattr(owner, last, value() if callable(value) and isinstance(value, type) else copy.deepcopy(value))
    return True


def run_program(prog: Program, tool_name: str) -> Result:
    """Run ``prog`` under one tool and classify the outcome (see the module docstring)."""
    tool = _TOOLS[tool_name]()
    gl = _Globals(prog)
    start = gl.save()
    rng_start = _Rng()
    res = Result(prog.name, tool_name, OK)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _run(prog, tool, gl, res)
    except _Stop as s:
        res.calls.append(s.outcome)
        if _RANK[s.outcome] > _RANK[res.outcome]:
            res.outcome, res.reason, res.exc_type = s.outcome, s.reason, s.exc_type
    finally:
        gl.restore(start)
        rng_start.set()
        torch.set_grad_enabled(True)
    return res


def _note(res: Result, outcome: str, reason: str, exc: Optional[BaseException] = None) -> None:
    res.calls.append(outcome if outcome == OK else f"{outcome}: {reason}")
    if _RANK[outcome] > _RANK[res.outcome]:
        res.outcome, res.reason = outcome, reason
        res.exc_type = type(exc).__name__ if exc is not None else ""


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg[:240]}"


def _run(prog: Program, tool: _Tool, gl: _Globals, res: Result) -> None:
    model = _make(prog)
    eager = _eager_copy(model, prog)
    before = _state(model)
    g_before = gl.frozen()

    torch.default_generator.manual_seed(SEED)
    random.seed(SEED)
    try:
        fn = tool.build(model, prog)
    except Exception as e:  # noqa: BLE001
        outcome = REFUSED if tool.refusal(e, True) else CRASH
        raise _Stop(outcome, f"at trace time: {_short(e)}", e)
    if tool.separate:  # tracing must leave the model and globals alone
        d = _state_diff(_state(model), before, None, "tracing changed the model", ref="the model before")
        if d:
            _note(res, WRONG, d)
        for n, v in gl.frozen().items():
            dd = _diff(v, g_before[n], n)
            if dd:
                _note(res, WRONG, f"tracing changed the global {dd}")
    leak = find_proxies(_owned(model) + [(f"global {n}", v) for n, v in zip(gl.names, gl.values())])
    if leak:
        _note(res, WRONG, f"a symtrace Proxy was left in {leak} after tracing")
    if tool.separate and isinstance(model, nn.Module):  # state lives in the graph module
        holder, eager_before = fn, _state(eager)
    else:  # the tool runs the model itself, or the program's state is a plain object it writes
        holder, eager_before = model, None

    rounds = [None] if prog.flip is None else [None, prog.flip]
    for flip in rounds:
        if flip is not None:
            if callable(flip) and not _takes_model(flip):
                flip()  # a change of globals (restored at the end)
            else:
                _apply_flip(flip, eager, False)
                try:
                    applied = _apply_flip(flip, holder, tool.separate)
                except Exception:  # noqa: BLE001 - e.g. a ScriptModule refuses a plain submodule
                    if not tool.separate:
                        raise
                    applied = False
                if not applied:
                    res.calls.append("flip skipped: the graph module does not hold the attribute")
                    break
        for i, inp in enumerate(prog.inputs):
            _one_call(prog, tool, fn, holder, model, eager, eager_before, gl, res,
                      f"{'after the flip, ' if flip is not None else ''}input {i}", inp)


def _one_call(prog, tool, fn, holder, model, eager, eager_before, gl, res, what, inp) -> None:
    g0 = gl.save()
    rng0 = _Rng()
    # eager
    try:
        ref, ref_args = _call(eager, inp)
        ref_exc = None
        ref_f, ref_args_f = _freeze(ref), _freeze(ref_args)
    except Exception as e:  # noqa: BLE001
        ref_exc = e
    rng_e = _Rng()
    g_e_frozen = gl.frozen()
    g_e = gl.save()
    state_e = _state(eager)
    # the tool, from the same globals and RNG state
    gl.restore(g0)
    rng0.set()
    try:
        out, out_args = _call(fn, inp)
        exc = None
    except Exception as e:  # noqa: BLE001
        exc = e
    rng_t = _Rng()

    def resync():
        gl.restore(g_e)
        rng_e.set()
        _resync_state(holder, eager, tool.separate)

    if exc is not None:
        if ref_exc is not None and _same_exception(exc, ref_exc):
            _note(res, OK, "")
            resync()
            return
        if tool.refusal(exc, False):
            why = _short(exc)
            if tool.name == "capture":
                why = f"capture raised {why}"
            _note(res, REFUSED, f"{what}: {why}", exc)
            resync()
            return
        if ref_exc is not None:
            raise _Stop(CRASH, f"{what}: raised {_short(exc)} where eager raises {_short(ref_exc)}", exc)
        raise _Stop(CRASH, f"{what}: {_short(exc)}", exc)
    if ref_exc is not None:
        _note(res, WRONG, f"{what}: returned a value where eager raises {_short(ref_exc)}")
        resync()
        return
    d = (_diff(_freeze(out), ref_f, "output")
         or _diff(_freeze(out_args), ref_args_f, "inputs after the call"))
    if d is None:
        g_t = gl.frozen()
        for n in gl.names:
            d = _diff(g_t[n], g_e_frozen[n], f"global {n}")
            if d:
                break
    if d is None:
        wanted = None if eager_before is None else set(state_e) | set(eager_before)
        d = _state_diff(_state(holder, wanted), state_e, eager_before, "module state")
    if d is None and prog.random and not rng_t.same(rng_e):
        d = "the RNG state after the call differs from eager's (random numbers drawn differently)"
    if d is None:
        leak = find_proxies(_owned(model) + ([("graph", holder)] if holder is not model else [])
                            + [(f"global {n}", v) for n, v in zip(gl.names, gl.values())])
        if leak:
            d = f"a symtrace Proxy was left in {leak}"
    if d is not None:
        _note(res, WRONG, f"{what}: {d}")
        resync()
        return
    _note(res, OK, "")


def _owned(model: Any) -> List[Tuple[str, Any]]:
    if isinstance(model, types.MethodType):
        return [("self", model.__self__)] if not isinstance(model.__self__, (type, types.ModuleType)) else []
    return [("model", model)] if isinstance(model, nn.Module) else []


def _resync_state(holder: Any, eager: Any, separate: bool) -> None:
    """After a refused or wrong call, put the tool's state back in line with eager's, so that the
    next calls are judged on their own."""
    if not isinstance(eager, nn.Module) or not isinstance(holder, nn.Module):
        if isinstance(eager, types.MethodType) and isinstance(holder, types.MethodType):
            try:
                vars(holder.__self__).clear()
                vars(holder.__self__).update(copy.deepcopy(vars(eager.__self__)))
            except Exception:  # noqa: BLE001
                pass
        return
    sd_e = eager.state_dict()
    with torch.no_grad():
        for k, v in holder.state_dict().items():
            if k in sd_e and v.shape == sd_e[k].shape:
                v.copy_(sd_e[k])
    if not separate:
        for (p, m), (_, me) in zip(holder.named_modules(remove_duplicate=False),
                                   eager.named_modules(remove_duplicate=False)):
            for k, v in vars(me).items():
                if k not in _MODULE_INTERNALS and not isinstance(v, (nn.Module, torch.Tensor)):
                    try:
                        setattr(m, k, copy.deepcopy(v))
                    except Exception:  # noqa: BLE001
                        pass
            m.training = me.training
