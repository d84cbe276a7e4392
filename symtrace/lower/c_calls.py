"""Calls into symtrace's own compiled kernels made from the C entry points of a CPU variant
(its last step before its wrapper is generated): weight-only linears and decode attention.

A lowered decode step alternates fused kernels with ``woq_linear`` calls (a 1B Llama: 65 per
token) and attention over the cache (16). Run as torch calls, each costs a trip through Python:
the call's checks, a fresh output tensor, the ctypes call, the layout check of the result (20 us
and more with the caches cold after the weights streamed through them: a 1B step's 65 linears
spent 1.4 ms of 22 ms there). :func:`bind_c_calls` turns such a call into a
:class:`~symtrace.lower.steps.CCallStep`: the C entry point that runs the kernels before and
after it makes the call itself, with what Python looked up per call bound once (the weight's
plan; attention's sizes and strides, the cache length as a size symbol), and the result goes
to an arena buffer (or a fresh output, when the caller gets it) like a kernel's. A decoder
layer then makes a few calls from Python (the entry points, the cache appends) instead of a
dozen.

A weight-only linear is bound only where nothing can make its plan stale unseen: every tensor it
reads from the module (quantized weight, scales, zero points, bias) is one the module's state
check covers (the inference pipeline's: :func:`~symtrace.lower.pipeline.state_check`), which runs
before each call and sends the call through torch once any of them is replaced or written.
Elsewhere the call stays a torch call (:class:`~symtrace.lower.woq_cpu.WoqSite`). So does a call
whose input is not rows of float32 with unit stride, or whose result is not dense rows.
Attention is bound without a mask, head size 64 or 128, float32, the last dimension contiguous.
A kernel that refuses at run time (NaN or an infinity meeting integer activations, no memory)
makes the wrapper run that call in torch. Switch: ``SYMTRACE_C_CALLS=0`` (read when a module is
lowered).
"""
from __future__ import annotations

import ctypes
import dataclasses
import math
import os
from typing import Any, Collection, List

import torch

from ..graph.symbols import c_text, is_symbolic
from ..passes.quant.kernels import woq_linear
from .ir import Buffer
from .steps import CCallStep, ExternStep, KernelStep, NodeReport
from .values import BufferValue, contiguous_strides

__all__ = ["bind_c_calls", "enabled", "WoqCallStep", "AttentionCallStep"]

#: the type of st_woq_linear / st_woq_linear_a8 (woq_csrc, woq_a8_csrc)
_WOQ_FN = "int (*)(const void *, const float *, int64_t, int64_t, float *, int32_t, int32_t)"
#: the type of st_decode_attention (attention_cpu)
_ATTENTION_FN = ("int (*)(const float *, const float *, const float *, float *, " + ", ".join(["int64_t"] * 16)
                 + ", float, const void *, int32_t, int64_t, int64_t, int64_t, int64_t, int32_t)")


def enabled() -> bool:
    """Whether variants make these calls from C (``SYMTRACE_C_CALLS``, default on)."""
    return os.environ.get("SYMTRACE_C_CALLS", "1").strip().lower() not in ("0", "false", "no", "off")


@dataclasses.dataclass(eq=False)
class WoqCallStep(CCallStep):
    """``woq_linear`` from C: ``function(address, x + offset, m, ldx, out, level, nt)``."""

    x: Any = None      # the input: a BufferValue, m rows of ldx elements from offset
    address: int = 0   # the plan's struct address
    level: int = 0     # the isa argument
    m: int = 0
    ldx: int = 0
    offset: int = 0

    kind = "woq"

    def reads(self) -> List[Buffer]:
        return [self.x.buffer]

    def c_call(self, p) -> str:
        return (f"(({_WOQ_FN}){p(self.function)})({p(self.address)}, (const float *){p(self.x.buffer)} + "
                f"{self.offset}, {self.m}, {self.ldx}, (float *){p(self.out)}, {self.level}, nt)")


@dataclasses.dataclass(eq=False)
class AttentionCallStep(CCallStep):
    """:class:`~symtrace.lower.attention_cpu.DecodeAttention` without a mask, from C:
    ``st_decode_attention(q, k, v, out, sizes..., strides..., scale, no mask, nt)``."""

    q: Any = None   # BufferValues (B, H, M, D), (B, Hkv, L, D), (B, Hkv, L, Dv)
    k: Any = None
    v: Any = None
    scale: float = 1.0

    kind = "attention"

    def reads(self) -> List[Buffer]:
        return [self.q.buffer, self.k.buffer, self.v.buffer]

    def c_call(self, p) -> str:
        (b, h, m, d), (_, hkv, n, _), dv = self.q.shape, self.k.shape, self.v.shape[3]
        ptr = (lambda bv: f"(const float *){p(bv.buffer)} + {c_text(bv.offset)}")
        sizes = [b, h, h // hkv, m, n, d, dv] + list(self.q.strides[:3]) + list(self.k.strides[:3]) \
            + list(self.v.strides[:3])
        return (f"(({_ATTENTION_FN}){p(self.function)})({ptr(self.q)}, {ptr(self.k)}, {ptr(self.v)}, "
                f"(float *){p(self.out)}, {', '.join(c_text(x) for x in sizes)}, {_float_literal(self.scale)}, "
                f"(const void *)0, 0, 0, 0, 0, 0, nt)")


@dataclasses.dataclass(eq=False)
class AppendCopyStep(CCallStep):
    """The second half of a cache append (:class:`~symtrace.lower.kv_append.AppendCat`) split
    in two: ``_Reserve`` made the result ``out`` before the entry point ran (``past``'s
    positions in place, room behind them); this copies ``new`` there, from element ``start``."""

    new: Any = None     # BufferValue: float32, fixed sizes
    start: Any = 0      # element offset of the new positions in ``out`` (a size expression)

    kind = "append"
    refuses = False
    makes_out = False

    def reads(self) -> List[Buffer]:
        return [self.new.buffer]

    def c_call(self, p) -> str:
        dims = [i for i, n in enumerate(self.new.shape) if n != 1]
        dst, src = " + ".join([f"i{i} * {c_text(self.out.strides[i])}" for i in dims] or ["0"]), \
            " + ".join([f"i{i} * {c_text(self.new.strides[i])}" for i in dims] or ["0"])
        loops = "".join(f"for (int64_t i{i} = 0; i{i} < {self.new.shape[i]}; i{i}++) " for i in dims)
        return (f"float *d_ = (float *){p(self.out)} + {c_text(self.start)}; "
                f"const float *s_ = (const float *){p(self.new.buffer)} + {c_text(self.new.offset)}; "
                f"{loops}d_[{dst}] = s_[{src}];")


class _Reserve:
    """The first half of a split cache append: ``AppendCat.reserve(past, new_shape, dtype)``,
    or, where that layout does not apply (not seen within a variant: its guards fix the
    layouts), a fresh tensor in it with ``past``'s positions copied."""

    def __init__(self, cat, new_shape, dtype, d: int):
        self.cat, self.new_shape, self.dtype, self.d = cat, tuple(new_shape), dtype, d
        self.__name__ = "append_cat_reserve"

    def __call__(self, past: torch.Tensor) -> torch.Tensor:
        out = self.cat.reserve(past, self.new_shape, self.dtype)
        if out is None:
            out = self.cat._fresh_for(past, self.new_shape, self.dtype, past.device, self.d, spare=False)
        return out

    def __repr__(self) -> str:
        return f"<append_cat reserve dim={self.d}>"


def _append_split(lw, step: ExternStep):
    """``(reserve step, copy step)`` for an ``AppendCat`` call whose ``new`` is float32 with
    fixed sizes and whose result is laid out as the op lays it out, else None."""
    from .kv_append import append_layout_strides
    if step.kwargs or len(step.args) != 2 or len(step.out_buffers) != 1 or step.out_buffers[0][0] != step.result:
        return None
    past, new = step.args
    out = step.out_buffers[0][1]
    if not (isinstance(past, BufferValue) and isinstance(new, BufferValue) and new.dtype is torch.float32
            and past.dtype is torch.float32 and out.dtype is torch.float32 and out.role == "extern"
            and len(new.shape) == len(out.shape) and new.shape):
        return None
    empty = tuple(past.shape) == (0,)   # (a cache's first step: nothing kept)
    if not empty and len(past.shape) != len(new.shape):
        return None
    if any(type(n) is not int for n in new.shape) or math.prod(new.shape) == 0:
        return None
    n = len(new.shape)
    d = step.target.dim + n if step.target.dim < 0 else step.target.dim
    if not 0 <= d < n or tuple(out.strides) != tuple(append_layout_strides(out.shape, d)):
        return None
    reserve = ExternStep(step.node, "function", _Reserve(step.target, new.shape, torch.float32, d), (past,), {},
                         step.result, step.out_buffers, step.label)
    copy = AppendCopyStep(step, out, 0, None, new=new, start=0 if empty else past.shape[d] * out.strides[d])
    return reserve, copy


def _producer(lw, buf: Buffer) -> int:
    """The index of the step that makes ``buf`` (-1: an input or a parameter)."""
    for i, st in enumerate(lw.steps):
        made = [b for _, b in st.out_buffers] if isinstance(st, ExternStep) else \
            [s.buffer for s in st.kernel.stores] if isinstance(st, KernelStep) else \
            [st.out] if isinstance(st, CCallStep) and st.makes_out else []
        if any(b is buf for b in made):
            return i
    return -1


def _as_float32(x: float) -> float:
    """``x`` rounded to float32 (what a ``float`` argument from ctypes gets; inf beyond its range)."""
    return float(ctypes.c_float(x).value)


def _float_literal(x: float) -> str:
    """``x`` rounded to float32, as an exact C literal (finite)."""
    return _as_float32(x).hex() + "f"


def bind_c_calls(lw, checked: Collection[int]) -> int:
    """Replace, in place, the torch calls of ``lw`` (a CPU lowering, C kernels) that C can make
    (see the module doc) by :class:`CCallStep`; ``checked``: ids of the tensors a state check
    covers. Returns how many were replaced."""
    from .attention_cpu import DecodeAttention
    from .kv_append import AppendCat
    done = 0
    reserves = []
    for i, step in enumerate(lw.steps):   # (one step for one: the reservations are inserted below)
        if not (isinstance(step, ExternStep) and step.kind == "function"):
            continue
        if step.target is woq_linear:
            call = _woq_call(lw, step, checked)
        elif isinstance(step.target, DecodeAttention):
            call = _attention_call(step)
        elif isinstance(step.target, AppendCat):
            call = _append_split(lw, step)
        else:
            continue
        if call is None:
            continue
        if isinstance(call, tuple):   # (the reservation is placed below, once every call is bound)
            reserve, call = call
            reserves.append((reserve, call))
        else:
            lw.alias_of[id(call.out)] = []   # (a fresh result: it shares no memory with the call's arguments)
            call.out.role = "temp"   # (an output where it reaches the caller: escape_again, below)
        lw.steps[i] = call
        r = lw.reports.get(step.node.name)
        if r is not None:
            lw.reports[step.node.name] = NodeReport(r.node, r.op, r.target, "C call",
                                                    f"symtrace's {call.kind} kernel, called by the C entry point "
                                                    "that runs the kernels around it")
        done += 1
    for reserve, copy in reserves:
        lw.alias_of[id(copy.out)] = [reserve.args[0].buffer]   # (past's storage: not new's)
        # just before the run of kernels and C calls the copy is in (after what makes past)
        at = lw.steps.index(copy)
        while at > 0 and isinstance(lw.steps[at - 1], (KernelStep, CCallStep)):
            at -= 1
        lw.steps.insert(max(at, _producer(lw, reserve.args[0].buffer) + 1), reserve)
    if done:
        lw.escape_again()
    return done


def _woq_call(lw, step: ExternStep, checked: Collection[int]):
    from .woq_cpu import c_binding
    site = _site(lw, step, checked)
    if site is None:
        return None
    x, out, tensors = site
    got = c_binding(*tensors, step.kwargs)
    if got is None or got[3] != out.shape[-1]:
        return None
    function, address, level, _, plan = got
    m = math.prod(x.shape[:-1])
    if m == 0:
        return None
    return WoqCallStep(step, out, function, plan, x=x, address=address, level=level, m=m,
                       ldx=step.kwargs["in_features"], offset=x.offset)


def _attention_call(step: ExternStep):
    from .attention_cpu import KERNEL
    target = step.target
    if step.kwargs or len(step.args) != 3 or len(step.out_buffers) != 1 or step.out_buffers[0][0] != step.result:
        return None
    q, k, v = step.args
    out = step.out_buffers[0][1]
    if not all(isinstance(t, BufferValue) and t.dtype is torch.float32 and len(t.shape) == 4 and t.strides[3] == 1
               for t in (q, k, v)) or out.dtype is not torch.float32 or out.role != "extern":
        return None
    (b, h, m, d), (kb, hkv, n, kd), dv = q.shape, k.shape, v.shape[3]
    fixed = (b, h, m, d, kb, hkv, kd, dv) + tuple(v.shape[:2])   # (the cache length may be a size symbol)
    if any(type(x) is not int for x in fixed) or type(q.offset) is not int:
        return None
    from .attention_cpu import MAX_ROWS
    if not (1 <= m <= MAX_ROWS and kb == b and kd == d and dv == d and d in (64, 128) and hkv > 0 and h % hkv == 0
            and (h == hkv or target.enable_gqa) and tuple(v.shape[:3]) == (b, hkv, n) and b > 0):
        return None
    if not (is_symbolic(n) or n > 0):
        return None
    if tuple(out.shape) != (b, h, m, dv) or not _dense_rows(out.shape, out.strides):
        return None
    scale = target.scale if target.scale is not None else 1.0 / math.sqrt(d)
    if type(scale) not in (int, float) or not math.isfinite(_as_float32(scale)) or not KERNEL.available():
        return None   # (a scale beyond float32's range: the ctypes call passes inf, a literal cannot)
    function = ctypes.cast(KERNEL._lib.st_decode_attention, ctypes.c_void_p).value
    return AttentionCallStep(step, out, function, None, q=q, k=k, v=v, scale=float(scale))


def _site(lw, step: ExternStep, checked: Collection[int]):
    """``(x, out buffer, (qweight, scale, zero, bias))`` of a call C can make, else None."""
    if len(step.args) != 5 or len(step.out_buffers) != 1 or step.out_buffers[0][0] != step.result:
        return None
    x, *stored = step.args
    out = step.out_buffers[0][1]
    if not isinstance(x, BufferValue) or x.dtype is not torch.float32 or out.dtype is not torch.float32 \
            or out.role != "extern" or x.buffer is out:
        return None
    sizes = tuple(x.shape) + tuple(x.strides) + (x.offset,) + tuple(out.shape) + tuple(out.strides)
    if any(is_symbolic(v) or type(v) is not int for v in sizes):
        return None
    k = step.kwargs.get("in_features")
    if not x.shape or x.shape[-1] != k or not _dense_rows(x.shape, x.strides):
        return None
    if tuple(out.shape[:-1]) != tuple(x.shape[:-1]) or not _dense_rows(out.shape, out.strides):
        return None
    tensors = []
    for v in stored:
        if v is None:
            tensors.append(None)
            continue
        if not isinstance(v, BufferValue) or v.buffer.role != "param" or not v.is_whole():
            return None
        owner, attr = lw.param_exprs[id(v.buffer)]
        t = getattr(owner, attr, None)
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or id(t) not in checked:
            return None
        tensors.append(t)
    if tensors[0] is None or tensors[1] is None:
        return None
    return x, out, tuple(tensors)


def _dense_rows(shape, strides) -> bool:
    """Whether a tensor of ``shape``/``strides`` is row-major dense (size-1 dimensions' strides
    aside), so its rows of ``shape[-1]`` follow each other."""
    return all(n == 1 or s == c for n, s, c in zip(shape, strides, contiguous_strides(shape)))
