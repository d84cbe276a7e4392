"""Save and load quantized graph modules: thin names over :mod:`symtrace.serialize`.

A quantized :class:`~symtrace.graph.GraphModule` (from :func:`~symtrace.passes.quant.lower`,
:func:`~symtrace.passes.quant.to_reference` or :func:`~symtrace.passes.quant.quantize_dynamic`)
holds its int8 weights, scales and biases as plain tensor buffers, its activation parameters as
node arguments and ``tensor_meta`` qparams, the int8 backend as a *name* (the ``backend=``
argument of its fused calls), and calls symtrace's own quantize/dequantize and int8 kernel
functions, which are on :mod:`symtrace.serialize`'s allow-list. So ``symtrace.save`` writes it
in the safe format (no pickle), and ``symtrace.load`` reads it back without running anything
from the file. Packed weights and compiled kernels are never saved: the backend rebuilds them
from the int8 tensors on first use.

:func:`save_quantized` is ``symtrace.save``; :func:`load_quantized` is ``symtrace.load`` plus
a backend choice: the saved backend if it is usable here, else the best available one (with a
warning), or the one you name. (The ``QuantConfig`` used for calibration is not part of a
quantized module: its observer factories are code; it stays in ``prepared.meta``.) A prepared
module is not a quantized model: its observer modules are not on the allow-list, so it is not
saved (finish with ``to_reference``/``lower`` first).

Files written by the earlier, pickle-based ``save_quantized`` are refused, unread: unpickling
runs code from the file.
"""
from __future__ import annotations

import os
import warnings
import zipfile
from typing import Any, Optional

from ...graph.graph_module import GraphModule
from ...serialize import SerializationError, load, save
from .registry import backend_available, default_backend, get_backend

__all__ = ["save_quantized", "load_quantized", "set_backend"]


def save_quantized(gm: GraphModule, path: Any) -> None:
    """Write a quantized module (from :func:`lower`, :func:`to_reference` or
    :func:`quantize_dynamic`) to ``path`` (a path or a writable binary file) with
    :func:`symtrace.save`."""
    if not isinstance(gm, GraphModule):
        raise TypeError(f"save_quantized expects a symtrace GraphModule, got {type(gm).__name__}")
    save(gm, path)


def set_backend(gm: GraphModule, backend: str) -> int:
    """Point every fused int8 call of ``gm`` at ``backend``; returns how many changed."""
    get_backend(backend)
    changed = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and "backend" in n.kwargs and n.kwargs["backend"] != backend:
            n.kwargs = dict(n.kwargs, backend=backend)
            changed += 1
    if changed:
        gm.meta["quant_backend"] = backend
        gm.recompile()
    return changed


def load_quantized(path: Any, backend: Optional[str] = None) -> GraphModule:
    """Read a module written by :func:`save_quantized` (or ``symtrace.save``) with
    :func:`symtrace.load`. ``backend``: run the fused int8 calls on this backend (default: the
    saved one if usable here, else the best available, with a warning). Raises
    :class:`~symtrace.serialize.SerializationError` for anything else, including files of the
    earlier pickle-based format (they are not unpickled)."""
    if backend is not None:
        get_backend(backend)  # an unknown name fails before reading the file
    old = _pickled(path)
    if old:
        raise SerializationError(
            f"cannot load {_name(path)}: it is {old} (the format of the earlier, pickle-based save_quantized), "
            "not a symtrace file; symtrace does not unpickle files (unpickling runs code from the file). If you "
            "trust it, load it with the symtrace version that wrote it and save it again with "
            "Q.save_quantized(gm, path) (or symtrace.save), which writes the safe format")
    gm = load(path, map_location="cpu")
    saved = gm.meta.get("quant_backend")
    if backend is None and isinstance(saved, str) and not backend_available(saved):
        backend = default_backend()
        warnings.warn(f"{_name(path)}: saved for int8 backend {saved!r}, which is not usable here; using {backend!r}",
                      stacklevel=2)
    if backend is not None:
        set_backend(gm, backend)
    return gm


def _name(path: Any) -> str:
    return os.fspath(path) if isinstance(path, (str, os.PathLike)) else getattr(path, "name", "<file>")


def _pickled(path: Any) -> str:
    """'a torch.save file' or 'a pickle' when ``path`` looks like one (by its first bytes and,
    for zip files, their entry names), else ''. Reads names only; unpickles nothing."""
    if not isinstance(path, (str, os.PathLike)):
        return ""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                names = zf.namelist()
            return "a torch.save file" if any(n == "data.pkl" or n.endswith("/data.pkl") for n in names) else ""
        with open(path, "rb") as f:
            head = f.read(2)
    except (OSError, zipfile.BadZipFile):
        return ""
    return "a pickle" if len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5 else ""
