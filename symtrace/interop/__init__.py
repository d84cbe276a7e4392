"""Interoperability with the PyTorch ecosystem: :func:`to_fx` / :func:`from_fx` convert graphs
to and from ``torch.fx``; :func:`backend` makes a ``torch.compile`` backend that runs symtrace
passes on the graphs Dynamo captures."""
from .dynamo import backend  # noqa: F401
from .fx import FxConversionError, from_fx, to_fx

__all__ = ["to_fx", "from_fx", "backend", "FxConversionError"]
