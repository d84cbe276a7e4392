"""Symbolic sizes: integer expressions over named size symbols.

A dynamic dimension is a :class:`Sym` (``s0``) with a value range; sizes derived from it are
:class:`SizeExpr` values — polynomials with integer coefficients over symbols and over
floor-division and modulo atoms (``s0*256``, ``(s0 + 1)//2``, ``s0 % 8``). They are immutable,
hashable and kept in one canonical form, so equal expressions compare equal structurally; their
``str`` is a Python expression over the symbols' names, ready for generated code.

Tensor metadata may hold them in place of ints (``float32[s0, 8, 256]``). Arithmetic with plain
ints gives ints where the result is constant. ``int(e)`` of a non-constant expression raises
:class:`SymbolicSizeError`: code that needs a concrete size must bind the symbols first
(:meth:`SizeExpr.evaluate`). :class:`Dim` is the user's declaration of a dynamic dimension.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, Mapping, Optional, Tuple, Union

__all__ = ["Dim", "Sym", "SizeExpr", "SizeLike", "SymbolicSizeError", "sym", "as_expr", "is_symbolic",
           "free_symbols", "evaluate", "bounds", "shape_str", "c_text", "at_least_1", "sample"]

INF = math.inf


class SymbolicSizeError(TypeError):
    """A symbolic size was used where a concrete int is needed."""


class Dim:
    """A dynamic dimension as the user declares it: a name and an inclusive value range.

    ``Dim("seq", min=1, max=2048)``. The default range is 2..inf: sizes 0 and 1 are
    specialised (a dimension seen at 0 or 1 stays static), as broadcasting and empty tensors
    make code behave differently there; declare ``min=0``/``min=1`` to keep them symbolic.
    """

    __slots__ = ("name", "min", "max")

    def __init__(self, name: str, *, min: int = 2, max: Union[int, float] = INF):
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"Dim name must be a Python identifier, got {name!r}")
        if not isinstance(min, int) or min < 0:
            raise ValueError(f"Dim {name!r}: min must be an int >= 0, got {min!r}")
        if max != INF and (not isinstance(max, int) or max < min):
            raise ValueError(f"Dim {name!r}: max must be an int >= min ({min}), got {max!r}")
        self.name, self.min, self.max = name, min, max

    def __repr__(self) -> str:
        hi = "inf" if self.max == INF else self.max
        return f"Dim({self.name!r}, min={self.min}, max={hi})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Dim) and (self.name, self.min, self.max) == (other.name, other.min, other.max)

    def __hash__(self) -> int:
        return hash(("Dim", self.name, self.min, self.max))


# --------------------------------------------------------------------------- atoms
class _Atom:
    """A factor of a monomial: a symbol, or ``expr // c`` / ``expr % c`` of a non-constant expr."""

    __slots__ = ()

    def _key(self) -> tuple:
        raise NotImplementedError

    def __lt__(self, other: "_Atom") -> bool:
        return self._key() < other._key()

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


class Sym(_Atom):
    """A size symbol with an inclusive range ``lo..hi`` (``hi`` may be ``math.inf``).

    Symbols compare by name: one graph must not give two ranges to one name."""

    __slots__ = ("name", "lo", "hi")

    def __init__(self, name: str, lo: int = 2, hi: Union[int, float] = INF):
        if not name.isidentifier():
            raise ValueError(f"size symbol name must be an identifier, got {name!r}")
        self.name, self.lo, self.hi = name, lo, hi

    def _key(self) -> tuple:
        return (0, self.name)

    def text(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Sym({self.name!r}, {self.lo}, {self.hi})"


class _Div(_Atom):
    __slots__ = ("arg", "c", "op")

    def __init__(self, arg: "SizeExpr", c: int, op: str):
        self.arg, self.c, self.op = arg, c, op

    def _key(self) -> tuple:
        return (1, self.op, self.arg._terms, self.c)

    def text(self) -> str:
        bare = len(self.arg._terms) == 1 and self.arg._terms[0][1] == 1 and len(self.arg._terms[0][0]) == 1 \
            and isinstance(self.arg._terms[0][0][0][0], Sym) and self.arg._terms[0][0][0][1] == 1
        return f"{self.arg if bare else f'({self.arg})'}{self.op}{self.c}"

    def __repr__(self) -> str:
        return self.text()


# --------------------------------------------------------------------------- expressions
Monomial = Tuple[Tuple[_Atom, int], ...]   # sorted (atom, power) pairs; () is the constant term


def _mono_mul(a: Monomial, b: Monomial) -> Monomial:
    powers: Dict[_Atom, int] = dict(a)
    for atom, p in b:
        powers[atom] = powers.get(atom, 0) + p
    return tuple(sorted(powers.items(), key=lambda kv: kv[0]._key()))


class SizeExpr:
    """An integer expression over size symbols (see the module docstring). Build them from
    symbols with ``+ - * // %`` and ints; ``evaluate`` binds the symbols."""

    __slots__ = ("_terms", "_hash")

    def __init__(self, terms: Iterable[Tuple[Monomial, int]]):
        acc: Dict[Monomial, int] = {}
        for mono, coef in terms:
            acc[mono] = acc.get(mono, 0) + coef
        self._terms = tuple(sorted(((m, c) for m, c in acc.items() if c != 0),
                                   key=lambda mc: tuple(a._key() + (p,) for a, p in mc[0])))
        c = self.constant
        self._hash = hash(self._terms) if c is None else hash(c)  # equal to its int, hashed alike

    # -- queries
    @property
    def constant(self) -> Optional[int]:
        """The value if the expression has no symbols, else None."""
        if not self._terms:
            return 0
        if len(self._terms) == 1 and self._terms[0][0] == ():
            return self._terms[0][1]
        return None

    def atoms(self) -> Iterable[_Atom]:
        for mono, _ in self._terms:
            for atom, _ in mono:
                yield atom

    def free_symbols(self) -> frozenset:
        """The :class:`Sym` objects the expression depends on (through ``//`` and ``%`` too)."""
        out = set()
        for atom in self.atoms():
            out |= {atom} if isinstance(atom, Sym) else atom.arg.free_symbols()
        return frozenset(out)

    def evaluate(self, env: Mapping[str, int]) -> int:
        """The value with each symbol's name bound by ``env``."""
        total = 0
        for mono, coef in self._terms:
            v = coef
            for atom, p in mono:
                v *= _atom_value(atom, env) ** p
            total += v
        return total

    def subs(self, env: Mapping[str, "SizeLike"]) -> "SizeLike":
        """Substitute some symbols by ints or expressions (others stay)."""
        total: SizeLike = 0
        for mono, coef in self._terms:
            v: SizeLike = coef
            for atom, p in mono:
                if isinstance(atom, Sym):
                    base = env.get(atom.name, _of_atom(atom))
                else:
                    inner = atom.arg.subs(env)
                    base = inner // atom.c if atom.op == "//" else inner % atom.c
                for _ in range(p):
                    v = v * base
            total = total + v
        return total

    # -- arithmetic
    def __add__(self, other):
        o = _coerce(other)
        return NotImplemented if o is None else _simplify(SizeExpr(self._terms + o._terms))

    __radd__ = __add__

    def __neg__(self):
        return SizeExpr((m, -c) for m, c in self._terms)

    def __sub__(self, other):
        o = _coerce(other)
        return NotImplemented if o is None else self + (-o)

    def __rsub__(self, other):
        o = _coerce(other)
        return NotImplemented if o is None else o + (-self)

    def __mul__(self, other):
        o = _coerce(other)
        if o is None:
            return NotImplemented
        return _simplify(SizeExpr((_mono_mul(m1, m2), c1 * c2) for m1, c1 in self._terms for m2, c2 in o._terms))

    __rmul__ = __mul__

    def __floordiv__(self, other):
        return _divmod(self, other, "//")

    def __mod__(self, other):
        return _divmod(self, other, "%")

    def __rfloordiv__(self, other):
        raise SymbolicSizeError(f"{other!r} // ({self}): dividing by a symbolic size is not supported")

    def __rmod__(self, other):
        raise SymbolicSizeError(f"{other!r} % ({self}): modulo by a symbolic size is not supported")

    # -- conversions
    def __int__(self) -> int:
        c = self.constant
        if c is None:
            raise SymbolicSizeError(f"the size {self} is symbolic: it has no int value until "
                                    f"{', '.join(sorted(s.name for s in self.free_symbols()))} are bound")
        return c

    __index__ = __int__

    def __eq__(self, other) -> bool:
        if isinstance(other, SizeExpr):
            return self._terms == other._terms
        if isinstance(other, int) and not isinstance(other, bool):
            return self.constant == other
        return NotImplemented

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        if not self._terms:
            return "0"
        parts = []
        for mono, coef in sorted(self._terms, key=lambda mc: mc[0] == ()):  # constant last
            # a // or % atom stands alone, or in parentheses: a*b//c, -a//c and a//c**2 would
            # group differently in Python
            alone = len(mono) == 1 and mono[0][1] == 1 and coef == 1
            factors = [(a.text() if alone or isinstance(a, Sym) else f"({a.text()})") + (f"**{p}" if p > 1 else "")
                       for a, p in mono]
            if not factors:
                parts.append((coef < 0, str(abs(coef))))
                continue
            if abs(coef) != 1:
                factors.append(str(abs(coef)))
            parts.append((coef < 0, "*".join(factors)))
        neg, first = parts[0]
        text = ("-" if neg else "") + first
        for neg, p in parts[1:]:
            text += (" - " if neg else " + ") + p
        return text

    def __repr__(self) -> str:
        return f"SizeExpr({self})"

    def __reduce__(self):  # rebuilt, so the cached hash is this process's
        return (SizeExpr, (self._terms,))


SizeLike = Union[int, SizeExpr]


def _of_atom(atom: _Atom) -> SizeExpr:
    return SizeExpr([(((atom, 1),), 1)])


def _atom_value(atom: _Atom, env: Mapping[str, int]) -> int:
    if isinstance(atom, Sym):
        try:
            return int(env[atom.name])
        except KeyError:
            raise SymbolicSizeError(f"no value bound for size symbol {atom.name}") from None
    v = atom.arg.evaluate(env)
    return v // atom.c if atom.op == "//" else v % atom.c


def _coerce(x) -> Optional[SizeExpr]:
    if isinstance(x, SizeExpr):
        return x
    if isinstance(x, int) and not isinstance(x, bool):
        return SizeExpr([((), x)]) if x else SizeExpr(())
    return None


def _simplify(e: SizeExpr) -> SizeLike:
    c = e.constant
    return e if c is None else c


def _divmod(e: SizeExpr, other, op: str) -> SizeLike:
    if isinstance(other, SizeExpr):
        if other.constant is None:
            raise SymbolicSizeError(f"({e}) {op} ({other}): dividing by a symbolic size is not supported")
        other = other.constant
    if not isinstance(other, int) or isinstance(other, bool):
        return NotImplemented
    if other <= 0:
        raise SymbolicSizeError(f"({e}) {op} {other}: sizes are divided by positive ints only")
    if other == 1:
        return e if op == "//" else 0
    if all(c % other == 0 for _, c in e._terms):
        return _simplify(SizeExpr((m, c // other) for m, c in e._terms)) if op == "//" else 0
    # split off the multiples of ``other``: (q*c + r) // c == q + r // c (exact, floor semantics)
    whole = [(m, c - c % other) for m, c in e._terms]
    rest = SizeExpr((m, c % other) for m, c in e._terms)
    rc = rest.constant
    if rc is not None:  # only a constant remainder: fold it
        q = _simplify(SizeExpr((m, c // other) for m, c in whole))
        return q + rc // other if op == "//" else rc % other
    if op == "%":
        return _of_atom(_Div(rest, other, "%"))
    q = SizeExpr((m, c // other) for m, c in whole)
    return _simplify(q + _of_atom(_Div(rest, other, "//")))


# --------------------------------------------------------------------------- helpers
def sym(name: str, lo: int = 2, hi: Union[int, float] = INF) -> SizeExpr:
    """A size expression that is the symbol ``name`` (range ``lo..hi``)."""
    return SizeExpr([(((Sym(name, lo, hi), 1),), 1)])


def as_expr(x: SizeLike) -> SizeExpr:
    """``x`` as a :class:`SizeExpr` (ints become constants)."""
    e = _coerce(x)
    if e is None:
        raise TypeError(f"expected an int or a SizeExpr, got {type(x).__name__}")
    return e


def is_symbolic(x) -> bool:
    """Whether ``x`` is (or, for a shape, contains) a size that depends on a symbol."""
    if isinstance(x, SizeExpr):
        return x.constant is None
    if isinstance(x, (tuple, list)):
        return any(is_symbolic(d) for d in x)
    return False


def free_symbols(x) -> frozenset:
    """The symbols a size or a shape depends on."""
    if isinstance(x, SizeExpr):
        return x.free_symbols()
    if isinstance(x, (tuple, list)):
        out = frozenset()
        for d in x:
            out |= free_symbols(d)
        return out
    return frozenset()


def evaluate(x, env: Mapping[str, int]):
    """A size or shape with its symbols bound by ``env`` (ints pass through)."""
    if isinstance(x, SizeExpr):
        return x.evaluate(env)
    if isinstance(x, (tuple, list)):
        return type(x)(evaluate(d, env) for d in x)
    return x


def bounds(x: SizeLike) -> Tuple[Union[int, float], Union[int, float]]:
    """An inclusive range holding every value of ``x`` over its symbols' ranges (interval
    arithmetic: sound, not always tight)."""
    if not isinstance(x, SizeExpr):
        return (x, x)
    lo_sum: Union[int, float] = 0
    hi_sum: Union[int, float] = 0
    for mono, coef in x._terms:
        lo, hi = coef, coef
        for atom, p in mono:
            alo, ahi = _atom_bounds(atom)
            for _ in range(p):
                lo, hi = _imul((lo, hi), (alo, ahi))
        lo_sum, hi_sum = lo_sum + lo, hi_sum + hi
    return lo_sum, hi_sum


def _atom_bounds(atom: _Atom):
    if isinstance(atom, Sym):
        return atom.lo, atom.hi
    lo, hi = bounds(atom.arg)
    if atom.op == "%":
        return (0, atom.c - 1)
    f = (lambda v: v if v in (INF, -INF) else v // atom.c)
    return f(lo), f(hi)


def _imul(a, b):
    prods = []
    for x in a:
        for y in b:
            prods.append(0 if (x == 0 or y == 0) else x * y)
    return min(prods), max(prods)


def shape_str(shape) -> str:
    """``[s0, 8, 256]`` — a shape whose sizes may be symbolic, as printed in tables."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


def c_text(x: SizeLike, *, cast: str = "(int64_t)", div: str = "/") -> str:
    """``x`` as a C expression of type ``int64_t`` over its symbols (``int64_t`` variables of the
    same names). ``//`` and ``%`` become C's ``/`` and ``%``, equal to Python's for the
    non-negative arguments sizes have. ``cast=""``, ``div="//"``: the same for Triton (no
    ``**``, which ``str`` writes)."""
    if not isinstance(x, SizeExpr):
        return str(int(x))
    c = x.constant
    if c is not None:
        return str(c)
    parts = []
    for mono, coef in x._terms:
        factors = []
        for atom, p in mono:
            t = atom.name if isinstance(atom, Sym) else \
                f"({c_text(atom.arg, cast=cast, div=div)} {div if atom.op == '//' else '%'} {atom.c})"
            factors.extend([t] * p)
        if not factors:
            parts.append(f"{cast}{coef}")
            continue
        parts.append("*".join(([f"{cast}{coef}"] if coef != 1 else []) + factors))
    return "(" + " + ".join(parts) + ")"


def at_least_1(x: SizeLike) -> SizeLike:
    """``max(x, 1)`` for a size: ``x`` itself when it is symbolic and its range starts at 1 or
    more (raises :class:`SymbolicSizeError` when the range includes 0)."""
    if not isinstance(x, SizeExpr):
        return max(x, 1)
    if bounds(x)[0] >= 1:
        return x
    raise SymbolicSizeError(f"max({x}, 1) of a size that may be 0")


#: the value :func:`sample` gives every symbol
SAMPLE_VALUE = 4099


def sample(x: SizeLike) -> int:
    """``x`` at a large sample size (every symbol at :data:`SAMPLE_VALUE`, clipped to its
    range): an ordering key for heuristics (which stride is the outer one) whose conclusions
    are then checked symbolically."""
    if not isinstance(x, SizeExpr):
        return x
    return x.evaluate({s.name: int(min(max(SAMPLE_VALUE, s.lo), s.hi)) for s in x.free_symbols()})
