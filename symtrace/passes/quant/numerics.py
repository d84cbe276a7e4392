"""Numerics tools: where does quantization lose accuracy?

* :func:`compare_numerics` -- run the float (prepared or folded) graph and a quantized graph
  (reference or lowered) on the same inputs; for every int8 value, the SQNR and cosine
  similarity of its dequantized value against the float one. One call, one table.
* :func:`weight_sqnr` -- per layer, float weight vs dequantized int8 weight.
* :func:`sensitivity` -- one layer at a time kept in float: how much output SQNR each layer costs.
* :func:`observer_table`, :func:`op_histogram`, :func:`model_size` -- summaries for printing.

Compare against the *folded* float graph (the prepared module computes it): batch-norm folding
changes the weights, so unfolded weights are not comparable.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from ...graph.graph_module import GraphModule
from ...graph.interpreter import Interpreter
from ...graph.node import Node
from .config import QuantConfig, annotate
from .kernels import int8_conv2d, int8_dynamic_linear, int8_linear
from .prepare import OBSERVER_CONTAINER, observers_of
from .qparams import QParams, dequantize_per_channel, dequantize_per_tensor, reference_conv2d, reference_linear, sqnr

__all__ = ["compare_numerics", "weight_sqnr", "sensitivity", "observer_table", "op_histogram", "format_histogram",
           "model_size", "cosine"]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.detach().reshape(-1).double()
    b = b.detach().reshape(-1).double()
    d = a.norm() * b.norm()
    return float((a @ b) / d) if d > 0 else float("nan")


class _Recorder(Interpreter):
    def __init__(self, gm, names):
        super().__init__(gm)
        self.names = set(names)
        self.values: Dict[str, Any] = {}

    def run_node(self, n: Node) -> Any:
        out = super().run_node(n)
        if n.name in self.names and isinstance(out, torch.Tensor):
            self.values[n.name] = out.detach().clone()
        return out


def _as_batches(inputs: Any) -> List[tuple]:
    if isinstance(inputs, torch.Tensor):
        return [(inputs,)]
    if isinstance(inputs, tuple):
        return [inputs]
    return [tuple(b) if isinstance(b, (tuple, list)) else (b,) for b in inputs]


def compare_numerics(float_gm: GraphModule, quant_gm: GraphModule, inputs: Any) -> List[Dict[str, Any]]:
    """Per int8 value of ``quant_gm``: ``{"node", "op", "qparams", "sqnr_db", "cosine",
    "max_abs_err"}`` against the same value in ``float_gm``, in graph order, plus a final
    ``"output"`` row. ``inputs``: a tensor, a tuple of inputs, or a list of batches."""
    wanted: Dict[str, Node] = {}
    for n in quant_gm.graph.nodes:
        of = n.meta.get("quant_of")
        tm = n.meta.get("tensor_meta")
        if of is not None and tm is not None and getattr(tm, "qparams", None):
            wanted[n.name] = n
    fnames = {n.meta["quant_of"] for n in wanted.values()}
    sums: Dict[str, List[torch.Tensor]] = {}
    outs_f, outs_q = [], []
    with torch.no_grad():
        for args in _as_batches(inputs):
            rf = _Recorder(float_gm, fnames)
            outs_f.append(rf.run(*args))
            rq = _Recorder(quant_gm, wanted)
            outs_q.append(rq.run(*args))
            for name, n in wanted.items():
                qv, fv = rq.values.get(name), rf.values.get(n.meta["quant_of"])
                if qv is None or fv is None:
                    continue
                qp = QParams.from_dict(n.meta["tensor_meta"].qparams)
                deq = dequantize_per_tensor(qv, qp.scale, qp.zero_point) if not qv.is_floating_point() else qv
                sums.setdefault(name, []).append(torch.stack([fv.reshape(-1).double(), deq.reshape(-1).double()]))
    rows = []
    for name, n in wanted.items():
        if name not in sums:
            continue
        both = torch.cat(sums[name], 1)
        f, q = both[0], both[1]
        qp = QParams.from_dict(n.meta["tensor_meta"].qparams)
        rows.append({"node": n.meta["quant_of"], "op": _label(quant_gm, n), "qparams": str(qp),
                     "sqnr_db": sqnr(f, q), "cosine": cosine(f, q), "max_abs_err": float((f - q).abs().max()),
                     "max_err_steps": float((f - q).abs().max() / qp.scale)})
    f = torch.cat([torch.as_tensor(o).reshape(-1) for o in outs_f])
    q = torch.cat([torch.as_tensor(o).reshape(-1) for o in outs_q])
    rows.append({"node": "output", "op": "output", "qparams": "float", "sqnr_db": sqnr(f, q), "cosine": cosine(f, q),
                 "max_abs_err": float((f.double() - q.double()).abs().max()), "max_err_steps": float("nan")})
    return rows


def _float_weights(float_gm: GraphModule) -> Dict[str, torch.Tensor]:
    out = {}
    for n in float_gm.graph.nodes:
        if n.op == "call_module":
            m = float_gm.get_submodule(n.target)
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                out[n.target] = m.weight.detach()
    return out


def _get(gm: nn.Module, n: Any):
    obj = gm
    for p in n.target.split("."):
        obj = getattr(obj, p)
    return obj


def _int8_weights(quant_gm: GraphModule) -> Dict[str, torch.Tensor]:
    """layer -> dequantized weight, from lowered nodes or reference ``dequantize_per_channel``."""
    out = {}
    for n in quant_gm.graph.nodes:
        layer = n.meta.get("quant_layer")
        if layer is None or n.op != "call_function":
            continue
        if n.target in (int8_conv2d, int8_linear, int8_dynamic_linear):
            wq, ws = _get(quant_gm, n.args[1]), _get(quant_gm, n.args[2])
            out[layer] = dequantize_per_channel(wq, ws, torch.zeros_like(ws, dtype=torch.int64), 0)
        elif n.target in (reference_conv2d, reference_linear):
            w = n.args[1]
            if type(w) is Node and w.target is dequantize_per_channel:
                wq, ws, wz = (_get(quant_gm, a) for a in w.args[:3])
                out[layer] = dequantize_per_channel(wq, ws, wz, w.args[3])
    return out


def weight_sqnr(float_gm: GraphModule, quant_gm: GraphModule) -> Dict[str, float]:
    """``{layer: SQNR dB}`` of each int8 weight against the float weight (folded graph)."""
    fw = _float_weights(float_gm)
    return {layer: sqnr(fw[layer], w) for layer, w in _int8_weights(quant_gm).items() if layer in fw}


def sensitivity(prepared: GraphModule, inputs: Any, *, float_gm: Optional[GraphModule] = None,
                precision: torch.dtype = torch.float32) -> List[Dict[str, Any]]:
    """For each fused int8 layer: the output SQNR (vs float) with only that layer kept in
    float, from the same calibration (reference models at ``precision``: float32 is fast and
    accurate enough for ranking). Rows sorted by gain, largest first (the layers that cost
    the most accuracy); the first row (``layer`` None) is everything quantized."""
    from .reference import strip_observers, to_reference
    float_gm = float_gm or prepared
    batches = _as_batches(inputs)
    with torch.no_grad():
        ref_out = [float_gm(*b) for b in batches]

    def score(gm) -> float:
        with torch.no_grad():
            out = [gm(*b) for b in batches]
        return sqnr(torch.cat([o.reshape(-1) for o in ref_out]), torch.cat([o.reshape(-1) for o in out]))

    config = prepared.meta.get("quant_config") or QuantConfig()
    probe = copy.deepcopy(prepared)
    strip_observers(probe)
    roots = [(n.name, n.target) for n in annotate(probe, config).fused]
    base = score(to_reference(prepared, precision=precision))
    rows = [{"layer": None, "node": None, "sqnr_db": base, "gain_db": 0.0}]
    for name, target in roots:
        s = score(to_reference(prepared, skip=[name], precision=precision))
        rows.append({"layer": target, "node": name, "sqnr_db": s, "gain_db": s - base})
    rows[1:] = sorted(rows[1:], key=lambda r: -r["gain_db"])
    return rows


def observer_table(prepared: GraphModule) -> List[Dict[str, Any]]:
    """One row per observer: the value it watches, its range and the chosen parameters; and
    one row per weight (per-channel, from the weight observer of the config)."""
    rows = []
    for n, obs in observers_of(prepared).items():
        d = obs.describe()
        try:
            qp = obs.qparams()
            scale, zp, dt = qp.scale, qp.zero_point, str(qp.dtype).replace("torch.", "")
        except RuntimeError:
            scale, zp, dt = float("nan"), None, "-"
        rows.append({"value": n.args[0].name, "kind": "activation", "observer": d["observer"], "min": d["min"],
                     "max": d["max"], "scale": scale, "zero_point": zp, "dtype": dt, "per_channel": False})
    config = prepared.meta.get("quant_config") or QuantConfig()
    probe = copy.deepcopy(prepared)
    from .reference import strip_observers
    strip_observers(probe)
    for root in annotate(probe, config).fused:
        mod = probe.get_submodule(root.target)
        obs = config.settings_for(probe, root)["weight"]()
        obs(mod.weight.detach().float())
        qp = obs.qparams()
        s = torch.as_tensor(qp.scale)
        rows.append({"value": root.target + ".weight", "kind": "weight", "observer": type(obs).__name__,
                     "min": float(mod.weight.detach().min()), "max": float(mod.weight.detach().max()),
                     "scale": f"{s.min().item():.3g}..{s.max().item():.3g}" if s.numel() > 1 else float(s),
                     "zero_point": 0 if bool((torch.as_tensor(qp.zero_point) == 0).all()) else "mixed",
                     "dtype": str(qp.dtype).replace("torch.", ""), "per_channel": qp.per_channel})
    return rows


def _label(gm: nn.Module, n: Node) -> str:
    if n.op == "call_module":
        try:
            return type(gm.get_submodule(n.target)).__name__
        except AttributeError:
            return str(n.target)
    if n.op == "call_method":
        return "." + n.target
    t = n.target
    name = getattr(t, "__name__", None) or str(t)
    if t is int8_conv2d:
        k = n.kwargs
        name += ("+add" if k.get("accum") is not None else "") + ("+relu" if k.get("post") == "relu" else "")
    elif t in (int8_linear, int8_dynamic_linear):
        k = n.kwargs
        name = ("q+" if k.get("x_range") is not None else "") + name + ("+relu" if k.get("post") == "relu" else "") \
            + ("+dq" if k.get("dequantize_out") else "")
    mod = getattr(t, "__module__", "") or ""
    if mod.startswith("torch.nn.functional") or name in ("relu", "flatten", "cat", "sigmoid", "tanh"):
        name = name if mod.startswith("torch.nn.functional") else "torch." + name
    if getattr(t, "__module__", "") in ("_operator", "operator"):
        name = "operator." + name
    return name


def op_histogram(gm: GraphModule) -> Dict[str, int]:
    """``{op label: count}`` for the computing nodes (not inputs, outputs, attributes or observers)."""
    out: Dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        if n.op == "call_module" and n.target.startswith(OBSERVER_CONTAINER + "."):
            lab = "observer"
        else:
            lab = _label(gm, n)
        out[lab] = out.get(lab, 0) + 1
    return out


def format_histogram(h: Dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in h.items())


def model_size(gm: nn.Module) -> int:
    """Bytes of parameters and buffers (observers excluded), counting shared tensors once."""
    seen, total = set(), 0
    for name, t in list(gm.named_parameters()) + list(gm.named_buffers()):
        if name.startswith(OBSERVER_CONTAINER + ".") or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total
