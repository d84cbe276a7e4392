"""Weight-only int8/int4 Linear on the CPU: the C kernels of :mod:`.woq_csrc`, called through ctypes.

:data:`KERNELS` (a :class:`WoqKernels`) builds its library on first use (through the
toolchain's cache) and checks every instruction set this CPU runs against
:func:`~symtrace.passes.quant.woq.woq_reference` before it answers. The ``"c"`` int8 backend
(:mod:`.int8_cpu`) sends ``woq_linear`` calls here; what the kernels do not cover (other
dtypes or devices, no compiler) runs the reference in torch.

Instruction sets are chosen at run time (``st_woq_cpu_isa``: AVX-512 with VNNI, AVX-512F, else
AVX2+FMA, else portable C); ``isa=`` picks a lower one (tests and benchmarks use it to check and
time each). ``activations="int8"`` runs the integer kernels of :mod:`.woq_a8_csrc` (AVX512-VNNI,
else AVX2) for int4 weights and symmetric int8 ones within [-127, 127]; elsewhere (the portable
level, int8 with zero points, K not a multiple of 32, fewer than 4 output rows, NaN or inf in
``x``) ``x`` is rounded in torch and the float kernels run.
No plan is saved: per weight tensor, the call's constants (scales and zero points as float32,
the bias) are built once and cached (:mod:`.int8_cache`).
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Optional

import torch

from ..passes.quant.woq import check_stored, group_count, round_activations, woq_reference
from . import toolchain
from .int8_cache import tensor_version, weight_cached
from .woq_csrc import ISAS, source

__all__ = ["WoqKernels", "KERNELS", "WoqSite", "c_binding"]

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class _StWoq(ctypes.Structure):
    _fields_ = [("w", _P), ("scale", _P), ("zero", _P), ("bias", _P), ("N", _I64), ("K", _I64), ("G", _I64),
                ("gs", _I64), ("ldw", _I64), ("zdef", ctypes.c_float), ("bits", _I32), ("blocked", _I32)]


class _Plan:
    """One weight's constants as the C ``st_woq`` struct; keeps the tensors it points into alive.
    :meth:`blocked_address`: the same weight in row blocks (see ``st_wptr`` in :mod:`.woq_csrc`),
    made on first use: a copy of the quantized weight that the AVX-512 float kernels stream faster
    and the integer (``activations="int8"``) kernels require."""

    __slots__ = ("tensors", "n", "k", "struct", "address", "_blocked", "_integer")

    def __init__(self, qweight, scale, zero, bias, bits, group_size, k):
        n = qweight.shape[0]
        g = group_count(k, group_size)
        scale = scale.detach().to(torch.float32).contiguous()
        zero = None if zero is None else zero.detach().to(torch.float32).contiguous()
        bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        qweight = qweight.detach().contiguous()
        self.tensors = (qweight, scale, zero, bias)
        self.n, self.k = n, k
        ptr = (lambda t: None if t is None else t.data_ptr())
        self.struct = _StWoq(qweight.data_ptr(), scale.data_ptr(), ptr(zero), ptr(bias), n, k, g,
                             max(k, 1) if group_size is None else group_size, qweight.shape[1] if n else 0,
                             0.0 if bits == 8 else 8.0, bits, 0)
        self.address = ctypes.addressof(self.struct)
        self._blocked = None
        self._integer = None

    def integer_products(self) -> bool:
        """Whether the ``activations="int8"`` kernels can take this weight: int4, or symmetric
        int8 with no -128 (they move ``x``'s sign onto the weight, and -(-128) is not a byte);
        checked once."""
        if self._integer is None:
            s = self.struct
            self._integer = s.bits == 4 or (s.bits == 8 and not s.zero and s.zdef == 0.0
                                            and (self.tensors[0].numel() == 0 or int(self.tensors[0].min()) > -128))
        return self._integer

    def blocked_address(self) -> int:
        """The address of a struct over the row-blocked copy (0 where K is not a multiple of 32)."""
        if self._blocked is None:
            self._blocked = (0,)
            qweight = self.tensors[0]
            if self.k % 32 == 0 and self.n >= 4:
                s = self.struct
                w = _row_blocks(qweight, s.bits)
                blocked = _StWoq(w.data_ptr(), s.scale, s.zero, s.bias, s.N, s.K, s.G, s.gs, s.ldw, s.zdef, s.bits, 1)
                self._blocked = (ctypes.addressof(blocked), blocked, w)
        return self._blocked[0]


class WoqKernels:
    """The compiled weight-only kernels (see the module docstring)."""

    def __init__(self):
        self._lib = None
        self._ok: Optional[bool] = None
        self._lock = threading.Lock()
        self.reason = ""  # why available() is False
        self.cpu_isa = 0  # the best instruction set this CPU runs (after available())

    def _load(self):
        lib = toolchain.load_library(source())
        lib.st_woq_linear.argtypes = [_P, _P, _I64, _I64, _P, _I32, _I32]
        lib.st_woq_linear.restype = ctypes.c_int
        lib.st_woq_cpu_isa.restype = ctypes.c_int
        lib.st_woq_linear_a8.argtypes = [_P, _P, _I64, _I64, _P, _I32, _I32]
        lib.st_woq_linear_a8.restype = ctypes.c_int
        self._one_stream = ctypes.c_int.in_dll(lib, "st_a8_one_stream")   # (see one_stream)
        return lib

    def available(self) -> bool:
        return toolchain.load_once(self, self._load, self._self_check)

    def _self_check(self) -> str:
        self.cpu_isa = int(self._lib.st_woq_cpu_isa())
        bad = _selftest(self)
        return f"the {bad} kernels disagree with the reference" if bad else ""

    @property
    def isa(self) -> str:
        """The instruction set used by default here: ``"avx512"``, ``"avx2"`` or ``"portable"``."""
        return ISAS[self.cpu_isa] if self.available() else "none"

    def isas(self):
        """The instruction sets this CPU can run (names), best last."""
        return [ISAS[i] for i in range(self.cpu_isa + 1)] if self.available() else []

    @contextlib.contextmanager
    def one_stream(self):
        """Within it, a GEMV with int8 activations (int4 or symmetric int8 weights) reads its
        weight as one sequential stream, as before ``st_a2_streams_1``/``st_a8_streams_1`` (same results;
        for benchmarks and tests to compare the two orders). It sets the library's flag
        ``st_a8_one_stream`` (yielded; None without kernels), so other threads' calls follow it
        too."""
        if not self.available():
            yield None
            return
        flag = self._one_stream
        old, flag.value = flag.value, 1
        try:
            yield flag
        finally:
            flag.value = old

    def linear(self, x, qweight, scale, zero, bias, bits: int, group_size, in_features: int,
               isa: Optional[str] = None, activations: str = "float") -> Optional[torch.Tensor]:
        """``woq_reference(..., activations)`` computed by the kernels, or None where they do
        not apply (not float32 CPU tensors, or no usable library). ``isa``: force an
        instruction set (one of :meth:`isas`)."""
        if not (x.dtype is torch.float32 and x.is_cpu and qweight.is_cpu and self.available()):
            return None
        x = x.resolve_neg()   # (a negative view's memory holds -x; the kernels read memory)
        level = self.cpu_isa if isa is None else _isa_level(isa, self.cpu_isa)
        return self._call(_plan_for(qweight, scale, zero, bias, bits, group_size, in_features), x, level, activations)

    def _call(self, plan: _Plan, x: torch.Tensor, level: int, activations: str = "float") -> torch.Tensor:
        if activations == "int8":
            out = self._call_a8(plan, x, level)
            if out is not None:
                return out
            x = round_activations(x)
        x2, m, ldx = _rows(x, plan.k)
        out = torch.empty(x.shape[:-1] + (plan.n,), dtype=torch.float32)
        rc = self._lib.st_woq_linear(_address(plan, level, False), x2.data_ptr(), m, ldx, out.data_ptr(), level,
                                     torch.get_num_threads())
        if rc == -1:
            raise MemoryError(f"woq_linear: no memory for the kernel's temporaries (a padded copy of the "
                              f"{tuple(x2.shape)} input, or the threads' counters)")
        if rc != 0:
            raise RuntimeError(f"woq_linear: the library has no kernels for isa {level} (error {rc})")
        return out


    def _call_a8(self, plan: _Plan, x: torch.Tensor, level: int) -> Optional[torch.Tensor]:
        """The integer kernels where they apply (``level`` AVX2 or above; int4, or symmetric int8
        within [-127, 127]; row-blocked weights), else None."""
        address = _address(plan, level, True)
        if not address:
            return None   # (int8 with zero points or a -128, no AVX2: the float kernels)
        x2, m, ldx = _rows(x, plan.k)
        out = torch.empty(x.shape[:-1] + (plan.n,), dtype=torch.float32)
        rc = self._lib.st_woq_linear_a8(address, x2.data_ptr(), m, ldx, out.data_ptr(), level, torch.get_num_threads())
        if rc == -1:
            raise MemoryError(f"woq_linear: no memory for the rounded copy of the {tuple(x.shape)} input")
        return out if rc == 0 else None  # -3: NaN/inf in x (rounded in torch, float kernels)


_AVX2 = {v: k for k, v in ISAS.items()}["avx2"]
_AVX512 = {v: k for k, v in ISAS.items()}["avx512"]


def _plan_for(qweight, scale, zero, bias, bits: int, group_size, k: int) -> "_Plan":
    """The plan of this weight and its constants, cached while they live and are not written."""
    return weight_cached(qweight, ("woq", bits, group_size, k, id(scale), _version(scale), id(zero), _version(zero),
                                   id(bias), _version(bias)),
                         lambda: _make_plan(qweight, scale, zero, bias, bits, group_size, k))


def _address(plan: "_Plan", level: int, integer: bool) -> int:
    """The struct address the kernels of ``level`` read the weight through: the row-blocked copy
    for the integer kernels (0 where they do not apply: below AVX2, int8 with zero points or a
    -128, K not a multiple of 32, fewer than 4 rows) and for AVX-512's float kernels, else the
    weight as stored."""
    if integer:
        return plan.blocked_address() if level >= _AVX2 and plan.integer_products() else 0
    return (plan.blocked_address() or plan.address) if level >= _AVX512 else plan.address


def _rows(x: torch.Tensor, k: int):
    """``(x2, M, ldx)``: ``x`` as M rows of ``k`` inputs with unit stride, and the row stride."""
    x2 = x.reshape(x.shape[:-1].numel(), k)
    m = x2.shape[0]
    if m > 1 and x2.stride(1) != 1 or m == 1 and not x2.is_contiguous():
        x2 = x2.contiguous()
    return x2, m, x2.stride(0) if m > 1 else k


def _row_blocks(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """``qweight`` (N, K) int8 or (N, K / 2) packed int4, K a multiple of 32, rearranged for
    ``st_wptr``'s blocked layout: (ceil(N / 4), K / 32, 4, one chunk of 32 weights) bytes, the
    rows past N zero (never read)."""
    n, ldw = qweight.shape
    w = qweight.detach().contiguous()
    if n % 4:
        w = torch.cat([w, w.new_zeros((4 - n % 4, ldw))])
    chunk = 32 * bits // 8
    return w.view(w.shape[0] // 4, 4, ldw // chunk, chunk).permute(0, 2, 1, 3).contiguous()


class _Binding:
    """What a :class:`WoqSite` bound: the weight's tensors, the versions they had, the kernel's
    struct address and constants, and the last input shape with its output shape."""

    __slots__ = ("tensors", "tracked", "address", "n", "k", "level", "integer", "plan", "last")

    def __init__(self, tensors, address, n, k, level, integer, plan):
        self.tensors = tensors
        # (tensor, version) of those that keep a counter (inference tensors have none and cannot
        # be written outside inference mode)
        self.tracked = tuple((t, t._version) for t in tensors if t is not None and not t.is_inference())
        self.address, self.n, self.k, self.level, self.integer = address, n, k, level, integer
        self.plan = plan   # (what address points into)
        self.last = (None, None)   # (input shape, output shape), replaced whole (threads share a site)

    def unchanged(self) -> bool:
        for t, version in self.tracked:
            if t._version != version:
                return False
        return True


class WoqSite:
    """One ``woq_linear`` call of a lowered CPU wrapper (``_woq3(x, qweight, scale, zero,
    bias)``): the first call binds the weight's plan, later calls with the same weight tensors
    at the same versions and a float32 CPU ``x`` go straight to the kernel, skipping the
    backend's dispatch and plan lookup (a decode step makes dozens of these calls). Anything
    else, and any kernel error, runs :func:`woq_linear` as the graph would."""

    __slots__ = ("kwargs", "_bound")

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self._bound = None

    def __call__(self, x, qweight, scale, zero, bias):
        b = self._bound
        if (b is None or type(x) is not torch.Tensor or x.dtype is not torch.float32 or not x.is_cpu
                or qweight is not b.tensors[0] or scale is not b.tensors[1] or zero is not b.tensors[2]
                or bias is not b.tensors[3] or not b.unchanged()):
            return self._bind(x, qweight, scale, zero, bias)
        if x.is_neg():   # (a negative view: its memory holds -x)
            return self._slow(x, qweight, scale, zero, bias)
        shape, last = x.shape, b.last
        if shape == last[0] and x.is_contiguous():   # (the decode step: rows of k, dense)
            x2, m, ldx = x, x.numel() // b.k, b.k
            out_shape = last[1]
        else:
            if shape[-1] != b.k:
                return self._slow(x, qweight, scale, zero, bias)
            x2, m, ldx = _rows(x, b.k)
            out_shape = shape[:-1] + (b.n,)
            b.last = (shape, out_shape)
        out = torch.empty(out_shape, dtype=torch.float32)
        lib = KERNELS._lib
        call = lib.st_woq_linear_a8 if b.integer else lib.st_woq_linear
        if call(b.address, x2.data_ptr(), m, ldx, out.data_ptr(), b.level,
                torch.get_num_threads()) != 0:   # (NaN in x for the integer kernels, no memory: as the graph)
            return self._slow(x, qweight, scale, zero, bias)
        return out

    def _slow(self, x, qweight, scale, zero, bias):
        from ..passes.quant.kernels import woq_linear
        return woq_linear(x, qweight, scale, zero, bias, **self.kwargs)

    def _bind(self, x, qweight, scale, zero, bias):
        out = self._slow(x, qweight, scale, zero, bias)
        self._bound = None
        if type(x) is torch.Tensor and x.dtype is torch.float32 and x.is_cpu:
            got = c_binding(qweight, scale, zero, bias, self.kwargs)
            if got is not None:   # (else: the integer kernels do not apply, another backend, ...)
                _, address, level, n, plan = got
                self._bound = _Binding((qweight, scale, zero, bias), address, n, self.kwargs["in_features"], level,
                                       self.kwargs.get("activations", "float") == "int8", plan)
        return out


def c_binding(qweight, scale, zero, bias, kwargs: dict) -> Optional[tuple]:
    """``(function, address, level, n, plan)`` for a C caller of a ``woq_linear`` call with
    these stored tensors and keyword arguments on float32 CPU input: the kernel entry's
    address (``st_woq_linear`` or ``st_woq_linear_a8``, called as ``function(address, x, m,
    ldx, y, level, nt)``), the plan's struct address, the isa argument, the output features and
    the plan (keep it alive while ``address`` is used). None where :class:`WoqSite` would not
    bind either: another backend or keyword, tensors off the CPU, no kernels here, or integer
    activations the kernels do not cover for this weight. The caller must make sure the tensors
    are not replaced or written while it uses the binding."""
    kw = kwargs
    if not (kw.get("backend") == "c" and set(kw) <= {"bits", "group_size", "in_features", "backend", "activations"}
            and type(kw.get("in_features")) is int and kw["in_features"] > 0 and type(kw.get("bits")) is int):
        return None
    tensors = [t for t in (qweight, scale, zero, bias) if t is not None]
    if not all(isinstance(t, torch.Tensor) and t.is_cpu for t in tensors) or not KERNELS.available():
        return None
    try:
        plan = _plan_for(qweight, scale, zero, bias, kw["bits"], kw.get("group_size"), kw["in_features"])
    except (ValueError, TypeError, RuntimeError):   # (not a stored weight these kernels take)
        return None
    level = KERNELS.cpu_isa
    integer = kw.get("activations", "float") == "int8"
    address = _address(plan, level, integer)
    if not address:
        return None
    fn = KERNELS._lib.st_woq_linear_a8 if integer else KERNELS._lib.st_woq_linear
    return ctypes.cast(fn, ctypes.c_void_p).value, address, level, plan.n, plan


def _version(t: Optional[torch.Tensor]) -> int:
    """A tensor's write counter (-1 for None; inference tensors have none and cannot be
    written outside inference mode)."""
    return -1 if t is None else tensor_version(t)


def _isa_level(name: str, best: int) -> int:
    levels = {v: k for k, v in ISAS.items()}
    if name not in levels or levels[name] > best:
        raise ValueError(f"isa={name!r} is not available on this CPU; choose one of "
                         f"{[ISAS[i] for i in range(best + 1)]}")
    return levels[name]


def _make_plan(qweight, scale, zero, bias, bits, group_size, k) -> _Plan:
    check_stored(qweight, scale, zero, bias, bits, group_size, k)
    return _Plan(qweight, scale, zero, bias, bits, group_size, k)


def _selftest(kern: WoqKernels) -> str:
    """Every (isa, bits, symmetric) against the reference on odd shapes; '' or what failed."""
    from ..passes.quant.woq import quantize_weight_only
    g = torch.Generator().manual_seed(0)
    for n, k in ((37, 70), (37, 64)):   # (K = 64: the row-blocked layout too)
        w = torch.randn(n, k, generator=g)
        bias = torch.randn(n, generator=g)
        for level in range(kern.cpu_isa + 1):
            for bits, gs, sym in ((8, None, True), (8, 32, False), (4, 32, True), (4, 64, False), (4, None, True)):
                q = quantize_weight_only(w, bits, gs, sym)
                plan = _make_plan(q.qweight, q.scale, q.zero, bias, bits, gs, k)
                for m, act in ((1, "float"), (5, "float"), (1, "int8")):
                    x = torch.randn(m, k, generator=g)
                    want = woq_reference(x, q.qweight, q.scale, q.zero, bias, bits, gs, k, act)
                    got = kern._call(plan, x, level, act)
                    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
                        return f"{ISAS[level]} int{bits}" + (" (int8 activations)" if act == "int8" else "")
    return ""


KERNELS = WoqKernels()
