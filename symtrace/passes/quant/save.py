"""Save and load quantized graph modules.

A quantized :class:`~symtrace.graph.GraphModule` holds its int8 weights, scales and biases as
buffers and its activation parameters as node arguments/metadata, and calls module-level
functions; it pickles without re-tracing. :func:`save_quantized` writes it with
``torch.save`` (plus a small header); :func:`load_quantized` reads it back (``torch.load`` with
``weights_only=False``: load only files you trust) and, if the saved backend is not usable on
this machine (e.g. oneDNN missing), switches the fused calls to another backend.
(Until a generic symtrace graph serializer exists, this is pickle-based.)
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from ...graph.graph_module import GraphModule
from .kernels import backend_available, default_backend, get_backend

__all__ = ["save_quantized", "load_quantized", "set_backend"]

_FORMAT = "symtrace.quant/1"


def save_quantized(gm: GraphModule, path: Any) -> None:
    """Write a quantized module (from :func:`lower`, :func:`to_reference` or
    :func:`quantize_dynamic`) to ``path``."""
    if not isinstance(gm, GraphModule):
        raise TypeError(f"save_quantized expects a symtrace GraphModule, got {type(gm).__name__}")
    torch.save({"format": _FORMAT, "torch": torch.__version__, "stage": gm.meta.get("quant_stage"),
                "module": gm}, path)


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
    """Read a module written by :func:`save_quantized`. ``backend``: use this backend for the
    fused calls (default: the saved one if usable here, else the best available)."""
    obj = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(obj, dict) or obj.get("format") != _FORMAT or not isinstance(obj.get("module"), GraphModule):
        raise ValueError(f"{path}: not a quantized symtrace module written by save_quantized "
                         f"(expected format {_FORMAT!r})")
    gm = obj["module"]
    saved = gm.meta.get("quant_backend")
    if backend is None and saved is not None and not backend_available(saved):
        backend = default_backend()
        warnings.warn(f"{path}: saved for int8 backend {saved!r}, which is not usable here; using {backend!r}")
    if backend is not None:
        set_backend(gm, backend)
    return gm
