"""Weight-only linears called from C between the kernels around them (a CPU variant's last step
before its wrapper is generated).

A lowered decode step alternates fused kernels with ``woq_linear`` calls (a 1B Llama: 65 per
token). Run as torch calls, each costs a trip through Python: the site's checks, a fresh output
tensor, the ctypes call, the layout check of the result (~20 us with the caches cold after the
weights streamed through them: 1.4 ms of a 22 ms step). :func:`bind_woq_calls` turns such a call
into a :class:`~symtrace.lower.steps.WoqCallStep`: the C entry point that runs the kernels before
and after it calls the weight-only kernel itself, its plan bound once, and the result goes to an
arena buffer (or a fresh output, when the caller gets it) like a kernel's. A decoder layer then
makes two or three calls from Python instead of a dozen.

A binding is only made where nothing can make it stale unseen: every tensor the call reads from
the module (quantized weight, scales, zero points, bias) is one the module's state check covers
(the inference pipeline's: :func:`~symtrace.lower.pipeline.state_check`), which runs before each
call and sends the call through torch once any of them is replaced or written. Elsewhere the
call stays a torch call (:class:`~symtrace.lower.woq_cpu.WoqSite`). So does a call whose input
is not rows of float32 with unit stride, or whose result is not dense rows. Switch:
``SYMTRACE_WOQ_C_CALLS=0`` (read when a variant is built).
"""
from __future__ import annotations

import os
from typing import Collection

import torch

from ..graph.symbols import is_symbolic
from ..graph.tree import tree_iter
from ..passes.quant.kernels import woq_linear
from .steps import ExternStep, WoqCallStep
from .values import BufferValue

__all__ = ["bind_woq_calls", "enabled"]


def enabled() -> bool:
    """Whether variants bind weight-only calls into C (``SYMTRACE_WOQ_C_CALLS``, default on)."""
    return os.environ.get("SYMTRACE_WOQ_C_CALLS", "1").strip().lower() not in ("0", "false", "no", "off")


def bind_woq_calls(lw, checked: Collection[int]) -> int:
    """Replace, in place, the ``woq_linear`` torch calls of ``lw`` (a CPU lowering, C kernels)
    that C can make (see the module doc) by :class:`WoqCallStep`; ``checked``: ids of the
    tensors a state check covers. Returns how many were replaced."""
    from .woq_cpu import c_binding
    out_ids = {id(v.buffer) for v in tree_iter(lw.outputs) if isinstance(v, BufferValue)}
    done = 0
    for i, step in enumerate(lw.steps):
        if not (isinstance(step, ExternStep) and step.kind == "function" and step.target is woq_linear):
            continue
        call = _site(lw, step, checked)
        if call is None:
            continue
        x, out, tensors = call
        got = c_binding(*tensors, step.kwargs)
        if got is None or got[3] != out.shape[-1]:
            continue
        function, address, level, _, plan = got
        k = step.kwargs["in_features"]
        m = 1
        for n in x.shape[:-1]:
            m *= n
        if m == 0:
            continue
        lw.alias_of[id(out)] = []   # (a fresh result: it shares no memory with the call's arguments)
        out.role = "output" if lw._alias_closure(out) & out_ids else "temp"
        lw.steps[i] = WoqCallStep(step, x, out, function, address, level, m, k, x.offset, plan)
        done += 1
    return done


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
    expect = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True
