"""Python values (node arguments, meta, guard values, module attributes) as tagged JSON.

``None``, bools, ints, finite floats and strings are themselves; a list is a JSON array; a
dict whose keys are strings not starting with ``$`` is a JSON object. Everything else is an
object with exactly one ``$``-key (see docs/file_format.md): ``{"$tuple": [...]}``,
``{"$node": 3}``, ``{"$tensor": 0}``, ``{"$ref": "torch.relu"}`` (a function or class, resolved
through the allow-list on load), ``{"$dtype": "float32"}`` ... Decoding accepts nothing else.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Callable, Dict, List, Optional

import torch

from ..graph.guard_expr import GExpr, from_record
from ..graph.guards import Guard
from ..graph.node import Node, TensorMeta
from ..graph.code_text import CONTROL_CHARS, one_line
from ..graph.source import SourceLocation
from .allowlist import how_to_register, is_value_name, name_of, resolve, _REGISTERED, _REGISTERED_IDS
from .errors import SerializationError, Unencodable
from .legacy_guards import guard_expr_from_text
from .tensors import TensorReader, TensorWriter, dtype_name, parse_device, parse_dtype

__all__ = ["Unencodable", "Encoder", "Decoder", "ENTRY_CHECKS", "DATA_CHECKS", "decode_tensor_meta", "make_location",
           "location_record"]

ENTRY_CHECKS = frozenset({"eq", "is", "isinstance", "type", "bool"})
DATA_CHECKS = frozenset({"eq", "is", "bool", "int", "float", "tolist"})
_MEMORY_FORMATS = {n: getattr(torch, n) for n in ("contiguous_format", "channels_last", "channels_last_3d",
                                                  "preserve_format")}
_LAYOUTS = {n: getattr(torch, n) for n in ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr",
                                           "sparse_bsc", "_mkldnn", "jagged") if hasattr(torch, n)}
_MF_NAMES = {v: k for k, v in _MEMORY_FORMATS.items()}
_LAYOUT_NAMES = {v: k for k, v in _LAYOUTS.items()}
_PLAIN = (str, int, bool, type(None))
MAX_DEPTH = 100
MAX_LOCATION_TEXT = 4096  # characters of a source location's file, function or line text


class Encoder:
    """Turns values into tagged JSON. ``nodes`` maps graph nodes to their index (None: nodes
    are not allowed here); ``tensors`` collects tensors (None: tensors not allowed)."""

    def __init__(self, tensors: Optional[TensorWriter] = None, nodes: Optional[Dict[Node, int]] = None):
        self.tensors = tensors
        self.nodes = nodes

    def __call__(self, v: Any, where: str, depth: int = 0) -> Any:
        t = type(v)
        if t in _PLAIN:
            return v
        if t is float:
            return v if math.isfinite(v) else {"$float": repr(v)}
        if depth > MAX_DEPTH:
            raise Unencodable(f"{where}: the value is nested more than {MAX_DEPTH} levels deep")
        d = depth + 1
        if t is Node:
            if self.nodes is None or v not in self.nodes:
                raise Unencodable(f"{where}: refers to the node {v.name!r}, which is not in this graph")
            return {"$node": self.nodes[v]}
        if t is list:
            return [self(x, where, d) for x in v]
        if t is tuple:
            return {"$tuple": [self(x, where, d) for x in v]}
        if t is dict:
            if all(type(k) is str and not k.startswith("$") for k in v):
                return {k: self(x, where, d) for k, x in v.items()}
            return {"$dict": [[self(k, where, d), self(x, where, d)] for k, x in v.items()]}
        if t is slice:
            return {"$slice": [self(v.start, where, d), self(v.stop, where, d), self(v.step, where, d)]}
        if v is Ellipsis:
            return {"$ellipsis": None}
        if t is complex:
            return {"$complex": [self(v.real, where, d), self(v.imag, where, d)]}
        if t is torch.dtype:
            return {"$dtype": dtype_name(v)}
        if t is torch.device:
            return {"$device": str(v)}
        if t is torch.Size:
            return {"$size": _ints(v, where)}
        if t is torch.memory_format and v in _MF_NAMES:
            return {"$memory_format": _MF_NAMES[v]}
        if t is torch.layout and v in _LAYOUT_NAMES:
            return {"$layout": _LAYOUT_NAMES[v]}
        if t is set or t is frozenset:
            return {"$" + t.__name__: [self(x, where, d) for x in v]}
        if t is SourceLocation:
            return {"$loc": location_record(v)}
        if t is TensorMeta:
            return {"$tmeta": {"shape": _ints(v.shape, where), "dtype": dtype_name(v.dtype), "device": str(v.device),
                               "stride": _ints(v.stride, where), "requires_grad": bool(v.requires_grad),
                               "qparams": self(v.qparams, where, d)}}
        if t is Guard:
            return {"$guard": self.guard(v, where, d)}
        if isinstance(v, torch.Tensor):
            if self.tensors is None:
                raise Unencodable(f"{where}: a tensor cannot be stored here")
            return {"$tensor": self.tensors.add(v, where)}
        if isinstance(v, tuple) and hasattr(t, "_fields"):
            return {"$namedtuple": [self._class_ref(t, where), [self(x, where, d) for x in v]]}
        if isinstance(v, enum.Enum):
            return {"$enum": [self._class_ref(t, where), v.name]}
        if isinstance(v, torch.nn.Module):
            raise Unencodable(f"{where}: a module object ({t.__qualname__}) can only be saved as a submodule")
        if callable(v) or isinstance(v, type):
            name = name_of(v)
            if name is None:
                raise Unencodable(f"{where}: {_describe(v)} is not on the allow-list of loadable objects; "
                                  f"{how_to_register(v)}")
            if not is_value_name(name):
                raise Unencodable(f"{where}: {name} may be called by a graph but cannot be stored as a value")
            return {"$ref": name}
        if id(t) in _REGISTERED_IDS and hasattr(v, "__dict__"):
            state = vars(v)
            if not all(type(k) is str and k.isidentifier() and not k.startswith("__") for k in state):
                raise Unencodable(f"{where}: a {t.__qualname__} object with attribute names that are not "
                                  "identifiers or are dunders")
            return {"$object": [_REGISTERED_IDS[id(t)], {k: self(x, f"{where}.{k}", d) for k, x in state.items()}]}
        hint = f"; {how_to_register(t)} (instances are rebuilt from their __dict__)" \
            if hasattr(v, "__dict__") or dataclasses.is_dataclass(v) else ""
        raise Unencodable(f"{where}: a {t.__module__}.{t.__qualname__} object cannot be saved{hint}")

    def _class_ref(self, cls: type, where: str) -> str:
        name = name_of(cls)
        if name is None:
            raise Unencodable(f"{where}: the class {cls.__module__}.{cls.__qualname__} is not on the allow-list; "
                              f"{how_to_register(cls)}")
        return name

    def guard(self, g: Guard, where: str, depth: int = 0) -> dict:
        """A guard's record; an entry guard's expression is stored as its tree, never as text."""
        where = f"{where} (guard {str(g.expr)!r})"
        if isinstance(g.expr, GExpr):
            expr = g.expr.to_record(lambda v: self(v, where, depth + 2))
        elif isinstance(g.expr, str):
            expr = g.expr  # a data guard's description
        else:
            raise Unencodable(f"{where}: a guard expression of type {type(g.expr).__name__}")
        return {"kind": g.kind, "expr": expr, "expected": self(g.expected, where, depth + 1),
                "check": g.check, "source": self(g.source, where, depth + 1), "reason": g.reason}


def _ints(seq: Any, where: Any) -> list:
    out = list(seq)
    if not all(type(x) is int for x in out):
        raise Unencodable(f"{where}: tensor metadata with symbolic or non-integer sizes cannot be saved")
    return out


def _describe(v: Any) -> str:
    mod = getattr(v, "__module__", None) or ""
    name = getattr(v, "__qualname__", None) or getattr(v, "__name__", None) or type(v).__name__
    kind = "the class" if isinstance(v, type) else "the function" if callable(v) else "the object"
    return f"{kind} {mod + '.' if mod else ''}{name}"


class Decoder:
    """Turns tagged JSON back into values, accepting only what :class:`Encoder` writes."""

    def __init__(self, tensors: Optional[TensorReader] = None, nodes: Optional[List[Node]] = None):
        self.tensors = tensors
        self.nodes = nodes

    def __call__(self, v: Any, where: Any, depth: int = 0) -> Any:
        t = type(v)
        if t in _PLAIN or t is float:
            return v
        if t is dict and len(v) == 1 and self.nodes is not None:
            ref = v.get("$node")
            if type(ref) is int and 0 <= ref < len(self.nodes):
                return self.nodes[ref]
        if depth > MAX_DEPTH:
            raise SerializationError(f"{where}: a value is nested more than {MAX_DEPTH} levels deep")
        d = depth + 1
        if t is list:
            return [self(x, where, d) for x in v]
        if t is not dict:
            raise SerializationError(f"{where}: unexpected JSON value {_short(v)}")
        if len(v) == 1:
            (tag, body), = v.items()
            if tag.startswith("$"):
                fn = _TAGS.get(tag)
                if fn is None:
                    raise SerializationError(f"{where}: unknown value tag {tag!r}")
                return fn(self, body, where, d)
        if any(k.startswith("$") for k in v):
            raise SerializationError(f"{where}: a plain dict holds a '$' key ({sorted(v)[:3]})")
        return {k: self(x, where, d) for k, x in v.items()}

    def items(self, body: Any, where: str, d: int, n: Optional[int] = None) -> list:
        if not isinstance(body, list) or (n is not None and len(body) != n):
            raise SerializationError(f"{where}: expected a list{'' if n is None else f' of {n}'}, got {_short(body)}")
        return [self(x, where, d) for x in body]

    def guard(self, body: Any, where: str, d: int = 0, checks=DATA_CHECKS, inputs: Optional[List[str]] = None,
              legacy: bool = False) -> Guard:
        """A guard from its record. With ``inputs`` (the graph's input names) it is an entry
        guard, whose expression is a tree rebuilt through the checking constructors of
        :mod:`symtrace.graph.guard_expr` (``legacy``: version-1 text, converted the same way);
        otherwise a data guard, whose expression is a one-line description."""
        if not isinstance(body, dict):
            raise SerializationError(f"{where}: a guard record is not an object")
        kind, expr, check, reason = body.get("kind"), body.get("expr"), body.get("check"), body.get("reason", "")
        if not all(isinstance(s, str) for s in (kind, check, reason)):
            raise SerializationError(f"{where}: guard kind/check/reason must be strings")
        if inputs is None:
            if not isinstance(expr, str):
                raise SerializationError(f"{where}: a data guard's description must be a string")
            expr = one_line(expr)
        elif legacy and isinstance(expr, str):
            expr = guard_expr_from_text(expr, inputs, where)
        else:
            try:
                expr = from_record(expr, lambda v: self(v, where, d + 1), set(inputs))
            except (ValueError, TypeError) as e:
                raise SerializationError(f"{where}: refusing the guard expression: {e}") from None
        if check not in checks:
            raise SerializationError(f"{where}: unknown guard check {check!r} (expected one of {sorted(checks)})")
        source = self(body.get("source"), where, d)
        if source is not None and type(source) is not SourceLocation:
            raise SerializationError(f"{where}: a guard's source must be a source location")
        expected = self(body.get("expected"), where, d)
        if check in ("isinstance", "type") and not (isinstance(expected, type) or (
                isinstance(expected, tuple) and expected and all(isinstance(e, type) for e in expected))):
            raise SerializationError(f"{where}: a {check} guard must expect a class, got {_short(expected)}")
        return Guard(kind, expr, expected, check, source, reason)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _node(dec: Decoder, body: Any, where: str, d: int) -> Any:
    if dec.nodes is None:
        raise SerializationError(f"{where}: a node reference is not allowed here")
    if type(body) is not int or not 0 <= body < len(dec.nodes):
        raise SerializationError(f"{where}: the node reference {body!r} does not name an earlier node")
    return dec.nodes[body]


def _float(dec: Decoder, body: Any, where: str, d: int) -> float:
    if body not in ("nan", "inf", "-inf"):
        raise SerializationError(f"{where}: bad special float {body!r}")
    return float(body)


def _dict(dec: Decoder, body: Any, where: str, d: int) -> dict:
    if not isinstance(body, list):
        raise SerializationError(f"{where}: $dict must hold a list of pairs")
    out = {}
    for pair in body:
        k, x = dec.items(pair, where, d, 2)
        try:
            out[k] = x
        except TypeError:
            raise SerializationError(f"{where}: unhashable dict key {_short(k)}") from None
    return out


def _set(kind: type) -> Callable:
    def build(dec: Decoder, body: Any, where: str, d: int):
        try:
            return kind(dec.items(body, where, d))
        except TypeError:
            raise SerializationError(f"{where}: unhashable item in a {kind.__name__}") from None
    return build


def _slice(dec: Decoder, body: Any, where: str, d: int) -> slice:
    return slice(*dec.items(body, where, d, 3))


def _complex(dec: Decoder, body: Any, where: str, d: int) -> complex:
    re_, im = dec.items(body, where, d, 2)
    if type(re_) not in (int, float) or type(im) not in (int, float):
        raise SerializationError(f"{where}: $complex needs two numbers")
    return complex(re_, im)


def _size(dec: Decoder, body: Any, where: str, d: int) -> torch.Size:
    if not isinstance(body, list) or not all(type(x) is int for x in body):
        raise SerializationError(f"{where}: $size needs a list of ints")
    return torch.Size(body)


def _named(table: dict, what: str) -> Callable:
    def build(dec: Decoder, body: Any, where: str, d: int):
        if not isinstance(body, str) or body not in table:
            raise SerializationError(f"{where}: unknown {what} {body!r}")
        return table[body]
    return build


def _tensor(dec: Decoder, body: Any, where: str, d: int) -> torch.Tensor:
    if dec.tensors is None:
        raise SerializationError(f"{where}: a tensor reference is not allowed here")
    return dec.tensors.get(body, where)


def _ref(dec: Decoder, body: Any, where: str, d: int) -> Any:
    obj = resolve(body, f"object (at {where})")
    if not is_value_name(body):  # reads attributes by a runtime name or calls what it is given
        raise SerializationError(f"{where}: {body!r} may be a call target but not a stored value")
    return obj


def _class(name: Any, where: str) -> type:
    cls = resolve(name, f"class (at {where})")
    if not isinstance(cls, type):
        raise SerializationError(f"{where}: {name!r} is not a class")
    return cls


def _namedtuple(dec: Decoder, body: Any, where: str, d: int) -> tuple:
    if not isinstance(body, list) or len(body) != 2:
        raise SerializationError(f"{where}: $namedtuple needs [class, fields]")
    cls = _class(body[0], where)
    fields = dec.items(body[1], where, d)
    if not (issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple)
            and len(cls._fields) == len(fields)):
        raise SerializationError(f"{where}: {body[0]!r} is not a namedtuple class with {len(fields)} fields")
    return cls(*fields)


def _enum(dec: Decoder, body: Any, where: str, d: int) -> enum.Enum:
    if not isinstance(body, list) or len(body) != 2 or not isinstance(body[1], str):
        raise SerializationError(f"{where}: $enum needs [class, member name]")
    cls = _class(body[0], where)
    member = cls.__members__.get(body[1]) if issubclass(cls, enum.Enum) else None
    if member is None:
        raise SerializationError(f"{where}: {body[0]!r} has no enum member {body[1]!r}")
    return member


def _object(dec: Decoder, body: Any, where: str, d: int) -> Any:
    if not isinstance(body, list) or len(body) != 2 or not isinstance(body[1], dict):
        raise SerializationError(f"{where}: $object needs [class, attributes]")
    name = body[0]
    cls = _REGISTERED.get(name) if isinstance(name, str) else None
    if not isinstance(cls, type):
        raise SerializationError(f"{where}: objects can only be rebuilt for registered classes, not {name!r}; "
                                 f"{how_to_register(name=str(name))}")
    if not all(k.isidentifier() and not k.startswith("__") for k in body[1]):
        raise SerializationError(f"{where}: $object attribute names must be identifiers, not dunders")
    state = {k: dec(x, where, d) for k, x in body[1].items()}
    obj = cls.__new__(cls)
    try:
        obj.__dict__.update(state)
    except AttributeError:
        raise SerializationError(f"{where}: instances of {name!r} have no __dict__ to restore") from None
    return obj


def _loc(dec: Decoder, body: Any, where: str, d: int) -> SourceLocation:
    return make_location(body, where)


def location_record(loc: SourceLocation) -> list:
    """``[file, line, function, text]``: the line's text as the saving machine sees it, so the
    loader never has to read ``file`` (each string made one line, as :func:`make_location` wants)."""
    return [one_line(loc.filename, MAX_LOCATION_TEXT), loc.lineno, one_line(loc.function, MAX_LOCATION_TEXT),
            one_line(loc.line(), MAX_LOCATION_TEXT)]


def make_location(body: Any, where: str) -> SourceLocation:
    """A SourceLocation from ``[file, line, function, text]`` (``text`` is ``""`` for files
    written without it). The result always has ``text`` set, so nothing ever reads the path the
    file names. File and function names become comments in generated code: control characters
    and line breaks in them are refused, as are names longer than ``MAX_LOCATION_TEXT``; the
    text has its control characters replaced and is clipped."""
    if not (isinstance(body, list) and len(body) in (3, 4) and isinstance(body[0], str) and type(body[1]) is int
            and isinstance(body[2], str) and (len(body) == 3 or isinstance(body[3], str))):
        raise SerializationError(f"{where}: a source location must be [file, line, function, text]")
    filename, lineno, function = body[0], body[1], body[2]
    if CONTROL_CHARS.search(filename) or CONTROL_CHARS.search(function):
        raise SerializationError(f"{where}: a source location's file or function name holds a line break "
                                 "or control character")
    if len(filename) > MAX_LOCATION_TEXT or len(function) > MAX_LOCATION_TEXT or not 0 <= lineno < 1 << 31:
        raise SerializationError(f"{where}: a source location's file or function name is longer than "
                                 f"{MAX_LOCATION_TEXT} characters, or its line number is out of range")
    text = one_line(body[3], MAX_LOCATION_TEXT).strip() if len(body) == 4 else ""
    return SourceLocation(filename, lineno, function, text)


def _tmeta(dec: Decoder, body: Any, where: str, d: int) -> TensorMeta:
    return decode_tensor_meta(dec, body, where, d)


def decode_tensor_meta(dec: Decoder, body: Any, where: str, d: int) -> TensorMeta:
    """A TensorMeta from its record (the body of a ``$tmeta`` value)."""
    if not isinstance(body, dict):
        raise SerializationError(f"{where}: tensor metadata must be an object")
    shape, stride = body.get("shape"), body.get("stride", [])
    if not (isinstance(shape, list) and isinstance(stride, list) and all(type(x) is int for x in shape + stride)):
        raise SerializationError(f"{where}: tensor metadata needs integer shape and stride lists")
    rg = body.get("requires_grad", False)
    if type(rg) is not bool:
        raise SerializationError(f"{where}: tensor metadata requires_grad must be a bool")
    qparams = dec(body.get("qparams"), where, d)
    if qparams is not None and not isinstance(qparams, dict):
        raise SerializationError(f"{where}: tensor metadata qparams must be a dict or null")
    return TensorMeta(tuple(shape), parse_dtype(body.get("dtype"), where), parse_device(body.get("device"), where),
                      tuple(stride), rg, qparams)


_TAGS = {
    "$tuple": lambda dec, b, w, d: tuple(dec.items(b, w, d)),
    "$node": _node, "$float": _float, "$dict": _dict, "$set": _set(set), "$frozenset": _set(frozenset),
    "$slice": _slice, "$ellipsis": lambda dec, b, w, d: Ellipsis, "$complex": _complex,
    "$dtype": lambda dec, b, w, d: parse_dtype(b, w), "$device": lambda dec, b, w, d: parse_device(b, w),
    "$size": _size, "$memory_format": _named(_MEMORY_FORMATS, "memory format"),
    "$layout": _named(_LAYOUTS, "layout"), "$tensor": _tensor, "$ref": _ref, "$namedtuple": _namedtuple,
    "$enum": _enum, "$object": _object, "$loc": _loc, "$tmeta": _tmeta,
    "$guard": lambda dec, b, w, d: dec.guard(b, w, d),
}
