"""What ``self`` is inside a traced forward: attribute reads of modules (parameters and buffers
become ``get_attr`` proxies, submodules shadows, plain values guarded), writes (replayed side
effects), submodule calls (a leaf node, or traced through with hooks), and module globals."""
from __future__ import annotations

import copy
import enum
import functools
import inspect
import os
import sys
import sysconfig
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import is_lazy

from ..errors import SymtraceError, TraceError, UninitializedModuleError
from ..graph.effects import is_inplace
from ..graph.graph_module import GraphModule
from ..graph.guard_expr import MODULE_TABLES, Attr, Call, Const, GExpr, Global, Item, Member, Root
from ..graph.guards import attr_names
from ..graph.node import TensorMeta
from ..graph.tree import tree_iter
from ..graph.replay import read_state
from ..graph.source import SourceLocation, _is_internal, user_location
from ..proxy import NO_VALUE, Proxy
from ..shadow import _DELETED, ObjectView, class_values, is_shadow, make_shadow, own_call, user_classes
from ..side_effects import _MISSING as _MISSING_CLASS_VALUE
from ..side_effects import MUTABLE_CONTAINERS, _attributes, _same, holds_traced, slot_names
from .bytecode import code_facts
from .live_objects import live_entry, trackable, untracked
from .own_call import OpaqueCallRetrace, watching, writes_state
from .values import _NN_MODULE_INTERNALS, _holds, _is_simple, _literal_expr, _no_torch_function, _viewable

_NOT_WRITTEN = object()


class ModuleAccess:
    """The part of :class:`~symtrace.trace.tracer.Tracer` that handles module attributes,
    submodule calls and globals."""

    #: module classes with their own ``__call__`` run as one node in this trace (``trace`` fills it)
    opaque_calls: frozenset = frozenset()

    # --- modules -------------------------------------------------------------------------
    def state_path(self, qualified: str) -> GExpr:
        """What reads the model's state at ``qualified`` (``"layers.0.fc.weight"``) in guards and
        in the graph: ``root.layers...``, where each submodule, parameter or buffer that
        ``Module.__getattr__`` would answer is read from its module's table
        (:class:`~symtrace.graph.guard_expr.Member`: 20x cheaper than the attribute, and a
        model's entry guards read hundreds of them on every call). Plain attributes, and
        members a class or instance attribute would shadow, stay attribute reads."""
        hit = self._state_paths.get(qualified)
        if hit is None:   # (one step below the parent's path, itself cached: (expr, the object or None))
            if not qualified:
                hit = (Root(), self.root)
            else:
                parent, _, part = qualified.rpartition(".")
                self.state_path(parent)
                hit = _state_step(*self._state_paths[parent], part)
            self._state_paths[qualified] = hit
        return hit[0]

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
            return None if sub is None else self.shadow_of(sub, qual)
        if name in d:
            return self._plain_attr(real, qual, name, d[name])
        if name in class_values(type(real)):   # `scale = 1.0` in the class body: guarded too
            return self._plain_attr(real, qual, name, inspect.getattr_static(type(real), name))
        # not on the instance: let the class (or its __getattr__) answer, like nn.Module would
        for klass in type(real).__mro__:
            if "__getattr__" in klass.__dict__ and klass is not nn.Module:
                return klass.__dict__["__getattr__"](real, name)
        if not name.startswith("__"):  # `hasattr(self, name)` answered False: guard that it stays absent
            self.add_entry_guard(Call("hasattr", (self.state_path(path), Const(name))), False, "is",
                                 f"self.{name} missing", kind="module", source=user_location(3))
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
                self.add_entry_guard(Call("list", (Attr(self.state_path(path), "_modules"),)),
                                     list(real.__dict__["_modules"]), "eq",
                                     "iterating or indexing a module container", kind="structure")
            kids = {name: (None if sub is None else self.shadow_of(sub, f"{path}.{name}" if path else name))
                    for name, sub in real.__dict__["_modules"].items()}
            self._attr_proxies[key] = kids
        return kids

    def _attr_proxy(self, qual: str, value: Any, clone: bool) -> Any:
        p = self._attr_proxies.get(qual)
        if p is not None:
            return p
        if value is None:
            return None
        same = self._tensor_proxies.get(id(value))
        if same is not None and same[0] is value:  # one tensor registered under two names: one value
            self._attr_proxies[qual] = same[1]
            return same[1]
        node = self.graph.create_node("get_attr", qual, meta={"module_path": self.module_path})
        expr = self.state_path(qual)
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
        self._tensor_proxies[id(value)] = (value, p)
        return p

    def add_live_guard(self, expr: GExpr, obj: Any) -> None:
        """An identity guard on model state, checked only where the graph runs against the live
        model (``symtrace.capture``): rebinding ``model.w = ...`` or ``model.act = nn.Tanh()``
        afterwards makes it re-capture. A GraphModule owns its own references instead."""
        if self.live:
            with untracked():   # (the guard's text is the object's repr: not a read of the program)
                self.add_entry_guard(expr, obj, "is", "the object the graph was captured with", kind="identity")

    def _plain_attr(self, real: nn.Module, qual: str, name: str, value: Any) -> Any:
        with untracked():   # (what this looks at of an object already handed out is not the program's read)
            return self._plain_attr_value(real, qual, name, value)

    def _plain_attr_value(self, real: nn.Module, qual: str, name: str, value: Any) -> Any:
        p = self._attr_proxies.get(qual)
        if p is not None:
            return p
        if isinstance(value, torch.Tensor):
            return self._attr_proxy(qual, value, clone=True)
        loc = user_location(3)
        if _is_simple(value):
            self.add_entry_guard(self.state_path(qual), copy.deepcopy(value),
                                 _value_check(value),
                                 f"reading self.{name}", source=loc)
            if type(value) in MUTABLE_CONTAINERS:  # the program works on a copy; changes are replayed
                self.extra_attrs[qual] = copy.deepcopy(value)
                working = self.effects.container_copy(self.state_path(qual), value)
                self._attr_proxies[qual] = working
                return working
            self.extra_attrs[qual] = value
            return value
        if type(value) in (list, tuple, dict) and _holds(value, lambda x: isinstance(x, torch.Tensor)):
            # a container of tensors in the module's state: read when the graph runs, guarded
            # like an input; the program works on a stand-in whose changes are replayed on it
            self.extra_attrs[qual] = value
            node = self.graph.create_node("call_function", read_state, (self.state_path(qual),), name=name)
            working = self._input_value(node, value, self.state_path(qual))
            self._attr_proxies[qual] = working
            return working
        if type(value) in (list, dict):   # (of plain objects: simple ones and tensors are above)
            working = self._object_container(self.state_path(qual), value, f"reading self.{name}", loc)
            if working is not None:
                self.extra_attrs[qual] = value
                self._attr_proxies[qual] = working
                return working
        # functions, classes and other objects: the graph was built with this very object; a
        # GraphModule keeps what it recorded, a live model (capture) is checked by identity
        expr = self.state_path(qual)
        self.add_live_guard(expr, value)
        if callable(value) or isinstance(value, (type, nn.Module)):
            return value
        if _slotted(value):
            self.extra_attrs[qual] = value
            self._attr_proxies[qual] = value
            return self._slotted_state(value, expr, loc)
        if not _viewable(value):
            self.note("module attribute", f"self.{name} (at {qual}, a {type(value).__name__}) is read but "
                      "its contents are not guarded", loc)
            return value
        self.extra_attrs[qual] = value
        view = self._plain_object(value, expr)
        self._attr_proxies[qual] = view
        return view

    def _object_container(self, expr: GExpr, value: Any, reason: str, loc) -> Optional[Any]:
        """A list or dict of the state holding plain objects (``self.log`` of records) as the
        program sees it: a shallow copy whose length (or keys), simple items' values and other
        items' identities are guarded, objects of the user's classes followed as module state
        is; what the program changes in it is replayed on the real one. None where it cannot
        be (too many items, keys that are not literals, an object the hooks cannot serve)."""
        shared = self._object_containers.get(id(value))
        if shared is not None and shared[0] is value:   # reached by another path: one copy for both
            self.add_live_guard(expr, value)
            return shared[1]
        if any(watched is value for _, watched, _ in self.effects.globals.values()):
            return None   # (also a global: changed in place while tracing, put back, replayed)
        items = list(value.items()) if type(value) is dict else list(enumerate(value))
        if len(items) > MAX_GLOBAL_CONTAINER_ITEMS or any(_literal_expr(k) is None for k, _ in items):
            return None
        objects = [(k, item) for k, item in items if not _is_simple(item)]
        if not objects or not all(_trackable_object(item) for _, item in objects):
            return None   # (only simple values and objects the hooks serve: a view would be stored back)
        if any(self._plain_object(item, Item(expr, _literal_expr(k))) is not item for k, item in objects):
            return None   # (tracked by another trace)
        self.add_live_guard(expr, value)
        self._guard_size(expr, value, items, reason, "module", loc)
        for k, item in items:
            item_expr = Item(expr, _literal_expr(k))
            if _is_simple(item):
                self.add_entry_guard(item_expr, copy.deepcopy(item), _value_check(item), reason, kind="module",
                                     source=loc)
            else:
                self.add_live_guard(item_expr, item)
        working = dict(value) if type(value) is dict else list(value)
        self.effects.object_container(expr, value, working)
        self._object_containers[id(value)] = (value, working)
        return working

    def _guard_size(self, expr: GExpr, value: Any, items: list, reason: str, kind: str, source) -> None:
        """Guard a list's (or tuple's) length, a dict's keys in order."""
        if type(value) is dict:
            self.add_entry_guard(Call("list", (expr,)), [k for k, _ in items], "eq", reason, kind=kind, source=source)
        else:
            self.add_entry_guard(Call("len", (expr,)), len(items), "eq", reason, kind=kind, source=source)

    def _plain_object(self, value: Any, expr: GExpr) -> Any:
        """A plain object of the module state as traced code sees it: the object itself, its
        reads and writes followed through class hooks (:mod:`.live_objects`), so that identity
        and ``type()`` answer as in eager; an :class:`ObjectView` where the class cannot take
        the hooks."""
        if self._live_objects.track(value, expr):
            return value
        return ObjectView(value, expr, self)

    def _slotted_state(self, value: Any, expr: GExpr, loc, depth: int = 0) -> Any:
        """A ``__slots__`` object of the module state (``value``, reached by ``expr``): the
        attribute hooks cannot serve it and a view would break ``is`` and ``type()``, so the
        program gets it as itself. Reads past it are invisible, so its attribute names and its
        simple values are guarded, nested ``__slots__`` objects likewise (what else it holds is
        noted as not guarded); what the program assigns to it, or changes in a list, dict or
        set it holds, is put back and replayed. An object reached again by another path was
        guarded and is watched on the first."""
        seen = self._slotted_seen.setdefault(id(value), (value, expr))
        if seen[1] != expr:   # (guarded on the first path: this one must reach the same object)
            self.add_entry_guard(Call("_st_distinct", (seen[1], expr)), False, "is",
                                 f"{expr.shown()} is {seen[1].shown()}", kind="module", source=loc)
            return value
        self.object_whole(expr, value, (), "its __slots__", loc, unguarded_note=True)
        self.effects.watch_state_object(expr, value)
        for k, v in (_attributes(value) or {}).items():
            if not _slotted(v) or not k.isidentifier() or k.startswith("__"):
                continue
            if depth + 1 >= MAX_SLOTTED_DEPTH:
                self.note("module attribute", f"{expr.shown()}.{k} (a {type(v).__name__}) lies deeper than "
                          f"{MAX_SLOTTED_DEPTH} __slots__ objects; its contents are not guarded", loc)
                continue
            self._slotted_state(v, Attr(expr, k), loc, depth + 1)
        return value

    def _live_read(self, entry, name: str, value: Any) -> Any:
        return self.object_attr(None, entry.expr, entry.obj, name, value, overlay=entry.overlay)

    def _live_write(self, entry, name: str, value: Any) -> None:
        if len(entry.exprs) > 1 and not self.live:   # (replayed on one path, the write could land on
            # another object; against a live model every path's identity is guarded)
            loc = user_location(2)
            raise TraceError(f"forward {'deletes' if value is _DELETED else 'assigns'} the attribute {name!r} of "
                             f"an object that the module state holds twice ({entry.exprs[0]} and {entry.exprs[1]}) "
                             f"at {loc.describe() if loc else 'an unknown line'}; symtrace replays a write on one "
                             "path and cannot tell which. Keep one reference, or make the write outside forward.")
        self.object_setattr(entry.expr, name, value)

    def _live_absent(self, entry, name: str) -> None:
        self.object_attr_absent(entry.expr, name)

    def object_attr_absent(self, expr: GExpr, name: str) -> None:
        """The program read ``obj.name`` of a plain object held by a module and found nothing
        (``hasattr`` answered False, ``getattr``'s default was used): guard that it stays absent."""
        if name.isidentifier() and not name.startswith("__"):
            self.add_entry_guard(Call("hasattr", (expr, Const(name))), False, "is",
                                 f"{str(expr).replace('root', 'self', 1)}.{name} missing", kind="module",
                                 source=user_location(4))

    def _live_whole(self, entry, name: str) -> None:
        """``vars(obj)``, ``obj.__dict__``, ``copy``/pickling of a tracked object: they see its
        whole state past the per-attribute hook, so every attribute is guarded (refused once the
        program assigned some: they would not see the assignments)."""
        self.object_whole(entry.expr, entry.obj, entry.written, name, user_location(2))

    def view_copy(self, view: ObjectView, deep: bool, memo: Optional[dict] = None) -> Any:
        """``copy.copy``/``copy.deepcopy`` of ``view``: a plain object of the program's own. Its
        attribute names and simple values are guarded on the original (:meth:`view_whole`);
        for ``deepcopy`` every other attribute is a deep copy of what the view reads (the
        program's working copy of a list, a nested view, a tensor the graph reads and clones).
        A ``copy.copy`` shares the lists, dicts and sets of plain values, which are watched
        (their changes put back and replayed); one that would share other objects or tensors
        with the state is refused."""
        get = object.__getattribute__
        obj = get(view, "_view_obj")
        self.view_whole(get(view, "_view_expr"), obj, "__deepcopy__" if deep else "__copy__")
        attributes, overlay = _attributes(obj) or {}, get(view, "_view_overlay")
        # what the program's view holds other than the object: objects, tensors, and the
        # working copies of lists it already read (plain values are the object's, guarded)
        shared = sorted(k for k, v in attributes.items() if not _is_simple(v) or k in overlay)
        if not deep:   # lists/dicts/sets of plain values are shared as they are, and watched like
            # a __slots__ object's: changed through the copy, they are put back and replayed
            self.effects.watch_state_object(get(view, "_view_expr"), obj)
        if not deep and shared:
            loc = _copy_caller()
            raise TraceError(f"forward makes copy.copy({get(view, '_view_expr').shown()}) at "
                             f"{loc.describe() if loc else 'an unknown line'}; the copy shares "
                             f"{', '.join(shared)} with the module's state, and symtrace cannot follow what the "
                             "program does through it. Use copy.deepcopy, or read the attributes you need.")
        new = copy.deepcopy(obj, memo) if deep else copy.copy(obj)
        for k in shared:
            if isinstance(k, str) and k.isidentifier() and not k.startswith("__"):
                object.__setattr__(new, k, _deep_copy_read(getattr(view, k), memo))
        return new

    def view_whole(self, expr: GExpr, obj: Any, name: str) -> None:
        """``copy.copy``/``copy.deepcopy`` of an :class:`ObjectView`: the copy holds the whole
        object, so its attribute names and simple values are guarded (refused once the program
        assigned some); :meth:`view_copy` takes the others as the view reads them."""
        written = {attr for (where, attr) in self.effects.view_writes if where == expr}
        self.object_whole(expr, obj, written, name, _copy_caller())

    def object_whole(self, expr: GExpr, obj: Any, written, name: str, loc, unguarded_note: bool = False) -> None:
        """Guard the attribute names of ``obj`` (reached by ``expr``) and every simple value,
        which the program read whole through ``name``; refused after it assigned attributes it
        would not see. Other values get an identity guard against a live model
        (``unguarded_note``: and a note that their contents are not guarded)."""
        if written:
            raise TraceError(f"forward reads {expr.shown()}.{name} (vars(), copy or pickling) at "
                             f"{loc.describe() if loc else 'an unknown line'} after assigning its attributes "
                             f"({', '.join(sorted(written))}); that would not see the assignments while "
                             "tracing. Read the attributes one by one, or copy the object before assigning.")
        reason = f"reading {expr.shown()} whole ({name})"
        self.add_entry_guard(Call("_st_attr_names", (expr,)), attr_names(obj), "eq", reason, kind="module",
                             source=loc)
        for k, v in (_attributes(obj) or {}).items():
            if not (isinstance(k, str) and k.isidentifier() and not k.startswith("__")):
                continue
            if _is_simple(v):
                self.add_entry_guard(Attr(expr, k), copy.deepcopy(v), _value_check(v), reason, kind="module",
                                     source=loc)
                continue
            self.add_live_guard(Attr(expr, k), v)
            if unguarded_note and not (_slotted(v) or callable(v) or isinstance(v, (type, nn.Module))):
                self.note("module attribute", f"{expr.shown()}.{k} (a {type(v).__name__}) is read through a "
                          "__slots__ object as it was when traced (its contents are not guarded)", loc)

    def object_attr(self, view: Optional[ObjectView], expr: GExpr, obj: Any, name: str, value: Any,
                    overlay: Optional[dict] = None) -> Any:
        """``obj.name`` for a plain object held by a module, read through ``view`` (or, for an
        object handed out as itself, ``view`` None and its writes in ``overlay``): guard what
        the program reads."""
        attr_expr = Attr(expr, name) if name.isidentifier() and not name.startswith("__") else None
        if overlay is None:
            overlay = object.__getattribute__(view, "_view_overlay")
            if inspect.isfunction(getattr(type(obj), name, None)):
                return types.MethodType(getattr(type(obj), name), view)  # methods read through the view
        elif inspect.ismethod(value) and value.__self__ is obj:
            return value   # (a method of the object itself: its reads come back here)
        if attr_expr is None:
            return value
        if _is_simple(value):
            self.add_entry_guard(attr_expr, copy.deepcopy(value), _value_check(value),
                                 f"reading {expr.shown().replace('root', 'self', 1)}.{name}", kind="module",
                                 source=user_location(3))
            if type(value) in MUTABLE_CONTAINERS:  # the program works on a copy; changes are replayed
                working = self.effects.container_copy(attr_expr, value)
                overlay[name] = working
                return working
            return value
        if (isinstance(value, torch.Tensor) or type(value) in (list, tuple, dict)) and \
                _holds(value, lambda x: isinstance(x, torch.Tensor)):
            # tensors (or containers of them) in an object's state: read when the graph runs,
            # guarded like inputs, changes to the container replayed on it
            node = self.graph.create_node("call_function", read_state, (attr_expr,), name=name)
            working = self._input_value(node, value, attr_expr)
            overlay[name] = working
            return working
        if type(value) in (list, dict):
            working = self._object_container(attr_expr, value, f"reading {attr_expr.shown()}", user_location(3))
            if working is not None:
                overlay[name] = working
                return working
        if _slotted(value):
            overlay[name] = value
            self.add_live_guard(attr_expr, value)
            return self._slotted_state(value, attr_expr, user_location(3))
        if callable(value) or isinstance(value, (type, nn.Module, torch.Tensor)) or not _viewable(value):
            self.note("object attribute", f"{attr_expr.shown()} (a {type(value).__name__}) is used as it was "
                      "when traced (not guarded)", user_location(3))
            return value
        nested = self._plain_object(value, attr_expr)
        if nested is value:   # (handed out as itself: `cfg.sub is X` is answered now, so checked later)
            self.add_live_guard(attr_expr, value)
        overlay[name] = nested
        return nested

    def object_setattr(self, expr: GExpr, name: str, value: Any) -> None:
        """``view.name = value`` on a plain object held by a module: replayed after the graph."""
        if not name.isidentifier() or name.startswith("__"):
            loc = user_location(3)
            raise TraceError(f"forward sets the attribute {name!r} of {expr.shown()} at "
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
                if _same_layout(current, value):
                    self.call_method("copy_", current, (value,), {})
                    return
                # another shape, dtype or device: eager rebinds the buffer to the new tensor (a
                # copy_ would fail or broadcast): later reads see it, the graph assigns it (a
                # GraphModule holds the buffer, so that it stays one of its buffers)
                self.extra_attrs.setdefault(qual, d["_buffers"][name])
                self._attr_proxies[qual] = value
                self.effects.attribute_written(qual)
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
            leaf = self.is_leaf_module(real, path) and not self._hooks_to_trace(real)
            if not leaf and custom_call(real):
                if self._own_call_traced(real, args, kwargs):
                    return self._trace_own_call(shadow, real, path, args, kwargs)
                if type(real) not in self.opaque_calls and writes_state(type(real)) is None:
                    return self._try_own_call(shadow, real, path, args, kwargs)
            if leaf or custom_call(real):
                # (a module with its own __call__ runs it: one node, as eager would call it)
                if self.live:
                    self.add_live_guard(self.state_path(path), real)
                # one node; the module's own hooks run when the node runs
                self._refuse_traced_objects(real, path, args, kwargs)
                value_module = self._value_module(real, path) if self.has_values else None
                return self._record("call_module", path, args, kwargs, module=value_module)
            return self.trace_forward(shadow, real, args, kwargs)
        finally:
            self.module_path = saved

    def _own_call_traced(self, real: nn.Module, args: tuple, kwargs: dict) -> bool:
        """Whether a module with its own ``__call__`` is traced through it rather than run as
        one node: when it is given a Python object (a KV cache, made by the program or passed
        in; a list or dict), which one node would hold as it was when traced and change behind
        the graph's back."""
        return any(_plain_object(v) for a in (*args, *kwargs.values()) for v in _objects_in(a))

    def _trace_own_call(self, shadow: nn.Module, real: nn.Module, path: str, args: tuple, kwargs: dict) -> Any:
        """Trace ``type(real).__call__`` with ``shadow`` as ``self``. ``super().__call__(...)``
        in it traces the hooks and forward (:class:`symtrace.shadow._ModuleCallTraced`); the
        hook lists are guarded here too, for a ``__call__`` that runs them another way
        (``nn.Module.__call__(self, ...)``). What cannot be traced there (``torch.utils.checkpoint``
        of a layer in training mode) is refused with a TraceError naming the module."""
        self._guard_traced_module(shadow, real)
        call = type(real).__call__
        self._guard_code_globals(call)
        try:
            return call(shadow, *args, **kwargs)
        except SymtraceError:
            raise
        except Exception as e:
            obj = next(v for a in (*args, *kwargs.values()) for v in _objects_in(a) if _plain_object(v))
            raise TraceError(
                f"the submodule {path!r} ({type(real).__name__}) defines its own __call__, which symtrace traces "
                f"through because it is given a {type(obj).__name__} (one node would keep the object it saw "
                f"while tracing); tracing that __call__ failed: {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}. Pass it tensors and simple values only (it then runs "
                "as one node), or call it outside the traced code.") from e

    def _try_own_call(self, shadow: nn.Module, real: nn.Module, path: str, args: tuple, kwargs: dict) -> Any:
        """A module with its own ``__call__`` given only tensors and simple values: traced
        through that ``__call__`` (its forward's operations become nodes the passes can work
        on: transformers <= 5.17 gives every decoder layer such a ``__call__``), when its code
        stores no state (:func:`~symtrace.trace.own_call.writes_state`, checked before). If
        tracing it fails, it calls anything that may have an effect
        (:class:`~symtrace.trace.own_call.CallWatcher`), or the trace shows it wrote Python
        state, :class:`OpaqueCallRetrace` starts the trace again with the class run as one
        node: one node runs it for real at every call."""
        def changed() -> tuple:   # (the Python state the trace saw written, so far)
            e = self.effects
            return (tuple(e.written), len(e.view_writes), len(e.objects),
                    frozenset(i for i, (_, snapshot, working) in enumerate(e.containers)
                              if not _same(working, snapshot)))
        cls = type(real)
        before = changed()
        try:
            with watching(cls):
                out = self._trace_own_call(shadow, real, path, args, kwargs)
        except Exception as e:
            raise OpaqueCallRetrace(cls, f"{type(e).__name__}: {e}") from e
        if changed() != before:
            raise OpaqueCallRetrace(cls, "its __call__ writes Python state")
        return out

    def _guard_traced_module(self, shadow: nn.Module, real: nn.Module) -> None:
        """Against a live model (capture), for a module traced through: adding or removing one
        of its forward hooks, which the graph ran inline, re-captures; so does swapping the
        submodule for one of another class (its forward was traced)."""
        if self.live:
            path = object.__getattribute__(shadow, "__dict__").get("_symtrace_path", "")
            if path:
                self.add_entry_guard(Call("type", (self.state_path(path),)), type(real), "is",
                                     "the class of a submodule traced through", kind="structure")
            for table in ("_forward_pre_hooks", "_forward_hooks"):
                self.add_entry_guard(Call("list", (Attr(self.state_path(path), table),)), list(getattr(real, table)), "eq",
                                     "the module's forward hooks, run inline", kind="structure")

    def _traced_object_in(self, args: tuple, kwargs: dict) -> Any:
        """The first object among the arguments that symtrace traces through (a stand-in whose
        tensors are graph values, such as a KV cache), or None."""
        stand_ins = self.effects.stand_ins

        def traced_state(x: Any, top: Any) -> bool:   # a traced value, or another stand-in inside
            hit = stand_ins.get(id(x))
            return type(x) is Proxy or (x is not top and hit is not None and hit[0] is x)

        for v in tree_iter((args, kwargs)):
            hit = stand_ins.get(id(v))
            if hit is not None and hit[0] is v and _holds(v, lambda x: traced_state(x, v)):
                return v
        return None

    def _refuse_traced_objects(self, real: nn.Module, path: str, args: tuple, kwargs: dict) -> None:
        """A module run as one node cannot be given an object symtrace traces through: the node
        would change the caller's object while the graph goes on reading the values it
        recorded before."""
        v = self._traced_object_in(args, kwargs)
        if v is not None:
            loc = user_location(3)
            raise TraceError(
                f"the submodule {path!r} ({type(real).__name__}) is a leaf module, so it runs as one node, but "
                f"it is given a {type(v).__name__} whose state is traced (tensors, nested objects)"
                f"{' at ' + loc.describe() if loc else ''}; a node cannot take such an object. Make the "
                "module traced through (not a leaf), or pass the tensors themselves.")

    def _hooks_to_trace(self, real: nn.Module) -> bool:
        """A torch layer with forward hooks of its own is traced through, its hooks inline, so
        what the hooks do to Python state is recorded like any traced code (as one node, the
        hooks would run once while tracing and again at every call). Leaves the user declared
        stay leaves."""
        if not (real._forward_hooks or real._forward_pre_hooks) or isinstance(real, LazyModuleMixin):
            return False  # (a lazy module's own pre-hook initialises it: it stays one node)
        return not (self.leaf_modules and isinstance(real, self.leaf_modules))

    def trace_forward(self, shadow: nn.Module, real: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Trace through ``real.forward`` with ``shadow`` as ``self``, with the module's forward
        pre-hooks and hooks traced around it as ``nn.Module.__call__`` would run them. Against a
        live model (capture) the hooks are guarded: adding or removing one re-captures."""
        if isinstance(real, LazyModuleMixin) and "_initialize_hook" in real.__dict__:
            path = object.__getattribute__(shadow, "__dict__").get("_symtrace_path", "")
            raise UninitializedModuleError(
                f"the lazy module {path or type(real).__name__!r} has not initialised itself yet; its first call "
                "changes the model, which a graph cannot record. Call the model once on example inputs before "
                "tracing (symtrace.capture does: its first call runs eagerly).")
        self._guard_traced_module(shadow, real)
        for hook in (*real._forward_pre_hooks.values(), *real._forward_hooks.values()):
            self._guard_code_globals(hook)
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
            out = self.trace_method(shadow, real, fn, args, kwargs)
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

    def trace_method(self, shadow: nn.Module, real: nn.Module, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """Trace the function ``fn`` of ``real``'s class with ``shadow`` as ``self`` (no hooks);
        the globals it and the other methods of the user's module classes read are guarded."""
        self._guard_code_globals(fn)
        for klass in type(real).__mro__:  # methods fn may call on self
            if _user_module_class(klass) and klass is not nn.Module:
                for method in _class_functions(klass):
                    if method.__code__ not in self._globals_seen and not _library_code(method.__code__):
                        self.guard_globals_of(method.__code__, method.__globals__, method.__qualname__)
        self.guard_class_values(shadow, real)
        self.guard_methods(shadow, real)
        return fn(shadow, *args, **kwargs)

    def shadow_of(self, real: nn.Module, path: str) -> nn.Module:
        """The shadow of ``real`` at ``path`` (:func:`~symtrace.shadow.make_shadow`). What the
        program assigns to the class of a module (``type(self).k`` lands on the shadow's class,
        ``self.__class__.k`` on the module's own) is put back when the trace ends and replayed on
        the module's class by the graph: both classes are watched from here, before any code
        reaches the module."""
        shadow = make_shadow(real, path, self)
        if id(type(shadow)) not in self.effects.classes:   # (once per class and trace)
            self.effects.watch_class(type(shadow), type(real), every_name=True)   # (ours)
            if _watched_class(type(real)):
                self.effects.watch_class(type(real), type(real))
        return shadow

    def guard_class_writes(self, class_changes) -> None:
        """What the program assigned to a class is replayed by the graph, but a later trace
        reads the class as it then is: each such attribute is guarded on the value it had before
        this trace (on the class, read through the global that names it), so a call after one
        that changed it re-captures, reading what eager would. A value the graph computes (a
        tensor, a size) on a class no global names is refused: nothing could check it."""
        for cls, target, changed, before in class_changes:
            real = target if isinstance(target, type) else None
            expr = target if isinstance(target, GExpr) else _class_global(real)
            for name, value in sorted(changed.items()):
                if expr is None or not name.isidentifier() or name.startswith("__"):
                    if holds_traced(value):
                        raise TraceError(f"forward assigns a value it computes (a tensor or size) to the class "
                                         f"attribute {(real or cls).__qualname__}.{name}, and no module global names "
                                         "that class, so a graph cannot check it at the next call. Keep it on the "
                                         "module (a buffer) or return it.")
                    continue
                # (a write to the tracer's stand-in class: what the real class, put back, holds)
                old = before[name] if real is None or real is cls else \
                    inspect.getattr_static(real, name, _MISSING_CLASS_VALUE)
                reason = f"the class attribute {(real or cls).__qualname__}.{name}, which the program assigns"
                if old is _MISSING_CLASS_VALUE:
                    self.add_entry_guard(Call("hasattr", (expr, Const(name))), False, "is", reason, kind="global")
                elif _is_simple(old):
                    self.add_entry_guard(Attr(expr, name), copy.deepcopy(old), _value_check(old), reason, kind="global")
                else:
                    self.add_entry_guard(Attr(expr, name), old, "is", reason, kind="global")

    def guard_methods(self, shadow: nn.Module, real: nn.Module) -> None:
        """Against a live model: the methods of ``real``'s user classes that their code names
        (``self.helper(x)``), and ``forward``, are guarded by identity of the function they
        resolve to on the instance, so replacing one on the class (``M.helper = f``) or on the
        instance (``m.helper = f``) afterwards re-captures."""
        path = object.__getattribute__(shadow, "__dict__")["_symtrace_path"]
        if not self.live or ("methods", path) in self._attr_proxies:
            return
        self._attr_proxies[("methods", path)] = real
        cls = type(real)
        for name in ("forward",) + _methods_named(cls):
            if name in real.__dict__:
                continue   # (an instance attribute: read through the module, guarded there)
            fn = inspect.getattr_static(cls, name, None)
            if isinstance(fn, types.FunctionType):
                self.add_entry_guard(Call("_st_method_function", (self.state_path(path), Const(name))), fn, "is",
                                     f"the method {cls.__qualname__}.{name} the graph ran", kind="identity")

    def guard_class_values(self, shadow: nn.Module, real: nn.Module) -> None:
        """Guard, on the class itself (``type(root.path).name``), the class values of
        ``real``'s class that its methods name (``type(self).k``, ``self.__class__.k``,
        ``super().k``, ``cls.k`` in a classmethod: reads the shadow does not see), once per
        class; ``self.k`` is guarded where it is read, as instance attributes are. Against a
        live model only (``capture``): a GraphModule keeps the values it recorded and holds no
        instance of the class."""
        cls = type(real)
        key = ("class values", cls)
        if not self.live or key in self._attr_proxies:
            return
        self._attr_proxies[key] = cls
        names = _class_values_named(cls)
        values = class_values(cls).difference(names)
        if values:   # (and those the user's functions it calls name: `type(obj).k` in a helper)
            for code in list(self._globals_seen):
                if not _library_code(code) and not _installed_file(code.co_filename):
                    names = names + sorted(values.intersection(_names_in(code)).difference(names))
        if not names:
            return
        path = object.__getattribute__(shadow, "__dict__")["_symtrace_path"]
        reason = f"the class values of {cls.__qualname__} that its code names"
        forward = getattr(cls.forward, "__code__", None)
        source = SourceLocation(forward.co_filename, forward.co_firstlineno, forward.co_name) if forward else None
        n = 0
        for name in names:
            # on the class (what type(self).k and self.k find), and on each user class further up
            # that defines it too (what super().k finds), where that class is reachable by name
            for expr in _class_value_exprs(cls, name, Call("type", (self.state_path(path),))):
                if n >= MAX_CLASS_ATTRIBUTE_GUARDS:
                    self.note("module attribute", f"{reason}: only the first {n} are guarded", source)
                    return
                n += 1
                value = expr[1]
                if _is_simple(value):
                    self.add_entry_guard(expr[0], copy.deepcopy(value), _value_check(value), reason,
                                         kind="structure", source=source)
                else:
                    self.add_live_guard(expr[0], value)

    def _value_module(self, real: nn.Module, path: str) -> nn.Module:
        """The module that computes example values for a leaf: a copy when running it would
        change its state (buffers updated in training mode; lazy parameters materialised, which
        the graph's own first call does, as eager's first call does)."""
        m = self._value_modules.get(path)
        if m is None:
            stateful = (real.training and any(True for _ in real.buffers())) or custom_call(real) or \
                any(is_lazy(t) for t in (*real.parameters(), *real.buffers()))
            with _no_torch_function():
                m = _private_copy(real) if stateful else real
            self._value_modules[path] = m
        return m

    # --- globals ---------------------------------------------------------------------------
    def _guard_code_globals(self, fn: Callable) -> None:
        """Guard the simple module globals ``fn`` reads, and watch the ones it may change (lists,
        dicts and sets it reads, names it rebinds) so the trace leaves them as they were."""
        fn = inspect.unwrap(fn)
        code = getattr(fn, "__code__", None)
        if code is not None and code not in self._globals_seen:
            self.guard_globals_of(code, getattr(fn, "__globals__", {}), fn.__qualname__)

    def guard_globals_of(self, code: Any, g: dict, qualname: str) -> None:
        """:meth:`_guard_code_globals` for code object ``code`` running with globals ``g``
        (every user function the program calls while tracing comes here, once)."""
        self._globals_seen.add(code)
        mod = g.get("__name__")
        if mod is None or sys.modules.get(mod) is None or sys.modules[mod].__dict__ is not g:
            return
        # an installed package's code is followed only into its own package: what it names of
        # another (transformers naming huggingface_hub's download code) is not what a forward runs,
        # and guarding those globals re-captured after any download
        home = mod.split(".")[0] if _installed_file(code.co_filename) else None
        for callee in _callees(code, g):  # helpers it may call: their globals steer the program too
            if len(self._globals_seen) >= MAX_GUARDED_FUNCTIONS:
                break
            if home is not None and str(callee[1].get("__name__") or "").split(".")[0] != home:
                continue
            if callee[0] not in self._globals_seen:
                self.guard_globals_of(*callee)
        self.effects.watch_globals(mod, g, _loaded_globals(code) + code_facts(code)[3])
        for name in _loaded_globals(code):   # (what the program assigns to a class it names is replayed)
            if _watched_class(g.get(name)):
                self.effects.watch_class(g[name], Global(mod, name))
        tracked = self._follow_global_objects(code, g, mod)
        if not self.guard_globals:
            return
        for name in _loaded_globals(code):
            if name in g:
                v = g[name]
                if _user_class(v):
                    self._guard_class_attributes(Global(mod, name), v, f"the class {name} read by {qualname}",
                                                 SourceLocation(code.co_filename, code.co_firstlineno, code.co_name))
                    continue
                if isinstance(v, nn.Module) and not is_shadow(v):
                    self._guard_global_module(Global(mod, name), v, f"the global module {name} read by "
                                              f"{qualname}", SourceLocation(code.co_filename,
                                                                                   code.co_firstlineno, code.co_name))
                    continue
                if type(v) in (list, tuple, dict) and not _is_simple(v):
                    self._guard_global_container(Global(mod, name), v, f"the global {name} read by {qualname}",
                                                 SourceLocation(code.co_filename, code.co_firstlineno, code.co_name))
                    continue
                if _is_simple(v) and not isinstance(v, (type, enum.EnumMeta)):
                    if name.startswith("__"):
                        self.note("global", f"the global {name} read by {qualname} is not guarded", None)
                        continue
                    self.add_entry_guard(Global(mod, name), copy.deepcopy(v),
                                         _value_check(v),
                                         f"the global {name} read by {qualname}", kind="global",
                                         source=SourceLocation(code.co_filename, code.co_firstlineno, code.co_name))
        self._guard_global_object_attributes(code, g, mod, qualname, tracked)

    def _follow_global_objects(self, code: Any, g: dict, mod: str) -> set:
        """The globals of ``code`` that are plain objects of the user's classes are followed as
        the module state's are (:mod:`.live_objects`): what the program reads of them, at any
        depth (``cfg.a.b``), is guarded, what it assigns is kept aside and replayed after the
        graph, and against a live model the global's identity is guarded. Namespaces and
        objects the hooks cannot serve have their attributes snapshotted instead, put back when
        the trace ends and what the program assigned replayed. Returns the names followed."""
        tracked = set()
        rebound = set(code_facts(code)[3])
        for name in _loaded_globals(code):
            v = g.get(name, _NOT_WRITTEN)
            if name.startswith("__") or name in rebound or isinstance(v, types.ModuleType) \
                    or not _plain_global_object(v):
                continue
            expr = Global(mod, name)
            entry = live_entry(v)
            if entry is not None and expr in entry.exprs:
                tracked.add(name)
            elif self._live_objects.track(v, expr):
                if self.guard_globals:
                    self.add_live_guard(expr, v)   # (`MODE is FAST` reads no attribute: guarded from the code)
                tracked.add(name)
            elif entry is None:
                self.effects.watch_global_object(mod, name, v)
        return tracked

    def _guard_global_object_attributes(self, code: Any, g: dict, mod: str, qualname: str, tracked: set) -> None:
        """``cfg.k`` in ``code`` where the global ``cfg`` is a namespace, a user's Python module
        or a plain object the attribute hooks cannot serve (those they serve are followed:
        :meth:`_follow_global_objects`, names in ``tracked``): each such pair in the code (run
        or not) whose value is simple and stored as data (looked up without running
        properties) is guarded by value, so changing ``cfg.k`` re-captures; deeper chains
        (``cfg.a.b``) are not."""
        for name, attr in code_facts(code)[1]:
            if name.startswith("__") or attr.startswith("__") or not attr.isidentifier() or name in tracked:
                continue
            v = g.get(name, _NOT_WRITTEN)
            if not _plain_global_object(v):
                continue
            try:
                value = _stored_attribute(v, attr)
            except AttributeError:
                continue
            expr = Attr(Global(mod, name), attr)
            source = SourceLocation(code.co_filename, code.co_firstlineno, code.co_name)
            if type(value) in (bool, int, float, str, type(None)) and _is_simple(value):  # (not NaN)
                self.add_entry_guard(expr, value, _value_check(value), f"{name}.{attr} read by {qualname}",
                                     kind="global", source=source)
            elif isinstance(value, torch.Tensor):
                # the graph holds this very tensor: rebinding cfg.t (the program's own
                # `NS.total = NS.total + x` too, replayed) re-captures
                self.add_entry_guard(expr, value, "is", f"{name}.{attr} read by {qualname}", kind="global",
                                     source=source)
            elif _plain_global_object(value) and not isinstance(value, types.ModuleType) \
                    and live_entry(value) is None and self._live_objects.track(value, expr):
                # an object of the user's class held by a namespace: followed as module state
                # is (its reads at any depth guarded, its writes replayed)
                if self.guard_globals:
                    self.add_live_guard(expr, value)


    def _guard_global_module(self, expr: GExpr, module: nn.Module, reason: str, source: SourceLocation) -> None:
        """A module held in a global runs as it is, not through the root: guard its identity
        (against the live model), and for it and its submodules (up to
        ``MAX_GLOBAL_MODULE_GUARDS``) the order of parameters, buffers and submodules and the
        forward hooks the graph ran, so reordering, adding or removing any of them re-captures."""
        if ("global module", id(module)) in self._attr_proxies:
            return
        self._attr_proxies[("global module", id(module))] = module
        self.add_live_guard(expr, module)
        stack, n = [(expr, module)], 0
        while stack and n < MAX_GLOBAL_MODULE_GUARDS:
            e, m = stack.pop()
            n += 1
            for table in ("_parameters", "_buffers", "_modules", "_forward_pre_hooks", "_forward_hooks"):
                self.add_entry_guard(Call("list", (Attr(e, table),)), list(getattr(m, table)), "eq",
                                     reason, kind="global", source=source)
            for sub_name, sub in m._modules.items():
                if sub is not None:
                    stack.append((Item(Attr(e, "_modules"), Const(sub_name)), sub))
        if stack:
            self.note("global", f"{reason}: only its first {MAX_GLOBAL_MODULE_GUARDS} modules are guarded", source)


    def _guard_global_container(self, expr: GExpr, value: Any, reason: str, source: SourceLocation) -> None:
        """A global list, tuple or dict holding tensors (which the graph uses as they are): its
        length or keys, the identity of each tensor and the value of each simple item are
        guarded (up to ``MAX_GLOBAL_CONTAINER_ITEMS`` items), so a program that appends to it or
        swaps a tensor re-captures instead of reusing what it saw."""
        items = list(value.items()) if type(value) is dict else list(enumerate(value))
        if len(items) > MAX_GLOBAL_CONTAINER_ITEMS or any(_literal_expr(k) is None for k, _ in items):
            self.note("global", f"{reason}: its contents are not guarded", source)
            return
        self._guard_size(expr, value, items, reason, "global", source)
        for k, item in items:
            item_expr = Item(expr, _literal_expr(k))
            if isinstance(item, torch.Tensor):
                self.add_entry_guard(item_expr, item, "is", reason, kind="global", source=source)
            elif _is_simple(item):
                self.add_entry_guard(item_expr, copy.deepcopy(item), _value_check(item), reason, kind="global",
                                     source=source)
            else:
                self.note("global", f"{reason}: item {k!r} (a {type(item).__name__}) is not guarded", source)

    def _guard_class_attributes(self, expr: GExpr, cls: type, reason: str, source: SourceLocation) -> None:
        """A user class (not a module class) the program names (``A.a``, ``cls.coeff``): its simple
        class attributes, its own and inherited, are guarded (up to ``MAX_CLASS_ATTRIBUTE_GUARDS``),
        so assigning ``A.a = 5`` afterwards re-captures."""
        key = ("class attributes", id(cls))
        if key in self._attr_proxies:
            return
        self._attr_proxies[key] = cls
        n = 0
        for klass in cls.__mro__:
            if not _user_class(klass):
                continue
            for attr, value in vars(klass).items():
                if attr.startswith("__") or not attr.isidentifier() or not _is_simple(value):
                    continue
                if n >= MAX_CLASS_ATTRIBUTE_GUARDS:
                    self.note("global", f"{reason}: only its first {n} class attributes are guarded", source)
                    return
                n += 1
                seen = getattr(cls, attr)  # (as the class resolves it)
                self.add_entry_guard(Attr(expr, attr), copy.deepcopy(seen),
                                     _value_check(seen), reason,
                                     kind="global", source=source)


def _value_check(v: Any) -> str:
    """How a guard compares a simple value: by identity for bools and None, else by equality."""
    return "is" if isinstance(v, bool) or v is None else "eq"


def _objects_in(tree: Any, depth: int = 0):
    """The leaves of ``tree`` and the lists, dicts and sets holding them (to depth 4)."""
    t = type(tree)
    if depth < 4 and t in (list, tuple, dict, set):
        if t is not tuple:
            yield tree
        for v in (tree.values() if t is dict else tree):
            yield from _objects_in(v, depth + 1)
    else:
        yield tree


def _plain_object(v: Any) -> bool:
    """An instance of a user's class (a cache, a config) or a list, dict or set, not a tensor,
    traced value, module, function or simple value."""
    if type(v) in (list, dict, set):
        return not _is_simple(v)
    if type(v) is Proxy or isinstance(v, (torch.Tensor, nn.Module, type, types.FunctionType, types.MethodType,
                                          types.BuiltinFunctionType)) or _is_simple(v):
        return False
    return (type(v).__module__ or "builtins").split(".")[0] not in ("builtins", "torch", "typing", "collections",
                                                                    "enum", "functools")


def custom_call(module: nn.Module) -> bool:
    """Whether the module's class defines its own ``__call__`` (user code, not torch's)."""
    return own_call(type(module))


def _class_global(cls: Optional[type]) -> Optional[GExpr]:
    """``sys.modules[mod].A.B`` naming the class ``cls``, or None (a class made in a function)."""
    if cls is None or "<" in cls.__qualname__:
        return None
    mod = sys.modules.get(cls.__module__)
    parts = cls.__qualname__.split(".")
    obj = mod
    for p in parts:
        obj = getattr(obj, p, None)
    if obj is not cls or not all(p.isidentifier() and not p.startswith("__") for p in parts):
        return None
    try:
        expr: GExpr = Global(cls.__module__, parts[0])
    except Exception:   # (a module name a guard cannot read)
        return None
    for p in parts[1:]:
        expr = Attr(expr, p)
    return expr


def _watched_class(v: Any) -> bool:
    return isinstance(v, type) and _watched_class_type(v)


@functools.lru_cache(maxsize=4096)
def _watched_class_type(v: type) -> bool:
    """A class of the user's code whose attributes the program may assign while tracing: not
    torch's, the standard library's or an installed package's (nor an enum's)."""
    if issubclass(v, enum.Enum) or getattr(v, "_symtrace_shadow", False) is True:
        return False
    if v.__module__ == "__main__":   # (a script, a notebook, python -c)
        return True
    home = sys.modules.get(v.__module__)
    f = getattr(home, "__file__", None) or ""
    return bool(f) and not _installed_file(f) and not f.startswith(_SYMTRACE_DIR)


_SYMTRACE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _user_class(v: Any) -> bool:
    """A class defined by user code (not a builtin, torch's, an enum or a module class)."""
    return isinstance(v, type) and not issubclass(v, (nn.Module, enum.Enum, BaseException)) and \
        (v.__module__ or "builtins").split(".")[0] not in ("builtins", "torch", "typing", "collections", "abc")


def _callees(code: Any, g: dict) -> List[Tuple[Any, dict, str]]:
    """``(code, globals, name)`` of the user functions ``code`` can reach by name: functions it
    loads as globals, functions reached as ``module.f`` from a global, the methods of user
    classes (and modules held in globals) it names, and code nested in it (lambdas,
    comprehensions, inner defs). Library and standard-library code is left out."""
    out: List[types.FunctionType] = []
    names, attrs, nested = _call_sites(code)
    for name in names:
        v = g.get(name)
        if isinstance(v, types.FunctionType):
            out.append(v)
        elif _user_class(v) or (isinstance(v, nn.Module) and not is_shadow(v)):
            cls = v if isinstance(v, type) else type(v)
            out.extend(f for klass in cls.__mro__ if _user_class(klass) or _user_module_class(klass)
                       for f in _class_functions(klass))
    for name, attr in attrs:
        v = g.get(name)
        if isinstance(v, types.ModuleType):
            f = getattr(v, attr, None)
            if isinstance(f, types.FunctionType):
                out.append(f)
    found = [(f.__code__, f.__globals__, f.__qualname__) for f in out]
    found.extend((c, g, c.co_qualname) for c in nested)
    return [c for c in found if not _library_code(c[0])]


def _call_sites(code: Any) -> Tuple[Tuple[str, ...], Tuple[Tuple[str, str], ...], Tuple[Any, ...]]:
    """What ``code`` names that may be called: the globals it loads, ``(global, attribute)``
    pairs it reads, and the code objects nested in it."""
    return code_facts(code)[:3]


def _class_functions(klass: type) -> List[types.FunctionType]:
    out = []
    for v in vars(klass).values():
        if isinstance(v, (staticmethod, classmethod)):
            v = v.__func__
        if isinstance(v, types.FunctionType):
            out.append(v)
    return out


def _trackable_object(item: Any) -> bool:
    """A plain object (not a tensor, module, class or callable) whose class the attribute hooks serve."""
    return _viewable(item) and trackable(item) and not callable(item) \
        and not isinstance(item, (type, nn.Module, torch.Tensor))


def _stored_attribute(obj: Any, name: str) -> Any:
    """``obj.name`` as stored, without running properties or ``__getattr__``: the instance's or
    class's entry (``inspect.getattr_static``), a ``__slots__`` entry read through its member
    descriptor (which runs no user code). AttributeError where it is not stored."""
    value = inspect.getattr_static(obj, name)
    if isinstance(value, types.MemberDescriptorType) and isinstance(obj, value.__objclass__):
        return value.__get__(obj, type(obj))
    return value


def _plain_global_object(v: Any) -> bool:
    """A global whose attributes are data the program reads: a plain object of a user's class
    (``__slots__`` ones too; not a class, function, module instance or tensor; a logger or other library object is
    left alone), a ``SimpleNamespace`` or ``argparse.Namespace``, or a Python module of the
    user's own (not the standard library's or an installed package's)."""
    if isinstance(v, types.ModuleType):
        f = getattr(v, "__file__", None) or ""
        return bool(f) and not _installed_file(f)
    cls = type(v)
    slotted = not hasattr(v, "__dict__") and type(cls) is type and bool(slot_names(cls))
    if not (_viewable(v) or slotted) or callable(v) or isinstance(v, (type, nn.Module, torch.Tensor)):
        return False
    if f"{cls.__module__}.{cls.__qualname__}" in ("types.SimpleNamespace", "argparse.Namespace"):
        return True
    home = sys.modules.get(cls.__module__)
    f = getattr(home, "__file__", None) or ""
    return bool(f) and not _installed_file(f)


def _class_values_named(cls: type) -> List[str]:
    """The class values of ``cls`` (:func:`~symtrace.shadow.class_values`) that the code of the
    methods of its classes before ``nn.Module`` (mixins too; not library or installed code;
    nested code too) names, sorted."""
    key = (cls, tuple(len(vars(k)) for k in cls.__mro__))
    hit = _CLASS_VALUES_NAMED.get(key)
    if hit is None:
        values = class_values(cls)
        named = set()
        if values:
            for klass in user_classes(cls):
                stack = [f.__code__ for f in _class_functions(klass)
                         if not _library_code(f.__code__) and not _installed_file(f.__code__.co_filename)]
                while stack:
                    code = stack.pop()
                    named.update(values.intersection(_names_in(code)))
                    stack.extend(code_facts(code)[2])
        hit = _CLASS_VALUES_NAMED[key] = sorted(named)
    return hit


def _state_path(root: Any, qualified: str) -> GExpr:
    """:meth:`ModuleAccess.state_path` below ``root``, without the tracer's cache (the same steps)."""
    expr, obj = Root(), root
    for part in qualified.split(".") if qualified else ():
        expr, obj = _state_step(expr, obj, part)
    return expr


def _state_step(expr: GExpr, obj: Any, part: str) -> Tuple[GExpr, Any]:
    """``expr.part`` as the path reads it, and the object it reaches (None below a plain
    attribute: what follows is read as attributes)."""
    table = _member_table(obj, part)
    if table is None:
        return Attr(expr, part), None
    return Member(expr, table, part), obj.__dict__[table][part]


def _member_table(obj: Any, name: str) -> Optional[str]:
    """The table of the module ``obj`` that ``obj.name`` is answered from (by
    ``Module.__getattr__``: not found on the class nor in the instance's ``__dict__``), or None."""
    if not isinstance(obj, nn.Module):
        return None
    cls = type(obj)
    if cls.__getattr__ is not nn.Module.__getattr__ or cls.__getattribute__ is not object.__getattribute__ \
            or type(cls).__getattribute__ is not type.__getattribute__:
        return None
    d = obj.__dict__
    if name in d or any(name in vars(klass) for klass in cls.__mro__):
        return None
    for table in MODULE_TABLES:
        entries = d.get(table)
        if isinstance(entries, dict) and name in entries:
            return table
    return None


def _methods_named(cls: type) -> Tuple[str, ...]:
    """The functions of ``cls``'s user classes (before ``nn.Module``) that their methods' code
    names (``self.helper``), sorted."""
    hit = _METHODS_NAMED.get(cls)
    if hit is None:
        functions = {k for klass in user_classes(cls) for k, v in vars(klass).items()
                     if isinstance(v, types.FunctionType) and not k.startswith("__") and k != "forward"}
        named = set()
        for klass in user_classes(cls):
            stack = [f.__code__ for f in _class_functions(klass)]
            while stack:
                code = stack.pop()
                named.update(functions.intersection(code.co_names))
                stack.extend(code_facts(code)[2])
        hit = _METHODS_NAMED[cls] = tuple(sorted(named))
    return hit


_METHODS_NAMED: Dict[type, Tuple[str, ...]] = {}


@functools.lru_cache(maxsize=4096)
def _names_in(code: Any) -> frozenset:
    """The attribute and global names ``code`` uses, and its string constants that are
    identifiers (``getattr(type(self), "k")``)."""
    return frozenset(code.co_names) | {c for c in code.co_consts if type(c) is str and c.isidentifier()}


_CLASS_VALUES_NAMED: Dict[tuple, List[str]] = {}


def _class_value_exprs(cls: type, name: str, own: GExpr) -> List[Tuple[GExpr, Any]]:
    """``(expression, value)`` guarding the class value ``name`` of ``cls``: ``own.name`` (as
    ``cls`` resolves it), then ``module.Class.name`` for each further user class (mixins too)
    that defines ``name`` and is a module-level class (``super().name`` reads it)."""
    out = [(Attr(own, name), getattr(cls, name))]
    definers = [klass for klass in user_classes(cls) if name in vars(klass)]
    for klass in definers[1:]:   # (the first resolves it: own.name covers it)
        mod = sys.modules.get(klass.__module__)
        if mod is not None and "." not in klass.__qualname__ and getattr(mod, klass.__qualname__, None) is klass \
                and not klass.__qualname__.startswith("__"):
            out.append((Attr(Global(klass.__module__, klass.__qualname__), name), vars(klass)[name]))
    return out


def _installed_file(filename: str) -> bool:
    """A file of the standard library or of an installed package (site-, dist-packages)."""
    return filename.startswith(_STDLIB) or filename.startswith(_SITE) or \
        f"{os.sep}site-packages{os.sep}" in filename or f"{os.sep}dist-packages{os.sep}" in filename


def _user_module_class(klass: type) -> bool:
    return issubclass(klass, nn.Module) and not (klass.__module__ or "").startswith(("torch.", "symtrace."))


_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_SITE = tuple({sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib")})


def _library_code(code: Any) -> bool:
    """torch's, symtrace's or the standard library's code (whose globals never steer a program)."""
    name = code.co_filename
    return _is_internal(code) or name.startswith("<frozen") or (name.startswith(_STDLIB) and not name.startswith(_SITE))


MAX_GUARDED_FUNCTIONS = 512
MAX_GLOBAL_CONTAINER_ITEMS = 64
MAX_CLASS_ATTRIBUTE_GUARDS = 32
MAX_GLOBAL_MODULE_GUARDS = 64


def _loaded_globals(code) -> Tuple[str, ...]:
    return code_facts(code)[0]


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


def _private_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module``; its lazy (uninitialised) parameters and buffers, which do not
    deep-copy, become fresh uninitialised ones."""
    memo = {}
    for t in (*module.parameters(), *module.buffers()):
        if is_lazy(t):
            fresh = nn.UninitializedParameter if isinstance(t, nn.Parameter) else nn.UninitializedBuffer
            memo[id(t)] = fresh(requires_grad=t.requires_grad, device=t.device, dtype=t.dtype)
    return copy.deepcopy(module, memo)


def _same_layout(current: Any, value: Any) -> bool:
    """Whether ``value`` has the shape, dtype and device of the buffer it is assigned to (then
    the assignment is recorded as ``copy_`` into the buffer); unknown (symbolic mode) counts as
    the same."""
    a, b = getattr(current, "node", None), getattr(value, "node", None)
    ma = a.meta.get("tensor_meta") if a is not None else TensorMeta.of(current) if isinstance(current, torch.Tensor) else None
    mb = b.meta.get("tensor_meta") if b is not None else TensorMeta.of(value) if isinstance(value, torch.Tensor) else None
    if ma is None or mb is None:
        return True
    return tuple(ma.shape) == tuple(mb.shape) and ma.dtype == mb.dtype and ma.device == mb.device


#: how deep __slots__ objects held by __slots__ objects of the module state are guarded
MAX_SLOTTED_DEPTH = 6


def _slotted(value: Any) -> bool:
    """A plain object of a user's class that stores its state in ``__slots__`` only (not a
    container: a subclass of tuple, list, dict or set holds items the slots do not show)."""
    cls = type(value)
    return type(cls) is type and not hasattr(value, "__dict__") and bool(slot_names(cls)) \
        and not callable(value) and not isinstance(value, (type, nn.Module, torch.Tensor, tuple, list, dict, set,
                                                           frozenset))


def _deep_copy_read(value: Any, memo: Optional[dict]) -> Any:
    """A deep copy of what a view read: traced tensors cloned in the graph (at any depth of
    lists, tuples and dicts), the rest by ``copy.deepcopy``."""
    if isinstance(value, (torch.Tensor, Proxy)):
        return value.clone()
    if type(value) not in (list, tuple, dict):
        return copy.deepcopy(value, memo)
    memo = {} if memo is None else memo
    if id(value) in memo:   # (one memo: a list copied twice is one copy, as deepcopy keeps it)
        return memo[id(value)]
    if type(value) is dict:
        new = {k: _deep_copy_read(v, memo) for k, v in value.items()}
    else:
        new = type(value)(_deep_copy_read(v, memo) for v in value)
    memo[id(value)] = new
    return new


def _copy_caller() -> Optional[SourceLocation]:
    """The user's line that called ``copy.copy``/``copy.deepcopy`` (past the copy module)."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == copy.__file__ or _is_internal(frame.f_code)):
        frame = frame.f_back
    return user_location(frame=frame) if frame is not None else None
