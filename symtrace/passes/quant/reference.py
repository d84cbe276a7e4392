"""``to_reference``: the quantized model as quantize/dequantize around float ops (the oracle).

Every int8 value of the plan becomes ``quantize_per_tensor`` -> ``dequantize_per_tensor`` on
plain ``uint8`` tensors with explicit scale and zero point, and every fused conv/linear reads
``dequantize_per_channel`` of its int8 weight (a buffer), then computes in float (float64 by
default, see :func:`to_reference`). The
result runs anywhere, is slow, and says exactly what the int8 model means: lowering
(:func:`~symtrace.passes.quant.lower`) must reproduce it to within one quantization step.

Quantization parameters are stored three ways, so a generic graph serializer keeps them:
as constants in the ``quantize``/``dequantize`` node arguments, as
``node.meta["tensor_meta"].qparams`` of each ``quantize`` node, and, for weights, as int8 /
float32 / int64 buffers (``<layer>_weight_int8``, ``_weight_scale``, ``_weight_zero_point``).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict, Iterable, Optional

import torch
from torch import nn

from ...graph.graph_module import GraphModule
from ...graph.node import Node
from .canonicalize import op_kind
from .config import Plan, QuantConfig, annotate
from .observers import Observer
from .prepare import OBSERVER_CONTAINER, observers_of
from .qat import is_qat, qat_to_prepared
from .qparams import (QParams, dequantize_per_channel, dequantize_per_tensor, qrange, quantize_per_channel,
                      quantize_per_tensor, reference_conv2d, reference_linear)

__all__ = ["to_reference", "strip_observers", "quantize_weight", "where"]


def where(node: Node) -> str:
    """``'name' (file:line)`` for messages."""
    loc = node.meta.get("source")
    return f"{node.name!r}" + (f" ({loc.describe()})" if loc is not None and hasattr(loc, "describe") else "")


def strip_observers(gm: GraphModule) -> Dict[Node, Observer]:
    """Remove observer nodes (in place); returns ``{observed node: observer}``."""
    obs = {}
    for n, mod in observers_of(gm).items():
        v = n.args[0]
        obs[v] = mod
        n.replace_all_uses_with(v)
        gm.graph.erase_node(n)
    if hasattr(gm, OBSERVER_CONTAINER):
        delattr(gm, OBSERVER_CONTAINER)
    return obs


def quantize_weight(w: torch.Tensor, observer: Observer):
    """``(int8 weight, QParams)`` of a float weight with a (fresh) weight observer."""
    observer(w.detach().float())
    qp = observer.qparams()
    if qp.per_channel:
        q = quantize_per_channel(w.detach().float(), qp.scale, qp.zero_point, qp.axis, qp.qmin, qp.qmax, qp.dtype)
    else:
        q = quantize_per_tensor(w.detach().float(), qp.scale, qp.zero_point, qp.qmin, qp.qmax, qp.dtype)
        n = w.shape[0]
        qp = QParams(torch.full((n,), qp.scale), torch.full((n,), qp.zero_point, dtype=torch.int64), qp.dtype,
                     qp.qmin, qp.qmax, 0)
    return q, qp


def _free_attr(gm: nn.Module, base: str) -> str:
    base = base.replace(".", "_")
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def _delete_module(gm: GraphModule, target: str) -> None:
    """Remove a module the graph no longer calls (conversion works on its own copy)."""
    if any(n.op == "call_module" and n.target == target for n in gm.graph.nodes):
        return
    path, _, leaf = target.rpartition(".")
    try:
        parent = gm.get_submodule(path) if path else gm
    except AttributeError:
        return
    if leaf in parent._modules:
        delattr(parent, leaf)


def _qmeta(v: Node, qp: QParams, dtype_override: Optional[torch.dtype] = None) -> Dict[str, Any]:
    meta = {k: val for k, val in v.meta.items() if k in ("source", "module_path")}
    tm = v.meta.get("tensor_meta")
    if tm is not None and dataclasses.is_dataclass(tm):
        meta["tensor_meta"] = dataclasses.replace(tm, dtype=dtype_override or qp.dtype, qparams=qp.as_dict(),
                                                  requires_grad=False)
    return meta


def _dqmeta(v: Node, dtype: torch.dtype) -> Dict[str, Any]:
    meta = {k: val for k, val in v.meta.items() if k in ("source", "module_path")}
    tm = v.meta.get("tensor_meta")
    if tm is not None and dataclasses.is_dataclass(tm):
        meta["tensor_meta"] = dataclasses.replace(tm, dtype=dtype, qparams=None, requires_grad=False)
    return meta


def _qparams_for(v: Node, plan: Plan, obs: Dict[Node, Observer], qps: Dict[Node, QParams],
                 config: QuantConfig) -> QParams:
    if v in plan.fixed:
        s, z = plan.fixed[v]
        lo, hi = qrange(config.spec.activation_dtype)
        return QParams(s, z, config.spec.activation_dtype, lo, hi)
    if v in plan.inherit:
        return qps[plan.inherit[v]]
    cur: Any = v
    seen = 0
    while type(cur) is Node and seen < 64:
        o = obs.get(cur)
        if o is not None:
            if not o.calibrated:
                raise RuntimeError(f"the observer of {where(cur)} has seen no data: run calibrate(prepared, data) "
                                   "before converting")
            return o.qparams()
        # a value the calibration plan did not observe (a layer kept in float since): borrow
        # the parameters of the value it passes through from
        if op_kind(None, cur) in config.spec.inherit and cur.args:
            cur = cur.args[0]
            seen += 1
            continue
        break
    raise RuntimeError(f"no calibration statistics for {where(v)}: it was not observed when the model was "
                       "prepared (prepare again with the same overrides)")


def to_reference(prepared: GraphModule, *, skip: Iterable[Any] = (), config: Optional[QuantConfig] = None,
                 precision: torch.dtype = torch.float64, inplace: bool = False) -> GraphModule:
    """Convert a calibrated, prepared module to the q/dq reference form (a new module unless
    ``inplace``; always a new one for a :func:`~symtrace.passes.quant.prepare_qat` model, whose
    batch norms are folded first). ``skip``: fused-pattern roots (nodes or their names) to keep in float.

    ``precision``: the dtype of the float math *between* dequantize and quantize. float64
    (default) makes the oracle exact to the integer arithmetic it describes (an int8 GEMM
    accumulates exactly; float32 convolution would add its own rounding, and then correct
    kernels would disagree with the oracle near rounding boundaries); float32 gives the
    classic fp32 q/dq model. Values read by float ops outside the int8 domain are
    dequantized to their own dtype."""
    if precision not in (torch.float32, torch.float64):
        raise ValueError(f"precision must be torch.float32 or torch.float64, got {precision}")
    if not observers_of(prepared):
        raise ValueError("to_reference needs a prepared, calibrated module (prepare(...) then calibrate(...)), "
                         "or a trained one from prepare_qat(...)")
    config = config or prepared.meta.get("quant_config") or QuantConfig()
    if is_qat(prepared):  # fold batch norm, fake quantization -> observers: the prepare(...) form
        gm = qat_to_prepared(prepared)
    else:
        gm = prepared if inplace else copy.deepcopy(prepared)
    obs = strip_observers(gm)
    names = {n.name: n for n in gm.graph.nodes}
    skip_nodes = []
    for s in skip:
        key = s.name if isinstance(s, Node) else s
        if key not in names:
            raise KeyError(f"skip: no node named {key!r} in the prepared graph")
        skip_nodes.append(names[key])
    plan = annotate(gm, config, skip_nodes)
    graph = gm.graph
    qps: Dict[Node, QParams] = {}
    for v in graph.nodes:
        if plan.is_quantized(v):
            qps[v] = _qparams_for(v, plan, obs, qps, config)

    # 1. quantize -> dequantize after every int8 value. Readers inside the int8 domain get a
    #    dequantize at ``precision``; float readers of an int8-made value get one in its dtype.
    made_in_int8 = {m.output for m in plan.fused.values()} | set(plan.int8_ops)
    for v in list(graph.nodes):
        qp = qps.get(v)
        if qp is None:
            continue
        q_readers = plan.quantized_consumers(v)
        f_readers = [u for u in v.users if u not in q_readers] if v in made_in_int8 else []
        if not q_readers and not f_readers:
            continue
        tm = v.meta.get("tensor_meta")
        own_dtype = getattr(tm, "dtype", None) or torch.float32
        with graph.inserting_after(v):
            q = graph.call_function(quantize_per_tensor, (v, qp.scale, qp.zero_point, qp.qmin, qp.qmax, qp.dtype),
                                    meta=_qmeta(v, qp))
            q.meta["quant_of"] = v.name
            for readers, dt in ((q_readers, precision), (f_readers, own_dtype)):
                if not readers:
                    continue
                args = (q, qp.scale, qp.zero_point) + ((dt,) if dt is not torch.float32 else ())
                dq = graph.call_function(dequantize_per_tensor, args, meta=_dqmeta(v, dt))
                for u in readers:
                    u.args = _swap(u.args, v, dq)
                    u.kwargs = _swap(u.kwargs, v, dq)

    # 2. fused roots: conv/linear modules -> F.conv2d/F.linear on dequantized int8 weights
    for root, m in list(plan.fused.items()):
        mod = gm.get_submodule(root.target)
        settings = config.settings_for(gm, root)
        wq, wqp = quantize_weight(mod.weight, settings["weight"]())
        base = root.target
        wq_name = _free_attr(gm, base + "_weight_int8")
        gm.register_buffer(wq_name, wq)
        ws_name = _free_attr(gm, base + "_weight_scale")
        gm.register_buffer(ws_name, wqp.scale.to(torch.float32).clone())
        wz_name = _free_attr(gm, base + "_weight_zero_point")
        gm.register_buffer(wz_name, wqp.zero_point.to(torch.int64).clone())
        b_name = None
        if mod.bias is not None:
            b_name = _free_attr(gm, base + "_bias")
            gm.register_buffer(b_name, mod.bias.detach().float().clone())
        gm.meta.setdefault("quant_buffers", []).extend(n for n in (wq_name, ws_name, wz_name, b_name) if n)
        with graph.inserting_before(root):
            wq_n = graph.get_attr(wq_name)
            ws_n = graph.get_attr(ws_name)
            wz_n = graph.get_attr(wz_name)
            wargs = (wq_n, ws_n, wz_n, wqp.axis) + ((precision,) if precision is not torch.float32 else ())
            wdq = graph.call_function(dequantize_per_channel, wargs)
            b_n = graph.get_attr(b_name) if b_name else None
            meta = _dqmeta(root, precision)
            meta.update({k: val for k, val in root.meta.items() if k != "tensor_meta"})
            if isinstance(mod, nn.Conv2d):
                new = graph.call_function(reference_conv2d, (root.args[0], wdq, b_n, tuple(mod.stride),
                                                             tuple(mod.padding), tuple(mod.dilation), mod.groups),
                                          meta=meta)
            else:
                new = graph.call_function(reference_linear, (root.args[0], wdq, b_n), meta=meta)
        new.meta["quant_layer"] = root.target
        root.replace_all_uses_with(new)
        graph.erase_node(root)
        _delete_module(gm, root.target)
    graph.lint()
    graph.created_by = "to_reference"
    gm.meta.pop("quant_config", None)  # the calibration recipe (observer factories: code) stays with `prepared`
    gm.meta["quant_stage"] = "reference"
    gm.meta["quant_precision"] = precision
    gm.recompile()
    return gm


def _swap(a, old, new):
    from ...graph.node import map_arg
    return map_arg(a, lambda n: new if n is old else n)
