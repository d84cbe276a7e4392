"""The math prelude of every generated Triton module: ``@triton.jit`` helpers the kernels call.

``st_max``/``st_min`` propagate NaN, ``st_relu``/``st_sign``/``st_gelu_*``/``st_silu``/``st_rsqrt``
follow the C prelude's definitions, ``st_wrap_*`` wrap int64 values into narrower integer dtypes and
``st_f2*``/``st_d2*`` convert float32/float64 to integers for every input (see
:mod:`~symtrace.lower.codegen_triton` for which eager semantics they follow where). Under the
Triton interpreter (``TRITON_INTERPRET=1``) libdevice is unavailable, so the prelude then builds
tanh, log1p, expm1, round, trunc and pow from ``tl`` primitives (:func:`prelude`).
"""
from __future__ import annotations

import os
from typing import Optional

__all__ = ["prelude", "interpreting", "interpreter_defect"]

_PRELUDE_COMMON = '''
_INF = tl.constexpr(float("inf"))


@triton.jit
def st_nan():
    # a float32 NaN from its bits: a NaN global constexpr never compares equal to itself, and
    # Triton re-checks the globals a kernel used on every launch (it then refuses to run)
    return tl.full([], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def st_max(a, b):
    return tl.where(a != a, a, tl.where(b != b, b, tl.maximum(a, b)))


@triton.jit
def st_min(a, b):
    return tl.where(a != a, a, tl.where(b != b, b, tl.minimum(a, b)))


@triton.jit
def st_relu(x):
    return tl.where(x < 0, 0, x).to(x.dtype)


@triton.jit
def st_sign(x):
    return ((x > 0).to(tl.int32) - (x < 0).to(tl.int32)).to(x.dtype)


@triton.jit
def st_gelu_erf(x):
    return 0.5 * x * (1 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def st_gelu_tanh(x):
    # 0.5 x (1 + tanh(u)) = x sigmoid(2u), as in the C prelude
    return tl.where(x != x, x, x * tl.sigmoid(x * (1.5957691216057308 + 0.07135481627159719 * x * x)))


@triton.jit
def st_silu(x):
    return x * tl.sigmoid(x)


@triton.jit
def st_rsqrt(x):
    # 1 / sqrt(x), as the C prelude's st_rsqrt (not tl.math.rsqrt: approximate on GPUs)
    return 1 / tl.sqrt(x)
'''

def _jit(name: str, args: str, body: str) -> str:
    """One ``@triton.jit`` helper returning ``body``, with the blank lines around it."""
    return f"\n\n@triton.jit\ndef {name}({args}):\n    return {body}\n"


# an int64 reduced modulo 2^N into an N-bit integer dtype (as torch's integer ops wrap)
_PRELUDE_WRAP = "".join(_jit(f"st_wrap_{n}", "x", f"x.to(tl.{t}).to(tl.int64)")
                        for n, t in (("i8", "int8"), ("u8", "uint8"), ("i16", "int16"), ("i32", "int32")))


# float -> integer casts, defined for every input (fptosi of NaN/Inf/out-of-range values is poison
# in LLVM and numpy's astype warns): only in-range values are converted, the rest selected. The
# narrow targets go through int32 (int8, int16) or int64 (uint8), as torch's kernels do.
_PRELUDE_F2I = "".join(_jit(f"st_{src}2{n}", "x", f"st_wrap_{n}(st_{src}2{via}(x))")
                       for n, via in (("i8", "i32"), ("i16", "i32"), ("u8", "i64")) for src in "fd")[1:]

# eager CPU (x86-64) semantics, for the interpreter (CPU tensors, checked against eager CPU):
# trunc(x) when it fits, else the "integer indefinite" INT_MIN (NaN, +-Inf, out of range)
_PRELUDE_F2I_CPU = '''
@triton.jit
def st_f2i32(x):
    ok = (x >= -2147483648.0) & (x < 2147483648.0)
    r = tl.where(ok, x, 0.0).to(tl.int32).to(tl.int64)
    return tl.where(ok, r, -2147483648)


@triton.jit
def st_d2i32(x):
    return st_f2i32(x)


@triton.jit
def st_f2i64(x):
    ok = (x >= -9.223372036854775808e18) & (x < 9.223372036854775808e18)
    r = tl.where(ok, x, 0.0).to(tl.int64)
    return tl.where(ok, r, tl.full([], -9223372036854775808, tl.int64))


@triton.jit
def st_d2i64(x):
    return st_f2i64(x)
'''

# eager CUDA semantics (cvt.rzi saturates), as reported by pytorch/pytorch#140347, #154311,
# #154724, #154726, #180159 (not measured by this project): out-of-range values clamp to the
# int32 / int64 range; NaN -> 0 from float32 (fp16/bf16 convert via float32) to int32, but
# INT32_MIN from float64 and INT64_MIN to int64
_PRELUDE_F2I_CUDA = '''
@triton.jit
def st__sat32(x, r, ok, nan):
    bad = tl.where(x > 0, 2147483647, -2147483648)
    return tl.where(ok, r, tl.where(x != x, nan, bad)).to(tl.int64)


@triton.jit
def st_f2i32(x):
    ok = (x >= -2147483648.0) & (x < 2147483648.0)
    return st__sat32(x, tl.where(ok, x, 0.0).to(tl.int32), ok, 0)


@triton.jit
def st_d2i32(x):
    ok = (x >= -2147483648.0) & (x < 2147483648.0)
    return st__sat32(x, tl.where(ok, x, 0.0).to(tl.int32), ok, -2147483648)


@triton.jit
def st_f2i64(x):
    ok = (x >= -9.223372036854775808e18) & (x < 9.223372036854775808e18)
    r = tl.where(ok, x, 0.0).to(tl.int64)
    hi = tl.full([], 9223372036854775807, tl.int64)
    lo = tl.full([], -9223372036854775808, tl.int64)
    return tl.where(ok, r, tl.where(x > 0, hi, lo))


@triton.jit
def st_d2i64(x):
    return st_f2i64(x)
'''

_PRELUDE_LIBDEVICE = "".join(_jit(f"st_{fn}", args, f"libdevice.{dev}({args})") for fn, dev, args in (
    ("tanh", "tanh", "x"), ("log1p", "log1p", "x"), ("expm1", "expm1", "x"), ("round", "rint", "x"),
    ("trunc", "trunc", "x"), ("pow", "pow", "x, y")))[1:]

# the interpreter has no libdevice: the same functions from tl primitives
_PRELUDE_PORTABLE = '''
@triton.jit
def st_tanh(x):
    e = tl.exp(-2 * tl.abs(x))
    small = x * (1 - x * x * (0.3333333333333333 - 0.13333333333333333 * x * x))
    r = tl.where(tl.abs(x) < 0.004, small, (1 - e) / (1 + e))
    return tl.where(x < 0, -tl.abs(r), tl.where(x != x, x, tl.abs(r)))


@triton.jit
def st_log1p(x):
    u = 1 + x
    r = tl.where(u == 1, x, tl.log(u) * (x / (u - 1)))
    return tl.where(u == _INF, u, r)


@triton.jit
def st_expm1(x):
    u = tl.exp(x)
    r = tl.where(u == 1, x, (u - 1) * (x / tl.log(u)))
    return tl.where(u == _INF, u, tl.where(u - 1 == -1, u - 1, r))


@triton.jit
def st_round(x):
    f = tl.floor(x)
    d = x - f
    odd = (f - 2 * tl.floor(f * 0.5)) != 0
    return tl.where(d > 0.5, f + 1, tl.where(d < 0.5, f, tl.where(odd, f + 1, f)))


@triton.jit
def st_trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@triton.jit
def st_pow(x, y):
    ax = tl.abs(x)
    r = tl.exp(y * tl.log(ax))
    yint = tl.floor(y) == y
    yodd = yint & ((y - 2 * tl.floor(y * 0.5)) != 0)
    r = tl.where((x < 0) & yodd, -r, r)
    r = tl.where((x < 0) & (~yint), st_nan(), r)
    r = tl.where((ax == 1) & (tl.abs(y) == _INF), 1, r).to(r.dtype)
    return tl.where(y == 0, 1, tl.where(x == 1, 1, r)).to(r.dtype)
'''


def interpreting() -> bool:
    """Whether kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _version(text: str) -> tuple:
    return tuple(int(p) for p in text.split("+")[0].split(".")[:2] if p.isdigit())


def interpreter_defect() -> Optional[str]:
    """Why kernels that loop over a size known only at run time cannot run in this Triton's
    interpreter, or None. Triton 3.6's interpreter turns such a size into an int with ``int()`` of
    a one-element array, which numpy 2.4 refuses (triton-lang/triton#9171; fixed in Triton 3.7).
    Compiled kernels on a GPU are not affected."""
    if not interpreting():
        return None
    try:
        import numpy
        import triton
    except ImportError:
        return None
    if _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 4):
        return (f"Triton {triton.__version__}'s interpreter cannot run kernels that loop over a run-time size "
                f"with numpy {numpy.__version__} (triton-lang/triton#9171): install Triton >= 3.7 or numpy < 2.4")
    return None


def prelude(portable: Optional[bool] = None) -> str:
    """Imports and math helpers; ``portable`` (default: :func:`interpreting`) avoids libdevice."""
    portable = interpreting() if portable is None else portable
    head = "# generated by symtrace.lower (Triton backend)\nimport triton\nimport triton.language as tl\n"
    if not portable:
        head += "from triton.language.extra import libdevice\n"
    return head + _PRELUDE_COMMON + _PRELUDE_WRAP + (_PRELUDE_PORTABLE + _PRELUDE_F2I_CPU if portable else
                                                     _PRELUDE_LIBDEVICE + _PRELUDE_F2I_CUDA) + _PRELUDE_F2I
