"""The ``symtrace`` command line: ``python -m symtrace <show|draw|explain|lower|diff> MODEL ...``.

``main(argv)`` runs it in-process and returns the exit code (see :class:`ExitCode`); the
``symtrace`` console script and ``python -m symtrace`` call it. Heavy imports (torch, the
tracer, ``symtrace.lower``) happen only when a subcommand runs.
"""
from .app import build_parser, main
from .errors import CliError, ExitCode

__all__ = ["main", "build_parser", "ExitCode", "CliError"]
