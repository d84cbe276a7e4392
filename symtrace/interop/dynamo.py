"""A ``torch.compile`` backend that runs symtrace passes on the graphs Dynamo captures::

    from symtrace.interop.dynamo import backend
    compiled = torch.compile(model, backend=backend(passes=[common_subexpression_elimination]))

Dynamo calls the backend once per captured graph (a graph break -- ``print``, a Python branch
on ``.item()`` -- gives several) with ``(fx_gm, example_inputs)``. The backend converts the
graph with :func:`~symtrace.interop.fx.from_fx` (Dynamo's ``example_value`` fake tensors give
each node its ``tensor_meta``), runs the passes, and returns the symtrace module's ``forward``,
or, with a ``target``, what ``symtrace.lower.compile`` makes of it.

In torch 2.11-2.13 ``example_inputs`` holds the real tensors of the call being compiled --
parameters and buffers too, since Dynamo passes module state as graph inputs -- and, once a
size has become dynamic (after a recompile for a new shape, or ``dynamic=True``), plain
``torch.SymInt`` sizes; other wrappers may pass fake tensors. ``symtrace.lower.compile`` gets
them as concrete examples (:func:`example_values`): a SymInt becomes the size it has in this
call, a fake tensor a zero-filled real tensor of its shape.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch

from ..passes import PassContext, run_passes
from .fx import _concrete, from_fx

__all__ = ["backend", "example_values"]


def backend(passes: Sequence[Callable] = (), target: Optional[str] = None, *,
            context: Optional[PassContext] = None) -> Callable:
    """A ``torch.compile`` backend: ``torch.compile(model, backend=backend(passes=[...]))``.

    ``passes``: symtrace passes (functions of a GraphModule, see
    :func:`symtrace.passes.run_passes`) applied to every captured graph, in order, under
    ``context`` (lint, timings, dumps). ``target``: lower the result with
    ``symtrace.lower.compile(gm, example_inputs, target=target)``; ``None`` runs the symtrace
    graph as generated Python. The returned backend keeps the symtrace modules it made in its
    ``graphs`` list (one per captured graph, in compile order) and, with a ``target``, the
    lowered modules in ``lowered`` (their ``report()`` says what became kernels).
    """
    passes = list(passes)
    for i, p in enumerate(passes, 1):
        if not callable(p):
            raise TypeError(f"backend(passes=...): pass {i} of {len(passes)} is a {type(p).__name__}, "
                            "not a callable")
    lower_compile = _lower_compile(target) if target is not None else None
    graphs: List[Any] = []
    lowered: List[Any] = []

    def symtrace_backend(fx_gm, example_inputs):
        gm = from_fx(fx_gm)
        if passes:
            gm = run_passes(gm, passes, context)
        graphs.append(gm)
        if lower_compile is not None:
            lm = lower_compile(gm, example_values(example_inputs), target=target)
            lowered.append(lm)
            return lm
        gm.recompile()
        return gm.forward

    symtrace_backend.graphs = graphs
    symtrace_backend.lowered = lowered
    return symtrace_backend


def _lower_compile(target: str) -> Callable:
    try:
        from ..lower import compile as lower_compile
    except ImportError as e:
        raise ImportError(
            f"symtrace.interop.dynamo.backend(target={target!r}) lowers each graph with "
            f"symtrace.lower.compile, which cannot be imported here ({e}). Use target=None to run "
            "the symtrace graphs as Python.") from e
    return lower_compile


_SYM_TYPES = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}


def example_values(example_inputs) -> list:
    """Dynamo's ``example_inputs`` as concrete values: symbolic sizes (``torch.SymInt``...)
    become the value they have in the call being compiled, fake tensors zero-filled real
    tensors of the same shape, stride, dtype and device; real tensors are passed as they are."""
    out = []
    for v in example_inputs:
        kind = _SYM_TYPES.get(type(v))
        if kind is not None:
            hint = getattr(v.node, "hint", None)
            if hint is not None:
                v = kind(hint)
        elif isinstance(v, torch.Tensor) and _is_fake(v):
            shape, stride = _concrete(v.shape), _concrete(v.stride())
            if shape is not None and stride is not None:
                real = torch.empty_strided(shape, stride, dtype=v.dtype, device=v.device).zero_()
                v = real.requires_grad_(v.requires_grad and (v.dtype.is_floating_point or v.dtype.is_complex))
        out.append(v)
    return out


def _is_fake(t: torch.Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    return is_fake(t)
