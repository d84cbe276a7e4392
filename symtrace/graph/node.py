"""``Node``: one operation of a graph, and the helpers that walk node arguments.

A node is a small slotted record: an opcode from a closed set, a target, arguments that may
contain other nodes, the nodes that use it, a free-form ``meta`` dict and typed tensor
metadata. Assigning ``args``/``kwargs`` keeps ``users`` of every input in sync.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch

from .tree import tree_iter, tree_map

__all__ = ["Node", "OPCODES", "TensorMeta", "map_arg", "map_aggregate", "iter_nodes", "remap_args"]

#: The closed set of opcodes, in the order a graph usually lists them.
OPCODES = ("placeholder", "get_attr", "call_function", "call_method", "call_module", "output")
_OPCODE_SET = frozenset(OPCODES)


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """Typed metadata of a tensor value: what passes may rely on without running the graph.

    ``qparams`` is room for quantization parameters (e.g. ``{"scale": ..., "zero_point": ...}``).
    ``shape`` and ``stride`` hold ints, or :class:`~symtrace.graph.symbols.SizeExpr` values in
    graphs with symbolic sizes (``float32[seq, 8, 256]``; see ``docs/dynamic_shapes.md``): code
    that needs ints checks :func:`~symtrace.graph.symbols.is_symbolic` or refuses clearly
    (``int()`` of a symbolic size raises ``SymbolicSizeError``).
    """

    shape: Tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    stride: Tuple[int, ...] = ()
    requires_grad: bool = False
    qparams: Optional[Dict[str, Any]] = None

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorMeta":
        """The metadata of a real (or fake/meta) tensor."""
        try:
            stride = tuple(t.stride())
        except RuntimeError:  # e.g. sparse or nested tensors
            stride = ()
        return cls(tuple(t.shape), t.dtype, t.device, stride, t.requires_grad)

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return f"{dt}[{', '.join(map(str, self.shape))}]"


_BASE = (int, float, bool, str, type(None), complex)


def map_aggregate(a: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every leaf of a nested argument structure, rebuilding it (see
    :mod:`.tree` for what counts as a container)."""
    return tree_map(fn, a)


def map_arg(a: Any, fn: Callable[["Node"], Any]) -> Any:
    """Apply ``fn`` to every ``Node`` inside a nested argument structure."""
    return tree_map(fn, a, only=Node)


def iter_nodes(a: Any) -> Iterator["Node"]:
    """Yield every ``Node`` inside a nested argument structure, in order (with repeats)."""
    return tree_iter(a, only=Node)


class Node:
    """One operation in a :class:`~symtrace.graph.Graph`.

    ========== ================================ ==================================
    op         target                           meaning
    ========== ================================ ==================================
    placeholder parameter name                  an input of the graph
    get_attr   qualified attribute name         a parameter, buffer or constant
    call_function a Python callable             ``target(*args, **kwargs)``
    call_method method name                     ``args[0].target(*args[1:], **kwargs)``
    call_module qualified submodule name        ``submodule(*args, **kwargs)``
    output     ``"output"``                     the value(s) the graph returns (``args[0]``)
    ========== ================================ ==================================

    ``meta`` is free-form; symtrace itself writes ``"source"`` (a
    :class:`~symtrace.graph.source.SourceLocation`), ``"module_path"`` (the qualified name of
    the module whose code made the node), and ``"tensor_meta"`` (a :class:`TensorMeta`,
    also reachable as :attr:`tensor_meta`).
    """

    __slots__ = ("graph", "name", "op", "_target", "_args", "_kwargs", "_inputs", "users",
                 "meta", "_prev", "_next", "_erased", "default", "__weakref__")

    def __init__(self, graph, name: str, op: str, target: Any, args: tuple = (),
                 kwargs: Optional[dict] = None, meta: Optional[dict] = None):
        if op not in _OPCODE_SET:
            raise ValueError(f"unknown opcode {op!r}; expected one of {', '.join(OPCODES)}")
        self.graph = graph
        self.name = name
        self.op = op
        self._target = target
        self.users: Dict[Node, None] = {}
        self.meta = {} if meta is None else meta
        self._prev = self._next = self
        self._erased = False
        self.default = _NO_DEFAULT
        self._args = ()
        self._kwargs = {}
        self._inputs: Dict[Node, None] = {}
        self._set_inputs(tuple(args), dict(kwargs) if kwargs else {})

    @classmethod
    def _flat(cls, graph, name: str, op: str, target: Any, args: tuple, meta: dict) -> "Node":
        """A call node whose ``args`` are a flat tuple of nodes and atoms, without kwargs: what
        ``__init__`` makes, without its opcode check and general argument walk (passes' hot
        path; the graph links it)."""
        node = object.__new__(cls)
        node.graph = graph
        node.name = name
        node.op = op
        node._target = target
        node.users = {}
        node.meta = meta
        node._erased = False
        node.default = _NO_DEFAULT
        node._args = args
        node._kwargs = {}
        inputs: Dict[Node, None] = {}
        for a in args:
            if type(a) is Node:
                if a.graph is not graph:
                    raise _foreign_input(name, a)
                inputs[a] = None
        for a in inputs:
            a.users[node] = None
        node._inputs = inputs
        return node

    @property
    def target(self) -> Any:
        """What the node calls or names (see the opcode table); assignable."""
        return self._target

    @target.setter
    def target(self, value: Any) -> None:
        g = self.graph
        if g is not None and not self._erased:
            g._retarget(self, value)
        else:
            self._target = value

    # --- arguments and users -------------------------------------------------------------
    @property
    def args(self) -> tuple:
        """Positional arguments; assigning them updates ``users`` of old and new inputs."""
        return self._args

    @args.setter
    def args(self, value) -> None:
        self._set_inputs(tuple(value), self._kwargs)

    @property
    def kwargs(self) -> dict:
        """Keyword arguments; assigning them updates ``users`` of old and new inputs."""
        return self._kwargs

    @kwargs.setter
    def kwargs(self, value) -> None:
        self._set_inputs(self._args, dict(value))

    def _set_inputs(self, args: tuple, kwargs: dict) -> None:
        if not kwargs:  # the same input nodes as before, in order (a literal or target changed)?
            it = iter(self._inputs)
            for a in args:
                t = type(a)
                if t is Node:
                    if next(it, None) is not a:
                        break
                elif t not in _BASE:
                    break
            else:
                if next(it, None) is None:  # nothing to update but the arguments
                    self._args = args
                    self._kwargs = kwargs
                    g = self.graph
                    if g is not None:
                        g._mutated()
                    return
        new: Dict[Node, None] = {}
        for a in args:  # (a flat loop: most arguments are nodes and atoms)
            t = type(a)
            if t is Node:
                new[a] = None
            elif t not in _BASE:
                for n in iter_nodes(a):
                    new[n] = None
        if kwargs:
            for n in iter_nodes(kwargs):
                new[n] = None
        g = self.graph
        for n in new:
            if n.graph is not g:
                raise _foreign_input(self.name, n)
        old = self._inputs
        if old:
            for n in old:
                if n not in new:
                    n.users.pop(self, None)
        for n in new:
            n.users[self] = None
        self._args = args
        self._kwargs = kwargs
        self._inputs = new
        if g is not None:
            g._mutated()

    @property
    def all_input_nodes(self) -> list:
        """The distinct nodes this node reads, in order of first appearance."""
        return list(self._inputs)

    def update_arg(self, index: int, value: Any) -> None:
        """Set ``args[index]`` to ``value``."""
        args = list(self._args)
        args[index] = value
        self.args = tuple(args)

    def insert_arg(self, index: int, value: Any) -> None:
        """Insert ``value`` at ``args[index]``."""
        args = list(self._args)
        args.insert(index, value)
        self.args = tuple(args)

    def update_kwarg(self, key: str, value: Any) -> None:
        """Set ``kwargs[key]`` to ``value``."""
        kwargs = dict(self._kwargs)
        kwargs[key] = value
        self.kwargs = kwargs

    def replace_input_with(self, old: "Node", new: "Node") -> None:
        """Make this node read ``new`` wherever it read ``old``."""
        if not self._kwargs and type(new) is Node and new.graph is self.graph is not None \
                and old in self._inputs:
            # flat arguments (the common case): one pass builds the new arguments and inputs
            flat: Any = []
            inputs: Dict[Node, None] = {}
            for a in self._args:
                if a is old:
                    a = new
                t = type(a)
                if t is Node:
                    inputs[a] = None
                elif t not in _BASE:
                    break
                flat.append(a)
            else:
                if old not in inputs:
                    old.users.pop(self, None)
                new.users[self] = None
                self._args = tuple(flat)
                self._inputs = inputs
                self.graph._mutated()
                return
        args: Any = []
        for a in self._args:  # flat arguments without a helper per value
            if a is old:
                args.append(new)
            elif type(a) is Node or type(a) in _BASE:
                args.append(a)
            else:
                args = map_arg(self._args, lambda n: new if n is old else n)
                break
        kwargs = self._kwargs
        if kwargs:
            kwargs = map_arg(kwargs, lambda n: new if n is old else n)
        self._set_inputs(tuple(args), kwargs if kwargs else {})

    def replace_all_uses_with(self, replacement: "Node",
                              delete_user_cb: Optional[Callable[["Node"], bool]] = None,
                              *, propagate_meta: bool = False) -> list:
        """Make every user of this node read ``replacement`` instead; returns the users changed.

        ``delete_user_cb(user)`` may return False to keep a user on this node.
        ``propagate_meta`` copies this node's meta keys that ``replacement`` lacks.
        """
        if propagate_meta:
            for k, v in self.meta.items():
                replacement.meta.setdefault(k, v)
        changed = []
        for user in list(self.users):
            if user is replacement or (delete_user_cb is not None and not delete_user_cb(user)):
                continue
            user.replace_input_with(self, replacement)
            changed.append(user)
        return changed

    # --- metadata ------------------------------------------------------------------------
    @property
    def tensor_meta(self) -> Optional[TensorMeta]:
        """Typed tensor metadata (``meta["tensor_meta"]``), or None when unknown."""
        return self.meta.get("tensor_meta")

    @tensor_meta.setter
    def tensor_meta(self, value: Optional[TensorMeta]) -> None:
        self.meta["tensor_meta"] = value

    @property
    def source(self):
        """The user's source location that created this node (``meta["source"]``), or None."""
        return self.meta.get("source")

    @property
    def stack_trace(self) -> Optional[str]:
        """torch.fx-compatible one-frame stack trace string, from :attr:`source`."""
        loc = self.meta.get("source")
        if loc is None:
            return None
        return f'  File "{loc.filename}", line {loc.lineno}, in {loc.function}\n    {loc.line()}\n'

    # --- list position -------------------------------------------------------------------
    @property
    def next(self) -> "Node":
        return self._next

    @property
    def prev(self) -> "Node":
        return self._prev

    def prepend(self, x: "Node") -> None:
        """Move ``x`` to just before this node."""
        self.graph._move_before(x, self)

    def append(self, x: "Node") -> None:
        """Move ``x`` to just after this node."""
        self.graph._move_before(x, self._next)

    # --- printing ------------------------------------------------------------------------
    def format_target(self) -> str:
        return format_target(self.target) if self.op == "call_function" else str(self.target)

    def format_node(self) -> str:
        """One-line text form: ``%name : [users=k] = op[target](args..., kw=...)``."""
        if self.op == "placeholder":
            return f"%{self.name} : [users={len(self.users)}] = placeholder[{self.target}]"
        args = ", ".join(format_arg(a) for a in self._args)
        if self._kwargs:
            kws = ", ".join(f"{k}={format_arg(v)}" for k, v in self._kwargs.items())
            args = f"{args}, {kws}" if args else kws
        return f"%{self.name} : [users={len(self.users)}] = {self.op}[{self.format_target()}]({args})"

    def __repr__(self) -> str:
        return self.name


def remap_args(a: Any, f: Callable[[Any], Any], leaf: type = Node) -> Any:
    """Copy a nested argument structure, replacing every instance of exactly ``leaf`` (a
    ``Node`` unless told) through ``f``. Containers are always copied."""
    return tree_map(f, a, only=leaf)


class _NoDefault:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<no default>"

    def __reduce__(self):
        return "_NO_DEFAULT"


_NO_DEFAULT = _NoDefault()


_NAMESPACES = None


def importable_name(fn: Any) -> Optional[str]:
    """The dotted name under which ``fn`` is reachable from a well-known namespace
    (``torch.add``, ``torch.nn.functional.relu``, ``operator.add``, ``math.sqrt``), else None."""
    global _NAMESPACES
    if _NAMESPACES is None:
        import builtins
        import math
        import operator
        _NAMESPACES = (("torch", torch), ("torch._C", torch._C), ("operator", operator), ("torch.nn.functional", torch.nn.functional),
                       ("math", math), ("torch.Tensor", torch.Tensor), ("torch.fft", torch.fft),
                       ("torch.linalg", torch.linalg), ("torch.special", torch.special), ("", builtins))
    name = getattr(fn, "__name__", None)
    if type(name) is not str or not name.isidentifier():
        return None
    for prefix, mod in _NAMESPACES:
        try:
            if getattr(mod, name, None) is fn:
                return f"{prefix}.{name}" if prefix else name
        except Exception:
            continue
    return None


def format_target(target: Any) -> str:
    """A readable name for a call target: ``torch.add``, ``operator.getitem``, ``F.relu``..."""
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):   # aten.add.Tensor, as torch.export shows it
        return f"torch.ops.{target.namespace}.{target._opname}.{target._overloadname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"torch.ops.{target._qualified_op_name.replace('::', '.')}"
    known = importable_name(target)
    if known is not None:
        return known
    mod = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    return f"{mod}.{name}" if mod and mod != "builtins" else name


def format_arg(a: Any, node_prefix: str = "%") -> str:
    """An argument as one line of text; nodes are shown by name after ``node_prefix``."""
    if type(a) is Node:
        return f"{node_prefix}{a.name}"
    if type(a) is tuple:
        inner = ", ".join(format_arg(x, node_prefix) for x in a)
        return f"({inner},)" if len(a) == 1 else f"({inner})"
    if type(a) is list:
        return "[" + ", ".join(format_arg(x, node_prefix) for x in a) + "]"
    if type(a) is dict:
        return "{" + ", ".join(f"{k!r}: {format_arg(v, node_prefix)}" for k, v in a.items()) + "}"
    if type(a) is slice:
        parts = (format_arg(x, node_prefix) for x in (a.start, a.stop, a.step))
        return f"slice({', '.join(parts)})"
    text = repr(a)
    return " ".join(text.split()) if "\n" in text else text  # e.g. a constant tensor


def _foreign_input(name: str, other: "Node") -> ValueError:
    return ValueError(f"node {name!r} cannot use {other.name!r}: it belongs to another graph "
                      "(copy it with Graph.node_copy or Graph.graph_copy first)")
