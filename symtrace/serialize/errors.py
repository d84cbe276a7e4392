"""The error :mod:`symtrace.serialize` raises."""
from __future__ import annotations

from ..errors import SymtraceError

__all__ = ["SerializationError", "Unencodable"]


class SerializationError(SymtraceError):
    """A GraphModule cannot be saved (it holds state the format cannot represent safely), or a
    file cannot be loaded (truncated, corrupted, from a newer format, or naming code that is
    not on the allow-list). The message names the node, module or target concerned."""


class Unencodable(SerializationError):
    """A value has no representation in the file format (raised while saving; meta values that
    raise it are left out with a warning, anything else makes ``save`` fail)."""
