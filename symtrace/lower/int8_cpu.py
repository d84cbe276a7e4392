"""The ``"c"`` int8 backend: symtrace-generated C kernels for int8 Linear (static and dynamic).

:mod:`symtrace.passes.quant.registry` names :data:`BACKEND` ``"c"`` in its fixed table (this
module is imported on first use of that name; importing it registers nothing), with a priority
above oneDNN, so ``lower(ref, "auto")`` / ``quantize_dynamic(gm, "auto")`` pick it wherever a
C compiler is found and its self-check passes. Its Linear kernels (:mod:`.int8_csrc`: int8
weights packed once per weight tensor, exact int32 accumulation with AVX512-VNNI where the CPU
has it, the requantize/bias/ReLU epilogue fused, dynamic activation quantization fused) give
the portable backend's integers exactly. :meth:`CInt8Backend.linear_edges` also takes a float
input (quantized inside the kernel with the static parameters) and/or returns the dequantized
float result, so a lowered MLP makes one call per layer. A call costs microseconds of dispatch,
where oneDNN's AMX kernels spend ~50-300 us per call at batch 1. Convolutions go to oneDNN
when usable, else to the portable backend.

Anything the kernels do not cover (non-CPU tensors, other dtypes) runs on the portable backend.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Optional

import torch

from ..passes.quant.backend import Int8Backend
from ..passes.quant.registry import backend_available, get_backend
from . import toolchain
from .int8_cache import tensor_version, weight_cached
from .int8_csrc import SOURCE
from .int8_portable import requant_terms
from ..passes.quant.woq import round_activations
from .woq_cpu import KERNELS as WOQ_KERNELS

__all__ = ["CInt8Backend", "pack_weight", "BACKEND"]

GROUP = 64  # output channels per packed group (ST_GW in the C source)
_P = ctypes.c_void_p
_I64, _I32, _F64 = ctypes.c_int64, ctypes.c_int32, ctypes.c_double
_PORTABLE = get_backend("portable")  # (the exact reference the C kernels agree with)


def pack_weight(w: torch.Tensor):
    """``(packed, rowsum)`` for an int8 weight (N, K): the kernels' layout (groups of 64 output
    channels x 4 inputs, zero-padded; see :mod:`.int8_csrc`) and the int32 row sums, padded to a
    multiple of 64 channels."""
    if w.dtype is not torch.int8 or w.dim() != 2:
        raise TypeError(f"pack_weight expects a 2-D int8 weight, got {w.dtype} of shape {tuple(w.shape)}")
    n, k = w.shape
    g, kg = -(-n // GROUP), -(-k // 4)
    padded = torch.zeros(g * GROUP, kg * 4, dtype=torch.int8)
    padded[:n, :k] = w.detach()
    packed = padded.reshape(g, GROUP, kg, 4).permute(0, 2, 1, 3).contiguous()
    return packed, padded.to(torch.int32).sum(1, dtype=torch.int32).contiguous()


_QDTYPES, _F32 = (torch.uint8, torch.int8), (torch.float32,)


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` as a contiguous (M, K) tensor (no copy when it already is one)."""
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    return x2 if x2.is_contiguous() else x2.contiguous()


def _pad64(t: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros(-(-n // GROUP) * GROUP, dtype=torch.float64)
    out[:n] = t.reshape(-1).to(torch.float64)
    return out


class _StPlan(ctypes.Structure):
    _fields_ = [("wp", _P), ("rowsum", _P), ("mult", _P), ("base", _P), ("lo", _F64), ("hi", _F64), ("N", _I64),
                ("K", _I64), ("mode", _I32), ("relu", _I32), ("dqs", _F64), ("dqz", _F64)]


class _Plan:
    """One call site's constants (packed weight, epilogue terms) as the C ``st_plan`` struct;
    keeps the tensors it points into alive."""

    __slots__ = ("packed", "rowsum", "mult", "base", "n", "k", "out_dtype", "struct", "address")

    def __init__(self, pack, mult, base, lo, hi, mode, relu, out_dtype, dq_scale=1.0, dq_zp=0):
        (self.packed, self.rowsum, self.n, self.k), self.mult, self.base = pack, mult, base
        self.out_dtype = out_dtype
        self.struct = _StPlan(self.packed.data_ptr(), self.rowsum.data_ptr(), mult.data_ptr(), base.data_ptr(),
                              lo, hi, self.n, self.k, mode, int(relu), float(dq_scale), float(dq_zp))
        self.address = ctypes.addressof(self.struct)


class CInt8Backend(Int8Backend):
    """int8 Linear in symtrace-generated C (see the module docstring). ``generic=True`` builds
    the plain-C kernels even on a VNNI CPU (for testing); ``name`` is the registry name."""

    def __init__(self, name: str = "c", generic: bool = False):
        self.name = name
        self.generic = generic
        self._lib = None
        self._ok: Optional[bool] = None
        self._lock = threading.Lock()
        self.reason = ""  # why available() is False

    # --- library ------------------------------------------------------------------------
    def _load(self):
        src = ("#define ST_INT8_GENERIC 1\n" if self.generic else "") + SOURCE
        lib = toolchain.load_library(src)
        lib.st_int8_linear.argtypes = [_P, _P, _I64, _I32, _I32, _P, _I32]
        lib.st_int8_linear.restype = ctypes.c_int
        lib.st_int8_linear_f32.argtypes = [_P, _P, _I64, _F64, _I32, _I32, _I32, _P, _I32]
        lib.st_int8_linear_f32.restype = ctypes.c_int
        lib.st_int8_dynamic_linear.argtypes = [_P, _P, _I64, _P, _I32]
        lib.st_int8_dynamic_linear.restype = ctypes.c_int
        lib.st_int8_quantize_dynamic.argtypes = [_P, _I64, _P, _P]
        lib.st_int8_quantize_dynamic.restype = ctypes.c_int
        lib.st_int8_isa.restype = ctypes.c_int
        return lib

    def available(self) -> bool:
        return toolchain.load_once(self, self._load, self._self_check)

    def _self_check(self) -> str:
        return "" if _selftest(self) else "the compiled kernels disagree with the portable backend"

    @property
    def isa(self) -> str:
        """``"avx512_vnni"`` or ``"generic"``: which kernels were compiled (after :meth:`available`)."""
        return "avx512_vnni" if self._lib is not None and self._lib.st_int8_isa() else "generic"

    @staticmethod
    def _fallback_conv():
        return get_backend("onednn" if backend_available("onednn") else "portable")

    def conv2d(self, *args, **kwargs):
        return self._fallback_conv().conv2d(*args, **kwargs)

    # --- linear ---------------------------------------------------------------------------
    @staticmethod
    def _check(x: torch.Tensor, w: torch.Tensor, what: str) -> bool:
        if w.dim() != 2 or x.dim() < 1:
            raise ValueError(f"{what}: expected a 2-D weight and an input with a feature dimension, got weight "
                             f"{tuple(w.shape)} and input {tuple(x.shape)}")
        if x.shape[-1] != w.shape[1]:
            raise ValueError(f"{what}: the input has {x.shape[-1]} features but the weight {tuple(w.shape)} "
                             f"expects {w.shape[1]}")
        return x.device.type == "cpu" and w.device.type == "cpu" and w.dtype is torch.int8

    def _packed(self, w):
        """``(packed, rowsum, N, K)`` for ``w``, cached per weight tensor."""
        return weight_cached(w, ("c-pack",), lambda: pack_weight(w) + tuple(w.shape))

    def _fits(self, x, w, dtypes, what: str = "int8 linear") -> bool:
        """The kernels apply (cheap checks first: this runs on every call); otherwise the caller
        takes the slow path, which explains bad shapes or falls back to the portable backend."""
        if self._ok and x.is_cpu and w.is_cpu and w.dtype is torch.int8 and x.dtype in dtypes \
                and w.dim() == 2 and x.dim() >= 1 and x.shape[-1] == w.shape[1]:
            return True
        return self._check(x, w, what) and x.dtype in dtypes and self.available()

    def linear(self, x, w, w_scale, bias, x_scale, x_zp, out_scale, out_zp, qmin, qmax, post, out_float=False):
        if not self._fits(x, w, _QDTYPES):
            return _PORTABLE.linear(x, w, w_scale, bias, x_scale, x_zp, out_scale, out_zp, qmin, qmax, post, out_float)
        return self._linear(x, w, w_scale, bias, x_scale, x_zp, out_scale, out_zp, qmin, qmax, post, out_float)

    def _linear(self, x, w, w_scale, bias, x_scale, x_zp, out_scale, out_zp, qmin, qmax, post, out_float):
        plan = weight_cached(w, ("c-site", x_scale, out_scale, out_zp, qmin, qmax, post, out_float, id(w_scale),
                                 tensor_version(w_scale), id(bias), -1 if bias is None else tensor_version(bias)),
                             lambda: self._static_plan(w, w_scale, bias, x_scale, out_scale, out_zp, qmin, qmax, post,
                                                       out_float))
        x2 = _rows(x, plan.k)
        out = torch.empty(x.shape[:-1] + (plan.n,), dtype=plan.out_dtype)
        s8 = x.dtype is torch.int8
        if self._lib.st_int8_linear(plan.address, x2.data_ptr(), x2.shape[0], s8, x_zp + 128 if s8 else x_zp,
                                    out.data_ptr(), torch.get_num_threads()) != 0:
            raise MemoryError(f"int8 linear: no memory for a {tuple(x2.shape)} temporary")
        return out

    def _static_plan(self, w, w_scale, bias, x_scale, out_scale, out_zp, qmin, qmax, post, out_float,
                     dequantize_out=False) -> "_Plan":
        n = w.shape[0]
        mult, base, lo, hi = requant_terms(w_scale, bias, n, x_scale, out_scale, out_zp, qmin, qmax, post, out_float)
        mode = 2 if out_float else 3 if dequantize_out else (1 if qmin < 0 else 0)
        return _Plan(self._packed(w), _pad64(mult, n), _pad64(base, n), lo or 0.0, hi or 0.0, mode,
                     post == "relu", (torch.uint8, torch.int8, torch.float32, torch.float32)[mode], out_scale, out_zp)

    def linear_edges(self, x, w, w_scale, bias, x_scale, x_zp, x_range, out_scale, out_zp, qmin, qmax, post,
                     dequantize_out):
        """One kernel call: the float input quantized in the kernel (``x_range``) and/or the
        quantized result dequantized in its epilogue (``dequantize_out``); same results as the
        composition in :meth:`Int8Backend.linear_edges`."""
        float_in = x_range is not None
        if not self._fits(x, w, _F32 if float_in else _QDTYPES):
            return Int8Backend.linear_edges(self, x, w, w_scale, bias, x_scale, x_zp, x_range, out_scale, out_zp,
                                            qmin, qmax, post, dequantize_out)
        return self._linear_edges(x, w, w_scale, bias, x_scale, x_zp, x_range, out_scale, out_zp, qmin, qmax, post,
                                  dequantize_out)

    def _linear_edges(self, x, w, w_scale, bias, x_scale, x_zp, x_range, out_scale, out_zp, qmin, qmax, post,
                      dequantize_out):
        plan = weight_cached(w, ("c-edges", x_scale, out_scale, out_zp, qmin, qmax, post, dequantize_out,
                                 id(w_scale), tensor_version(w_scale), id(bias), -1 if bias is None else tensor_version(bias)),
                             lambda: self._static_plan(w, w_scale, bias, x_scale, out_scale, out_zp, qmin, qmax, post,
                                                       False, dequantize_out))
        x2 = _rows(x, plan.k)
        out = torch.empty(x.shape[:-1] + (plan.n,), dtype=plan.out_dtype)
        nt = torch.get_num_threads()
        if x_range is not None:
            rc = self._lib.st_int8_linear_f32(plan.address, x2.data_ptr(), x2.shape[0], 1.0 / x_scale, x_zp,
                                              x_range[0], x_range[1], out.data_ptr(), nt)
        else:
            s8 = x.dtype is torch.int8
            rc = self._lib.st_int8_linear(plan.address, x2.data_ptr(), x2.shape[0], s8, x_zp + 128 if s8 else x_zp,
                                          out.data_ptr(), nt)
        if rc != 0:
            raise MemoryError(f"int8 linear: no memory for a {tuple(x2.shape)} temporary")
        return out

    def dynamic_linear(self, x, w, w_scale, bias, post):
        if not self._fits(x, w, _F32, "dynamic int8 linear"):
            return _PORTABLE.dynamic_linear(x, w, w_scale, bias, post)
        return self._dynamic_linear(x, w, w_scale, bias, post)

    def _dynamic_linear(self, x, w, w_scale, bias, post):
        plan = weight_cached(w, ("c-dynamic", post, id(w_scale), tensor_version(w_scale), id(bias),
                                 -1 if bias is None else tensor_version(bias)),
                             lambda: _Plan(self._packed(w), _pad64(w_scale, w.shape[0]),
                                           _pad64(bias.detach() if bias is not None else torch.zeros(w.shape[0]),
                                                  w.shape[0]), 0.0, 0.0, 2, post == "relu", torch.float32))
        x2 = _rows(x, plan.k)
        out = torch.empty(x.shape[:-1] + (plan.n,), dtype=torch.float32)
        rc = self._lib.st_int8_dynamic_linear(plan.address, x2.data_ptr(), x2.shape[0], out.data_ptr(),
                                              torch.get_num_threads())
        if rc == -2:
            raise MemoryError(f"dynamic int8 linear: no memory for a {tuple(x2.shape)} temporary")
        if rc != 0:  # inf/nan in x: the portable backend raises the explanatory error
            return _PORTABLE.dynamic_linear(x, w, w_scale, bias, post)
        return out

    def woq_linear(self, x, qweight, scale, zero, bias, bits, group_size, in_features, activations="float"):
        """Weight-only int8/int4 Linear on the kernels of :mod:`.woq_cpu` (float32 CPU inputs)
        or of :mod:`.woq_triton` (float32 CUDA inputs, where triton is installed; with
        ``activations="int8"``, ``x`` is rounded in torch first), else the reference."""
        if x.is_cuda and qweight.is_cuda and x.dtype is torch.float32 and _has_triton():
            from . import woq_triton
            if activations == "int8":
                x = round_activations(x)
            return woq_triton.linear(x, qweight, scale, zero, bias, bits, group_size, in_features)
        out = WOQ_KERNELS.linear(x, qweight, scale, zero, bias, bits, group_size, in_features, activations=activations)
        if out is None:
            return Int8Backend.woq_linear(self, x, qweight, scale, zero, bias, bits, group_size, in_features,
                                          activations)
        return out

    def quantize_dynamic_input(self, x: torch.Tensor):
        """``(q, scale, zero_point)``: the per-call uint8 quantization dynamic Linear applies
        (same results as the portable backend's). For tests and tools."""
        if not self.available():
            raise RuntimeError(f"int8 backend {self.name!r} is not usable here: {self.reason}")
        x = x.detach().to(torch.float32).contiguous()
        q = torch.empty(x.shape, dtype=torch.uint8)
        info = torch.empty(2, dtype=torch.float64)  # scale, zero point
        if self._lib.st_int8_quantize_dynamic(x.data_ptr(), x.numel(), q.data_ptr(), info.data_ptr()) != 0:
            raise ValueError("dynamic int8 quantization: the input holds inf/nan")
        return q, float(info[0]), int(info[1])


def _has_triton() -> bool:
    import importlib.util
    return importlib.util.find_spec("triton") is not None


def _selftest(b: CInt8Backend) -> bool:
    """Static (uint8/int8 in and out, float out, ReLU, fused graph edges) and dynamic Linear
    against the portable backend on odd sizes: the results must be identical."""
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-128, 128, (70, 37), generator=g, dtype=torch.int64).to(torch.int8)
    ws = torch.rand(70, generator=g) * 0.01 + 1e-3
    bias = torch.randn(70, generator=g)
    xu = torch.randint(0, 256, (7, 37), generator=g, dtype=torch.int64).to(torch.uint8)
    xs = torch.randint(-128, 128, (7, 37), generator=g, dtype=torch.int64).to(torch.int8)
    cases = [(xu, 0.05, 120, 0.3, 100, 0, 255, "relu", False), (xu, 0.05, 3, 0.2, 0, -128, 127, "none", False),
             (xs, 0.04, -5, 0.5, 128, 0, 255, "none", False), (xu, 0.05, 120, 1.0, 0, 0, 255, "relu", True)]
    for x, xsc, xz, osc, oz, lo, hi, post, of in cases:
        want = _PORTABLE.linear(x, w, ws, bias, xsc, xz, osc, oz, lo, hi, post, of)
        got = b._linear(x, w, ws, bias, xsc, xz, osc, oz, lo, hi, post, of)
        if got.dtype != want.dtype or not torch.equal(got, want):
            return False
    xf = torch.randn(5, 37, generator=g) * 4
    edges = [(xf, 120, (0, 255), 100, 0, 255, "relu", True), (xf, 4, (-128, 127), 3, -128, 127, "none", False),
             (xu, 120, None, 7, -128, 127, "none", True)]  # float in and/or dequantized out
    for x, xz, xr, oz, lo, hi, post, deq in edges:
        args = (x, w, ws, bias, 0.05, xz, xr, 0.3, oz, lo, hi, post, deq)
        want = Int8Backend.linear_edges(_PORTABLE, *args)
        got = b._linear_edges(*args)
        if got.dtype != want.dtype or not torch.equal(got, want):
            return False
    return torch.equal(b._dynamic_linear(xf, w, ws, bias, "relu"), _PORTABLE.dynamic_linear(xf, w, ws, bias, "relu"))


BACKEND = CInt8Backend()  # the registry's "c" (symtrace.passes.quant.registry.BUILTIN_BACKENDS)
