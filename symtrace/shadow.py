"""Shadow modules (what ``self`` is inside a traced ``forward``) and object views (what traced
code sees for plain objects such as ``self.config``).

A shadow is an instance of a subclass of the user's module class that holds no state of its
own: every attribute read goes to the real module through the tracer, which turns parameters
and buffers into ``get_attr`` proxies, submodules into shadows, and guards plain attributes
(``self.training``, ``self.flag``). Writes are recorded or refused; the real module is never
changed. ``isinstance``, ``super()`` and methods behave as on the real module.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List

from torch import nn

from .proxy import python_reads_attribute

__all__ = ["make_shadow", "is_shadow", "real_module", "ObjectView", "class_values", "own_call"]

_SHADOW_CLASSES: Dict[Any, type] = {}
#: every shadow class made so far (a fast test for ``type(obj) in SHADOW_TYPES``)
SHADOW_TYPES: set = set()
_FIELDS = ("_symtrace_real", "_symtrace_path", "_symtrace_tracer")


def _getattr(self, name: str) -> Any:
    d = object.__getattribute__(self, "__dict__")
    try:
        tracer = d["_symtrace_tracer"]
    except KeyError:  # during unpickling/copying of a stray shadow
        raise AttributeError(name) from None
    return tracer.module_getattr(d["_symtrace_real"], d["_symtrace_path"], name)


def _setattr(self, name: str, value: Any) -> None:
    d = object.__getattribute__(self, "__dict__")
    d["_symtrace_tracer"].module_setattr(d["_symtrace_real"], d["_symtrace_path"], name, value)


def _delattr(self, name: str) -> None:
    d = object.__getattribute__(self, "__dict__")
    d["_symtrace_tracer"].module_setattr(d["_symtrace_real"], d["_symtrace_path"], name, _DELETED)


def _call(self, *args, **kwargs):
    d = object.__getattribute__(self, "__dict__")
    return d["_symtrace_tracer"].call_module(self, d["_symtrace_real"], d["_symtrace_path"], args, kwargs)


def _repr(self) -> str:
    d = object.__getattribute__(self, "__dict__")
    return f"<traced {type(d['_symtrace_real']).__name__} at {d['_symtrace_path'] or 'root'}>"


def _class_of(self) -> type:
    """``self.linear1.__class__`` in traced code: the real module's class. Python code that
    reads it decides on it, so a submodule's class is then guarded (a GraphModule whose
    submodule is swapped for another class refuses instead of keeping the old branch)."""
    d = object.__getattribute__(self, "__dict__")
    real = d.get("_symtrace_real")
    if real is None:
        return type(self).__mro__[1]
    cls = type(real)
    path = d["_symtrace_path"]
    if path and python_reads_attribute(sys._getframe(1)):
        d["_symtrace_tracer"].module_class_read(path, cls)
    return cls


def class_decided(obj: Any) -> None:
    """User code asked ``isinstance`` of the shadow ``obj``: a submodule's class is guarded,
    as when it reads ``.__class__``."""
    d = object.__getattribute__(obj, "__dict__")
    real = d.get("_symtrace_real")
    if real is not None and d["_symtrace_path"]:
        d["_symtrace_tracer"].module_class_read(d["_symtrace_path"], type(real))


class _Deleted:
    def __repr__(self):
        return "<deleted>"


_DELETED = _Deleted()


class _ModuleCallTraced(nn.Module):
    """Sits between a user's module class and ``nn.Module`` in the method order of its shadow
    class, so that ``super().__call__(...)`` inside the user's own ``__call__`` (traced
    through, see :meth:`ModuleAccess.call_module`) traces ``nn.Module.__call__``: the
    module's hooks and ``forward``."""

    def __call__(self, *args, **kwargs):
        d = object.__getattribute__(self, "__dict__")
        watcher = sys.getprofile()   # (the own-call watcher looks at the __call__'s frame only)
        suspend = getattr(watcher, "suspend_inside_super_call", False)
        if suspend:
            sys.setprofile(None)
        try:
            return d["_symtrace_tracer"].trace_forward(self, d["_symtrace_real"], args, kwargs)
        finally:
            if suspend:
                sys.setprofile(watcher)


def own_call(cls: type) -> bool:
    """Whether the module class ``cls`` has a ``__call__`` of its own (user code, not torch's)."""
    call = getattr(cls, "__call__", None)
    if call is nn.Module.__call__ or call is None:
        return False
    owner = getattr(call, "__module__", None) or ""
    return not owner.startswith(("torch.", "symtrace."))


_SIMPLE_TYPES = (bool, int, float, str, type(None))


def simple_class_value(v: Any, depth: int = 0) -> bool:
    """A class-body value guarded when read: a number, string, bool or None, a numpy scalar,
    or a tuple, list, dict or set of simple values (at most 64 items, 2 levels)."""
    t = type(v)
    if isinstance(v, _SIMPLE_TYPES):
        return not isinstance(v, float) or v == v
    if t.__module__ == "numpy" and getattr(v, "shape", None) == () and hasattr(v, "dtype"):
        return True
    if depth < 2 and t in (tuple, list, set, frozenset) and len(v) <= 64:
        return all(simple_class_value(x, depth + 1) and type(x).__module__ != "numpy" for x in v)
    if depth < 2 and t is dict and len(v) <= 64:
        return all(isinstance(k, (str, int)) and simple_class_value(x, depth + 1) and type(x).__module__ != "numpy"
                   for k, x in v.items())
    return False


_LIBRARY_ROOTS = frozenset({"builtins", "typing", "abc", "collections", "torch", "symtrace", "enum", "types"})


def user_classes(cls: type) -> List[type]:
    """The classes of module class ``cls`` whose bodies are the user's: those before
    ``nn.Module`` in the method order, mixins included, not torch's, symtrace's or the standard
    library's (``typing.Generic``, ``abc.ABC``)."""
    out = []
    for klass in cls.__mro__:
        if klass is nn.Module:
            break
        if (klass.__module__ or "").split(".")[0] not in _LIBRARY_ROOTS:
            out.append(klass)
    return out


def class_values(cls: type) -> frozenset:
    """Names of the simple values (:func:`simple_class_value`) that ``self.name`` finds on
    ``cls``'s user classes (before ``nn.Module`` in the method order, mixins too; not torch's):
    ``scale = 1.0`` in a class body.
    The shadow reads them through the tracer, so they are guarded like instance attributes
    (assigning ``A.scale = 5.0``, or ``m.scale = 7.0`` on the instance, re-captures; a list is
    guarded by its contents, a numpy scalar by identity against a live model)."""
    # (keyed by the sizes of the classes' dicts too: a class value added later is seen)
    key = (cls, tuple(len(vars(k)) for k in cls.__mro__))
    hit = _CLASS_VALUES.get(key)
    if hit is not None:
        return hit
    import inspect
    names = []
    for klass in user_classes(cls):
        for k in vars(klass):
            if not k.startswith("__") and k not in names and \
                    simple_class_value(inspect.getattr_static(cls, k, None)):
                names.append(k)
    hit = _CLASS_VALUES[key] = frozenset(names)
    return hit


_CLASS_VALUES: Dict[tuple, frozenset] = {}


class _ClassValue:
    """The shadow class's descriptor for a class value ``name``: read on a shadow, it goes
    through the tracer (guarded); read on the shadow class itself (``type(self).name``), it is
    the user's class's value (the tracer guards the class values a traced class's code names,
    see ``ModuleAccess.guard_class_values``)."""

    __slots__ = ("name", "cls")

    def __init__(self, name: str, cls: type):
        self.name, self.cls = name, cls

    def __get__(self, obj, owner=None):
        if obj is None:
            return getattr(self.cls, self.name)
        return _getattr(obj, self.name)

    def __set__(self, obj, value):
        _setattr(obj, self.name, value)


def _shadow_class(cls: type) -> type:
    values = class_values(cls)
    key = ("shadow", cls, values)
    sc = _SHADOW_CLASSES.get(key)
    if sc is None:
        ns = {n: _ClassValue(n, cls) for n in values}
        ns.update({"__getattr__": _getattr, "__setattr__": _setattr, "__delattr__": _delattr,
              "__call__": _call, "__repr__": _repr, "__module__": cls.__module__,
              "__qualname__": cls.__qualname__, "_symtrace_shadow": True,
              # `self.__class__(...)` (e.g. nn.Sequential slicing) builds a real module
              "__class__": property(_class_of)})
        bases = (cls, _ModuleCallTraced) if own_call(cls) else (cls,)
        sc = type(cls)(cls.__name__, bases, ns)
        _SHADOW_CLASSES[key] = sc
        SHADOW_TYPES.add(sc)
    return sc


_METHOD_NAMES: Dict[type, frozenset] = {}


def _method_names(cls: type) -> frozenset:
    """Names the class defines as non-data descriptors (functions, static/class methods):
    an instance attribute of the same name hides them."""
    names = _METHOD_NAMES.get(cls)
    if names is None:
        found = set()
        for klass in cls.__mro__:
            for k, v in vars(klass).items():
                if not k.startswith("__") and hasattr(v, "__get__") and not hasattr(v, "__set__"):
                    found.add(k)
        names = _METHOD_NAMES[cls] = frozenset(found)
    return names


def _hiding_class(cls: type, names: tuple) -> type:
    """A shadow class whose ``names`` read the real module's instance attributes, which hide
    the class's methods of those names (as on the real module)."""
    base = _shadow_class(cls)
    key = ("hiding", base, names)
    sc = _SHADOW_CLASSES.get(key)
    if sc is None:
        ns = {n: property(lambda self, _n=n: _getattr(self, _n), lambda self, v, _n=n: _setattr(self, _n, v))
              for n in names}
        ns.update({"__module__": cls.__module__, "__qualname__": cls.__qualname__})
        sc = type(base)(cls.__name__, (base,), ns)
        _SHADOW_CLASSES[key] = sc
    return sc


def make_shadow(real: nn.Module, path: str, tracer) -> nn.Module:
    """A shadow of ``real`` (at qualified name ``path``) whose attribute traffic goes to ``tracer``."""
    cls = type(real)
    hidden = _method_names(cls).intersection(real.__dict__)
    obj = object.__new__(_shadow_class(cls) if not hidden else _hiding_class(cls, tuple(sorted(hidden))))
    d = object.__getattribute__(obj, "__dict__")
    d["_symtrace_real"] = real
    d["_symtrace_path"] = path
    d["_symtrace_tracer"] = tracer
    return obj


def is_shadow(obj: Any) -> bool:
    return getattr(type(obj), "_symtrace_shadow", False) is True and "_symtrace_real" in getattr(obj, "__dict__", {})


def real_module(obj: Any) -> nn.Module:
    return object.__getattribute__(obj, "__dict__")["_symtrace_real"]


class ObjectView:
    """What traced code sees for a plain object held by a module (e.g. ``self.config``): reads
    of simple attributes become entry guards (``root.config.use_cache == False``), nested
    objects become views, methods run against the view, and writes stay in the view — the
    real object is never changed."""

    __slots__ = ("_view_obj", "_view_expr", "_view_tracer", "_view_overlay")

    def __init__(self, obj: Any, expr, tracer):  # expr: the GExpr that reads obj
        osa = object.__setattr__
        osa(self, "_view_obj", obj)
        osa(self, "_view_expr", expr)
        osa(self, "_view_tracer", tracer)
        osa(self, "_view_overlay", {})

    @property
    def __class__(self):
        return type(object.__getattribute__(self, "_view_obj"))

    def __getattr__(self, name: str) -> Any:
        overlay = object.__getattribute__(self, "_view_overlay")
        if name in overlay:
            return overlay[name]
        obj = object.__getattribute__(self, "_view_obj")
        tracer = object.__getattribute__(self, "_view_tracer")
        try:
            value = getattr(obj, name)
        except AttributeError:
            tracer.object_attr_absent(object.__getattribute__(self, "_view_expr"), name)
            raise
        return tracer.object_attr(self, object.__getattribute__(self, "_view_expr"), obj, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__getattribute__(self, "_view_overlay")[name] = value
        tracer = object.__getattribute__(self, "_view_tracer")
        tracer.object_setattr(object.__getattribute__(self, "_view_expr"), name, value)

    def __delattr__(self, name: str) -> None:
        object.__getattribute__(self, "_view_overlay").pop(name, None)

    def __repr__(self) -> str:
        return repr(object.__getattribute__(self, "_view_obj"))

    def __copy__(self) -> Any:
        return object.__getattribute__(self, "_view_tracer").view_copy(self, deep=False)

    def __deepcopy__(self, memo) -> Any:
        return object.__getattribute__(self, "_view_tracer").view_copy(self, deep=True, memo=memo)


def _delegate(name: str):
    def method(self, *args):
        return getattr(object.__getattribute__(self, "_view_obj"), name)(*args)

    method.__name__ = name
    return method


# container-style protocols go straight to the object (not guarded; listed by explain's limits)
for _name in ("__iter__", "__len__", "__getitem__", "__contains__", "__bool__", "__eq__", "__ne__",
              "__hash__", "__call__", "__str__", "__format__"):
    setattr(ObjectView, _name, _delegate(_name))
