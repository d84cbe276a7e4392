"""Tensors in a saved file: a table of tensor records over raw little-endian storage blobs.

A tensor record is ``{"storage": i, "dtype": "float32", "shape": [...], "stride": [...],
"offset": k, "requires_grad": b, "param": b}`` (``offset`` and strides in elements); storage
``i`` is the zip entry ``tensors/<i>.bin`` holding its bytes, plus ``{"device": "cpu",
"nbytes": n}``. Tensors that share storage (tied weights, views) share a blob, and the same
tensor object referenced twice is one record, so aliasing survives a round trip.
"""
from __future__ import annotations

import ctypes
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .errors import SerializationError, Unencodable

__all__ = ["TensorWriter", "TensorReader", "DTYPES", "dtype_name", "parse_device", "MAX_NDIM"]

DTYPES: Dict[str, torch.dtype] = {}
for _name in ("float32", "float64", "float16", "bfloat16", "complex64", "complex128", "complex32", "uint8",
              "int8", "int16", "int32", "int64", "bool", "uint16", "uint32", "uint64", "float8_e4m3fn",
              "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "qint8", "quint8", "qint32"):
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        DTYPES[_name] = _dt
_DTYPE_NAMES = {dt: n for n, dt in DTYPES.items()}
_DEVICE_TYPES = frozenset({"cpu", "cuda", "mps", "xpu", "hpu", "meta", "privateuseone", "mtia"})
_STORABLE = frozenset(dt for name, dt in DTYPES.items() if not name.startswith(("qint", "quint")))
MAX_NDIM = 64


def dtype_name(dt: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        raise Unencodable(f"the dtype {dt} cannot be saved")
    return name


def parse_dtype(name: Any, where: str) -> torch.dtype:
    dt = DTYPES.get(name) if isinstance(name, str) else None
    if dt is None:
        raise SerializationError(f"{where}: unknown dtype {name!r}")
    return dt


def parse_device(text: Any, where: str) -> torch.device:
    if not isinstance(text, str) or len(text) > 40:
        raise SerializationError(f"{where}: {text!r} is not a device")
    kind, _, index = text.partition(":")
    if kind not in _DEVICE_TYPES or (index and not (index.isdigit() and len(index) <= 4)):
        raise SerializationError(f"{where}: {text!r} is not a device")
    return torch.device(text)


class TensorWriter:
    """Collects the tensors of a module tree for saving (each object once)."""

    def __init__(self):
        self.records: List[dict] = []
        self.blobs: List[Tuple[str, Any]] = []  # (zip name, tensor whose storage to write)
        self._ids: Dict[int, int] = {}
        self._keep: List[torch.Tensor] = []  # keeps ids stable while saving
        self._storages: Dict[tuple, int] = {}

    def add(self, t: torch.Tensor, where: str) -> int:
        """The index of ``t`` in the table (added on first sight)."""
        hit = self._ids.get(id(t))
        if hit is not None:
            return hit
        if type(t) not in (torch.Tensor, nn.Parameter):
            raise Unencodable(f"{where}: a {type(t).__name__} (tensor subclass) cannot be saved; "
                                     "only plain tensors and nn.Parameter")
        if t.layout is not torch.strided or t.is_quantized or t.is_nested or t.device.type == "meta":
            what = "a meta tensor (it has no data)" if t.device.type == "meta" else f"a {t.layout} tensor" \
                if t.layout is not torch.strided else "a quantized tensor" if t.is_quantized else "a nested tensor"
            raise Unencodable(f"{where}: {what} cannot be saved; only strided tensors with data")
        if t.dtype not in _STORABLE:
            raise Unencodable(f"{where}: tensors of dtype {t.dtype} cannot be saved")
        data = t.detach()
        if data.is_conj() or data.is_neg():
            data = data.resolve_conj().resolve_neg()
        storage = data.untyped_storage()
        nbytes = storage.nbytes()
        key = (storage.data_ptr(), str(data.device), nbytes) if nbytes else ("empty", len(self.records))
        sid = self._storages.get(key)
        if sid is None:
            sid = self._storages[key] = len(self.blobs)
            self.blobs.append((f"tensors/{sid}.bin", data))
        rec = {"storage": sid, "dtype": dtype_name(t.dtype), "shape": list(data.shape),
               "stride": list(data.stride()), "offset": data.storage_offset(),
               "requires_grad": bool(t.requires_grad), "param": type(t) is nn.Parameter}
        idx = len(self.records)
        self.records.append(rec)
        self._ids[id(t)] = idx
        self._keep.append(t)
        return idx

    def storage_records(self) -> List[dict]:
        return [{"device": str(d.device), "nbytes": d.untyped_storage().nbytes()} for _, d in self.blobs]

    def write(self, zf) -> None:
        """Write every storage blob (raw bytes, little-endian) into the open zip file."""
        if sys.byteorder != "little":
            raise SerializationError("saving on a big-endian machine is not supported")
        for name, data in self.blobs:
            storage = data.untyped_storage()
            if storage.device.type != "cpu":
                storage = storage.cpu()
            n = storage.nbytes()
            with zf.open(name, "w", force_zip64=n > (1 << 30)) as f:
                if n:
                    f.write(memoryview((ctypes.c_char * n).from_address(storage.data_ptr())))


class TensorReader:
    """Rebuilds tensors from a file's tensor table, checking every record against its blob."""

    def __init__(self, records: Any, storages: Any, read_blob, map_location: Optional[torch.device]):
        if not isinstance(records, list) or not isinstance(storages, list):
            raise SerializationError("the tensor table is not a list")
        self.records = records
        self.storage_recs = storages
        self.read_blob = read_blob
        self.map_location = map_location
        self._storages: Dict[int, torch.Tensor] = {}
        self._tensors: Dict[int, torch.Tensor] = {}

    def get(self, idx: Any, where: str) -> torch.Tensor:
        if type(idx) is not int or not 0 <= idx < len(self.records):
            raise SerializationError(f"{where}: tensor reference {idx!r} is out of range")
        t = self._tensors.get(idx)
        if t is None:
            t = self._tensors[idx] = self._build(idx, f"{where} (tensor {idx})")
        return t

    def _storage(self, sid: Any, where: str) -> torch.Tensor:
        if type(sid) is not int or not 0 <= sid < len(self.storage_recs):
            raise SerializationError(f"{where}: storage reference {sid!r} is out of range")
        hit = self._storages.get(sid)
        if hit is not None:
            return hit
        rec = self.storage_recs[sid]
        if not isinstance(rec, dict):
            raise SerializationError(f"{where}: storage record {sid} is not an object")
        nbytes = rec.get("nbytes")
        if type(nbytes) is not int or nbytes < 0:
            raise SerializationError(f"{where}: storage {sid} has a bad byte count {nbytes!r}")
        device = parse_device(rec.get("device"), where)
        buf = self.read_blob(f"tensors/{sid}.bin", nbytes)
        flat = torch.frombuffer(buf, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        target = self.map_location if self.map_location is not None else device
        if target.type != "cpu":
            try:
                flat = flat.to(target)
            except (RuntimeError, AssertionError, AttributeError) as e:
                raise SerializationError(
                    f"{where}: the tensors were saved on {device}, which is not available here ({e}); "
                    "pass map_location='cpu' to load them on the CPU") from None
        self._storages[sid] = flat
        return flat

    def _build(self, idx: int, where: str) -> torch.Tensor:
        rec = self.records[idx]
        if not isinstance(rec, dict):
            raise SerializationError(f"{where}: the record is not an object")
        dtype = parse_dtype(rec.get("dtype"), where)
        shape, stride, offset = rec.get("shape"), rec.get("stride"), rec.get("offset")
        if not (_int_list(shape) and _int_list(stride) and len(shape) == len(stride) and len(shape) <= MAX_NDIM):
            raise SerializationError(f"{where}: shape {shape!r} / stride {stride!r} are not lists of "
                                     f"non-negative ints of the same length (at most {MAX_NDIM})")
        if type(offset) is not int or offset < 0:
            raise SerializationError(f"{where}: bad storage offset {offset!r}")
        flat = self._storage(rec.get("storage"), where)
        if dtype not in _STORABLE:
            raise SerializationError(f"{where}: tensors of dtype {dtype} are not stored in symtrace files")
        itemsize = dtype.itemsize
        nbytes = flat.numel()
        numel = 1
        for s in shape:
            numel *= s
        extent = 0 if numel == 0 else offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride))
        if extent * itemsize > nbytes:
            raise SerializationError(
                f"{where}: shape {shape} with strides {stride} at offset {offset} needs {extent * itemsize} "
                f"bytes, but its storage holds {nbytes} (the file is corrupted)")
        if nbytes % itemsize:
            raise SerializationError(f"{where}: storage of {nbytes} bytes is not a whole number of {dtype} items")
        if dtype is torch.bool and nbytes and bool((flat > 1).any()):
            raise SerializationError(f"{where}: a bool tensor holds bytes other than 0 and 1")
        base = flat.view(dtype) if nbytes else torch.empty(0, dtype=dtype, device=flat.device)
        t = torch.as_strided(base, shape, stride, offset) if numel else \
            torch.empty_strided(shape, stride, dtype=dtype, device=flat.device)
        rg = rec.get("requires_grad", False)
        if type(rg) is not bool or type(rec.get("param", False)) is not bool:
            raise SerializationError(f"{where}: requires_grad/param must be booleans")
        if rg and not (dtype.is_floating_point or dtype.is_complex):
            raise SerializationError(f"{where}: a {dtype} tensor cannot require grad")
        if rec.get("param", False):
            return nn.Parameter(t, requires_grad=rg)
        return t.requires_grad_(rg) if rg else t


def _int_list(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is int and 0 <= x < (1 << 62) for x in v)
