"""The container: a zip archive (entries stored, not compressed) holding ``symtrace.json``
(the header: format name and version, module records with graphs, tensor and storage
tables) and ``tensors/<i>.bin`` (raw little-endian storage bytes). See docs/file_format.md.
"""
from __future__ import annotations

import io
import json
import os
import struct
import sys
import tempfile
import warnings
import zipfile
from typing import Any, BinaryIO, Dict, List, Optional, Union

import torch

from ..graph._gc import gc_paused
from ..graph.graph_module import GraphModule
from .errors import SerializationError
from .modules import ModuleReader, ModuleWriter
from .tensors import TensorReader, TensorWriter

__all__ = ["save", "load", "FORMAT_NAME", "FORMAT_VERSION", "HEADER_NAME"]

FORMAT_NAME = "symtrace.GraphModule"
FORMAT_VERSION = 2  # 2: entry guards are expression trees (1 stored them as text)
HEADER_NAME = "symtrace.json"
MAX_HEADER_BYTES = 1 << 30
MAX_ENTRIES = 1 << 20  # zip entries read before the header says how many there should be
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length

PathOrFile = Union[str, "os.PathLike[str]", BinaryIO]


def save(gm: GraphModule, f: PathOrFile) -> None:
    """Save ``gm`` (graph, node meta, entry guards, submodules, parameters, buffers and plain
    attributes) to ``f``, a path or a writable binary file.

    Nothing is pickled: call targets and module classes are stored by name and must be on the
    allow-list that :func:`load` resolves them through (register your own with
    :func:`register_target`). Raises :class:`SerializationError`, before writing anything, when
    the module holds state the format cannot represent. Node or module ``meta`` values that
    cannot be stored are left out with one warning naming their keys.
    """
    if not isinstance(gm, GraphModule):
        raise SerializationError(f"save expects a symtrace GraphModule, got {type(gm).__name__}")
    tensors = TensorWriter()
    dropped_nodes: Dict[str, int] = {}
    dropped_module: List[str] = []
    with gc_paused():  # the records are garbage once written: free them before the GC runs again
        modules = ModuleWriter(tensors, dropped_nodes, dropped_module)
        root = modules.add(gm, "")
        version = getattr(sys.modules.get("symtrace"), "__version__", "")
        header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "byteorder": "little",
                  "torch_version": str(torch.__version__), "symtrace_version": version, "root": root,
                  "modules": modules.records, "tensors": tensors.records, "storages": tensors.storage_records()}
        data = json.dumps(header, separators=(",", ":"), allow_nan=False).encode("utf-8")
        header = modules = None
        if isinstance(f, (str, os.PathLike)):
            _write_atomically(os.fspath(f), data, tensors)
        else:
            _write(f, data, tensors)
    if dropped_nodes or dropped_module:
        parts = [f"{k!r} ({n} node{'s' if n != 1 else ''})" for k, n in dropped_nodes.items()] + dropped_module
        warnings.warn("symtrace.serialize.save left out meta values it cannot store: " + ", ".join(parts)
                      + " (only numbers, strings, containers, dtypes, devices, tensors, TensorMeta and "
                      "source locations are kept)", stacklevel=2)


def _write(f: BinaryIO, header: bytes, tensors: TensorWriter) -> None:
    with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        zf.writestr(HEADER_NAME, header)
        tensors.write(zf)


def _write_atomically(path: str, header: bytes, tensors: TensorWriter) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".symtrace-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as out:
            _write(out, header, tensors)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def load(f: PathOrFile, map_location: Any = None) -> GraphModule:
    """Load a GraphModule saved by :func:`save` from a path or a readable binary file.

    Nothing in the file is executed: call targets, classes and methods resolve only through
    the allow-list (torch, operator, math, safe builtins, symtrace's own helpers and what
    :func:`register_target` added), and guard expressions are checked against an ``ast``
    allow-list. ``map_location`` (e.g. ``"cpu"``) puts every tensor on that device. A truncated,
    corrupted or hostile file raises :class:`SerializationError`; a missing file the usual
    ``OSError``.
    """
    location = None
    if map_location is not None:
        try:
            location = torch.device(map_location)
        except (RuntimeError, TypeError) as e:
            raise SerializationError(f"map_location={map_location!r} is not a device: {e}") from None
    if isinstance(f, (str, os.PathLike)):
        name = os.fspath(f)
        with open(name, "rb") as fh:
            return _load_guarded(fh, name, location)
    return _load_guarded(f, getattr(f, "name", "<file>"), location)


def _load_guarded(fh: BinaryIO, name: Any, location: Optional[torch.device]) -> GraphModule:
    try:
        with gc_paused():
            return _load(fh, location)
    except SerializationError as e:
        raise SerializationError(f"cannot load {name}: {e}") from None
    except Exception as e:  # anything a damaged file provokes (zip, json, torch) becomes one error type
        raise SerializationError(f"cannot load {name}: the file is damaged or not a symtrace file "
                                 f"({type(e).__name__}: {_clip(str(e))})") from e


def _clip(text: str, n: int = 300) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def _load(fh: BinaryIO, location: Optional[torch.device]) -> GraphModule:
    try:
        zf = zipfile.ZipFile(fh, "r")
    except zipfile.BadZipFile as e:
        raise SerializationError(f"not a symtrace file (not a zip archive: {e})") from None
    try:
        return _read_archive(fh, zf, location)
    except zipfile.BadZipFile as e:   # newer Pythons' zipfile checks some layouts itself
        what = "entries overlap in the archive" if "verlap" in str(e) else "the archive is damaged"
        raise SerializationError(f"{what} ({e})") from None


def _read_archive(fh: BinaryIO, zf: zipfile.ZipFile, location: Optional[torch.device]) -> GraphModule:
    with zf:
        infos: Dict[str, zipfile.ZipInfo] = {}
        if len(zf.infolist()) > MAX_ENTRIES:
            raise SerializationError(f"the archive has {len(zf.infolist())} entries, more than the limit "
                                     f"{MAX_ENTRIES}")
        for info in zf.infolist():
            if info.filename in infos:
                raise SerializationError(f"the archive holds {info.filename!r} twice")
            infos[info.filename] = info
        size = _size_of(fh)
        _check_layout(fh, zf, size)

        def entry(entry_name: str, limit: int) -> zipfile.ZipInfo:
            info = infos.get(entry_name)
            if info is None:
                raise SerializationError(f"the archive has no {entry_name!r} entry (truncated or not a symtrace file)")
            if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
                raise SerializationError(f"{entry_name!r} is compressed or encrypted; symtrace files store "
                                         "entries as they are")
            if info.file_size != info.compress_size or info.file_size > limit or (
                    size is not None and info.file_size > size):
                raise SerializationError(f"{entry_name!r} claims {info.file_size} bytes, more than the file holds")
            return info

        def read_blob(entry_name: str, nbytes: int) -> bytearray:
            info = entry(entry_name, 1 << 62)
            if info.file_size != nbytes:
                raise SerializationError(f"{entry_name!r} holds {info.file_size} bytes, but the tensor table "
                                         f"says {nbytes}")
            buf = bytearray(nbytes)
            view = memoryview(buf)
            with zf.open(info) as src:
                got = 0
                while got < nbytes:
                    n = src.readinto(view[got:])
                    if not n:
                        break
                    got += n
                if got != nbytes or src.read(1):
                    raise SerializationError(f"{entry_name!r} is truncated")
            return buf

        raw = zf.read(entry(HEADER_NAME, MAX_HEADER_BYTES))
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as e:
            raise SerializationError(f"the header {HEADER_NAME!r} is not valid JSON ({_clip(str(e), 120)})") from None
        _check_header(doc)
        _check_names(infos, doc.get("storages"))
        tensors = TensorReader(doc.get("tensors"), doc.get("storages"), read_blob, location)
        gm = ModuleReader(doc.get("modules"), tensors, doc["version"]).build_root(doc.get("root", 0))
        if not isinstance(gm, GraphModule):
            raise SerializationError("the root module is not a GraphModule")
        return gm


def _check_layout(fh: BinaryIO, zf: zipfile.ZipFile, size: Optional[int]) -> None:
    """Refuse an archive whose entries overlap or leave the file, before reading any of them.

    Each entry spans its local header (read here: the name and extra field lengths there, not
    the central directory's, decide where zipfile finds the data) and ``compress_size`` bytes
    of data; the spans must lie before the central directory and not overlap, so the entries
    together hold at most the file's bytes however the central directory points at them.
    """
    end = getattr(zf, "start_dir", None)
    if end is None or (size is not None and end > size):
        end = size
    spans = []
    for info in zf.infolist():
        start = info.header_offset
        if start < 0 or (end is not None and start + _LOCAL_HEADER.size > end):
            raise SerializationError(f"the archive entry {info.filename!r} starts outside the file")
        fh.seek(start)
        raw = fh.read(_LOCAL_HEADER.size)
        if len(raw) != _LOCAL_HEADER.size:
            raise SerializationError(f"the archive entry {info.filename!r} is truncated")
        sig, n_name, n_extra = _LOCAL_HEADER.unpack(raw)
        if sig != b"PK\x03\x04":
            raise SerializationError(f"the archive entry {info.filename!r} has no local header where the "
                                     "central directory says")
        stop = start + _LOCAL_HEADER.size + n_name + n_extra + info.compress_size
        if info.compress_size < 0 or (end is not None and stop > end):
            raise SerializationError(f"the archive entry {info.filename!r} runs past the end of its data "
                                     "(into the central directory or out of the file)")
        spans.append((start, stop, info.filename))
    spans.sort()
    for (_, stop, name), (start, _, other) in zip(spans, spans[1:]):
        if start < stop:
            raise SerializationError(f"the archive entries {name!r} and {other!r} overlap (a crafted archive)")


def _check_names(infos: Dict[str, zipfile.ZipInfo], storages: Any) -> None:
    """The archive holds the header and one blob per storage, nothing else."""
    count = len(storages) if isinstance(storages, list) else 0
    for name in infos:
        if name == HEADER_NAME:
            continue
        index = name[len("tensors/"):-len(".bin")] if name.startswith("tensors/") and name.endswith(".bin") else ""
        if not (index.isascii() and index.isdigit() and len(index) <= 18 and str(int(index)) == index
                and int(index) < count):
            raise SerializationError(f"the archive holds {name[:80]!r}, which is neither the header nor the "
                                     f"blob of one of its {count} storages")


def _size_of(fh: BinaryIO) -> Optional[int]:
    try:
        pos = fh.tell()
        end = fh.seek(0, io.SEEK_END)
        fh.seek(pos)
        return end
    except (OSError, AttributeError, ValueError):
        return None


def _check_header(doc: Any) -> None:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise SerializationError(f"not a symtrace file (the header's format is not {FORMAT_NAME!r})")
    version = doc.get("version")
    if type(version) is not int or version < 1:
        raise SerializationError(f"the header has a bad format version {version!r}")
    if version > FORMAT_VERSION:
        raise SerializationError(f"the file has format version {version}, written by a newer symtrace; this "
                                 f"symtrace reads versions up to {FORMAT_VERSION}. Upgrade symtrace to load it")
    if doc.get("byteorder", "little") != "little":
        raise SerializationError(f"unsupported byte order {doc.get('byteorder')!r}")
    if sys.byteorder != "little":
        raise SerializationError("loading on a big-endian machine is not supported")
