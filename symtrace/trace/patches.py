"""Process-wide patches while any thread traces, and the torch function mode of one trace.

``builtins.isinstance``/``callable`` answer for proxies as for their values; torch's factories,
global-state reads, ``from_numpy``, ``finfo``/``iinfo``, ``autograd.Function.apply`` and Python's
``random`` functions record into the calling thread's tracer. Each patch is shared by nested and
concurrent traces (installed by the first, restored by the last); threads that are not tracing
see everything behave as usual.
"""
from __future__ import annotations

import builtins
import os
import random
import sys
import threading
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.overrides import TorchFunctionMode

from ..errors import TraceError
from ..graph.effects import register_side_effect
from ..graph.guard_expr import TorchState
from ..graph.source import _is_internal, user_location
from ..graph.tree import tree_iter
from ..proxy import NO_VALUE, Attribute, Proxy, claimed_class
from ..shadow import SHADOW_TYPES, class_decided
from .values import _contains_proxy, _unwrap

# torch functions patched while tracing (restored afterwards): factories whose traced sizes
# torch's argument parser would force to ints, and global-state reads that become guards
_FACTORIES = ("zeros", "ones", "empty", "rand", "randn", "full", "randint", "eye")
_STATE_READS = ("is_grad_enabled", "get_default_dtype")
class _ActiveTracers(threading.local):
    """The tracers running in this thread, innermost last (another thread's eager
    ``torch.randn`` must not be recorded into this thread's trace)."""

    def __init__(self):
        self.stack: List[Any] = []


_ACTIVE = _ActiveTracers()


def _active_tracer() -> Optional[Any]:
    stack = _ACTIVE.stack
    return stack[-1] if stack else None


_REAL_ISINSTANCE = builtins.isinstance


def _tracing_isinstance(obj: Any, cls: Any, /) -> bool:
    """``isinstance`` while tracing: a proxy is also an instance of the class of the value it
    stands for, so ``isinstance(x, torch.Tensor)`` holds for a traced tensor. (The proxy's
    ``__class__`` cannot say so for tensors: torch's C code asks the same question and would
    then read the proxy as a C tensor.)"""
    t = type(obj)
    if t in SHADOW_TYPES and not _is_internal(sys._getframe(1).f_code):
        class_decided(obj)  # `isinstance(self.sub, nn.Linear)` in the program decides on its class
    if _REAL_ISINSTANCE(obj, cls):
        return True
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


_REAL_MAX, _REAL_MIN = builtins.max, builtins.min


def _traced_number(a: Any) -> bool:
    return (type(a) is Proxy) and type(a.value) in (int, float)


def _extremum(real: Callable) -> Callable:
    def traced(*args, **kwargs):
        """``max(a, b, ...)`` / ``min`` while tracing: with traced numbers among plain ones (a
        cache's length, a size), one graph node, not comparisons forced to a branch."""
        if len(args) >= 2 and not kwargs and any(_traced_number(a) for a in args) and \
                all(_traced_number(a) or type(a) in (int, float) for a in args):
            tracer = _active_tracer()
            if tracer is not None:
                return tracer.call_function(real, args)
        return real(*args, **kwargs)
    traced.__name__ = real.__name__
    return traced


_TRACING_MAX, _TRACING_MIN = _extremum(_REAL_MAX), _extremum(_REAL_MIN)


def _install_builtin_patches() -> None:
    builtins.isinstance = _tracing_isinstance
    builtins.callable = _tracing_callable
    builtins.max = _TRACING_MAX
    builtins.min = _TRACING_MIN


def _restore_builtin_patches() -> None:
    builtins.isinstance = _REAL_ISINSTANCE
    builtins.callable = _REAL_CALLABLE
    builtins.max = _REAL_MAX
    builtins.min = _REAL_MIN


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
#: the global random generator's state, read or set by the program: nodes run in order
_RNG_STATE = ("manual_seed", "get_rng_state", "set_rng_state")
#: NumPy conversions that do not dispatch ``__array_function__``: recorded on traced values
_NUMPY_CONVERSIONS = ("asarray", "array", "asanyarray", "ascontiguousarray")
_UNPATCHED_NUMPY: Dict[str, Callable] = {}
#: checks on a condition: a traced condition is decided (and guarded) first
_CHECKS = ("_check",)


def _install_torch_patches() -> None:
    _UNPATCHED.update({n: getattr(torch, n)
                       for n in _FACTORIES + _STATE_READS + _NON_DISPATCHING + _DTYPE_INFO + _RNG_STATE + _CHECKS})
    for n in _RNG_STATE:  # (registered as found now: importing Dynamo rewraps torch.manual_seed)
        register_side_effect(_UNPATCHED[n])
    for n, f in _UNPATCHED.items():
        patch = _traced_factory(f) if n in _FACTORIES else _traced_call(f) if n in _NON_DISPATCHING \
            else _dtype_info(f) if n in _DTYPE_INFO else _user_call(f) if n in _RNG_STATE \
            else _decided_check(f) if n in _CHECKS else _guarded_state_read(f)
        setattr(torch, n, patch)
    torch.autograd.Function.apply = _traced_function_apply
    torch.nn.Parameter.__new__ = _traced_parameter_new
    torch.default_generator = _TRACED_DEFAULT_GENERATOR
    for owner, names in ((torch, _GENERATOR_FUNCS), (torch.Tensor, _GENERATOR_METHODS)):
        for n in names:
            _UNPATCHED_GENERATOR_USERS.append((owner, n, owner.__dict__.get(n)))
            setattr(owner, n, _real_generator_call(getattr(owner, n)))
    _UNPATCHED_RANDOM.update({n: getattr(random, n) for n in _PY_RANDOM})
    for n, f in _UNPATCHED_RANDOM.items():
        setattr(random, n, _traced_py_random(f))
    np = sys.modules.get("numpy")  # (never imported here: only a program that uses NumPy has it)
    if np is not None:
        _UNPATCHED_NUMPY.update({n: getattr(np, n) for n in _NUMPY_CONVERSIONS if hasattr(np, n)})
        for n, f in _UNPATCHED_NUMPY.items():
            setattr(np, n, _traced_call(f))


def _restore_torch_patches() -> None:
    for n, f in _UNPATCHED.items():
        setattr(torch, n, f)
    _UNPATCHED.clear()
    torch.autograd.Function.apply = _ORIGINAL_FUNCTION_APPLY
    torch.nn.Parameter.__new__ = _ORIGINAL_PARAMETER_NEW
    torch.default_generator = _DEFAULT_GENERATOR
    for owner, n, original in reversed(_UNPATCHED_GENERATOR_USERS):
        if original is None:
            delattr(owner, n)
        else:
            setattr(owner, n, original)
    _UNPATCHED_GENERATOR_USERS.clear()
    for n, f in _UNPATCHED_RANDOM.items():
        setattr(random, n, f)
    _UNPATCHED_RANDOM.clear()
    np = sys.modules.get("numpy")
    for n, f in _UNPATCHED_NUMPY.items():
        setattr(np, n, f)
    _UNPATCHED_NUMPY.clear()


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


class _TracingMode(TorchFunctionMode):
    """Sees every torch call while tracing, so factories and random ops without traced
    arguments (``torch.randn(3)``) and grad-mode switches become nodes instead of constants."""

    def __init__(self, tracer: Any):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = real_generator(kwargs) if kwargs else {}
        tracer = self.tracer
        if Proxy in types or _contains_proxy(args) or _contains_proxy(kwargs):
            return tracer.torch_function(func, args, kwargs)
        if func is torch._C._set_grad_enabled:
            return tracer.record_grad_mode(args, kwargs)
        taken_over = tracer.outside_call(func, args, kwargs)
        if taken_over is not None:
            return tracer.torch_function(func, *taken_over)
        if not types and _returns_tensor_or_random(func):
            return tracer.call_function(func, args, kwargs)
        if types and _is_random_name(func):
            return tracer.call_function(func, args, kwargs)
        return tracer.made_while_tracing(func(*args, **kwargs))


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


def _traced_factory(f: Callable) -> Callable:
    """``torch.zeros(n, m)`` with traced sizes: record the call directly, so the sizes stay
    symbolic (torch's argument parser would force them to ints, each a guard)."""
    def factory(*args, **kwargs):
        kwargs = real_generator(kwargs) if kwargs else kwargs
        tracer = _active_tracer()
        if tracer is not None and _contains_proxy((args, kwargs)):
            if args and not isinstance(args[0], (tuple, list, torch.Size)) and f.__name__ not in ("full", "randint", "eye"):
                args = (tuple(args),)
            return tracer.call_function(f, args, kwargs)
        return f(*args, **kwargs)

    factory.__wrapped__ = f
    factory.__name__ = f.__name__
    return factory


def _recorded(f: Callable, when: Callable[[tuple, dict], bool]) -> Callable:
    """``f`` recorded as a node into the calling thread's trace where ``when(args, kwargs)``
    holds; called as usual otherwise (and in threads that are not tracing)."""
    def call(*args, **kwargs):
        tracer = _active_tracer()
        if tracer is not None and when(args, kwargs):
            return tracer.call_function(f, args, kwargs)
        return f(*args, **kwargs)

    call.__wrapped__ = f
    call.__name__ = f.__name__
    return call


def _traced_call(f: Callable) -> Callable:
    """A torch function that does not dispatch ``__torch_function__`` (``torch.from_numpy``):
    recorded as a node when it receives traced values."""
    return _recorded(f, lambda args, kwargs: _contains_proxy((args, kwargs)))


def _called_by_the_program(args, kwargs) -> bool:
    return not _is_internal(sys._getframe(2).f_code)  # (0: this test, 1: the wrapper, 2: its caller)


def _dtype_info(cls: type) -> Callable:
    """``torch.finfo(x.dtype)`` / ``torch.iinfo``: the answer for the traced dtype's example
    value (which reading it guarded); without example inputs the dtype is unknown."""
    def info(*args, **kwargs):
        if _contains_proxy((args, kwargs)):
            values = _unwrap((args, kwargs))
            if any(v is NO_VALUE for v in tree_iter(values, subclasses=True)):
                loc = user_location(2)
                raise TraceError(f"torch.{cls.__name__}() of a traced dtype needs its value at "
                                 f"{loc.describe() if loc else 'an unknown line'}, but without example inputs "
                                 "the dtype is unknown. Pass example_inputs=(...) to symbolic_trace.")
            args, kwargs = values
        return cls(*args, **kwargs)

    info.__wrapped__ = cls
    info.__name__ = cls.__name__
    return info


def _user_call(f: Callable) -> Callable:
    """A torch function the traced program calls for its effect on global state
    (``torch.manual_seed``, ``get_rng_state``/``set_rng_state``): a node, in program order."""
    return _recorded(f, _called_by_the_program)


def _decided_check(f: Callable) -> Callable:
    """``torch._check(cond, message)``: a traced condition is decided with ``bool`` (and so
    guarded) before torch checks it."""
    def check(cond, *args, **kwargs):
        if type(cond) is Proxy or type(cond) is Attribute:
            cond = bool(cond)
        return f(cond, *args, **kwargs)

    check.__wrapped__ = f
    check.__name__ = f.__name__
    return check


def _traced_py_random(f: Callable) -> Callable:
    """``random.random()`` & co. called by the traced program: a node drawing from Python's
    generator at run time (its value while tracing is a traced value, so decisions on it are
    guarded), not a number frozen into the graph."""
    return _recorded(f, _called_by_the_program)


@classmethod
def _traced_function_apply(cls, *args, **kwargs):
    """``MyFunction.apply(x)`` (a ``torch.autograd.Function``) with traced arguments becomes one
    node, which keeps the custom backward; its C implementation cannot take proxies."""
    tracer = _active_tracer()
    if tracer is not None and _contains_proxy((args, kwargs)):
        if _holds_module((args, kwargs)):
            return _inline_function_forward(tracer, cls, args, kwargs)
        return tracer.call_function(apply_autograd_function, (cls,) + args, kwargs)
    return _ORIGINAL_FUNCTION_APPLY.__get__(None, cls)(*args, **kwargs)


def _holds_module(value: Any) -> bool:
    return any(isinstance(v, torch.nn.Module) for v in tree_iter(value, subclasses=True))


class _InlineContext:
    """The ``ctx`` of an autograd Function whose forward is traced inline (no backward)."""
    needs_input_grad = ()
    materialize_grads = True

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_dirty(self, *args):
        pass

    def mark_non_differentiable(self, *args):
        pass

    def set_materialize_grads(self, value):
        pass


def _inline_function_forward(tracer: Any, cls: type, args: tuple, kwargs: dict) -> Any:
    """``MyFunction.apply(x, modules...)``: modules cannot be node arguments, so the forward is
    traced inline. Without autograd that is the same computation; with it the custom backward
    would be lost, so that is refused, and grad mode is guarded."""
    loc = user_location(3)
    where = loc.describe() if loc else "an unknown line"
    if torch._C.is_grad_enabled():
        raise TraceError(f"{cls.__name__}.apply at {where} takes modules among its arguments, which cannot "
                         "be graph values; symtrace can trace its forward inline only without autograd (the "
                         "custom backward would be lost). Trace under torch.no_grad(), or make the caller a leaf.")
    tracer.add_entry_guard(TorchState("is_grad_enabled"), False, "is",
                           f"{cls.__name__}.forward traced inline (no autograd)", kind="grad_mode", source=loc)
    if getattr(cls, "setup_context", None) is not getattr(torch.autograd.Function, "setup_context", None):
        return cls.forward(*args, **kwargs)  # (a forward without ctx; setup_context only serves backward)
    return cls.forward(_InlineContext(), *args, **kwargs)


_DEFAULT_GENERATOR = torch.default_generator


@register_side_effect
def generator_get_state() -> torch.Tensor:
    """``torch.default_generator.get_state()`` called by a traced program."""
    return _DEFAULT_GENERATOR.get_state()


@register_side_effect
def generator_set_state(state: torch.Tensor) -> None:
    """``torch.default_generator.set_state(state)`` called by a traced program."""
    _DEFAULT_GENERATOR.set_state(state)


@register_side_effect
def generator_manual_seed(seed: int) -> None:
    """``torch.default_generator.manual_seed(seed)`` called by a traced program."""
    _DEFAULT_GENERATOR.manual_seed(seed)


class _TracedDefaultGenerator:
    """``torch.default_generator`` while tracing: the program's reads and writes of the global
    generator's state become nodes in program order (the graph's random ops draw from the
    state they leave), as ``torch.get_rng_state``/``set_rng_state`` do. Passed as
    ``generator=`` it stands for the real generator."""

    def get_state(self):
        return _on_generator(generator_get_state, _DEFAULT_GENERATOR.get_state)

    def set_state(self, state):
        return _on_generator(generator_set_state, _DEFAULT_GENERATOR.set_state, state, returns_self=self)

    def manual_seed(self, seed):
        return _on_generator(generator_manual_seed, _DEFAULT_GENERATOR.manual_seed, seed, returns_self=self)

    def __getattr__(self, name):
        return getattr(_DEFAULT_GENERATOR, name)


def _on_generator(helper: Callable, method: Callable, *args, returns_self: Any = None) -> Any:
    """A node calling ``helper(*args)`` in the tracing thread (the stand-in's result: the node,
    or ``returns_self``), else the real generator's ``method(*args)``."""
    tracer = _active_tracer()
    if tracer is None:
        return method(*args)
    node = tracer.call_function(helper, args)
    return node if returns_self is None else returns_self


_TRACED_DEFAULT_GENERATOR = _TracedDefaultGenerator()


def real_generator(kwargs: dict) -> dict:
    """``kwargs`` with the traced stand-in for the default generator replaced by the real one."""
    if kwargs.get("generator") is _TRACED_DEFAULT_GENERATOR:
        kwargs = dict(kwargs, generator=_DEFAULT_GENERATOR)
    return kwargs


#: torch functions and Tensor methods that take ``generator=``: given the traced stand-in for
#: the default generator, they get the real one (torch's argument parser checks the class)
_GENERATOR_FUNCS = ("bernoulli", "multinomial", "normal", "poisson", "randperm")
_GENERATOR_METHODS = ("random_", "uniform_", "normal_", "cauchy_", "exponential_", "geometric_", "log_normal_",
                      "bernoulli_", "bernoulli", "multinomial")
_UNPATCHED_GENERATOR_USERS: List[tuple] = []


def _real_generator_call(f: Callable) -> Callable:
    def call(*args, **kwargs):
        return f(*args, **real_generator(kwargs)) if kwargs else f(*args)

    call.__wrapped__ = f
    call.__name__ = getattr(f, "__name__", "call")
    return call


_ORIGINAL_PARAMETER_NEW = torch.nn.Parameter.__new__


def _traced_parameter_new(cls, data=None, requires_grad=True):
    """``nn.Parameter(x)`` made by the traced program from a traced value: a node that makes
    the parameter at run time (torch's own ``__new__`` would set an attribute on the proxy)."""
    tracer = _active_tracer()
    if tracer is not None and (type(data) is Proxy or type(requires_grad) is Proxy):
        p = tracer.call_function(make_parameter, (data, requires_grad), {"cls": cls} if cls is not torch.nn.Parameter else {})
        if type(p) is Proxy and p.value is NO_VALUE:
            object.__setattr__(p, "guess", cls)  # (without example inputs: a parameter of this class)
        return p
    return _ORIGINAL_PARAMETER_NEW(cls, data, requires_grad)


def make_parameter(data, requires_grad=True, cls=torch.nn.Parameter):
    """``cls(data, requires_grad)``: the target of the node a traced ``nn.Parameter(x)`` becomes."""
    return _ORIGINAL_PARAMETER_NEW(cls, data, requires_grad)


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
