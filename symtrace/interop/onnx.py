"""Export a symtrace graph to an ONNX file: :func:`export`.

The path is ``gm`` → :func:`~symtrace.interop.export.to_export` (``to_fx`` + ``torch.export``,
with ``gm``'s entry guards checked) → torch's ONNX exporter for ``ExportedProgram`` s
(``torch.onnx.export(..., dynamo=True)``, which translates ATen ops with onnxscript). The
TorchScript-based exporter is not used: it is deprecated and cannot take an ExportedProgram.

Needs the ``onnx`` and ``onnxscript`` packages (``pip install onnx onnxscript``; the ``dev``
extra of symtrace installs them, with ``onnxruntime`` to run the result). They are imported only
when :func:`export` runs.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Optional

import torch

from ..graph import GraphModule
from .export import to_export

__all__ = ["export", "missing_packages"]

_NEEDED = ("onnx", "onnxscript")


def missing_packages() -> list:
    """The packages :func:`export` needs that are not installed (``[]`` when it can run)."""
    return [name for name in _NEEDED if importlib.util.find_spec(name) is None]


def export(gm: GraphModule, example_inputs: tuple, path: "str | os.PathLike", *,
           example_kwargs: Optional[dict] = None, dynamic_shapes: Any = None,
           opset_version: Optional[int] = None, external_data: bool = False) -> str:
    """Write ``gm`` as an ONNX model to ``path`` and return the path.

    ``example_inputs`` / ``example_kwargs`` are the arguments of one call of ``gm``;
    ``dynamic_shapes`` marks dimensions that stay symbolic in the ONNX graph, keyed by ``gm``'s
    input names as in ``torch.export.export`` (``{"x": {0: torch.export.Dim("batch")}}``). The
    ONNX inputs and outputs are the call's tensors, flattened in order (Python values such as
    ``None`` or numbers are fixed at their example values, as ``gm``'s guards require). ``opset_version``
    defaults to torch's choice. ``external_data=True`` stores the weights in a file beside
    ``path`` (needed above ONNX's 2 GB limit).

    Raises ``ImportError`` naming the missing packages when onnx or onnxscript is not installed,
    and what :func:`~symtrace.interop.export.to_export` raises for graphs torch.export cannot take.
    """
    missing = missing_packages()
    if missing:
        raise ImportError(f"symtrace.interop.onnx.export needs {' and '.join(missing)} (torch's ONNX exporter "
                          f"translates with them): pip install {' '.join(missing)}")
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    ep = to_export(gm, args, example_kwargs, dynamic_shapes=dynamic_shapes)
    # the exporter takes the program as it is (the example inputs were used by to_export)
    program = torch.onnx.export(ep, (), dynamo=True, opset_version=opset_version, verbose=False,
                                external_data=external_data)
    path = os.fspath(path)
    program.save(path, external_data=external_data)
    return path
