"""Interoperability with the PyTorch ecosystem: :func:`to_fx` / :func:`from_fx` convert graphs
to and from ``torch.fx``; :func:`from_export` / :func:`to_export` to and from ``torch.export``'s
``ExportedProgram``; ``symtrace.interop.onnx.export`` writes an ONNX file; :func:`backend` makes a
``torch.compile`` backend that runs symtrace passes on the graphs Dynamo captures."""
from . import onnx  # noqa: F401  (imports neither onnx nor onnxscript until it exports)
from .dynamo import backend  # noqa: F401
from .export import from_export, to_export
from .fx import FxConversionError, from_fx, to_fx

__all__ = ["to_fx", "from_fx", "from_export", "to_export", "backend", "FxConversionError"]
