"""Insert observers, and calibrate: ``prepare`` -> ``calibrate``.

:func:`insert_observers` is a pass: it annotates a canonicalized graph
(:func:`~symtrace.passes.quant.config.annotate`) and puts one observer ``call_module`` after
every value that will be int8, under ``gm.quant_observers``. The prepared module still
computes the float model (observers return their input), so calibration is running it on
sample inputs -- :func:`calibrate` does that, through the module or the interpreter, with a
progress bar for long runs.
"""
from __future__ import annotations

import copy
import sys
import time
from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

from ...graph.graph_module import GraphModule
from ...graph.interpreter import Interpreter
from ..fold_bn import fold_batch_norm
from .canonicalize import canonicalize
from .config import QuantConfig, annotate, observer_for
from .observers import Observer

__all__ = ["insert_observers", "prepare", "calibrate", "observers_of", "OBSERVER_CONTAINER"]

OBSERVER_CONTAINER = "quant_observers"


def insert_observers(gm: GraphModule, config: Optional[QuantConfig] = None) -> int:
    """Pass: add observers to ``gm`` in place (after :func:`canonicalize` and BN folding);
    returns how many. The config is kept in ``gm.meta["quant_config"]`` for conversion."""
    config = config or QuantConfig()
    if hasattr(gm, OBSERVER_CONTAINER):
        raise ValueError("this module already has observers (prepare it only once; convert with to_reference)")
    plan = annotate(gm, config)
    container = nn.Module()
    gm.add_module(OBSERVER_CONTAINER, container)
    graph = gm.graph
    count = 0
    for v in list(graph.nodes):
        if v not in plan.observe:
            continue
        obs = observer_for(config, plan, v)
        name = v.name
        container.add_module(name, obs)
        with graph.inserting_after(v):
            meta = {k: val for k, val in v.meta.items() if k in ("source", "module_path", "tensor_meta")}
            meta["quant_observes"] = v.name
            node = graph.call_module(f"{OBSERVER_CONTAINER}.{name}", (v,), meta=meta)
        v.replace_all_uses_with(node, delete_user_cb=lambda u: u is not node)
        count += 1
    graph.lint()
    gm.meta["quant_config"] = config
    return count


def observers_of(gm: GraphModule):
    """``{observed node: observer module}`` for a prepared module (observer nodes in the graph)."""
    out = {}
    for n in gm.graph.nodes:
        if n.op == "call_module" and n.target.startswith(OBSERVER_CONTAINER + "."):
            mod = gm.get_submodule(n.target)
            if isinstance(mod, Observer):
                out[n] = mod
    return out


def prepare(gm: GraphModule, config: Optional[QuantConfig] = None, *, fold_bn: bool = True,
            inplace: bool = False) -> GraphModule:
    """Canonicalize, fold batch norm, insert observers: returns a prepared copy (``inplace``
    to change ``gm`` itself). ``gm`` must be in eval mode (batch norm is folded with its
    running statistics)."""
    if not isinstance(gm, GraphModule):
        raise TypeError(f"prepare expects a symtrace GraphModule (from symtrace.symbolic_trace), "
                        f"got {type(gm).__name__}")
    if gm.training:
        raise ValueError("prepare needs a model in eval mode: post-training quantization folds batch norm "
                         "with running statistics. Call model.eval() before tracing (or use prepare_qat(...) "
                         "to train the model with quantization).")
    if not inplace:
        gm = copy.deepcopy(gm)
    canonicalize(gm)
    if fold_bn:
        fold_batch_norm(gm)
    insert_observers(gm, config)
    gm.graph.created_by = "prepare"
    return gm


class _Progress:
    def __init__(self, total: Optional[int], enabled: Optional[bool], what: str):
        self.total, self.what = total, what
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.shown = False

    def update(self, i: int, samples: int) -> None:
        el = time.perf_counter() - self.t0
        on = self.enabled if self.enabled is not None else (sys.stderr.isatty() and el > 0.5)
        if not on:
            return
        if self.total:
            frac = i / self.total
            bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
            msg = f"\r{self.what} [{bar}] {i}/{self.total} batches, {samples} samples, {el:.1f} s"
        else:
            msg = f"\r{self.what}: {i} batches, {samples} samples, {el:.1f} s"
        sys.stderr.write(msg)
        sys.stderr.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()


def calibrate(gm: GraphModule, data: Union[torch.Tensor, Iterable[Any]], *, batch_size: int = 32,
              progress: Optional[bool] = None, interpreter: bool = False) -> int:
    """Run ``gm`` on calibration data so its observers see it; returns the number of samples.

    ``data``: a tensor (split into ``batch_size`` batches along dim 0) or an iterable of
    batches (a tensor, or a tuple/list of positional inputs each). ``progress``: True/False
    to force the bar on stderr; None shows it on a terminal once calibration takes > 0.5 s.
    ``interpreter``: run node by node with :class:`~symtrace.graph.Interpreter` (slower;
    errors name the failing node and source line)."""
    if not observers_of(gm):
        raise ValueError("this module has no observers: call prepare(...) first")
    if gm.meta.get("quant_stage") == "qat" and not gm.training:
        raise ValueError("a prepare_qat model observes ranges in training mode only, so calibrating it in eval "
                         "mode would record nothing: call .train() first (batch norms then update their "
                         "running statistics too), or just train it")
    if isinstance(data, torch.Tensor):
        batches = list(data.split(batch_size))
    else:
        batches = data
    total = len(batches) if hasattr(batches, "__len__") else None
    bar = _Progress(total, progress, "calibrating")
    samples = 0
    run = Interpreter(gm).run if interpreter else gm
    try:
        with torch.no_grad():
            for i, b in enumerate(batches, 1):
                args = tuple(b) if isinstance(b, (tuple, list)) else (b,)
                run(*args)
                first = args[0] if args else None
                samples += len(first) if isinstance(first, torch.Tensor) and first.dim() else 1
                bar.update(i, samples)
    finally:
        bar.close()
    return samples
