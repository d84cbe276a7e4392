"""What an entry guard reads: a small expression tree over the graph's inputs, the module
(``root``), module globals and torch's global state.

Guards hold these trees, never source text. Every name in a tree is checked when the tree is
built (identifiers, no dunders; functions, methods and operators from closed sets; constants of
a few plain types), and a tree becomes Python only through :meth:`GExpr.render`, which writes
names it checked and constants with ``repr``. So rendering cannot produce anything but a
read-only expression such as ``x.shape[0] > 1`` or ``getattr(root.layer1, '0').training``.

A saved file stores a tree as nested lists (:meth:`GExpr.to_record`) and loading rebuilds it
through the same constructors (:func:`from_record`): nothing is parsed or evaluated.
"""
from __future__ import annotations

import keyword
import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from .code_text import UnsafeNameError, check_identifier

__all__ = ["GExpr", "Input", "Root", "Global", "TorchState", "Attr", "Item", "Call", "Method", "BinOp",
           "Const", "root_path", "Member", "as_attributes", "MODULE_TABLES", "render_sharing", "from_record", "GUARD_CALLS", "GUARD_METHODS", "TORCH_STATE", "BIN_OPS"]

#: functions a guard may call on what it reads
GUARD_CALLS = frozenset({"len", "list", "tuple", "type", "bool", "int", "float", "abs", "hasattr", "max", "min",
                         # the function a method name resolves to (graph/guards.py)
                         "_st_method_function",
                         # one level of a torch.utils._pytree container (graph/pytree_bridge.py)
                         "_st_pytree_children", "_st_pytree_context",
                         # an object's instance attribute names; whether objects are distinct (graph/guards.py)
                         "_st_attr_names", "_st_distinct"})
#: methods a guard may call: read-only questions about tensors, sizes, tuples and numbers
GUARD_METHODS = frozenset({"size", "numel", "dim", "ndimension", "is_contiguous", "is_floating_point",
                           "is_complex", "element_size", "get_device", "is_pinned", "storage_offset",
                           "stride", "has_names", "is_signed", "nelement", "data_ptr", "count", "index",
                           "bit_length", "keys", "values", "items"})
#: torch's global state a guard may read (``torch.<name>()``)
TORCH_STATE = frozenset({"is_grad_enabled", "get_default_dtype", "is_inference_mode_enabled"})
BIN_OPS = frozenset({"+", "-", "*", "/", "//", "%", "**", "==", "!=", "<", "<=", ">", ">=", "&", "|", "^",
                     "is"})
_CONST_TYPES = (bool, int, float, str, type(None), type(Ellipsis), slice, tuple, torch.dtype, torch.Size)
MAX_DEPTH = 64
MAX_CONST_CHARS = 4096


def _attr_name(name: Any) -> str:
    if not isinstance(name, str) or not name or name.startswith("__") or len(name) > 256 \
            or any(c < " " or c == "\x7f" for c in name):
        raise UnsafeNameError(f"a guard cannot read the attribute {name!r} (names must be non-empty, printable "
                              "and not start with '__')")
    return name


class GExpr:
    """One node of a guard expression; immutable and hashable. ``str(e)`` is its Python text."""

    __slots__ = ("_text", "_hash")
    tag = ""

    def _parts(self) -> tuple:
        raise NotImplementedError

    def children(self) -> Tuple["GExpr", ...]:
        out = []
        for p in self._parts():
            if isinstance(p, GExpr):
                out.append(p)
            elif type(p) is tuple and type(self) is not Const:  # a call's arguments
                out.extend(p)
        return tuple(out)

    def render(self) -> str:
        """The expression as Python source."""
        try:
            return self._text
        except AttributeError:
            text = self._render(_plain)
            object.__setattr__(self, "_text", text)
            return text

    def _render(self, text: Callable[["GExpr"], str]) -> str:
        """The source of this node, ``text(child)`` giving each child's."""
        raise NotImplementedError

    def bare(self) -> str:
        """The text without the parentheses an operator expression carries around itself."""
        return self.render()

    def shown(self) -> str:
        """The expression as its user wrote it, for messages: a module's member read from its
        table (``root._modules['fc']``) shows as the attribute (``root.fc``); no outer
        parentheses. Not code: :meth:`render` is."""
        text = _shown(self)
        return text[1:-1] if type(self) is BinOp else text

    def __str__(self) -> str:
        return self.render()

    def __repr__(self) -> str:
        return f"GExpr({self.render()})"

    def __eq__(self, other: Any) -> bool:
        return type(other) is type(self) and self._parts() == other._parts()

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            h = hash((self.tag,) + tuple(_hashable(p) for p in self._parts()))
            object.__setattr__(self, "_hash", h)
            return h

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("guard expressions are immutable")

    def __reduce__(self):
        return (type(self), self._parts())

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def walk(self) -> Iterator["GExpr"]:
        """This node and every node below it."""
        stack = [self]
        while stack:
            e = stack.pop()
            yield e
            stack.extend(e.children())

    def reads_root(self) -> bool:
        """Whether the expression reads the module (``root``)."""
        return any(type(e) is Root for e in self.walk())

    def inputs(self) -> List[str]:
        """The names of the graph inputs it reads."""
        return sorted({e.name for e in self.walk() if type(e) is Input})

    def root_chain(self) -> Optional[List[str]]:
        """``[a, b, c]`` when this is ``root.a.b.c`` (attribute reads, or a module's members read
        from its tables: :class:`Member`), else None."""
        parts: List[str] = []
        e: GExpr = self
        while type(e) is Attr or type(e) is Member:
            parts.append(e.name)
            e = e.obj
        return parts[::-1] if type(e) is Root and parts else None

    def root_chains(self) -> List[List[str]]:
        """Every maximal attribute chain read from ``root`` anywhere in the expression."""
        out, stack = [], [self]
        while stack:
            e = stack.pop()
            chain = e.root_chain()
            if chain is not None:
                out.append(chain)
                continue
            stack.extend(e.children())
        return out

    def to_record(self, encode: Callable[[Any], Any]) -> list:
        """Nested lists for a file; ``encode`` writes a constant's value."""
        if type(self) is Const:
            return [self.tag, encode(self.value)]
        out: list = [self.tag]
        for p in self._parts():
            if isinstance(p, GExpr):
                out.append(p.to_record(encode))
            elif type(p) is tuple:  # arguments
                out.append([x.to_record(encode) for x in p])
            else:
                out.append(p)
        return out


def _hashable(p: Any) -> Any:
    if type(p) is slice:
        return ("slice", p.start, p.stop, p.step)
    if type(p) is tuple or type(p) is torch.Size:
        return tuple(_hashable(x) for x in p)
    if type(p) is float and p != p:
        return "nan"
    return p


class Input(GExpr):
    """A graph input, by its placeholder name."""

    __slots__ = ("name",)
    tag = "input"

    def __init__(self, name: str):
        object.__setattr__(self, "name", check_identifier(name, "a guarded input name"))

    def _parts(self):
        return (self.name,)

    def _render(self, text):
        return self.name


class Root(GExpr):
    """The module the graph runs against (``root``)."""

    __slots__ = ()
    tag = "root"

    def _parts(self):
        return ()

    def _render(self, text):
        return "root"


class Global(GExpr):
    """A module global: ``sys.modules['pkg.mod'].name``."""

    __slots__ = ("module", "name")
    tag = "global"

    def __init__(self, module: str, name: str):
        if not isinstance(module, str) or not module or len(module) > 256 or any(
                not p.isidentifier() or keyword.iskeyword(p) for p in module.split(".")):
            raise UnsafeNameError(f"a guard cannot read globals of the module {module!r} (not a dotted name)")
        if not isinstance(name, str) or name.startswith("__"):
            raise UnsafeNameError(f"a guard cannot read the global {name!r} (a dunder)")
        object.__setattr__(self, "module", module)
        object.__setattr__(self, "name", check_identifier(name, "a guarded global"))

    def _parts(self):
        return (self.module, self.name)

    def _render(self, text):
        return f"sys.modules[{self.module!r}].{self.name}"


class TorchState(GExpr):
    """torch's global state: ``torch.is_grad_enabled()`` and the like (:data:`TORCH_STATE`)."""

    __slots__ = ("fn",)
    tag = "torch"

    def __init__(self, fn: str):
        if fn not in TORCH_STATE:
            raise UnsafeNameError(f"a guard cannot call torch.{fn} (only {sorted(TORCH_STATE)})")
        object.__setattr__(self, "fn", fn)

    def _parts(self):
        return (self.fn,)

    def _render(self, text):
        return f"torch.{self.fn}()"


class Attr(GExpr):
    """``obj.name`` (``getattr(obj, 'name')`` when ``name`` is not an identifier); no dunders."""

    __slots__ = ("obj", "name")
    tag = "attr"

    def __init__(self, obj: GExpr, name: str):
        object.__setattr__(self, "obj", _expr(obj))
        object.__setattr__(self, "name", _attr_name(name))

    def _parts(self):
        return (self.obj, self.name)

    def _render(self, text):
        base = _receiver(self.obj, text)
        if self.name.isidentifier() and not keyword.iskeyword(self.name):
            return f"{base}.{self.name}"
        return f"getattr({base}, {self.name!r})"


class Item(GExpr):
    """``obj[key]``."""

    __slots__ = ("obj", "key")
    tag = "item"

    def __init__(self, obj: GExpr, key: GExpr):
        object.__setattr__(self, "obj", _expr(obj))
        object.__setattr__(self, "key", _expr(key))

    def _parts(self):
        return (self.obj, self.key)

    def _render(self, text):
        return f"{_receiver(self.obj, text)}[{text(self.key)}]"


class Call(GExpr):
    """``fn(args...)`` for a function of :data:`GUARD_CALLS`."""

    __slots__ = ("fn", "args")
    tag = "call"

    def __init__(self, fn: str, args: Tuple[GExpr, ...]):
        if fn not in GUARD_CALLS:
            raise UnsafeNameError(f"a guard cannot call {fn!r} (only {sorted(GUARD_CALLS)})")
        named = fn in ("hasattr", "_st_method_function")
        if named and (len(args) != 2 or type(args[1]) is not Const or type(args[1].value) is not str):
            raise UnsafeNameError(f"a guard's {fn} takes an object and a constant attribute name")
        if named:
            _attr_name(args[1].value)  # not a dunder
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "args", tuple(_expr(a) for a in args))

    def _parts(self):
        return (self.fn, self.args)

    def _render(self, text):
        return f"{self.fn}({', '.join(text(a) for a in self.args)})"


class Method(GExpr):
    """``obj.name(args...)`` for a read-only method of :data:`GUARD_METHODS`."""

    __slots__ = ("obj", "name", "args")
    tag = "method"

    def __init__(self, obj: GExpr, name: str, args: Tuple[GExpr, ...] = ()):
        if name not in GUARD_METHODS:
            raise UnsafeNameError(f"a guard cannot call the method {name!r} (only read-only ones: "
                                  f"{sorted(GUARD_METHODS)})")
        object.__setattr__(self, "obj", _expr(obj))
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "args", tuple(_expr(a) for a in args))

    def _parts(self):
        return (self.obj, self.name, self.args)

    def _render(self, text):
        return f"{_receiver(self.obj, text)}.{self.name}({', '.join(text(a) for a in self.args)})"


class BinOp(GExpr):
    """``(a op b)`` for an operator of :data:`BIN_OPS` (``is`` tests identity)."""

    __slots__ = ("op", "a", "b")
    tag = "binop"

    def __init__(self, op: str, a: GExpr, b: GExpr):
        if op not in BIN_OPS:
            raise UnsafeNameError(f"a guard cannot use the operator {op!r}")
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "a", _expr(a))
        object.__setattr__(self, "b", _expr(b))

    def _parts(self):
        return (self.op, self.a, self.b)

    def _render(self, text):
        return f"({text(self.a)} {self.op} {text(self.b)})"

    def bare(self):
        return self.render()[1:-1]


class Const(GExpr):
    """A constant: bool, int, float, str, None, ``...``, a slice or tuple of those, a dtype."""

    __slots__ = ("value",)
    tag = "const"

    def __init__(self, value: Any):
        _check_const(value, 0)
        object.__setattr__(self, "value", value)

    def _parts(self):
        return (self.value,)

    def _render(self, text):
        return _const_text(self.value)


def _check_const(v: Any, depth: int) -> None:
    t = type(v)
    if depth > MAX_DEPTH or t not in _CONST_TYPES:
        raise UnsafeNameError(f"a guard constant must be a number, string, bool, None, slice, tuple or dtype, "
                              f"not {t.__name__}")
    if t is str and len(v) > MAX_CONST_CHARS:
        raise UnsafeNameError(f"a guard constant string is longer than {MAX_CONST_CHARS} characters")
    if t is tuple or t is torch.Size:
        for x in v:
            _check_const(x, depth + 1)
    elif t is slice:
        for x in (v.start, v.stop, v.step):
            _check_const(x, depth + 1)


def _const_text(v: Any) -> str:
    t = type(v)
    if t is float:
        if math.isnan(v):
            return "float('nan')"
        if math.isinf(v):
            return "float('inf')" if v > 0 else "(-float('inf'))"
        return repr(v)
    if t is tuple:
        inner = ", ".join(_const_text(x) for x in v)
        return f"({inner},)" if len(v) == 1 else f"({inner})"
    if t is torch.Size:
        return f"torch.Size([{', '.join(_const_text(x) for x in v)}])"
    if t is slice:
        return f"slice({_const_text(v.start)}, {_const_text(v.stop)}, {_const_text(v.step)})"
    if t is torch.dtype:
        return str(v)  # torch.float32: read through the generated code's torch
    if v is Ellipsis:
        return "..."
    return repr(v)  # bool, int, str, None


def _plain(e: GExpr) -> str:
    return e.render()


def _receiver(e: GExpr, text: Callable[[GExpr], str]) -> str:
    t = text(e)
    if type(e) is Const and (t[:1] == "-" or t[:1].isdigit()):
        return f"({t})"
    return t


def render_sharing(exprs: List[GExpr], prefix: str) -> List[str]:
    """The texts of ``exprs``, meant to be evaluated in order in one function body (an ``and``
    chain), with every subexpression read more than once evaluated once: its first use binds
    it (``(_g0 := getattr(root.layers, '0'))``), later uses read the name. Python evaluates
    these trees left to right as they are written, so a name is always bound before it is
    read; what a read returns is assumed not to change between the reads (they are attribute
    and item reads of inputs and the module). Names are ``<prefix><k>``. Subexpressions are the
    same when their texts are (``Const(1)`` and ``Const(True)`` compare equal as trees)."""
    key = (tuple(e.render() for e in exprs), prefix)
    hit = _SHARED.get(key)
    if hit is None:   # (a graph recompiled renders the same guards again)
        if len(_SHARED) >= 256:
            _SHARED.clear()
        hit = _SHARED[key] = _render_sharing(exprs, prefix)
    return list(hit)


_SHARED: Dict[tuple, Tuple[str, ...]] = {}


def _render_sharing(exprs: List[GExpr], prefix: str) -> Tuple[str, ...]:
    counts: Dict[str, int] = {}
    for e in exprs:
        for sub in e.walk():
            if type(sub) not in (Input, Root, Const):
                t = sub.render()
                counts[t] = counts.get(t, 0) + 1
    names = {t: f"{prefix}{k}" for k, t in enumerate(t for t, c in counts.items() if c > 1)}
    bound: set = set()

    def text(e: GExpr) -> str:
        plain = e.render()
        name = names.get(plain)
        if name is None:
            return e._render(text)
        if plain in bound:
            return name
        body = e._render(text)
        bound.add(plain)
        return f"({name} := {body})"

    return tuple(text(e) for e in exprs)


def _expr(e: Any) -> GExpr:
    if not isinstance(e, GExpr):
        raise TypeError(f"expected a guard expression, got {type(e).__name__}")
    return e


#: the tables of an ``nn.Module`` where ``Module.__getattr__`` finds parameters, buffers and
#: submodules, in the order it looks
MODULE_TABLES = ("_parameters", "_buffers", "_modules")


class Member(GExpr):
    """``obj._modules['name']`` (or ``_parameters``, ``_buffers``): a submodule, parameter or
    buffer of the module ``obj``, read straight from its table, which is what ``obj.name``
    returns when ``Module.__getattr__`` answers it, about 20x faster (the attribute read first
    fails in C, then calls that Python method). Shown as ``obj.name`` in messages
    (:meth:`GExpr.shown`); ``name`` follows :class:`Attr`'s rules."""

    __slots__ = ("obj", "table", "name")
    tag = "member"

    def __init__(self, obj: GExpr, table: str, name: str):
        if table not in MODULE_TABLES:
            raise UnsafeNameError(f"a module member is read from one of {MODULE_TABLES}, not {table!r}")
        object.__setattr__(self, "obj", _expr(obj))
        object.__setattr__(self, "table", table)
        object.__setattr__(self, "name", _attr_name(name))

    def _parts(self):
        return (self.obj, self.table, self.name)

    def _render(self, text):
        return f"{_receiver(self.obj, text)}.{self.table}[{self.name!r}]"


def as_attributes(e: GExpr) -> GExpr:
    """``e`` with each module member (:class:`Member`) read as the attribute it stands for:
    for a ``root`` that has the attributes but not a module's tables (torch.fx's guard check
    builds such a ``root`` from dotted paths)."""
    if type(e) is Member:
        return Attr(as_attributes(e.obj), e.name)
    if type(e) in (Input, Root, Const, Global, TorchState):
        return e
    parts = tuple(as_attributes(p) if isinstance(p, GExpr) else
                  tuple(as_attributes(a) for a in p) if type(p) is tuple else p for p in e._parts())
    return type(e)(*parts)


def _shown(e: GExpr) -> str:
    if type(e) is not Member:
        return e._render(_shown)
    base = _receiver(e.obj, _shown)
    name = e.name
    return f"{base}.{name}" if name.isidentifier() and not keyword.iskeyword(name) else f"getattr({base}, {name!r})"


def root_path(qualified: str) -> GExpr:
    """``root.a.b`` for the qualified attribute name ``"a.b"`` (``root`` for ``""``)."""
    e: GExpr = Root()
    if qualified:
        for part in qualified.split("."):
            e = Attr(e, part)
    return e


# --- records (files) ----------------------------------------------------------------------------
def from_record(rec: Any, decode: Callable[[Any], Any], inputs: Optional[set] = None, depth: int = 0) -> GExpr:
    """Rebuild a tree from :meth:`GExpr.to_record`'s lists through the checking constructors.

    ``decode`` reads a constant's value; ``inputs``, when given, are the only input names the
    tree may read. Raises :class:`UnsafeNameError` or ``ValueError`` for anything else."""
    if depth > MAX_DEPTH:
        raise ValueError(f"a guard expression is nested more than {MAX_DEPTH} levels deep")
    if not isinstance(rec, list) or not rec or not isinstance(rec[0], str):
        raise ValueError(f"a guard expression record must be a list starting with its kind, got {_short(rec)}")
    tag, body = rec[0], rec[1:]
    d = depth + 1

    def sub(x: Any) -> GExpr:
        return from_record(x, decode, inputs, d)

    def subs(x: Any) -> Tuple[GExpr, ...]:
        if not isinstance(x, list):
            raise ValueError(f"a guard expression's arguments must be a list, got {_short(x)}")
        return tuple(sub(a) for a in x)

    def arity(n: int) -> None:
        if len(body) != n:
            raise ValueError(f"a {tag!r} guard expression takes {n} parts, got {len(body)}")

    if tag == "input":
        arity(1)
        e = Input(body[0])
        if inputs is not None and e.name not in inputs:
            raise ValueError(f"a guard reads {e.name!r}, which is not an input of the graph")
        return e
    if tag == "root":
        arity(0)
        return Root()
    if tag == "global":
        arity(2)
        return Global(body[0], body[1])
    if tag == "torch":
        arity(1)
        return TorchState(body[0])
    if tag == "attr":
        arity(2)
        return Attr(sub(body[0]), body[1])
    if tag == "item":
        arity(2)
        return Item(sub(body[0]), sub(body[1]))
    if tag == "member":
        arity(3)
        return Member(sub(body[0]), body[1], body[2])
    if tag == "call":
        arity(2)
        return Call(body[0], subs(body[1]))
    if tag == "method":
        arity(3)
        return Method(sub(body[0]), body[1], subs(body[2]))
    if tag == "binop":
        arity(3)
        return BinOp(body[0], sub(body[1]), sub(body[2]))
    if tag == "const":
        arity(1)
        return Const(decode(body[0]))
    raise ValueError(f"unknown guard expression kind {tag!r}")


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
