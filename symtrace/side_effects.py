"""What a traced program writes to Python state, kept away from the user's objects while
tracing and turned into replay nodes at the end (see :mod:`symtrace.graph.replay`).

* Module attributes (``self.counter += 1``) are written to the tracer's overlay; the last value
  of each becomes an :func:`~symtrace.graph.replay.assign_attribute` node.
* Lists, dicts and sets read from module attributes or plain objects are handed to the program
  as copies; a copy that changed becomes a :func:`~symtrace.graph.replay.replace_contents`
  node.
* Module globals cannot be redirected (the program reads its module's dict), so the ones
  a traced function reads or rebinds are snapshotted when it starts, put back when the trace
  ends (also when it fails), and their new values replayed.

Nothing of this survives in the user's objects: no proxy, no changed value.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .graph.guard_expr import Attr, GExpr, Global, Item, Member, root_path
from .graph.guards import slot_names
from .graph.replay import (assign_attribute, assign_global, delete_attribute, refill, replace_contents,
                           set_attributes, set_class_attributes)
from .errors import TraceError
from .proxy import NO_VALUE, Attribute, Proxy
from .shadow import is_shadow

__all__ = ["SideEffects", "MUTABLE_CONTAINERS", "shallow_copy", "holds_same_items", "slot_names"]

MUTABLE_CONTAINERS = (list, dict, set)
_MISSING = object()


def _same(a: Any, b: Any, depth: int = 0) -> bool:
    """Structural equality that never asks a proxy (which would record an operation)."""
    ta, tb = type(a), type(b)
    if ta is Proxy or ta is Attribute or tb is Proxy or tb is Attribute or ta is not tb or depth > 20:
        return False
    if ta in (list, tuple):
        return len(a) == len(b) and all(_same(x, y, depth + 1) for x, y in zip(a, b))
    if ta is dict:   # (in order: a program that moves a key to the end changed the dict)
        return list(a) == list(b) and all(_same(a[k], b[k], depth + 1) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an odd __eq__: count it as changed
        return False


class SideEffects:
    """The Python state one trace wrote, and how to replay it."""

    def __init__(self):
        self.containers: List[Tuple[GExpr, Any, Any]] = []  # (where, snapshot, the program's copy)
        self.written: Dict[str, None] = {}  # qualified module attributes assigned, in order
        self.view_writes: Dict[Tuple[GExpr, str], Any] = {}  # (object, attribute) -> last value
        self.globals: Dict[Tuple[str, str], Tuple[dict, Any, Any]] = {}  # (mod, name) -> (dict, value, snapshot)
        self.global_objects: Dict[Tuple[str, str], Tuple[Any, dict]] = {}  # (mod, name) -> (object, its attributes)
        #: id(a __slots__ object) -> (where, it, its attributes, its containers' items)
        self.state_objects: Dict[int, Tuple[GExpr, Any, dict, dict]] = {}
        self.inputs: List[Tuple[Any, Any, Any]] = []  # (graph node of an input, the program's copy, snapshot)
        self.objects: List[Tuple[Any, Any, dict]] = []  # (input node, the program's stand-in, its attributes)
        self.stand_ins: Dict[int, Tuple[Any, Any]] = {}  # id(stand-in) -> (it, its input node)
        self.cells: List[Tuple[Any, Any, Any]] = []  # (closure cell, its value, shallow snapshot or None)
        self.cell_nodes: Dict[int, Any] = {}  # id(cell) -> the node reading it
        #: id(class) -> (the class, where the graph finds it at run time, its attributes before,
        #: whether every name counts: see watch_class)
        self.classes: Dict[int, Tuple[type, Any, Dict[str, Any], bool]] = {}

    # --- while tracing -----------------------------------------------------------------
    def container_copy(self, where: GExpr, value: Any) -> Any:
        """A copy of the list/dict/set ``value`` (read from ``where``) for the program to use."""
        snapshot = copy.deepcopy(value)
        working = copy.deepcopy(value)
        self.containers.append((where, snapshot, working))
        return working

    def object_container(self, where: GExpr, value: Any, working: Any) -> None:
        """Note ``working``, the shallow copy of the list/dict ``value`` (read from ``where``,
        holding objects the program uses as themselves) that the program works on."""
        self.containers.append((where, shallow_copy(value), working))

    def input_object(self, node: Any, stand_in: Any) -> None:
        """Note the stand-in for object input ``node``: what the program assigns to it is
        replayed on the caller's object, and returning it returns ``node``."""
        self.objects.append((node, stand_in, dict(vars(stand_in))))
        self.stand_ins[id(stand_in)] = (stand_in, node)

    def input_container(self, node: Any, working: Any) -> Any:
        """Note the rebuilt list/dict ``working`` standing for input ``node``: if the program
        changes it, the graph refills the caller's object. Returns ``working``."""
        self.inputs.append((node, working, shallow_copy(working)))
        return working

    def attribute_written(self, qual: str) -> None:
        self.written.pop(qual, None)
        self.written[qual] = None

    def watch_globals(self, module: str, g: dict, names) -> None:
        """Snapshot the globals ``names`` of module ``module`` (dict ``g``) that a traced
        function reads or rebinds, before it runs."""
        for name in names:
            key = (module, name)
            if key in self.globals:
                continue
            value = g.get(name, _MISSING)
            if value is _MISSING or isinstance(value, MUTABLE_CONTAINERS) or _rebindable(value):
                # a shallow snapshot: which objects the container holds (not copies of them)
                snapshot = shallow_copy(value) if isinstance(value, MUTABLE_CONTAINERS) else value
                self.globals[key] = (g, value, snapshot)

    def watch_class(self, cls: type, target: Any, every_name: bool = False) -> None:
        """Snapshot the attributes of the class ``cls`` before the program runs: what it assigns
        to the class (``type(self).calls += 1``, ``Counter.total = 0``) lands on the class while
        tracing; it is put back at the end and replayed when the graph runs, on ``target``: the
        global naming the class (a ``Global``: whatever it names then), or the class itself (the
        class of a module or input, which the graph's guards hold to be this one).
        ``every_name``: the tracer's own shadow classes, where every change is the program's; on
        the user's classes dunder names are left out (the tracer's attribute hooks live there)."""
        if id(cls) not in self.classes:
            self.classes[id(cls)] = (cls, target, dict(vars(cls)), every_name)

    def restore_classes(self) -> List[Tuple[type, Any, Dict[str, Any], Dict[str, Any]]]:
        """Put watched classes back as they were; returns what the program changed: ``(class,
        target, {attribute: new value or _MISSING}, {attribute: old value or _MISSING})``."""
        changes = []
        for cls, target, snapshot, every_name in self.classes.values():
            now = dict(vars(cls))
            # (dunders of the user's classes are left alone: the tracer's attribute hooks come and go there)
            changed = {k: now.get(k, _MISSING) for k in set(now) | set(snapshot)
                       if now.get(k, _MISSING) is not snapshot.get(k, _MISSING)
                       and (every_name or type(k) is str and not k.startswith("__"))}
            if changed:
                changes.append((cls, target, changed, {k: snapshot.get(k, _MISSING) for k in changed}))
                for k in changed:   # (type's own methods: a metaclass's __setattr__ ran for the program)
                    if k in snapshot:
                        type.__setattr__(cls, k, snapshot[k])
                    else:
                        type.__delattr__(cls, k)
        return changes

    def watch_global_object(self, module: str, name: str, obj: Any) -> None:
        """Snapshot the attributes of ``obj``, the global ``name`` of ``module`` (a namespace, or
        an object the attribute hooks cannot serve), before the program runs: what it assigns
        is put back at the end and replayed."""
        if (module, name) not in self.global_objects:
            attributes = _attributes(obj)
            if attributes is not None:
                self.global_objects[(module, name)] = (obj, attributes)

    def watch_state_object(self, where: GExpr, obj: Any) -> None:
        """Snapshot the attributes of ``obj``, a ``__slots__`` object of the module state that
        the program gets as itself, and the items of the lists, dicts and sets it holds: what
        the program assigns or changes in them is put back at the end and replayed on
        ``where``."""
        if id(obj) not in self.state_objects:
            attributes = _attributes(obj)
            if attributes is not None:
                contents = {k: shallow_copy(v) for k, v in attributes.items() if type(v) in MUTABLE_CONTAINERS}
                self.state_objects[id(obj)] = (where, obj, attributes, contents)

    def restore_state_objects(self, deleted: Any) -> None:
        """Put watched state objects back as they were; what the program assigned becomes a
        write to replay (``deleted`` marks a deleted attribute), what it changed in a container
        they hold a refill."""
        for where, obj, snapshot, contents in self.state_objects.values():
            for k, before in contents.items():
                container = snapshot[k]
                if not holds_same_items(container, before):
                    self.containers.append((Attr(where, k), before, shallow_copy(container)))
                    _put_contents(container, before)
            now = _attributes(obj)
            changed = {k: now.get(k, _MISSING) for k in set(now) | set(snapshot)
                       if now.get(k, _MISSING) is not snapshot.get(k, _MISSING)}
            if changed:
                _put_attributes(obj, snapshot)
                for k in sorted(changed):
                    self.view_writes[(where, k)] = deleted if changed[k] is _MISSING else changed[k]
        self.state_objects.clear()

    # --- at the end --------------------------------------------------------------------
    def restore_globals(self) -> List[Tuple[str, str, str, Any]]:
        """Put watched globals back as they were; returns what the program changed:
        ``(module, name, "contents" | "rebind" | "delete", new value)``, and ``(module, name,
        "attributes", {attribute: new value or _MISSING})`` for a watched global object."""
        changes = []
        for (mod, name), (obj, snapshot) in self.global_objects.items():
            d = _attributes(obj)
            changed = {k: d.get(k, _MISSING) for k in set(d) | set(snapshot)
                       if d.get(k, _MISSING) is not snapshot.get(k, _MISSING)}
            if changed:
                changes.append((mod, name, "attributes", changed))
                _put_attributes(obj, snapshot)
        for (mod, name), (g, value, snapshot) in self.globals.items():
            now = g.get(name, _MISSING)
            if now is not value:
                changes.append((mod, name, "delete" if now is _MISSING else "rebind", now))
                if value is _MISSING:
                    g.pop(name, None)
                else:
                    g[name] = value
            elif isinstance(value, MUTABLE_CONTAINERS) and not holds_same_items(value, snapshot):
                changes.append((mod, name, "contents", shallow_copy(value)))
                _put_contents(value, snapshot)
        return changes

    def emit(self, record: Callable[[Any, tuple], Any], overlay: Dict[str, Any], deleted: Any,
             global_changes, note: Callable[[str], None], class_changes=()) -> None:
        """Record one replay node per change through ``record(helper, args)``."""
        for cls, target, changed, _ in class_changes:   # (first: what follows may read the class)
            changed = {k: _class_value(cls, k, v) for k, v in changed.items()}
            if isinstance(target, GExpr):
                for attr, v in sorted(changed.items()):
                    if v is _MISSING:
                        record(delete_attribute, (target, attr))
                    else:
                        record(assign_attribute, (target, attr, v))
            else:
                values = {k: v for k, v in sorted(changed.items()) if v is not _MISSING}
                gone = tuple(sorted(k for k, v in changed.items() if v is _MISSING))
                record(set_class_attributes, (target, values, gone) if gone else (target, values))
            note(f"attributes of the class {cls.__qualname__} are assigned (replayed after the graph)")
        # changes to containers and object attributes, deepest receiver first: every receiver is
        # a path at the graph's entry, and a change at `a.b` (rebinding `a.b`, or refilling the
        # container `a.b` holds) would make a deeper path `a.b.c`/`a.b[0]` reach another object
        steps = [(where, None, working, snapshot) for where, snapshot, working in self.containers]
        steps += [(where, name, value, None) for (where, name), value in self.view_writes.items()]
        steps.sort(key=lambda step: -_depth(step[0]))   # (stable: the program's order otherwise)
        for where, name, value, snapshot in steps:
            if name is None:
                if not _same(value, snapshot):
                    record(replace_contents, (where, shallow_copy(value)))
                    note(f"{where.shown()} is changed in place (replayed after the graph)")
            elif value is deleted:
                record(delete_attribute, (where, name))
                note(f"del {where.shown()}.{name} (replayed after the graph)")
            else:
                record(assign_attribute, (where, name, value))
                note(f"{where.shown()}.{name} is assigned (replayed after the graph)")
        # module attributes last: their owners are modules, which the program cannot rebind
        for qual in self.written:
            owner, _, name = qual.rpartition(".")
            value = overlay.get(qual, deleted)
            if value is deleted:
                record(delete_attribute, (root_path(owner), name))
                note(f"del {root_path(owner)}.{name} (replayed after the graph)")
            else:
                record(assign_attribute, (root_path(owner), name, value))
                note(f"{root_path(owner)}.{name} is assigned (replayed after the graph)")
        for node, stand_in, before in self.objects:
            now = vars(stand_in)
            changed = {k: v for k, v in now.items() if before.get(k, _MISSING) is not v}
            deleted = tuple(k for k in before if k not in now)
            if changed or deleted:   # (no deletions: the node's arguments as they always were)
                record(set_attributes, (node, changed, deleted) if deleted else (node, changed))
                what = " and ".join(w for w, done in (("assigned", changed), ("deleted", deleted)) if done)
                note(f"attributes of the input {node} are {what} (replayed after the graph)")
        for node, working, snapshot in self.inputs:
            now = shallow_copy(working)
            if not holds_same_items(now, snapshot):
                record(refill, (node, now))
                note(f"the input {node} is changed in place (replayed after the graph)")
        for mod, name, kind, value in global_changes:
            if kind == "attributes":
                for attr, v in sorted(value.items()):
                    if not attr.isidentifier() or attr.startswith("__"):
                        note(f"the attribute {attr!r} of the global {mod}.{name} is changed by forward; the graph "
                             "does not replay that")
                    elif v is _MISSING:
                        record(delete_attribute, (Global(mod, name), attr))
                    else:
                        record(assign_attribute, (Global(mod, name), attr, v))
                note(f"attributes of the global {mod}.{name} are assigned (replayed after the graph)")
                continue
            if kind == "contents":
                record(replace_contents, (Global(mod, name), value))
            elif kind == "rebind":
                record(assign_global, (mod, name, value))
            else:
                note(f"the global {mod}.{name} is deleted by forward; the graph does not replay that")
                continue
            note(f"the global {mod}.{name} is {'changed in place' if kind == 'contents' else 'rebound'} "
                 "(replayed after the graph)")


def _class_value(cls: type, name: str, value: Any) -> Any:
    """What the graph assigns to ``cls.name`` for the program's ``value``; a module is refused."""
    if is_shadow(value) or isinstance(value, torch.nn.Module):
        raise TraceError(f"forward stores a module on the class attribute {cls.__qualname__}.{name}; a graph "
                         "cannot record that. Do it outside forward.")
    return value


def holds_traced(v: Any, depth: int = 0) -> bool:
    """Whether ``v`` is or holds (in containers, namedtuples, dict subclasses, objects'
    attributes; 4 levels deep) a value the traced program computes."""
    t = type(v)
    if t is Proxy or t is Attribute or is_shadow(v):
        return True
    if depth >= 4 or v is None or t in (bool, int, float, str, bytes, type) or isinstance(v, torch.Tensor):
        return False
    if isinstance(v, (list, tuple, set, frozenset)):
        return any(holds_traced(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return any(holds_traced(k, depth + 1) or holds_traced(x, depth + 1) for k, x in dict.items(v))
    d = getattr(v, "__dict__", None)
    return isinstance(d, dict) and any(holds_traced(x, depth + 1) for x in list(d.values()))


def _depth(expr: GExpr) -> int:
    """How many attribute or item steps ``expr`` takes from its root."""
    n = 0
    while isinstance(expr, (Attr, Item, Member)):
        expr, n = expr.obj, n + 1
    return n


def holds_same_items(container: Any, snapshot: Any) -> bool:
    """Whether ``container`` holds the very objects of its shallow ``snapshot``."""
    if isinstance(container, dict):   # (the stored values: a subclass's __getitem__ may make new ones)
        items = dict.items(container)
        return len(items) == len(snapshot) and all(k in snapshot and v is snapshot[k] for k, v in items)
    items = list(container)
    return len(items) == len(snapshot) and (all(x is y for x, y in zip(items, snapshot))
                                            if isinstance(container, list) else set(map(id, items)) == set(map(id, snapshot)))


def _attributes(obj: Any) -> Optional[Dict[str, Any]]:
    """The attributes stored on ``obj``: its instance dict and the ``__slots__`` that are set;
    None for objects with neither (extension types)."""
    d = getattr(obj, "__dict__", None)
    names = slot_names(type(obj))
    if type(d) is not dict and not names:
        return None
    out = dict(d) if type(d) is dict else {}
    for n in names:
        try:
            out[n] = object.__getattribute__(obj, n)
        except AttributeError:   # (an unset slot)
            pass
    return out


def _put_attributes(obj: Any, snapshot: Dict[str, Any]) -> None:
    d = getattr(obj, "__dict__", None)
    names = slot_names(type(obj))
    if type(d) is dict:
        d.clear()
        d.update({k: v for k, v in snapshot.items() if k not in names})
    for n in names:
        if n in snapshot:
            object.__setattr__(obj, n, snapshot[n])
        else:
            try:
                object.__delattr__(obj, n)
            except AttributeError:
                pass


def _rebindable(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str, bytes, type(None), tuple, complex))


def shallow_copy(value: Any) -> Any:
    """A plain list or dict of what ``value`` (a list, dict or set, or a subclass) holds."""
    if isinstance(value, dict):  # a traced key was hashed, so guarded: its value stands for it
        return {(k.value if type(k) is Proxy and k.value is not NO_VALUE else k): v for k, v in dict.items(value)}
    return list(value) if isinstance(value, (list, set)) else value


_put_contents = refill  # (putting a container's own items back is the same operation)
