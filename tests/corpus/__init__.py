"""An acceptance corpus of programs taken from PyTorch's own test suites.

Each ``programs_*.py`` module holds self-contained eager PyTorch programs extracted from one
(or a few) of PyTorch's test files -- the ``fn``/``forward`` bodies those tests compile --
each registered with :func:`program` together with 2-4 input sets that flip what its Python
depends on (values, shapes, dtypes, requires_grad, keyword arguments), an optional state flip
(``"eval"``, ``"train"``, ``{"attr.path": value}`` or a callable), and the test it came from as
a comment line right above it::

    # pytorch test/dynamo/test_functions.py::FunctionTests::test_dtype_compare
    @program(In(r(3)), In(r(3, dtype=torch.float16)))
    def dtype_compare(a, b): ...

The comment is the program's ``origin`` (read with :func:`inspect.getcomments`). Nothing here
is a test: ``tests/test_corpus.py`` runs the corpus under pytest, ``benchmarks/soundness_bench.py``
compares tools on it, and :mod:`tests.corpus.runner` runs one program in one mode.
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["In", "Fresh", "Program", "program", "add", "load_programs", "r", "t", "MODULES"]

#: the corpus modules, in order (one per group of PyTorch test files)
MODULES = ("programs_functions", "programs_misc", "programs_repros", "programs_modules", "programs_fx")


class In:
    """One call: positional and keyword arguments, optionally run under ``torch.no_grad()``."""

    def __init__(self, *args, **kwargs):
        self.args = args
        self.kwargs = kwargs
        self.grad = True

    def no_grad(self) -> "In":
        self.grad = False
        return self

    def __repr__(self):
        return f"In({len(self.args)} args, {sorted(self.kwargs)}{', no_grad' if not self.grad else ''})"


class Fresh:
    """An input made anew for every call (an iterator, a generator): ``Fresh(lambda: iter(...))``."""

    def __init__(self, make: Callable[[], Any]):
        self.make = make

    def __repr__(self):
        return "Fresh(...)"


@dataclass
class Program:
    name: str
    make: Callable[[], Any]  # a fresh nn.Module, or the function
    inputs: List[In]  # inputs[0] is the example the strict (traced) mode specialises on
    origin: str  # "test/dynamo/test_misc.py::MiscTests::test_foo"
    # a state change, after which all inputs run again: "eval" | "train" | {"attr.path": value}
    # (a class as value: a fresh instance) | callable(model) (one model: its hooks, parameters;
    # skipped for separate graph modules) | callable() (module globals, listed in ``globals``)
    flip: Any = None
    random: bool = False  # compared under torch / python seeds (RNG state carried from call to call)
    globals: Tuple[str, ...] = ()  # module globals the program reads or writes: reset between runs
    module: str = ""  # the corpus module that defines it (for ``globals``)
    refused: Optional[str] = None  # capture may refuse it at trace time (TraceError), by design: why
    remake: bool = False  # the eager copy is made by calling ``make`` again (not deepcopy)

    def __repr__(self):
        return self.name


_REGISTRY: Dict[str, List[Program]] = {}
_ORIGIN = re.compile(r"#\s*pytorch\s+(\S+)")


def _origin(obj: Any) -> str:
    comments = inspect.getcomments(obj) or ""
    found = _ORIGIN.findall(comments)
    if not found:
        raise ValueError(f"{obj!r}: no '# pytorch test/...::Class::test' origin comment above it")
    return found[-1]


def program(*inputs: In, name: Optional[str] = None, flip: Any = None, random: bool = False,
            globals: Sequence[str] = (), refused: Optional[str] = None, factory: bool = False,
            origin: Optional[str] = None):
    """Register the decorated function or ``nn.Module`` class as a program.

    A class is instantiated afresh for every run; a function is used as it is, unless
    ``factory=True``: then calling it returns the program (for closures with state).
    """
    def deco(obj):
        if isinstance(obj, type):
            make = obj
        elif factory:
            make = obj
        else:
            make = lambda: obj  # noqa: E731
        add(Program(name or obj.__name__, make, list(inputs), origin or _origin(obj), flip, random,
                    tuple(globals), obj.__module__, refused, remake=factory))
        return obj
    return deco


def add(p: Program) -> Program:
    if not p.module:
        p.module = inspect.stack()[1].frame.f_globals.get("__name__", "")
    assert len(p.inputs) >= 1, p.name
    _REGISTRY.setdefault(p.module, []).append(p)
    return p


def load_programs() -> List[Program]:
    """Every program of the corpus (importing the ``programs_*`` modules); names are unique."""
    out: List[Program] = []
    for m in MODULES:
        mod = importlib.import_module(f"{__name__}.{m}")
        out.extend(_REGISTRY.get(mod.__name__, []))
    names = [p.name for p in out]
    dup = {n for n in names if names.count(n) > 1}
    assert not dup, f"duplicate program names: {sorted(dup)}"
    return out


# --- small deterministic tensors -----------------------------------------------------------------
def r(*shape, seed: int = 0, dtype=torch.float32, requires_grad: bool = False) -> torch.Tensor:
    """A seeded normal tensor (own generator: building the corpus draws no global random numbers)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if dtype.is_floating_point:
        x = x.to(dtype)
    else:
        x = (x * 4).round().to(dtype)
    return x.requires_grad_() if requires_grad else x


def t(*vals, dtype=torch.float32, requires_grad: bool = False) -> torch.Tensor:
    x = torch.tensor(vals, dtype=dtype)
    return x.requires_grad_() if requires_grad else x


CORPUS_DIR = os.path.dirname(os.path.abspath(__file__))
