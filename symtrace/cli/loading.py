"""Turn command-line text into objects: a model spec into an ``nn.Module`` (or a saved
GraphModule), ``--input`` strings into example tensors, and both into a traced GraphModule.

Model specs: ``package.module:factory``, ``path/to/file.py:factory`` (``factory`` may be
dotted, ``module:Class.build``; it is called with no arguments, or used as is when it is
already an ``nn.Module``), or ``saved.symtrace``: a GraphModule written with
``symtrace.save(gm, path)``, read with ``symtrace.load`` (which never runs code from the file;
pickles and ``torch.save`` files are refused with a message saying how to re-save them).

Input specs: ``SHAPE[:DTYPE]`` with ``SHAPE`` the sizes joined by ``x`` (``1x3x32x32``) or
``scalar`` for a 0-d tensor, and ``DTYPE`` a torch dtype name (default ``float32``).
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import os
import sys
import zipfile
from typing import Any, Callable, List, Optional, Sequence, Tuple

from .errors import CliError, ExitCode, describe_exception

__all__ = ["InputSpec", "parse_input", "make_inputs", "load_model", "load_target", "trace_model",
           "SAVED_SUFFIXES", "is_saved_spec"]

#: File suffixes read as saved GraphModules instead of model specs (``.symtrace`` is what
#: ``symtrace.save`` files are called; the others are recognised to explain that pickles are refused).
SAVED_SUFFIXES = (".symtrace", ".pt", ".pth", ".pkl", ".pickle")

SPEC_HELP = ("package.module:factory, path/to/file.py:factory, or a GraphModule saved with "
             "symtrace.save (e.g. model.symtrace)")


# --- inputs --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One ``--input``: a shape and a torch dtype."""

    shape: Tuple[int, ...]
    dtype: Any  # torch.dtype; torch is imported lazily

    def __str__(self) -> str:
        shape = "x".join(map(str, self.shape)) if self.shape else "scalar"
        return f"{shape}:{str(self.dtype).replace('torch.', '')}"


def _dtype(name: str, text: str):
    import torch
    dt = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dt, torch.dtype):
        raise CliError(ExitCode.USAGE, f"{text!r}: {name!r} is not a torch dtype "
                                       "(try float32, float16, bfloat16, int64, int32, bool)")
    return dt


def _is_shape(text: str) -> bool:
    return text == "scalar" or all(p.strip().isdigit() for p in text.split("x"))


def parse_input(text: str) -> InputSpec:
    """Parse ``SHAPE[:DTYPE]`` (``1x3x32x32``, ``8x128:int64``, ``scalar:float64``)."""
    shape_text, sep, dtype_text = text.strip().partition(":")
    example = "write it as SHAPE[:DTYPE], e.g. 1x3x32x32 or 8x128:int64"
    if sep and not _is_shape(shape_text) and _is_shape(dtype_text):
        raise CliError(ExitCode.USAGE, f"{text!r}: the shape comes first: "
                                       f"{dtype_text}:{shape_text}")
    if not shape_text:
        raise CliError(ExitCode.USAGE, f"{text!r} has no shape; {example} "
                                       "(or scalar:float32 for a 0-d tensor)")
    if shape_text == "scalar":
        shape: Tuple[int, ...] = ()
    else:
        dims = shape_text.split("x")
        bad = [d for d in dims if not d.strip().isdigit()]
        if bad:
            raise CliError(ExitCode.USAGE, f"{text!r}: {bad[0]!r} is not a size "
                                           f"(a whole number >= 0); {example}")
        shape = tuple(int(d) for d in dims)
    if sep and not dtype_text:
        raise CliError(ExitCode.USAGE, f"{text!r} ends with ':' but names no dtype; {example}")
    import torch
    return InputSpec(shape, _dtype(dtype_text, text) if sep else torch.float32)


def make_inputs(specs: Sequence[InputSpec], seed: int = 0, int_high: int = 10) -> tuple:
    """Random tensors for ``specs``: normal floats, integers in ``[0, int_high)``, random bools;
    drawn from a generator seeded with ``seed``, so runs are repeatable."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in specs:
        if s.dtype == torch.bool:
            t = torch.randint(0, 2, s.shape, generator=gen).bool()
        elif s.dtype.is_complex:
            t = torch.randn(s.shape, generator=gen, dtype=s.dtype)
        elif s.dtype.is_floating_point:
            t = torch.randn(s.shape, generator=gen).to(s.dtype)
        else:
            t = torch.randint(0, int_high, s.shape, generator=gen, dtype=s.dtype)
        out.append(t)
    return tuple(out)


# --- models --------------------------------------------------------------------------------
def is_saved_spec(spec: str) -> bool:
    """Whether ``spec`` names a saved GraphModule file rather than a factory: a name without
    ``:factory`` that ends in one of :data:`SAVED_SUFFIXES` or is an existing file other than
    a ``.py`` file."""
    if ":" in spec.replace("\\", "/").rpartition("/")[2]:
        return False
    return spec.lower().endswith(SAVED_SUFFIXES) or (os.path.isfile(spec) and not spec.endswith(".py"))


def _split(spec: str) -> Tuple[str, str]:
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr or not all(p.isidentifier() for p in attr.split(".")):
        raise CliError(ExitCode.USAGE, f"model {spec!r} is not of the form {SPEC_HELP}")
    return where, attr


def _import_module(name: str):
    if not all(p.isidentifier() for p in name.split(".")):
        raise CliError(ExitCode.USAGE, f"{name!r} is not a module name (package.module) or a path "
                                       "to a .py file")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # as `python -m` does: modules next to the user are found
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise CliError(ExitCode.MODEL, f"cannot find module {e.name!r} (looked in the working "
                                           f"directory {cwd} and sys.path); check the spelling, the "
                                           "working directory, or that the package is installed") from None
        raise CliError(ExitCode.MODEL, f"importing {name!r} failed: {describe_exception(e)}") from None
    except Exception as e:
        raise CliError(ExitCode.MODEL, f"importing {name!r} failed: {describe_exception(e)}") from None


def _import_file(path: str):
    if not os.path.isfile(path):
        raise CliError(ExitCode.MODEL, f"cannot find the file {path!r}")
    if not path.endswith(".py"):
        raise CliError(ExitCode.USAGE, f"{path!r} is not a Python file (.py)")
    full = os.path.abspath(path)
    name = "_symtrace_cli_" + "".join(c if c.isalnum() else "_" for c in os.path.splitext(full)[0])
    if name in sys.modules:
        return sys.modules[name]
    folder = os.path.dirname(full)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # sibling modules of the file import as they would in a script
    spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise CliError(ExitCode.MODEL, f"running {path!r} failed: {describe_exception(e)}") from None
    return module


def _candidates(module) -> List[str]:
    """Names in ``module`` that look like factories: its own classes and functions."""
    out = []
    for k, v in vars(module).items():
        if not k.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v)) \
                and getattr(v, "__module__", None) == module.__name__:
            out.append(k)
    return sorted(out)


def load_target(spec: str) -> Tuple[Any, str]:
    """The object ``spec`` names (before calling it) and a short name for messages."""
    where, attr = _split(spec)
    is_file = where.endswith(".py") or "/" in where or os.sep in where
    module = _import_file(where) if is_file else _import_module(where)
    obj = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = where if i == 0 else f"{where}:{'.'.join(attr.split('.')[:i])}"
            msg = f"{owner} has no attribute {part!r}"
            if i == 0:
                names = _candidates(module)
                close = difflib.get_close_matches(part, names, n=1)
                if close:
                    msg += f"; did you mean {close[0]!r}?"
                if names:
                    msg += f" (it defines: {', '.join(names[:12])}{' ...' if len(names) > 12 else ''})"
            raise CliError(ExitCode.MODEL, msg)
        obj = getattr(obj, part)
    return obj, spec


def load_model(spec: str, train: bool = False):
    """The ``nn.Module`` of ``spec`` (``factory()`` called; in eval mode unless ``train``), or
    the GraphModule saved (by ``symtrace.save``) in a ``.symtrace`` file."""
    from torch import nn
    if is_saved_spec(spec):
        return _load_saved(spec)
    obj, name = load_target(spec)
    if isinstance(obj, nn.Module):
        model = obj
    elif callable(obj):
        _check_no_required_args(obj, name)
        try:
            model = obj()
        except Exception as e:
            raise CliError(ExitCode.MODEL, f"{name}() raised {describe_exception(e)}") from None
        if not isinstance(model, nn.Module):
            raise CliError(ExitCode.MODEL, f"{name}() returned {type(model).__name__!r}, not an "
                                           "nn.Module; the factory must build and return the model")
    else:
        raise CliError(ExitCode.MODEL, f"{name} is of type {type(obj).__name__!r}, not a factory or "
                                       "an nn.Module")
    return model.train(train)


def _check_no_required_args(fn: Callable, name: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: just call it
        return
    try:
        sig.bind()
    except TypeError:
        required = [p.name for p in sig.parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        raise CliError(ExitCode.MODEL, f"{name} needs arguments ({', '.join(required)}) but is "
                                       "called with none; write a small factory that builds the "
                                       "model with them (def make(): return Net(...))") from None


def _load_saved(path: str):
    """The GraphModule in ``path``, read with ``symtrace.load`` (nothing in the file is run)."""
    from .. import SerializationError, load
    if not os.path.isfile(path):
        raise CliError(ExitCode.MODEL, f"cannot find the saved graph {path!r}")
    try:
        return load(path, map_location="cpu")
    except SerializationError as e:
        pickled = _pickle_kind(path)
        if pickled:
            raise CliError(ExitCode.MODEL, f"{path!r} is {pickled}, not a symtrace file. symtrace does "
                                           "not unpickle files (unpickling runs code from the file); "
                                           "load it in Python if you trust it and re-save it with "
                                           "symtrace.save(gm, 'model.symtrace')") from None
        raise CliError(ExitCode.MODEL, f"{e} (the MODEL file must be written by symtrace.save)") from None
    except OSError as e:
        raise CliError(ExitCode.MODEL, f"cannot read {path!r}: {e.strerror or e}") from None


def _pickle_kind(path: str) -> str:
    """'a torch.save file' or 'a pickle' when ``path`` looks like one (by its first bytes and,
    for zip files, their entry names), else ''. Reads names only; unpickles nothing."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                names = zf.namelist()
            return "a torch.save file" if any(n.endswith("data.pkl") for n in names) else ""
        with open(path, "rb") as f:
            head = f.read(2)
    except (OSError, zipfile.BadZipFile):
        return ""
    return "a pickle" if len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5 else ""


# --- tracing -------------------------------------------------------------------------------
def trace_model(model, inputs: tuple, mode: Optional[str], name: str, progress: Callable):
    """Trace ``model`` into a GraphModule: with ``inputs`` as example inputs (``mode``
    ``"example"``, the default when there are inputs) or symbolically (``"symbolic"``, then
    shapes are filled in from ``inputs`` when there are any). A GraphModule (saved, or returned
    by a factory) is used as it is, with shapes propagated when inputs are given."""
    from .. import GraphModule, TraceError, symbolic_trace
    mode = mode or ("example" if inputs else "symbolic")
    if mode == "example" and not inputs:
        raise CliError(ExitCode.USAGE, "--trace-mode example needs the input shapes: add --input SHAPE "
                                       "(e.g. --input 1x3x32x32) once per argument of forward")
    if inputs and not isinstance(model, GraphModule):
        _check_input_count(model, inputs, name)
    try:
        with progress(f"tracing {name}"):
            if isinstance(model, GraphModule):  # a saved graph: already traced
                gm = model
            elif mode == "example":
                gm = symbolic_trace(model, example_inputs=inputs)
            else:
                gm = symbolic_trace(model)
            if inputs and (gm is model or mode == "symbolic"):
                importlib.import_module("symtrace.passes").propagate_shapes(gm, *inputs)
    except TraceError as e:
        raise CliError(ExitCode.TRACE, f"tracing {name} failed:\n{e}") from None
    except CliError:
        raise
    except Exception as e:
        hint = "\n  check the --input shapes and dtypes" if inputs else ""
        raise CliError(ExitCode.TRACE, f"tracing {name} failed: the model raised "
                                       f"{describe_exception(e)}{hint}") from None
    return gm


def _check_input_count(model, inputs: tuple, name: str) -> None:
    """Refuse, in terms of ``--input``, a number of inputs that forward cannot take."""
    fn = model.forward if hasattr(model, "forward") else model
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*inputs)
    except TypeError:
        params = [p for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        required = [p for p in params if p.default is p.empty]
        want = (f"{len(required)}" if len(required) == len(params)
                else f"{len(required)} to {len(params)}")
        names = ", ".join(p.name for p in params) or "no arguments"
        raise CliError(ExitCode.USAGE, f"{name}: forward takes {want} input(s) ({names}) but --input "
                                       f"was given {len(inputs)} time(s); give --input SHAPE once per "
                                       "argument, in order") from None
