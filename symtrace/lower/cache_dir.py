"""Where symtrace keeps files between processes, and the one hash its cache keys use.

:func:`cache_dir` is ``$SYMTRACE_CACHE_DIR`` if set, else ``~/.cache/symtrace`` (read at each
call), with one subfolder per use: compiled C libraries (``<key[:2]>/``, see
:mod:`.toolchain`), ``probes/`` and ``compilers/`` (toolchain answers), ``records/`` (the
lowering's recorded metadata), ``triton/`` (generated Triton kernel modules).

:func:`digest` is the SHA-256 of its parts, each prefixed with its length, so no two different
part lists share a key; every cache key is made with it. (Checksums of file contents stored in
entries, such as the ``.sha256`` sidecars, are plain SHA-256 of the bytes.)
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Union

__all__ = ["cache_dir", "digest", "ENV_VAR"]

ENV_VAR = "SYMTRACE_CACHE_DIR"


def cache_dir(*sub: str) -> Path:
    """``$SYMTRACE_CACHE_DIR`` (else ``~/.cache/symtrace``), joined with ``sub``; not created."""
    env = os.environ.get(ENV_VAR)
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "symtrace"
    return root.joinpath(*sub)


def digest(*parts: Union[str, bytes]) -> str:
    """Hex SHA-256 of ``parts`` (str as UTF-8, lone surrogates kept), each length-prefixed."""
    h = hashlib.sha256()
    for p in parts:
        b = p if isinstance(p, bytes) else p.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()
