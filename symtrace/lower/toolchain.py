"""Compile generated C source into a shared library and load it, through an on-disk cache.

``load_library(source)`` returns a ``ctypes.CDLL``. Libraries are cached by content: the key is
the SHA-256 of the source, the compiler (real path and ``--version``), the flags, the CPU's
feature flags and :data:`FORMAT_VERSION`. Entries live in ``$SYMTRACE_CACHE_DIR`` (default
``~/.cache/symtrace``) as ``<key[:2]>/<key>.so`` with the ``.c`` beside it for reading and a
``.sha256`` sidecar used to detect damaged files; ``probes/`` and ``compilers/`` keep the
OpenMP probe's answer and each compiler's ``--version`` so that a cache hit in a new process
runs no subprocess. Writes go to a temporary file in the same directory followed by
``os.replace``, so concurrent processes need no lock.

Every entry is checked before it is used, and anything unexpected is a miss, never an error
or a wrong kernel: a library must match its sidecar's SHA-256 *and* carry its own key (each
library is linked with a one-line translation unit defining ``symtrace_cache_key``, so an entry
copied or renamed from another key is refused before it is loaded); JSON entries must parse,
have the expected types and name their key. Damaged entries (truncated, non-UTF-8, wrong
JSON, a directory where a file belongs, ...) are rebuilt and rewritten.

A large source made of independent units (kernels after a shared head, separated by
:data:`UNIT_BREAK`) is compiled as several objects in parallel, one compiler process per core
(at most :data:`MAX_PARALLEL_COMPILES`), then linked: the cache key and the library's contents
are those of the whole source, only the cold compile is shorter.

No compiler: :class:`CompilerUnavailable`. The compiler rejects the source: :class:`CompileError`
(with its stderr and the path of the ``.c`` file). Both derive from :class:`ToolchainError`,
which callers catch to fall back to eager execution.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import SymtraceError
from .cache_dir import cache_dir as _cache_root, digest

__all__ = ["load_once", "CheckedLibrary", "ToolchainError", "CompilerUnavailable", "CompileError", "CompilerInfo", "ToolchainStats", "stats",
           "find_compiler", "compiler_flags", "openmp_available", "cpu_signature", "cache_dir", "cache_key",
           "library_path", "load_library", "prelude_source", "clear_memory_cache", "read_cache_entry",
           "write_cache_entry", "FORMAT_VERSION", "BASE_FLAGS", "UNIT_BREAK"]

FORMAT_VERSION = "2"  # bump when the cache layout, the flag logic or the prelude's contract changes
BASE_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared", "-std=c99")
LINK_LIBS = ("-lm",)
COMPILE_TIMEOUT_S = 600
#: separates the units of a source (the first is the head every unit needs: includes, prelude,
#: prototypes); a C comment, so the whole source is also one valid translation unit
UNIT_BREAK = "\n/* symtrace: unit boundary */\n"
#: sources at least this long (bytes) with units are compiled in parts, in parallel
PARALLEL_COMPILE_MIN_BYTES = 96 * 1024
MAX_PARALLEL_COMPILES = 8
PRELUDE_PATH = Path(__file__).with_name("prelude.h")


class ToolchainError(SymtraceError):
    """Base class: the C toolchain cannot produce a kernel library (callers fall back to eager)."""


class CompilerUnavailable(ToolchainError):
    """No usable C compiler (``$CC`` points nowhere, nothing on ``PATH``) or no writable cache."""


class CompileError(ToolchainError):
    """The C compiler rejected generated source. ``stderr``: its output; ``c_path``: the source file."""

    def __init__(self, message: str, *, stderr: str = "", c_path: Path | None = None, command: tuple = ()):
        super().__init__(message)
        self.stderr = stderr
        self.c_path = c_path
        self.command = command


@dataclass(frozen=True)
class CompilerInfo:
    """The C compiler in use: ``command`` is the argv prefix (``$CC`` may carry arguments)."""

    command: tuple[str, ...]
    path: str
    realpath: str
    version: str
    kind: str  # "gcc", "clang" or "cc"


@dataclass
class ToolchainStats:
    """Counters for this process: ``compiles`` and ``seconds`` (total compile wall time; each call's
    time is in ``times``), ``hits`` (memory or disk), ``disk_hits``, ``rebuilds`` (damaged entries
    replaced) and ``probes`` (OpenMP probe compiles)."""

    compiles: int = 0
    hits: int = 0
    disk_hits: int = 0
    rebuilds: int = 0
    probes: int = 0
    seconds: float = 0.0
    times: list = field(default_factory=list)

    def reset(self) -> None:
        self.__init__()


stats = ToolchainStats()

_lock = threading.Lock()
_key_locks: dict[str, threading.Lock] = {}
_loaded: dict[str, ctypes.CDLL] = {}
_compilers: dict[tuple, CompilerInfo] = {}
_probe_answers: dict[str, str] = {}
_cpu_sig: list[str] = []
_prelude: list[str] = []


# ------------------------------------------------------------------------------ compiler ----
def find_compiler() -> CompilerInfo:
    """The C compiler named by ``$CC``, else the first of ``cc``, ``gcc``, ``clang`` on ``PATH``.

    Cached per process for each (``$CC``, ``$PATH``) pair; raises :class:`CompilerUnavailable`.
    """
    cc, path_env = os.environ.get("CC", "").strip(), os.environ.get("PATH", "")
    key = (cc, path_env)
    info = _compilers.get(key)
    if info is None:
        info = _compilers[key] = _probe_compiler(cc, path_env)
    return info


def _probe_compiler(cc: str, path_env: str) -> CompilerInfo:
    hint = "symtrace needs a C compiler (gcc or clang) to build fused CPU kernels."
    if cc:
        try:
            argv = shlex.split(cc)
        except ValueError:
            argv = [cc]
        exe = shutil.which(argv[0], path=path_env) if argv else None
        if exe is None:
            raise CompilerUnavailable(f"$CC is set to {cc!r}, but {argv[0] if argv else cc!r} is not an executable "
                                      f"file (or not on PATH). {hint} Set CC to a working C compiler or unset it.")
    else:
        argv, exe = [], None
        for name in ("cc", "gcc", "clang"):
            exe = shutil.which(name, path=path_env)
            if exe:
                argv = [name]
                break
        if exe is None:
            raise CompilerUnavailable(f"no C compiler found on PATH (looked for cc, gcc and clang). {hint} "
                                      "Install one or set $CC.")
    command = (exe, *argv[1:])
    real = os.path.realpath(exe)
    version = _compiler_version(command, real, hint)
    low = version.lower()
    kind = "clang" if "clang" in low else "gcc" if ("gcc" in low or "free software foundation" in low) else "cc"
    return CompilerInfo(command=command, path=exe, realpath=real, version=version, kind=kind)


def _compiler_version(command: tuple[str, ...], real: str, hint: str) -> str:
    """``cc --version``, remembered on disk per compiler binary (path, size, mtime): running it
    costs several ms in a process as large as one with torch loaded, and a cache hit runs nothing."""
    record = None
    if len(command) == 1:  # a wrapper such as "ccache gcc" may change what it runs: always ask
        try:
            st = os.stat(real)
            record = cache_dir() / "compilers" / f"{_hash(FORMAT_VERSION, real, str(st.st_size), str(st.st_mtime_ns))}.json"
            doc = _read_json(record)
            if isinstance(doc, dict) and doc.get("compiler", real) == real:
                version = doc.get("version")
                if isinstance(version, str) and version.strip():
                    return version
        except OSError:
            pass
    try:
        out = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise CompilerUnavailable(f"the C compiler {command[0]} could not be run ({e}). {hint}") from e
    if out.returncode != 0 or not out.stdout.strip():
        raise CompilerUnavailable(f"the C compiler {command[0]} failed on --version (exit code {out.returncode}): "
                                  f"{out.stderr.strip()[:500]} {hint}")
    version = out.stdout.strip()
    if record is not None:
        try:
            _ensure_subdir(record.parent)
            _atomic_write(record, json.dumps({"version": version, "compiler": real}).encode())
        except (OSError, CompilerUnavailable):
            pass  # only an optimisation
    return version


def cpu_signature() -> str:
    """The CPU's feature list (the ``flags`` line of /proc/cpuinfo, or ``platform.processor()``)."""
    if not _cpu_sig:
        sig = ""
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.startswith(("flags", "Features")):
                        sig = line.split(":", 1)[-1].strip()
                        break
        except OSError:
            pass
        _cpu_sig.append(f"{platform.machine()}|{sig or platform.processor()}")
    return _cpu_sig[0]


def _has_avx512f() -> bool:
    return "avx512f" in cpu_signature().split("|", 1)[-1].split()


# ---------------------------------------------------------------------------------- cache ----
def cache_dir() -> Path:
    """``$SYMTRACE_CACHE_DIR`` if set, else ``~/.cache/symtrace`` (read at each call; see
    :mod:`.cache_dir`)."""
    return _cache_root()


def _ensure_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CompilerUnavailable(f"cannot create the kernel cache directory {path} ({e}); set SYMTRACE_CACHE_DIR "
                                  "to a writable directory.") from e
    return path


def _ensure_subdir(path: Path) -> Path:
    """A directory inside the cache, created when missing; a file (or a link to one) in its place is a
    damaged entry: it is removed first."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        _remove(path)
    return _ensure_dir(path)


def _remove(path: Path) -> None:
    """Remove a damaged cache entry (a file, a link or a directory), ignoring errors."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        _unlink(path)


def _read_json(path: Path):
    """The JSON value in ``path``, or None when it is missing or unreadable (not a file, not
    UTF-8, not JSON, nested too deeply)."""
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):   # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None


_hash = digest  # (the cache keys' one hash: length-prefixed SHA-256, see :mod:`.cache_dir`)


# --------------------------------------------------------------------------------- flags ----
def compiler_flags(info: CompilerInfo | None = None) -> tuple[str, ...]:
    """Flags for kernel libraries: :data:`BASE_FLAGS`, ``-mprefer-vector-width=512`` on AVX-512 CPUs and
    ``-fopenmp`` (or ``-fopenmp-simd``) when the compiler can build with it. Never ``-ffast-math``."""
    info = info or find_compiler()
    base = BASE_FLAGS + (("-mprefer-vector-width=512",) if _has_avx512f() and info.kind in ("gcc", "clang") else ())
    omp = _openmp_flag(info, base)
    return base + ((omp,) if omp else ())


def openmp_available() -> bool:
    """True when kernels are built with ``-fopenmp`` (``#pragma omp parallel for`` runs in parallel)."""
    return "-fopenmp" in compiler_flags()


_PROBES = {
    "-fopenmp": "#include <omp.h>\nint st_probe(int n) {\n  int s = 0;\n#pragma omp parallel for reduction(+:s)\n"
                "  for (int i = 0; i < n; i++) s += i;\n  return s + omp_get_max_threads();\n}\n",
    "-fopenmp-simd": "float st_probe(const float* x, int n) {\n  float s = 0;\n#pragma omp simd reduction(+:s)\n"
                     "  for (int i = 0; i < n; i++) s += x[i];\n  return s;\n}\n",
    "": "int st_probe(int n) { return n + 1; }\n",
}


def _openmp_flag(info: CompilerInfo, base: tuple[str, ...]) -> str:
    """Which OpenMP flag works: one probe compile per (compiler, flags) key, answer kept on disk."""
    key = _hash(FORMAT_VERSION, info.realpath, info.version, *base, cpu_signature())
    answer = _probe_answers.get(key)
    if answer is not None:
        return answer
    probe_dir = _ensure_subdir(cache_dir() / "probes")
    record = probe_dir / f"{key}.json"
    doc = _read_json(record)
    answer = doc.get("openmp_flag") if isinstance(doc, dict) else None
    if not isinstance(answer, str) or answer not in _PROBES:
        answer = _run_probes(info, base, probe_dir)
        _atomic_write(record, json.dumps({"openmp_flag": answer, "compiler": info.realpath}).encode())
    _probe_answers[key] = answer
    return answer


def _run_probes(info: CompilerInfo, base: tuple[str, ...], probe_dir: Path) -> str:
    with tempfile.TemporaryDirectory(dir=probe_dir) as tmp:
        last = ""
        for flag, src in _PROBES.items():
            c = Path(tmp) / "probe.c"
            c.write_text(src)
            cmd = [*info.command, *base, *([flag] if flag else []), "-o", str(Path(tmp) / "probe.so"), str(c)]
            stats.probes += 1
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError) as e:
                raise CompilerUnavailable(f"the C compiler {info.path} could not be run ({e}).") from e
            if out.returncode == 0:
                return flag
            last = out.stderr.strip()
    raise CompilerUnavailable(f"the C compiler {info.path} cannot build a shared library with the flags "
                              f"{' '.join(base)}:\n{last[:2000]}")


# ---------------------------------------------------------------------------- libraries ----
def cache_key(source: str, flags=None, info: CompilerInfo | None = None) -> str:
    """SHA-256 naming the library built from ``source`` with ``flags`` on this compiler and CPU."""
    info = info or find_compiler()
    flags = compiler_flags(info) if flags is None else tuple(flags)
    return _hash(FORMAT_VERSION, info.realpath, info.version, "\0".join(flags), "\0".join(LINK_LIBS),
                 cpu_signature(), source)


def library_path(source: str, flags=None) -> Path:
    """Where the cache keeps (or will keep) the library built from ``source``."""
    key = cache_key(source, flags)
    return cache_dir() / key[:2] / f"{key}.so"


def load_library(source: str, flags=None) -> ctypes.CDLL:
    """Compile ``source`` (C99) into a shared library, or reuse the cached one, and load it.

    ``flags`` replaces :func:`compiler_flags` when given. Raises :class:`CompilerUnavailable` or
    :class:`CompileError`.
    """
    info = find_compiler()
    flags = compiler_flags(info) if flags is None else tuple(flags)
    key = cache_key(source, flags, info)
    lib = _loaded.get(key)
    if lib is not None:
        stats.hits += 1
        return lib
    with _lock:
        key_lock = _key_locks.setdefault(key, threading.Lock())
    with key_lock:
        lib = _loaded.get(key)
        if lib is not None:
            stats.hits += 1
            return lib
        entry = _ensure_subdir(cache_dir() / key[:2])
        so = entry / f"{key}.so"
        lib, damaged = _load_cached(so, key)
        if lib is not None:
            stats.hits += 1
            stats.disk_hits += 1
        else:
            stats.rebuilds += damaged
            _compile(info, flags, source, entry, key)
            try:
                lib = ctypes.CDLL(str(so))
            except OSError as e:
                raise CompileError(f"the kernel library {so} was built but cannot be loaded: {e}",
                                   c_path=entry / f"{key}.c") from e
        _loaded[key] = lib
        return lib


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _key_marker(key: str) -> bytes:
    """The bytes every library built for ``key`` contains (the string ``symtrace_cache_key``)."""
    return b"symtrace-cache-key:" + key.encode("ascii")


def _key_source(key: str) -> str:
    """The translation unit linked into the library built for ``key``: it names its key."""
    return f'const char symtrace_cache_key[] = "{_key_marker(key).decode()}";\n'


def _load_cached(so: Path, key: str) -> tuple[ctypes.CDLL | None, bool]:
    """(library, False) on a good cache entry; (None, damaged?) when it must be (re)built. Good:
    the bytes match the sidecar's SHA-256 and contain this key's marker (checked before dlopen:
    a library loaded once stays mapped under its path)."""
    try:
        data = so.read_bytes()
    except FileNotFoundError:
        return None, False
    except OSError:
        return None, True
    try:
        expected = so.with_suffix(".sha256").read_bytes().decode("ascii").strip()
    except (OSError, UnicodeError):
        return None, True
    if expected != hashlib.sha256(data).hexdigest() or _key_marker(key) not in data:
        return None, True
    try:
        return ctypes.CDLL(str(so)), False
    except OSError:
        return None, True


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        _replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _replace(src, dst: Path) -> None:
    """``os.replace``; a directory where the file belongs (a damaged entry) is removed first."""
    try:
        os.replace(src, dst)
    except OSError:
        if not os.path.isdir(dst) or os.path.islink(dst):
            raise
        _remove(dst)
        os.replace(src, dst)


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _compile(info: CompilerInfo, flags: tuple[str, ...], source: str, entry: Path, key: str) -> None:
    c_path, so = entry / f"{key}.c", entry / f"{key}.so"
    tmp_so = key_c = None
    try:
        _atomic_write(c_path, source.encode("utf-8"))
        fd, tmp_so = tempfile.mkstemp(dir=entry, prefix=f"{key}.", suffix=".so.tmp")
        os.close(fd)
        fd, key_c = tempfile.mkstemp(dir=entry, prefix=f"{key}.key.", suffix=".c")
        with os.fdopen(fd, "w") as f:
            f.write(_key_source(key))
    except OSError as e:
        for p in (tmp_so, key_c):
            if p is not None:
                _unlink(p)
        raise CompilerUnavailable(f"cannot write to the kernel cache directory {entry} ({e}); set "
                                  "SYMTRACE_CACHE_DIR to a writable directory.") from e
    t0 = time.perf_counter()
    parts = _split_units(source, _compile_workers(), str(c_path)) if len(source) >= PARALLEL_COMPILE_MIN_BYTES else []
    temps: list = []
    try:
        if len(parts) > 1:   # compile the parts to objects in parallel, then link them
            objects = _compile_parts(info, flags, parts, entry, key, temps, c_path)
            _run_compiler((*info.command, *flags, "-o", tmp_so, *objects, key_c, *LINK_LIBS), c_path, info)
        else:
            _run_compiler((*info.command, *flags, "-o", tmp_so, str(c_path), key_c, *LINK_LIBS), c_path, info)
        _atomic_write(so.with_suffix(".sha256"), _file_sha256(Path(tmp_so)).encode())
        _replace(tmp_so, so)
    finally:
        for p in temps:
            _unlink(p)
        _unlink(tmp_so)
        _unlink(key_c)
        dt = time.perf_counter() - t0
        stats.compiles += 1
        stats.seconds += dt
        stats.times.append(dt)


def _run_compiler(command: tuple, c_path: Path, info: CompilerInfo) -> None:
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise CompileError(f"the C compiler took longer than {COMPILE_TIMEOUT_S} s on {c_path}; command: "
                           f"{shlex.join(command)}", c_path=c_path, command=command) from e
    except OSError as e:
        raise CompilerUnavailable(f"the C compiler {info.path} could not be run ({e}).") from e
    if out.returncode != 0:
        err = out.stderr.strip()
        raise CompileError(f"the C compiler failed (exit code {out.returncode}) on the generated kernel source "
                           f"{c_path}\ncommand: {shlex.join(command)}\n{err[:4000]}",
                           stderr=err, c_path=c_path, command=command)


def _c_string(text: str) -> str:
    """``text`` inside a C string literal (a file name in ``#line``)."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def _compile_workers() -> int:
    """Compiler processes to run at once: the cores this process may use, at most
    :data:`MAX_PARALLEL_COMPILES`."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(n, MAX_PARALLEL_COMPILES))


def _split_units(source: str, workers: int, path: str = "") -> list:
    """``source`` as at most ``workers`` translation units of about equal size: each is the
    head (the text before the first :data:`UNIT_BREAK`) followed by a run of consecutive units.
    [] where there is nothing to split. With ``path`` (the whole source's file), each unit is
    preceded by a ``#line`` directive, so that the compiler's messages name that file and its
    line numbers."""
    pieces = source.split(UNIT_BREAK)
    head, units = pieces[0], pieces[1:]
    if workers < 2 or len(units) < 2:
        return []
    if path:
        line, step, marked = head.count("\n") + 1, UNIT_BREAK.count("\n"), []
        for u in units:
            line += step
            marked.append(f'#line {line} "{_c_string(path)}"\n{u}')
            line += u.count("\n")
        units = marked
    n = min(workers, len(units))
    parts, start, left = [], 0, sum(len(u) for u in units)
    for j in range(n - 1):   # each part about an equal share of what is left, at least one unit
        target, size, end = left / (n - j), 0, start
        while end < len(units) - (n - 1 - j) and (end == start or size + len(units[end]) / 2 <= target):
            size += len(units[end])
            end += 1
        parts.append(units[start:end])
        start, left = end, left - size
    parts.append(units[start:])
    return [head + UNIT_BREAK + UNIT_BREAK.join(p) for p in parts]


def _compile_parts(info: CompilerInfo, flags: tuple, parts: list, entry: Path, key: str, temps: list,
                   c_path: Path) -> list:
    """Each part compiled to an object file (``-c``), all at once; their paths (added to
    ``temps`` with the parts' sources, which the caller removes). An error names ``c_path``,
    the whole source, which stays in the cache to be read."""
    compile_flags = tuple(f for f in flags if f != "-shared") + ("-c",)
    jobs = []
    try:
        for i, text in enumerate(parts):
            fd, c_part = tempfile.mkstemp(dir=entry, prefix=f"{key}.part{i}.", suffix=".c")
            temps.append(c_part)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            obj = c_part[:-2] + ".o"
            temps.append(obj)
            jobs.append(((*info.command, *compile_flags, "-o", obj, c_part), c_path, obj))
    except OSError as e:
        raise CompilerUnavailable(f"cannot write to the kernel cache directory {entry} ({e}); set "
                                  "SYMTRACE_CACHE_DIR to a writable directory.") from e
    errors: list = []

    def run(job):
        try:
            _run_compiler(job[0], job[1], info)
        except BaseException as e:   # (re-raised by the caller's thread)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(job,), daemon=True) for job in jobs[1:]]
    for t in threads:
        t.start()
    run(jobs[0])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [obj for _, _, obj in jobs]


# ------------------------------------------------------------------------- JSON entries ----
def _entry_path(kind: str, key: str) -> Path:
    return cache_dir() / kind / key[:2] / f"{key}.json"


def read_cache_entry(kind: str, key: str):
    """The JSON value stored under ``kind``/``key`` (e.g. the lowering's recorded metadata),
    or None when it is missing or damaged: unreadable, not UTF-8 or not JSON, of the wrong
    shape, written for another key, or its payload's SHA-256 does not match. Callers still
    check the value's type and contents."""
    doc = _read_json(_entry_path(kind, key))
    if not isinstance(doc, dict):
        return None
    payload, digest = doc.get("payload"), doc.get("sha256")
    if not (isinstance(payload, str) and isinstance(digest, str) and doc.get("key") == key):
        return None
    try:
        if digest != hashlib.sha256(payload.encode("utf-8")).hexdigest():
            return None
        return json.loads(payload)
    except (ValueError, RecursionError):   # a lone surrogate, a payload that is not JSON
        return None


def write_cache_entry(kind: str, key: str, value) -> bool:
    """Store the JSON-able ``value`` under ``kind``/``key`` (atomically); False when the cache
    cannot be written (entries are only an optimisation)."""
    payload = json.dumps(value, separators=(",", ":"))
    doc = {"key": key, "sha256": hashlib.sha256(payload.encode()).hexdigest(), "payload": payload}
    path = _entry_path(kind, key)
    try:
        _ensure_subdir(path.parent)
        _atomic_write(path, json.dumps(doc).encode())
    except (OSError, CompilerUnavailable):
        return False
    return True


def clear_memory_cache() -> None:
    """Forget loaded libraries and probe answers of this process (the disk cache stays)."""
    with _lock:
        _loaded.clear()
        _probe_answers.clear()
        _compilers.clear()


def prelude_source() -> str:
    """The text of ``prelude.h`` (the math prelude pasted into every generated translation unit)."""
    if not _prelude:
        _prelude.append(PRELUDE_PATH.read_text())
    return _prelude[0]


def load_once(owner: Any, load: Callable[[], Any], check: Callable[[], str]) -> bool:
    """Compile ``owner``'s kernel library once, thread-safe, and check it against a reference:
    sets ``owner._lib`` to ``load()``, then ``owner.reason`` to ``check()`` (empty when the kernels
    agree) and ``owner._ok``; a toolchain failure is the reason instead. Needs ``owner._ok``
    (None until then) and ``owner._lock``. Returns ``owner._ok``."""
    if owner._ok is None:
        with owner._lock:
            if owner._ok is None:
                try:
                    owner._lib = load()
                    owner.reason = check()
                    owner._ok = not owner.reason
                except ToolchainError as e:
                    owner._ok, owner.reason = False, f"{type(e).__name__}: {e}"
    return owner._ok


class CheckedLibrary:
    """A kernel library compiled on first use and checked against a reference once
    (:func:`load_once`): a subclass gives ``_load()`` (the loaded library) and
    ``_self_check()`` ("" when its kernels agree, else why not); ``available()`` answers
    whether they may run, ``reason`` why not."""

    def __init__(self):
        self._lib = None
        self._ok: Any = None
        self._lock = threading.Lock()
        self.reason = ""

    def available(self) -> bool:
        return load_once(self, self._load, self._self_check)

    def _load(self) -> Any:
        raise NotImplementedError

    def _self_check(self) -> str:
        raise NotImplementedError
