"""The int8 backends by name: a fixed table of where each lives, resolved on first use.

Nothing registers itself at import time. Each built-in backend is kernel code in
:mod:`symtrace.lower`, named here by module path and attribute (``"c"``:
``symtrace.lower.int8_cpu:BACKEND``); the first :func:`get_backend` / :func:`backend_available`
/ :func:`default_backend` that needs one imports its module (by name, so this package keeps to
the layering: passes never import ``lower`` in their own code) and keeps the object. The
interface they implement is :class:`~.backend.Int8Backend`. A name read from a file can only pick an entry of this table or a backend added
with :func:`register_backend`. :func:`default_backend` picks the usable backend with the highest
priority (portable 0, onednn 10, c 20).
"""
from __future__ import annotations

import importlib
from typing import Any, Dict, List, Optional

from .backend import Int8Backend

__all__ = ["register_backend", "get_backend", "backend_available", "available_backends", "default_backend",
           "builtin_class", "BUILTIN_BACKENDS", "BUILTIN_CLASSES"]

#: name -> ("module:attribute", priority) of the backends symtrace defines
BUILTIN_BACKENDS: Dict[str, tuple] = {
    "portable": ("symtrace.lower.int8_portable:BACKEND", 0),
    "onednn": ("symtrace.lower.int8_onednn:BACKEND", 10),
    "c": ("symtrace.lower.int8_cpu:BACKEND", 20),
}
#: the built-in backends' classes, by the names ``symtrace.passes.quant`` gives them
BUILTIN_CLASSES: Dict[str, str] = {
    "PortableBackend": "symtrace.lower.int8_portable:PortableBackend",
    "OneDNNBackend": "symtrace.lower.int8_onednn:OneDNNBackend",
}

#: name -> backend object, or its "module:attribute" until first resolved
_BACKENDS: Dict[str, Any] = {n: where for n, (where, _) in BUILTIN_BACKENDS.items()}
_PRIORITY: Dict[str, int] = {n: p for n, (_, p) in BUILTIN_BACKENDS.items()}
_ERRORS: Dict[str, str] = {}


def _resolve(where: str) -> Any:
    module, _, attr = where.partition(":")
    return getattr(importlib.import_module(module), attr)


def builtin_class(name: str) -> type:
    """A built-in backend's class by its name in :data:`BUILTIN_CLASSES` (its module is imported)."""
    return _resolve(BUILTIN_CLASSES[name])


def register_backend(backend: Any, priority: int = 5) -> Any:
    """Add (or replace) a backend under ``backend.name`` (an :class:`~.backend.Int8Backend`).
    :func:`default_backend` picks the available backend with the highest ``priority``."""
    if not isinstance(backend, Int8Backend):
        raise TypeError(f"expected an Int8Backend, got {type(backend).__name__}")
    _BACKENDS[backend.name] = backend
    _PRIORITY[backend.name] = int(priority)
    return backend


def _lookup(name: Any) -> Optional[Any]:
    if not isinstance(name, str):
        return None
    b = _BACKENDS.get(name)
    if isinstance(b, str):  # a built-in not loaded yet: import its module by its fixed path
        try:
            obj = _resolve(b)
        except ImportError as e:
            _ERRORS[name] = f"{type(e).__name__}: {e}"
            return None
        if _BACKENDS.get(name) == b:
            _BACKENDS[name] = obj
        b = _BACKENDS[name]
    return b


def get_backend(name: str) -> Any:
    b = _lookup(name)
    if b is None:
        why = f" ({_ERRORS[name]})" if isinstance(name, str) and name in _ERRORS else ""
        raise ValueError(f"unknown int8 backend {name!r}{why}; known: {', '.join(_BACKENDS)} (more with "
                         f"symtrace.passes.quant.register_backend)")
    return b


def backend_available(name: str) -> bool:
    """Whether ``name`` is known and usable here (an unknown name is not)."""
    b = _lookup(name)
    return b is not None and b.available()


def available_backends() -> List[str]:
    return [n for n in list(_BACKENDS) if backend_available(n)]


def default_backend() -> str:
    """The usable backend with the highest priority: ``"c"`` (symtrace-generated C Linear kernels)
    where a C compiler is found and its self-check passes, else ``"onednn"`` when present and
    correct on this build, else ``"portable"``."""
    usable = available_backends()
    return max(usable, key=lambda n: _PRIORITY.get(n, 0)) if usable else "portable"
