"""The one walker over nested values: which containers hold other values, and how to map or
list what they hold.

Containers, by exact type: ``tuple``, ``list``, ``dict`` (its values; the keys stay),
``slice`` (start, stop, step), namedtuples (tuple subclasses with ``_fields``), and whatever
:func:`register_container` adds. Everything else is a leaf: nodes, proxies, tensors, numbers,
``torch.Size``, subclasses of ``list``/``dict``/``tuple`` that are not namedtuples.

:func:`tree_map` rebuilds the containers with every leaf replaced; :func:`tree_iter` yields the
leaves in order; :func:`tree_children` is one level of a container (for code that needs the
structure itself); :func:`tree_depth` says how deeply containers nest. Any depth works: past
:data:`_RECURSION` levels :func:`tree_map` goes on with an explicit stack, so deep values never
raise ``RecursionError``. Only a value's class is looked at (``type(v)``, never
``isinstance``): a proxy that claims to be a tuple stays a leaf and is asked nothing, and the
walks run at full speed while tracing patches ``isinstance``. Nothing here touches
``torch.utils._pytree``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Tuple

__all__ = ["register_container", "tree_children", "tree_map", "tree_iter", "tree_depth"]

#: children(value) -> an iterable of the values it holds, in order; rebuild(value, new_children)
#: -> a copy of value holding new_children (a list) instead
_Entry = Tuple[Callable[[Any], Iterable[Any]], Callable[[Any, list], Any]]

_CONTAINERS: Dict[type, _Entry] = {
    tuple: (iter, lambda v, c: tuple(c)),
    list: (iter, lambda v, c: c),
    dict: (dict.values, lambda v, c: dict(zip(v, c))),
    slice: (lambda v: (v.start, v.stop, v.step), lambda v, c: slice(*c)),
}
_NAMEDTUPLE: _Entry = (iter, lambda v, c: type(v)(*c))
_RECURSION = 100  # levels tree_map walks by recursion before it switches to its own stack


def register_container(cls: type, children: Callable[[Any], Iterable[Any]],
                       rebuild: Callable[[Any, list], Any]) -> None:
    """Walk instances of exactly ``cls`` as containers: ``children(value)`` gives the values
    it holds (an iterable, in order); ``rebuild(value, new_children)`` returns a copy of
    ``value`` holding ``new_children`` (a list of the same length) instead."""
    if not isinstance(cls, type):
        raise TypeError(f"register_container needs a class, got {cls!r}")
    _CONTAINERS[cls] = (children, rebuild)


def _entry(v: Any) -> Optional[_Entry]:
    t = type(v)
    entry = _CONTAINERS.get(t)
    if entry is None and issubclass(t, tuple) and hasattr(t, "_fields"):
        return _NAMEDTUPLE
    return entry


def tree_children(v: Any) -> Optional[Iterable[Any]]:
    """The values container ``v`` holds (one level, in order); None for a leaf."""
    entry = _entry(v)
    return None if entry is None else entry[0](v)


def tree_map(fn: Callable[[Any], Any], value: Any, is_leaf: Optional[Callable[[Any], bool]] = None,
             only: Optional[type] = None, _depth: int = 0) -> Any:
    """``value`` with every leaf ``x`` replaced by ``fn(x)``; containers are always copied.
    ``only``: a class; ``fn`` gets only the leaves of exactly that class, the others stay.
    ``is_leaf`` is asked of each container but plain tuples and lists (those are always walked:
    they are the structure of arguments) before it is walked: where it returns True, ``fn`` gets
    the whole container instead (whatever ``only`` says). (``_depth``: how deep this call is,
    for the walk's own recursion; leaves are mapped in their container's loop.)"""
    t = type(value)
    entry = _CONTAINERS.get(t)
    if entry is None:
        if not (issubclass(t, tuple) and hasattr(t, "_fields")):
            return fn(value) if only is None or t is only else value
        entry = _NAMEDTUPLE
    if _depth >= _RECURSION:
        return _map_deep(fn, value, is_leaf, only)
    if is_leaf is not None and t is not tuple and t is not list and is_leaf(value):
        return fn(value)
    out = []
    for x in (value if t is tuple or t is list else entry[0](value)):
        tx = type(x)
        if tx in _CONTAINERS or (issubclass(tx, tuple) and hasattr(tx, "_fields")):
            x = tree_map(fn, x, is_leaf, only, _depth + 1)
        elif only is None or tx is only:
            x = fn(x)
        out.append(x)
    if t is tuple:
        return tuple(out)
    return out if t is list else entry[1](value, out)


def _map_deep(fn, value, is_leaf, only):
    """:func:`tree_map` with an explicit stack of open containers: (container, rebuild, its
    children not yet walked, the results so far)."""
    top: list = []
    stack = [(None, None, iter((value,)), top)]
    while stack:
        v, rebuild, todo, done = stack[-1]
        for x in todo:
            entry = _entry(x)
            if entry is not None and (is_leaf is None or type(x) in (tuple, list) or not is_leaf(x)):
                stack.append((x, entry[1], iter(entry[0](x)), []))
                break
            done.append(fn(x) if entry is not None or only is None or type(x) is only else x)
        else:
            stack.pop()
            if rebuild is not None:
                stack[-1][3].append(rebuild(v, done))
    return top[0]


def tree_iter(value: Any, subclasses: bool = False, only: Optional[type] = None) -> Iterator[Any]:
    """The leaves of ``value``, in order (``only``: those of exactly that leaf class).
    ``subclasses=True`` also walks subclasses of ``tuple``, ``list`` and ``dict`` that are not
    registered (``torch.Size``, ``OrderedDict``, a program's own list class): what looking into
    the values a program passes needs."""
    get = _CONTAINERS.get
    stack: list = []
    todo = iter((value,))
    while True:
        for v in todo:
            t = type(v)
            if t is only:
                yield v
                continue
            entry = get(t)
            if entry is not None:
                children = entry[0]
            elif issubclass(t, tuple) and hasattr(t, "_fields"):
                children = iter
            elif subclasses and issubclass(t, (tuple, list, dict)):
                children = dict.values if issubclass(t, dict) else iter
            else:
                if only is None:
                    yield v
                continue
            stack.append(todo)
            todo = iter(children(v))
            break
        else:
            if not stack:
                return
            todo = stack.pop()


def tree_depth(value: Any, limit: int) -> int:
    """How many containers deep ``value`` nests (a leaf: 0); counting stops at ``limit``."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        children = tree_children(v)
        if children is None:
            continue
        d += 1
        deepest = max(deepest, d)
        if d < limit:
            stack.extend((x, d) for x in children)
    return deepest
