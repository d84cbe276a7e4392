"""Containers registered with ``torch.utils._pytree`` (``register_pytree_node``), one level at a
time: what tracing needs to take them as inputs and give them back as outputs.

A *pytree container* here is an instance of exactly a registered class that symtrace does not
already walk itself (tuples, lists, dicts, namedtuples, dataclasses, plain objects and torch's
own types have their own rules). :func:`pytree_children` and :func:`pytree_context` are one
level of the registered flatten function; :func:`rebuild_pytree` is its unflatten function.
The first two may appear in entry guards (by the names in :data:`GUARD_FUNCTIONS`), the last
in graphs that return such containers.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

__all__ = ["is_pytree_container", "pytree_children", "pytree_context", "rebuild_pytree", "GUARD_FUNCTIONS"]

_NATIVE_MODULES = ("builtins", "collections", "torch")


def _registry() -> Optional[Dict[type, Any]]:
    try:
        from torch.utils import _pytree
    except ImportError:  # pragma: no cover - every supported torch has it
        return None
    return _pytree.SUPPORTED_NODES


def is_pytree_container(value: Any) -> bool:
    """Whether ``value``'s class was registered with ``torch.utils._pytree`` by the user or a
    library (not one of the containers symtrace walks on its own)."""
    t = type(value)
    if t.__module__.split(".")[0] in _NATIVE_MODULES or dataclasses.is_dataclass(t):
        return False
    if issubclass(t, tuple) and hasattr(t, "_fields"):
        return False
    nodes = _registry()
    return nodes is not None and t in nodes


def _flatten(value: Any) -> Tuple[list, Any]:
    nodes = _registry()
    entry = nodes.get(type(value)) if nodes is not None else None
    if entry is None:
        raise TypeError(f"{type(value).__name__} is not registered with torch.utils._pytree")
    children, context = entry.flatten_fn(value)
    return list(children), context


def pytree_children(value: Any) -> tuple:
    """The values one level down in ``value`` (its registered flatten function's children)."""
    return tuple(_flatten(value)[0])


def pytree_context(value: Any) -> Any:
    """The context of ``value``'s registered flatten function (what rebuilding needs besides
    the children: keys, field names, flags)."""
    return _flatten(value)[1]


def rebuild_pytree(cls: type, children: list, context: Any) -> Any:
    """An instance of the registered ``cls`` holding ``children``, by its unflatten function."""
    nodes = _registry()
    entry = nodes.get(cls) if nodes is not None else None
    if entry is None:
        raise TypeError(f"{cls.__name__} is no longer registered with torch.utils._pytree; "
                        "register it before running this graph")
    return entry.unflatten_fn(list(children), context)


#: helpers entry guards may call, under these names (bound in the guards' namespace)
GUARD_FUNCTIONS = {"_st_pytree_children": pytree_children, "_st_pytree_context": pytree_context}
