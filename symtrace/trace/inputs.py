"""Binding a traced program's inputs: placeholders for its parameters, proxies for tensors
(copied with their layout), containers rebuilt around them, and guards on everything the
graph was specialised on (types, dtypes, devices, ranks, lengths, Python values)."""
from __future__ import annotations

import copy
import dataclasses
import inspect
import operator
import re
import sys
from typing import Any, Callable, Optional, Tuple

import torch

from ..errors import SpecializedDimError, TraceError
from ..graph.dynamic_spec import normalize_dynamic_shapes
from ..graph.symbolic_shapes import symbolic_input_meta
from ..graph.code_text import MAX_NESTING
from ..graph.guard_expr import Attr, BinOp, Call, Const, GExpr, Input, Item
from ..graph.guards import attr_names
from ..graph.node import _NO_DEFAULT, Node, TensorMeta
from ..graph.pytree_bridge import is_pytree_container, pytree_children, pytree_context, rebuild_pytree
from ..graph.tree import tree_depth
from ..proxy import NO_VALUE, Proxy
from ..shadow import class_values, user_classes
from .dynamic import DynamicInput, declaration_guards, declare, describe_symbolic, pinned_dims, reads_symbols
from .modules import MAX_CLASS_ATTRIBUTE_GUARDS, _installed_file, _library_code, _value_check, _watched_class
from .values import _holds, _is_simple, _layout_copy, _literal_expr, _no_torch_function, is_plain_object

_INDEX = re.compile(r"\[\d+\]")


def dynamic_value_key(expr: Any) -> str:
    """How ``capture`` names an int input that changed between calls: its guard expression,
    list positions generalised (``cache.layers[*].cumulative_length``), since the items of one
    list change alike (a cache's layers) and each found one capture later would cost a capture."""
    return _INDEX.sub("[*]", str(expr))


class CallArgs:
    """Example inputs given as both positional and keyword arguments: ``CallArgs(args, kwargs)``."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple = (), kwargs: Optional[dict] = None):
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})


#: tensor inputs checked pairwise for being distinct objects (against a live model)
MAX_ALIAS_GUARDED_INPUTS = 8


def _is_mapping_object(value: Any) -> bool:
    """A dict subclass with attributes that holds tensors, not a dataclass (transformers'
    ``ModelOutput`` is one: its fields are rebuilt, since it refuses ``update``)."""
    return isinstance(value, dict) and isinstance(getattr(value, "__dict__", None), dict) \
        and not dataclasses.is_dataclass(value) and _holds(dict(value), lambda x: isinstance(x, torch.Tensor))


class InputBinding:
    """The part of :class:`~symtrace.trace.tracer.Tracer` that turns the example inputs (or
    symbols, without them) into the graph's placeholders."""

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
            if self._dynamic_spec is not None:
                self._declare_dynamic(params, values)
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
            node = self.graph.placeholder(name, default if default is not p.empty else _NO_DEFAULT)
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
                if not isinstance(value, torch.Tensor):
                    recipe = example_recipe(value)
                    if recipe is not None:
                        node.meta[EXAMPLE_META_KEY] = recipe
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

    # --- dynamic dimensions (see :mod:`.dynamic`) ------------------------------------------
    def _declare_dynamic(self, params, values) -> None:
        named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        names = [p.name for p in named]
        examples = [values.get(p.name, p.default) for p in named]
        try:
            spec = normalize_dynamic_shapes(self._dynamic_spec, names, examples)
        except (ValueError, TypeError) as e:
            raise type(e)(f"symbolic_trace: {e}") from None
        for pos in spec:
            if not isinstance(examples[pos], torch.Tensor):
                raise TypeError(f"symbolic_trace: dynamic_shapes declares dimensions of {names[pos]!r}, "
                                f"which is a {type(examples[pos]).__name__}, not a tensor")
        self._dynamic_names = declare(spec, names)

    def _dynamic_input(self, node: Node, value: torch.Tensor, dims) -> TensorMeta:
        """A tensor input with symbolic dimensions: its symbolic metadata and the entry guards
        its declaration implies (ranges; equal sizes for a shared Dim)."""
        name = node.name
        try:
            meta = symbolic_input_meta(value, dims, f"the input {node.target!r}")
        except ValueError as e:
            raise TraceError(str(e)) from None
        self.dynamic_inputs[name] = DynamicInput(name, dict(dims), value.ndim, node.target)
        self._dynamic_examples[name] = value
        for e, reason in declaration_guards(list(self.dynamic_inputs.values())):
            self.add_entry_guard(e, True, "bool", reason, kind="shape", source=self._input_loc)
        return meta

    def _check_pinned(self) -> None:
        """A symbolic size that a Python decision held only at its example value is refused,
        or, with ``specialise_pinned`` (``capture``'s automatic dimensions), made static."""
        for g in self.graph.guards:
            pinned = pinned_dims(g, self.dynamic_inputs)
            if not pinned:
                if g.kind != "shape" or not reads_symbols(g, self.dynamic_inputs) or g.reason.startswith(
                        ("the declared range", "the inputs' sizes declared")):
                    continue
                # a decision on symbolic sizes: its failure message says it over the symbols too
                g.reason = f"{g.reason}; over the size symbols: {describe_symbolic(g, self.dynamic_inputs)}"
                continue
            if self.specialise_pinned:
                self._make_static(pinned)
                continue
            name, dim = sorted(pinned)[0]
            inp = self.dynamic_inputs[name]
            sym = inp.dims[dim]
            raise SpecializedDimError(
                f"the dynamic dimension {sym.name} ({inp.param}.shape[{dim}]) is specialised to its example "
                f"size by {g.reason or 'a decision'} at {g.where()} (the graph would assume "
                f"{g.describe()}). Remove it from dynamic_shapes, or keep the size a traced value "
                "there (x.shape[i] in tensor ops and arithmetic stays symbolic; int(), range(), str(), "
                "hashing and == on a size need one value).",
                {(self.dynamic_inputs[n].param, d) for n, d in pinned})

    def _make_static(self, pinned) -> None:
        for name, dim in pinned:
            inp = self.dynamic_inputs[name]
            del inp.dims[dim]
            self.pinned.add((inp.param, dim))
            node = next(n for n in self.graph.nodes if n.op == "placeholder" and n.name == name)
            value = self._dynamic_examples[name]
            node.meta["tensor_meta"] = symbolic_input_meta(value, inp.dims, name) if inp.dims else TensorMeta.of(value)
            if not inp.dims:
                del self.dynamic_inputs[name]

    def _specialise_input(self, expr: GExpr, value: Any, make_node: Optional[Callable[[], Node]] = None) -> Any:
        if make_node is not None and type(value) is int and self.dynamic_values and \
                dynamic_value_key(expr) in self.dynamic_values:
            # an int that changed between captures (a cache's length): traced like a size, so
            # arithmetic stays in the graph and decisions on it are guards over it
            self.add_entry_guard(expr, int, "type", "an int input traced as a value", kind="type",
                                 source=self._input_loc)
            return Proxy(make_node(), self, value, expr)
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
                "or dataclasses), or register its class with torch.utils._pytree.register_pytree_node.")
        else:
            self.add_entry_guard(expr, value, "is", "an opaque input object", kind="value",
                                 source=self._input_loc)
            self.note("input", f"input {expr} ({type(value).__name__}) is guarded by identity only", None)
        return value

    def _input_value(self, node: Node, value: Any, expr: GExpr) -> Any:
        """The traced stand-in for one input value (tensors become proxies; containers are
        rebuilt with proxies inside; Python values are specialised with guards)."""
        if type(value) in (tuple, list, dict) and tree_depth(value, MAX_NESTING + 1) > MAX_NESTING:
            raise TraceError(f"the input {expr} nests containers more than {MAX_NESTING} levels deep; symtrace "
                             "binds each level to a graph node and guards it, so pass flatter inputs (or the "
                             "tensors themselves)")
        if isinstance(value, torch.Tensor):
            first = self._input_exprs.get(id(value))
            if first is not None:  # the same tensor passed twice: keep the aliasing
                self.add_entry_guard(BinOp("is", expr, first[0]), True, "is", "the same tensor passed for two inputs",
                                     kind="value", source=self._input_loc)
                node.meta["tensor_meta"] = TensorMeta.of(value)
                return first[1]  # the very proxy: `a is b` answers as in eager (the guard keeps it so)
            self.add_entry_guard(expr, torch.Tensor, "isinstance", "a Tensor input", kind="type", source=self._input_loc)
            self.add_entry_guard(Attr(expr, "dtype"), value.dtype, "is", "the input's dtype", kind="dtype", source=self._input_loc)
            self.add_entry_guard(Attr(expr, "device"), value.device, "eq", "the input's device", kind="device", source=self._input_loc)
            self.add_entry_guard(Attr(expr, "ndim"), value.ndim, "eq", "the input's rank", kind="ndim", source=self._input_loc)
            with _no_torch_function():
                v = _layout_copy(value)
            dyn = self._dynamic_names.get(node.target) if type(expr) is Input and node.op == "placeholder" else None
            if dyn is not None:
                node.meta["tensor_meta"] = self._dynamic_input(node, value, dyn)
            else:
                node.meta["tensor_meta"] = TensorMeta.of(value)
            if self.live and len(self._input_exprs) < MAX_ALIAS_GUARDED_INPUTS:
                # `a is b` between inputs cannot be seen while tracing: against a live model
                # (capture re-captures) distinct tensor inputs are guarded to stay distinct
                for other, _ in self._input_exprs.values():
                    self.add_entry_guard(BinOp("is", expr, other), False, "is", "distinct tensor inputs",
                                         kind="value", source=self._input_loc)
            p = Proxy(node, self, v, expr)
            self._input_exprs[id(value)] = (expr, p)
            return p
        t = type(value)
        if t in (list, dict) or is_plain_object(value) or _is_mapping_object(value):
            first = self._input_objects.get(id(value))
            if first is not None:   # one object reached twice: one stand-in (what one name writes, the other reads)
                self.add_entry_guard(BinOp("is", expr, first[0]), True, "is", "the same object passed for two inputs",
                                     kind="value", source=self._input_loc)
                return first[1]
            stand_in = self._mutable_input(node, value, expr)
            # (an object input registers itself before walking its attributes; `value` is kept
            # so that its id stays its own while tracing)
            self._input_objects.setdefault(id(value), (expr, stand_in, value))
            return stand_in
        if t is tuple or (isinstance(value, tuple) and hasattr(value, "_fields")):
            items = self._sequence_items(node, value, expr)
            return t(*items) if hasattr(value, "_fields") else t(items)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            # (a slotted one: a dataclass with a __dict__ is an object input, above)
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
        if is_pytree_container(value):
            return self._pytree_input(node, value, expr)
        return self._specialise_input(expr, value, lambda: node)

    def _sequence_items(self, node: Node, value: Any, expr: GExpr) -> list:
        """A tuple, namedtuple or list input's class and length guarded; its items' stand-ins."""
        self.add_entry_guard(expr, type(value), "type", "a container input", kind="type", source=self._input_loc)
        self.add_entry_guard(Call("len", (expr,)), len(value), "eq", "a container input's length", kind="shape",
                             source=self._input_loc)
        return [self._input_item(node, i, item, Item(expr, Const(i))) for i, item in enumerate(value)]

    def _mutable_input(self, node: Node, value: Any, expr: GExpr) -> Any:
        """The stand-in for a list, dict, plain object or mapping object input: what the program
        changes in it is replayed on the caller's object."""
        t = type(value)
        if t is list:
            return self.effects.input_container(node, self._sequence_items(node, value, expr))
        if t is dict:
            self.add_entry_guard(expr, dict, "type", "a dict input", kind="type", source=self._input_loc)
            self.add_entry_guard(Call("list", (expr,)), list(value), "eq", "a dict input's keys", kind="value", source=self._input_loc)
            bad = [k for k in value if _literal_expr(k) is None or type(k) is Proxy]
            if bad:
                raise TraceError(f"the dict input {expr} has the key {bad[0]!r} ({type(bad[0]).__name__}); symtrace "
                                 "guards dict inputs whose keys are strings, numbers, bools, None or tuples of them")
            return self.effects.input_container(
                node, {k: self._input_item(node, k, item, Item(expr, _literal_expr(k))) for k, item in value.items()})
        if is_plain_object(value):
            return self._object_input(node, value, expr)
        return self._mapping_object_input(node, value, expr)

    def _pytree_input(self, node: Node, value: Any, expr: GExpr) -> Any:
        """A container registered with ``torch.utils._pytree``: its class, context and number of
        children are guarded, each child is an input value, and the program gets the container
        rebuilt around them by the registered unflatten function."""
        t = type(value)
        children, context = list(pytree_children(value)), pytree_context(value)
        kids = Call("_st_pytree_children", (expr,))
        self.add_entry_guard(Call("type", (expr,)), t, "is", "a pytree container input", kind="type",
                             source=self._input_loc)
        self.add_entry_guard(Call("_st_pytree_context", (expr,)), context, "eq",
                             "a pytree container input's context", kind="value", source=self._input_loc)
        self.add_entry_guard(Call("len", (kids,)), len(children), "eq", "a pytree container input's size",
                             kind="shape", source=self._input_loc)
        with self.graph.inserting_before(None):
            knode = self.graph.create_node("call_function", pytree_children, (node,), name=f"{node.name}_children")
        items = [self._input_item(knode, i, child, Item(kids, Const(i))) for i, child in enumerate(children)]
        return rebuild_pytree(t, items, context)

    def _mapping_object_input(self, node: Node, value: dict, expr: GExpr) -> Any:
        """A dict subclass with attributes (transformers' ``ModelOutput``): a stand-in of the same
        class holding traced items (and the same traced values under attributes that name the
        very same objects); what the program changes in it is replayed on the caller's object."""
        t = type(value)
        self.add_entry_guard(Call("type", (expr,)), t, "is", "a mapping object input", kind="type", source=self._input_loc)
        self.add_entry_guard(Call("list", (expr,)), list(value), "eq", "a mapping input's keys", kind="value",
                             source=self._input_loc)
        bad = [k for k in value if _literal_expr(k) is None]
        if bad:
            raise TraceError(f"the mapping input {expr} has the key {bad[0]!r} ({type(bad[0]).__name__}); symtrace "
                             "guards mapping inputs whose keys are strings, numbers, bools, None or tuples of them")
        self._guard_attr_names(value, expr)
        base = next(b for b in t.__mro__ if b.__module__ in ("builtins", "collections"))  # dict, OrderedDict
        items = {k: self._input_item(node, k, item, Item(expr, _literal_expr(k))) for k, item in base.items(value)}
        by_id = {id(base.__getitem__(value, k)): v for k, v in items.items()}
        stand_in = t.__new__(t)
        for k, v in items.items():
            base.__setitem__(stand_in, k, v)  # (the class's own __setitem__ may do more)
        for name, attr in vars(value).items():
            if not isinstance(name, str) or not name.isidentifier() or name.startswith("__"):
                continue
            if id(attr) in by_id:
                stand_in.__dict__[name] = by_id[id(attr)]
            elif isinstance(attr, torch.Tensor) or type(attr) in (tuple, list, dict):
                anode = self.graph.create_node("call_function", getattr, (node, name), name=f"{node.name}_{name}")
                stand_in.__dict__[name] = self._input_value(anode, attr, Attr(expr, name))
            else:
                stand_in.__dict__[name] = self._specialise_input(Attr(expr, name), attr)
        self.effects.input_object(node, stand_in)
        if _watched_class(t):   # (what the program assigns to its class is replayed on the caller's)
            self.effects.watch_class(t, t)
        return self.effects.input_container(node, stand_in)

    def _object_input(self, node: Node, value: Any, expr: GExpr) -> Any:
        """A plain object (``Boxes(tensor)``, a config): the program gets a stand-in of the same
        class whose attributes are traced values (Python values guarded); what it assigns to the
        stand-in is replayed on the caller's object, and returning it returns the caller's object."""
        t = type(value)
        self.add_entry_guard(Call("type", (expr,)), t, "is", "an object input", kind="type", source=self._input_loc)
        self._guard_attr_names(value, expr)
        stand_in = object.__new__(t)
        # (known before its attributes are walked: one that leads back to it gets this stand-in)
        self._input_objects[id(value)] = (expr, stand_in, value)
        # a dataclass's objects are guarded by identity, as when dataclasses were rebuilt around
        # their fields (walking them met loggers and other library objects with cycles)
        walk = not dataclasses.is_dataclass(value)
        fields = {}
        for name, item in vars(value).items():
            if not isinstance(name, str) or not name.isidentifier() or name.startswith("__"):
                continue
            if isinstance(item, torch.Tensor) or type(item) in (tuple, list, dict) or walk and is_plain_object(item):
                fnode = self.graph.create_node("call_function", getattr, (node, name), name=f"{node.name}_{name}")
                fields[name] = self._input_value(fnode, item, Attr(expr, name))
            else:
                fields[name] = self._specialise_input(Attr(expr, name), item, self._getattr_node(node, name))
        stand_in.__dict__.update(vars(value))
        stand_in.__dict__.update(fields)
        self.effects.input_object(node, stand_in)
        if _watched_class(t):   # (what the program assigns to its class is replayed on the caller's)
            self.effects.watch_class(t, t)
        return stand_in

    def _guard_attr_names(self, value: Any, expr: GExpr) -> None:
        """Guard the names of an input object's instance attributes: the program may read one as
        missing (``getattr(o, "k", default)``, ``hasattr``) or find it on the class, and the
        stand-in cannot see those reads; an object with other attributes re-captures."""
        self.add_entry_guard(Call("_st_attr_names", (expr,)), attr_names(value), "eq",
                             "the input object's attribute names", kind="value", source=self._input_loc)

    def guard_distinct_inputs(self) -> None:
        """Against a live model (capture re-captures): the list, dict and object inputs that
        were different objects when traced must stay so (one passed for two of them would be
        written through one name and read through the other)."""
        if self.live and len(self._input_objects) > 1:
            exprs = tuple(entry[0] for entry in self._input_objects.values())
            self.add_entry_guard(Call("_st_distinct", exprs), True, "is", "distinct list, dict and object inputs",
                                 kind="value", source=self._input_loc)

    def guard_input_classes(self) -> None:
        """Against a live model (``capture``), after the trace: for each object input of a user
        class, the simple class values of its class (numbers, strings, bools, None, tuples of
        them) that the traced user code names as attributes or globals, and that the instance
        does not hold itself, are guarded on the object's class (``type(o).k == 2.0``), so
        assigning ``Cls.k = 5`` later re-captures, as it does for a module's class. (Methods
        replaced on the class are not: a guard on a function would not save.)"""
        if not self.live:
            return
        named = None
        for expr, _, value in list(self._input_objects.values()):
            cls = type(value)
            if not is_plain_object(value) or not user_classes(cls) or \
                    _installed_file(getattr(sys.modules.get(cls.__module__), "__file__", None) or ""):
                continue
            if named is None:   # (the attribute and global names the traced user code uses, once)
                named = set()
                for code in list(self._globals_seen):
                    if not _library_code(code) and not _installed_file(code.co_filename):
                        named.update(code.co_names)
            names = sorted(class_values(cls).intersection(named).difference(vars(value)))
            for name in names[:MAX_CLASS_ATTRIBUTE_GUARDS]:
                v = inspect.getattr_static(cls, name)
                if _is_simple(v):
                    self.add_entry_guard(Attr(Call("type", (expr,)), name), copy.deepcopy(v), _value_check(v),
                                         f"the class of the input object {expr}, as its code names", kind="structure",
                                         source=self._input_loc)
            if len(names) > MAX_CLASS_ATTRIBUTE_GUARDS:
                self.note("input", f"the class values of input {expr} that the code names: only the first "
                                   f"{MAX_CLASS_ATTRIBUTE_GUARDS} are guarded", None)

    def _input_item(self, parent: Node, key: Any, value: Any, expr: GExpr) -> Any:
        if isinstance(value, torch.Tensor) or type(value) in (tuple, list, dict) or (
                isinstance(value, tuple) and hasattr(value, "_fields")) or is_plain_object(value) or \
                is_pytree_container(value):
            # (a plain object gets a stand-in even without tensors: what the program writes to it
            # is replayed on the caller's object, never done to it while tracing)
            with self.graph.inserting_before(None):
                item = self.graph.create_node("call_function", operator.getitem, (parent, key),
                                              name=f"{parent.name}_{key}" if isinstance(key, (int, str)) else None)
            return self._input_value(item, value, expr)
        return self._specialise_input(expr, value, lambda: self._inserted(
            "call_function", operator.getitem, (parent, key),
            f"{parent.name}_{key}" if isinstance(key, (int, str)) else None))

    def _getattr_node(self, parent: Node, name: str) -> Callable[[], Node]:
        return lambda: self._inserted("call_function", getattr, (parent, name), f"{parent.name}_{name}")

    def _inserted(self, op: str, target: Any, args: tuple, name: Optional[str]) -> Node:
        with self.graph.inserting_before(None):
            return self.graph.create_node(op, target, args, name=name)


#: the placeholder meta key of :func:`example_recipe`'s record (symtrace's own: FX and Dynamo use
#: ``example_value`` for fake tensors)
EXAMPLE_META_KEY = "symtrace_example_input"


def is_recipe(recipe: Any, depth: int = 0) -> bool:
    """Whether ``recipe`` has the form :func:`example_recipe` gives (a meta entry may come from
    anywhere: a loaded or converted graph)."""
    if type(recipe) is not tuple or len(recipe) != 2 or depth > MAX_NESTING + 1:
        return False
    kind, body = recipe
    if kind == "tensor":
        return isinstance(body, TensorMeta) and all(type(d) is int and d >= 0 for d in body.shape) \
            and isinstance(body.dtype, torch.dtype)
    if kind == "value":
        return _is_simple(body)
    if kind == "dict":
        return type(body) is dict and all(type(k) is str and is_recipe(v, depth + 1) for k, v in body.items())
    return kind in ("tuple", "list") and type(body) is tuple and all(is_recipe(v, depth + 1) for v in body)


def example_recipe(value: Any, depth: int = 0) -> Optional[Tuple[str, Any]]:
    """What a non-tensor example input was, to make another like it without the caller's objects
    (``symtrace.lower.compile`` of a traced graph given no example inputs): ``("value", v)`` for a
    plain Python value, ``("tensor", TensorMeta)``, or a tuple/list/dict of those; None for
    anything else (other objects, deep or long containers)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", TensorMeta.of(value))
    if _is_simple(value):
        return ("value", copy.deepcopy(value))
    if depth < MAX_NESTING and type(value) in (tuple, list) and len(value) <= 64:
        items = [example_recipe(v, depth + 1) for v in value]
        return None if any(i is None for i in items) else (type(value).__name__, tuple(items))
    if depth < MAX_NESTING and type(value) is dict and len(value) <= 64 and all(type(k) is str for k in value):
        items = {k: example_recipe(v, depth + 1) for k, v in value.items()}
        return None if any(i is None for i in items.values()) else ("dict", items)
    return None


def from_recipe(recipe: Tuple[str, Any]) -> Any:
    """A value like the one :func:`example_recipe` described: tensors random (floating) or zero
    (other dtypes), of the recorded shape, dtype and device."""
    kind, body = recipe
    if kind == "tensor":
        shape = tuple(body.shape)
        return torch.randn(shape, dtype=body.dtype, device=body.device) if body.dtype.is_floating_point \
            else torch.zeros(shape, dtype=body.dtype, device=body.device)
    if kind == "value":
        return copy.deepcopy(body)
    if kind == "dict":
        return {k: from_recipe(v) for k, v in body.items()}
    items = [from_recipe(v) for v in body]
    return tuple(items) if kind == "tuple" else items
