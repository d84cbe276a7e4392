"""Exit codes of the ``symtrace`` command and the error that carries one to ``main``."""
from __future__ import annotations

import enum
import os
import traceback
from typing import Optional

__all__ = ["ExitCode", "EXIT_CODE_HELP", "CliError", "user_frame", "describe_exception"]


class ExitCode(enum.IntEnum):
    """What the process exit status means (:data:`EXIT_CODE_HELP` says it in words)."""

    OK = 0
    DIFFERENT = 1
    USAGE = 2
    MODEL = 3
    TRACE = 4
    OUTPUT = 5
    LOWER_UNAVAILABLE = 6
    LOWER_FAILED = 7
    INTERNAL = 70
    INTERRUPTED = 130


#: One line per exit code, for ``--help``.
EXIT_CODE_HELP = {
    ExitCode.OK: "success (diff: the graphs are the same)",
    ExitCode.DIFFERENT: "diff: the graphs differ",
    ExitCode.USAGE: "bad command line: options, --input strings, MODEL syntax",
    ExitCode.MODEL: "the model could not be loaded: module, attribute or factory error",
    ExitCode.TRACE: "tracing failed (a TraceError, or the model raised on the inputs)",
    ExitCode.OUTPUT: "an output file could not be written",
    ExitCode.LOWER_UNAVAILABLE: "lower: symtrace.lower.compile is not available",
    ExitCode.LOWER_FAILED: "lower: compiling or running failed, or results differ from eager",
    ExitCode.INTERNAL: "a bug in symtrace (a traceback is printed)",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C)",
}


class CliError(Exception):
    """An error meant for the user of the command line: ``message`` is printed as is (after
    ``symtrace: error:``) and the process exits with ``code``."""

    def __init__(self, code: ExitCode, message: str):
        super().__init__(message)
        self.code = ExitCode(code)
        self.message = message


_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # symtrace/


def _is_library(filename: str) -> bool:
    if filename.startswith("<frozen") or filename.startswith(_HERE):
        return True
    parts = filename.replace("\\", "/").split("/")
    return "site-packages" in parts and "torch" in parts


def user_frame(exc: BaseException) -> Optional[str]:
    """``file:line in function: code`` of the innermost frame of ``exc``'s traceback that is
    the user's code (not symtrace's, torch's or importlib's), or None.

    A ``SyntaxError`` points at its own file and line, which is the user's.
    """
    if isinstance(exc, SyntaxError) and exc.filename:
        text = (exc.text or "").strip()
        return f"{exc.filename}:{exc.lineno}" + (f": {text}" if text else "")
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not _is_library(f.filename)]
    if not frames:
        return None
    f = frames[-1]
    code = (f.line or "").strip()
    return f"{f.filename}:{f.lineno} in {f.name}" + (f": {code}" if code else "")


def describe_exception(exc: BaseException) -> str:
    """``TypeName: message`` followed by the user's line when there is one."""
    text = f"{type(exc).__name__}: {exc}"
    where = user_frame(exc)
    return f"{text}\n  at {where}" if where else text
