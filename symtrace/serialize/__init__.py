"""Safe saving and loading of GraphModules.

``save(gm, path)`` writes the graph itself (not generated code), every node's ``meta``, the
entry guards, and the module hierarchy (submodules, parameters, buffers, plain attributes) to
a zip archive with a JSON header and raw tensor bytes. ``load(path)`` rebuilds it without
executing anything from the file: call targets, module classes and method names resolve only
through an allow-list (extend it with :func:`register_target`), and guard expressions pass an
``ast`` allow-list. The format is described in docs/file_format.md.
"""
from .allowlist import register_target
from .errors import SerializationError
from .format import FORMAT_VERSION, load, save

__all__ = ["save", "load", "register_target", "SerializationError", "FORMAT_VERSION"]
