"""The metadata recorder of the lowering: runs a graph once on copies of the example inputs
and describes every node's value (tensor metadata, tuples of them, or Python values)."""
from __future__ import annotations

from types import FunctionType
from typing import Any, Dict

import torch
from torch import nn

from ..graph.graph_module import GraphModule
from ..graph.interpreter import Interpreter
from ..graph.replay import ROOT_HELPERS, read_state
from ..graph.node import Node, TensorMeta


class _Recorder(Interpreter):
    """Runs the graph on example inputs and records each node's value description."""

    def __init__(self, gm):
        super().__init__(gm, garbage_collect_values=True)
        self.seen: Dict[Node, Any] = {}

    def run_node(self, n):
        result = super().run_node(n)
        self.seen[n] = _describe(result)
        return result

    def call_function(self, target, args, kwargs):
        if type(target) is FunctionType and target in ROOT_HELPERS and target is not read_state:
            return None  # a replayed Python side effect: it runs when the lowered module runs
        # (read_state reads live Python state, a dict of cached tensors say: later nodes need its value)
        return super().call_function(target, args, kwargs)


def _describe(v):
    if isinstance(v, torch.Tensor):
        return TensorMeta.of(v)
    if isinstance(v, (tuple, list)) and v and all(isinstance(x, torch.Tensor) for x in v):
        return tuple(TensorMeta.of(x) for x in v)
    return ("py", v)


def _record_real(gm: GraphModule, inputs: tuple) -> Dict[Node, Any]:
    inputs = tuple(_copy_keeping_layout(x) if isinstance(x, torch.Tensor) else x for x in inputs)
    saved = [(b, _version(b), b.detach().clone()) for b in gm.buffers()]
    rng = torch.get_rng_state()
    rec = _Recorder(gm)
    try:
        with torch.no_grad():
            rec.run(*inputs)
    finally:
        with torch.no_grad():
            for b, v, c in saved:
                if v is None or _version(b) != v:   # (untouched buffers keep their version counter)
                    b.copy_(c)
        torch.set_rng_state(rng)
    return rec.seen


def _version(t: torch.Tensor):
    """``t``'s version counter (None for an inference tensor, which has none)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _copy_keeping_layout(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` with its strides (``clone`` makes sliced or overlapping tensors
    contiguous, and the recorded strides become the variant's guard)."""
    y = x.clone()
    if x.layout != torch.strided or type(x) not in (torch.Tensor, nn.Parameter) or x.is_quantized \
            or y.stride() == x.stride():
        return y
    with torch.no_grad():
        z = torch.empty(0, dtype=x.dtype, device=x.device)
        z.set_(x.untyped_storage().clone(), x.storage_offset(), x.shape, x.stride())
    return z.requires_grad_(x.requires_grad)
