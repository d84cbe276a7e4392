"""Plain objects of a module's state handed to traced code as themselves.

A traced ``forward`` that reads ``self.config`` gets the config object itself, so identity
(``self.mode is FAST``), ``type(self.config) is Config``, hashing and every method behave as in
eager. What the program reads of such an object still becomes guards, and what it writes is kept
aside (the real object is not changed while tracing) and replayed after the graph runs. Both go
through ``__getattribute__`` / ``__setattr__`` / ``__delattr__`` hooks that :class:`LiveObjects`
installs on the object's class for one trace and removes after it (also when the trace fails).
The hooks act only on the objects the trace registered, on the tracing thread, and not while
the tracer itself looks at them (:func:`untracked`); every other instance of the class takes the
default path. A class the hooks cannot serve exactly (attribute hooks of its own other than a
frozen dataclass's, a metaclass, ``__slots__``, an extension type) is not tracked: the tracer hands out an
:class:`~symtrace.shadow.ObjectView` instead.

Reads the hooks cannot see are refused or guarded whole: ``vars()``, ``__dict__``, ``copy`` and
pickling of a tracked object guard all its attributes (or raise :class:`TraceError` once the
program assigned some, since they would not see the assignments), and a change made past the
hooks (``object.__setattr__``, ``__dict__[k] = v``) is undone and refused when the trace ends
(:meth:`LiveObjects.check_untouched`).
"""
from __future__ import annotations

import functools
import threading
import types
from contextlib import contextmanager
from typing import Any, Callable, Dict, List

import torch

from ..errors import TraceError
from ..shadow import _DELETED
from .values import _is_simple

__all__ = ["LiveObjects", "trackable", "untracked", "live_entry"]

_HOOKS = ("__getattribute__", "__setattr__", "__delattr__")
#: dunder reads that expose the whole state past the per-attribute hook
_WHOLE_READS = frozenset({"__dict__", "__getstate__", "__reduce_ex__", "__reduce__", "__copy__", "__deepcopy__"})
_ABSENT = object()
_GETATTR = object.__getattribute__
_SETATTR = object.__setattr__
_DELATTR = object.__delattr__
_local = threading.local()


class _Entry:
    """One tracked object: the guard expressions that reach it (the first is where its writes
    are replayed), the writes kept aside, and the trace that tracks it (its callbacks)."""

    __slots__ = ("obj", "exprs", "overlay", "written", "owner", "thread", "snapshot")

    def __init__(self, obj, expr, owner: "LiveObjects"):
        self.obj, self.exprs, self.overlay, self.written, self.owner = obj, [expr], {}, set(), owner
        self.thread = threading.get_ident()
        self.snapshot = dict(_GETATTR(obj, "__dict__"))

    @property
    def expr(self):
        return self.exprs[0]


#: id(object) -> its entry, for every trace in progress (entries are removed when it ends)
_ENTRIES: Dict[int, _Entry] = {}
#: class -> [traces using its hooks, its own previous entries for the hook names]
_PATCHED: Dict[type, list] = {}
_LOCK = threading.Lock()


@contextmanager
def untracked():
    """The tracer's own looks at tracked objects (``repr`` for a guard, walks): not recorded."""
    _local.paused = getattr(_local, "paused", 0) + 1
    try:
        yield
    finally:
        _local.paused -= 1


def live_entry(obj) -> Any:
    """The entry of ``obj`` if a trace on this thread tracks it (None otherwise)."""
    e = _ENTRIES.get(id(obj))
    if e is None or e.obj is not obj or e.thread != threading.get_ident():
        return None
    return e


def _entry(obj) -> Any:
    return None if getattr(_local, "paused", 0) else live_entry(obj)


def _getattribute(obj, name):
    e = _entry(obj)
    if e is None:
        return _GETATTR(obj, name)
    if name[:2] == "__":
        if name in _WHOLE_READS:
            with untracked():
                e.owner.on_whole(e, name)
        return _GETATTR(obj, name)
    written = e.overlay.get(name, _ABSENT)
    if written is _DELETED:   # (deleted in this trace: what the class gives, as eager would)
        return _class_attribute(obj, name)
    if written is not _ABSENT:
        return written
    cached = _class_lookup(type(obj), name)
    if isinstance(cached, functools.cached_property) and name not in _GETATTR(obj, "__dict__"):
        value = cached.func(obj)   # (its reads come back here; storing the result is a write, replayed)
        with untracked():          # (and the value guarded: a value the user stores there instead differs)
            value = e.owner.on_read(e, name, value)
        _setattr(obj, name, value)
        return value
    try:
        value = _GETATTR(obj, name)
    except AttributeError:
        return _absent(e, obj, name)
    if e.written and _computed(type(obj), name) and _is_simple(value):
        return value   # (a property read after the program assigned attributes: what its getter read
        #              was followed through these hooks; its result is not the state at the graph's entry)
    with untracked():
        return e.owner.on_read(e, name, value)


def _absent(e: _Entry, obj, name: str):
    """``obj.name`` found nothing: the class's ``__getattr__`` answers (its result guarded like
    a read), or ``hasattr(obj, name)`` is guarded to stay False and the AttributeError goes on."""
    fallback = getattr(type(obj), "__getattr__", None)
    if fallback is not None:
        try:
            value = fallback(obj, name)
        except AttributeError:
            pass
        else:
            if not (_is_simple(value) or isinstance(value, torch.Tensor)):
                return value   # (an object it makes or forwards: its identity is its own business)
            with untracked():
                return e.owner.on_read(e, name, value)
    with untracked():
        e.owner.on_absent(e, name)
    raise AttributeError(f"{type(obj).__name__!r} object has no attribute {name!r}")


def _setattr(obj, name, value):
    e = _entry(obj)
    if e is None:
        return _SETATTR(obj, name, value)
    desc = _data_descriptor(type(obj), name)
    if desc is not None:   # a property's setter runs, as in eager: its own writes come back here
        return type(desc).__set__(desc, obj, value)
    with untracked():
        e.owner.on_write(e, name, value)
    e.overlay[name] = value
    e.written.add(name)


def _delattr(obj, name):
    e = _entry(obj)
    if e is None:
        return _DELATTR(obj, name)
    desc = _data_descriptor(type(obj), name)
    if desc is not None:   # (a property's deleter, or its error, as in eager)
        return type(desc).__delete__(desc, obj) if hasattr(type(desc), "__delete__") else _DELATTR(obj, name)
    if e.overlay.get(name, _ABSENT) is _DELETED or (name not in e.overlay and name not in _GETATTR(obj, "__dict__")):
        raise AttributeError(name)   # (as eager: nothing to delete)
    with untracked():
        e.owner.on_write(e, name, _DELETED)
    e.overlay[name] = _DELETED
    e.written.add(name)


def _class_lookup(cls: type, name: str) -> Any:
    """What the first class of ``cls``'s MRO that defines ``name`` holds for it (``_ABSENT``)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return _ABSENT


def _computed(cls: type, name: str) -> bool:
    """Whether ``cls`` gives ``name`` through a descriptor other than a function (a property)."""
    v = _class_lookup(cls, name)
    return hasattr(type(v), "__get__") and not isinstance(v, (types.FunctionType, staticmethod, classmethod))


def _data_descriptor(cls: type, name: str) -> Any:
    """The data descriptor (a property, most often) ``cls`` defines for ``name``, else None."""
    v = _class_lookup(cls, name)
    return v if hasattr(type(v), "__set__") else None


def _class_attribute(obj, name):
    v = _class_lookup(type(obj), name)
    if v is _ABSENT:
        raise AttributeError(f"{type(obj).__name__!r} object has no attribute {name!r}")
    get = getattr(type(v), "__get__", None)
    return get(v, obj, type(obj)) if get is not None else v


_HOOK_FUNCS = {"__getattribute__": _getattribute, "__setattr__": _setattr, "__delattr__": _delattr}


def trackable(obj: Any) -> bool:
    """Whether the hooks serve ``obj`` exactly: an instance of a Python class (of metaclass
    ``type``) with an instance ``__dict__`` and no attribute hooks of its own (a frozen
    dataclass's, which only raise, excepted)."""
    cls = type(obj)
    if type(cls) is not type or cls.__module__ == "builtins" or "__slots__" in vars(cls):
        return False
    try:
        if not isinstance(_GETATTR(obj, "__dict__"), dict):
            return False
    except AttributeError:
        return False
    frozen = _frozen(cls)
    return (cls.__getattribute__ in (object.__getattribute__, _getattribute)
            and (frozen or cls.__setattr__ in (object.__setattr__, _setattr))
            and (frozen or cls.__delattr__ in (object.__delattr__, _delattr)))


def _frozen(cls: type) -> bool:
    """A frozen dataclass itself: its ``__setattr__`` / ``__delattr__`` stay, raising for every
    name as in eager. (A plain subclass of one lets other names through to the object: not
    frozen here, and so not tracked; a write past the hooks is caught by
    :meth:`LiveObjects.check_untouched`.)"""
    params = vars(cls).get("__dataclass_params__")
    return params is not None and bool(getattr(params, "frozen", False))


class LiveObjects:
    """The objects one trace tracks, and the class hooks it holds; :meth:`close` ends both."""

    def __init__(self, on_read: Callable, on_write: Callable, on_whole: Callable, on_absent: Callable):
        """The tracer's callbacks: ``on_read(entry, name, value) -> value`` for an attribute
        read, ``on_write(entry, name, value)`` for an assignment (``_DELETED`` for a delete),
        ``on_whole(entry, dunder)`` for a read of the whole state (``vars()``, ``copy``),
        ``on_absent(entry, name)`` for a read of an attribute the object does not have."""
        self.on_read, self.on_write, self.on_whole, self.on_absent = on_read, on_write, on_whole, on_absent
        self._mine: Dict[int, _Entry] = {}
        self._classes: List[type] = []

    def track(self, obj: Any, expr: Any) -> bool:
        """Register ``obj`` (read through ``expr``; an object already tracked gets ``expr`` as
        one more path); False where its class cannot take the hooks (:func:`trackable`) or
        another trace tracks it, and the caller falls back to a view."""
        e = _ENTRIES.get(id(obj))
        if e is not None:
            if e.obj is not obj or self._mine.get(id(obj)) is not e:
                return False
            if expr not in e.exprs:
                e.exprs.append(expr)
            return True
        if not trackable(obj) or not self._hook(type(obj)):
            return False
        e = _ENTRIES[id(obj)] = self._mine[id(obj)] = _Entry(obj, expr, self)
        return True

    def _hook(self, cls: type) -> bool:
        if cls in self._classes:
            return True
        names = ("__getattribute__",) if _frozen(cls) else _HOOKS
        with _LOCK:
            held = _PATCHED.get(cls)
            if held is None:
                saved = {n: vars(cls).get(n, _ABSENT) for n in names}
                try:
                    for n in names:
                        setattr(cls, n, _HOOK_FUNCS[n])
                except (TypeError, AttributeError):   # (an immutable type)
                    _restore(cls, saved)
                    return False
                held = _PATCHED[cls] = [0, saved]
            held[0] += 1
        self._classes.append(cls)
        return True

    def check_untouched(self) -> None:
        """After a trace: raise :class:`TraceError` if the program changed a tracked object past
        the hooks (``object.__setattr__``, its ``__dict__``), which the graph could not replay;
        the object is put back first."""
        for e in self._mine.values():
            d = _GETATTR(e.obj, "__dict__")
            if d.keys() != e.snapshot.keys() or any(d[k] is not v for k, v in e.snapshot.items()):
                changed = sorted(set(d) ^ set(e.snapshot) | {k for k in d.keys() & e.snapshot.keys()
                                                               if d[k] is not e.snapshot[k]})
                _put_back(e)
                raise TraceError(f"forward changes {e.expr.shown()} ({', '.join(changed)}) past attribute assignment "
                                 "(object.__setattr__, its __dict__, or a frozen dataclass's __setattr__ letting a "
                                 "name through); symtrace records only `obj.name = value` and `del obj.name` on "
                                 "the module state's plain objects. Keep such state elsewhere, or change it "
                                 "outside forward.")

    def close(self) -> None:
        """Put back any tracked object changed past the hooks, forget this trace's objects and
        remove the hooks no other trace holds."""
        for i, e in self._mine.items():
            _put_back(e)
            _ENTRIES.pop(i, None)
        self._mine.clear()
        with _LOCK:
            for cls in self._classes:
                held = _PATCHED[cls]
                held[0] -= 1
                if held[0] == 0:
                    del _PATCHED[cls]
                    _restore(cls, held[1])
        self._classes.clear()


def _put_back(e: _Entry) -> None:
    d = _GETATTR(e.obj, "__dict__")
    if d.keys() != e.snapshot.keys() or any(d[k] is not v for k, v in e.snapshot.items()):
        d.clear()
        d.update(e.snapshot)


def _restore(cls: type, saved: Dict[str, Any]) -> None:
    for n, v in saved.items():
        if v is _ABSENT:
            if n in vars(cls):
                delattr(cls, n)
        else:
            setattr(cls, n, v)
