"""Lower a reference (q/dq) graph to int8 execution, and dynamic int8 Linear.

:func:`lower` pattern-matches what :func:`~symtrace.passes.quant.to_reference` emits, at each
``quantize`` node, looking backwards:

==============================================================  =================================
reference                                                       lowered
==============================================================  =================================
``q(relu?(add?(conv2d(dq(x), dq_w(W)), dq(r))))``               ``int8_conv2d(x, W, ..., accum=r, post=relu)``
``q(relu?(linear(dq(x), dq_w(W))))``                            ``int8_linear(x, W, ...)``
``q(max_pool2d / flatten / view / reshape (dq(x)))``, same params  the op on ``x`` itself
``q(relu(dq(x)))`` / ``q(avg_pool(dq(x)))``, same params         ``int8_relu`` / ``int8_avg_pool2d``
``q(add(dq(a), dq(b)))``, ``q(cat([dq(a), ...]))``              ``int8_add``, ``int8_cat``
``q(sigmoid(dq(x)))``, ``q(tanh(dq(x)))``                       ``int8_lut(x, table)`` (exact)
``q(dq(x))``                                                    ``x`` (or a requantize)
==============================================================  =================================

so int8 flows through pooling, flattening and concatenation: a plain CNN keeps one
``quantize`` at its input and one ``dequantize`` at its output. With ``fuse_edges`` (the
default) those fold into an adjacent ``int8_linear`` as well (``x_range``: it quantizes its
float input; ``dequantize_out``: it returns float), so an MLP is one call per layer. Anything unmatched stays as
in the reference (correct, just slower). The fused calls dispatch to a backend
by name (:mod:`~symtrace.passes.quant.registry`): ``"c"``, ``"onednn"``, ``"portable"``, or ``"auto"``.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any, Dict, Iterable, Optional, Tuple

import torch
from torch import nn

from ...graph.graph_module import GraphModule
from ...graph.node import Node
from ...graph.effects import is_impure
from .canonicalize import canonicalize, op_kind
from ..module_hooks import runs_forward_hooks
from .kernels import (int8_adaptive_avg_pool2d, int8_add, int8_avg_pool2d, int8_cat, int8_conv2d, int8_dynamic_linear,
                      int8_linear, int8_lut, int8_max_pool2d, int8_relu)
from .observers import PerChannelSymmetricObserver
from .qparams import (dequantize_per_channel, dequantize_per_tensor, quantize_per_tensor, reference_conv2d,
                      reference_linear, requantize_per_tensor)
from .reference import _free_attr, _delete_module, quantize_weight
from .registry import backend_available, default_backend, get_backend

__all__ = ["lower", "quantize_dynamic", "resolve_backend"]

_VIEWLIKE = {"flatten", "view", "reshape", "contiguous", "squeeze", "unsqueeze"}
_LUT_FUNCS = {torch.sigmoid, torch.tanh}
_FRESH = {int8_conv2d, int8_linear, int8_add, quantize_per_tensor, int8_max_pool2d}


def resolve_backend(backend: str) -> str:
    """``"auto"`` -> the best available backend (with a warning, once, where none of them is
    fast on this CPU); a named one must be available."""
    if backend == "auto":
        chosen = default_backend()
        _warn_if_slow(chosen)
        return chosen
    get_backend(backend)  # unknown name -> ValueError
    if not backend_available(backend):
        raise RuntimeError(f"int8 backend {backend!r} is not usable with this torch build "
                           f"(torch {torch.__version__}); use backend='auto' or 'portable'")
    return backend


_SLOW_WARNED = False


def _warn_if_slow(chosen: str) -> None:
    """Warn once when the int8 kernels that "auto" found are all plain code: symtrace's C
    kernels without AVX512-VNNI and no usable oneDNN int8 (torch's oneDNN int8 ops saturate
    their int16 sums on CPUs without VNNI, and fail the exactness self-check there)."""
    global _SLOW_WARNED
    if _SLOW_WARNED:
        return
    isa = getattr(get_backend(chosen), "isa", None)
    fast = (chosen == "onednn" or backend_available("onednn")) or (callable(isa) and isa() != "generic")
    if fast:
        return
    _SLOW_WARNED = True
    warnings.warn(
        f"symtrace.passes.quant: this CPU has no fast exact int8 kernels (symtrace's need AVX512-VNNI; torch's "
        f"oneDNN int8 ops failed the exactness check or are missing), so the {chosen!r} backend runs int8 layers "
        "in plain C: correct, but slower than float32 (an AVX2 AMD EPYC: the digits CNN 13-28x, an MLP 3-10x). "
        "For speed here keep the model in float32, or quantize weights only (passes.quant.weight_only has AVX2 "
        "kernels).", stacklevel=3)


def _is(n: Any, fn) -> bool:
    return type(n) is Node and n.op == "call_function" and n.target is fn


def _dq_params(n: Node) -> Tuple[float, int]:
    return n.args[1], n.args[2]


def _q_params(q: Node):
    _, s, z, lo, hi, dt = q.args
    return s, z, lo, hi, dt


def _attr_tensor(gm: nn.Module, n: Any) -> Optional[torch.Tensor]:
    if type(n) is not Node or n.op != "get_attr":
        return None
    obj: Any = gm
    for part in n.target.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.Tensor) else None


def _single_user(n: Node) -> bool:
    return len(n.users) == 1


class _Lowerer:
    def __init__(self, gm: GraphModule, backend: str):
        self.gm, self.g, self.backend = gm, gm.graph, backend
        self.stats: Dict[str, int] = {}

    def count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1

    # --- fused conv / linear ---------------------------------------------------------------
    def fused(self, q: Node) -> Optional[Node]:
        cur = q.args[0]
        post, other = "none", None
        if type(cur) is Node and op_kind(self.gm, cur) == "relu" and cur.op == "call_function" and _single_user(cur):
            post, cur = "relu", cur.args[0]
        if type(cur) is Node and op_kind(self.gm, cur) == "add" and _single_user(cur) and len(cur.args) == 2:
            a, b = cur.args
            if _is(a, reference_conv2d) and _single_user(a) and _is(b, dequantize_per_tensor):
                cur, other = a, b
            elif _is(b, reference_conv2d) and _single_user(b) and _is(a, dequantize_per_tensor):
                cur, other = b, a
            else:
                return None
        if type(cur) is not Node or not _single_user(cur) or cur.kwargs:
            return None
        is_conv = _is(cur, reference_conv2d)
        if not (is_conv or _is(cur, reference_linear)):
            return None
        x_dq, w_dq = cur.args[0], cur.args[1]
        bias = cur.args[2] if len(cur.args) > 2 else None
        if not _is(x_dq, dequantize_per_tensor) or not _is(w_dq, dequantize_per_channel) or w_dq.args[3] != 0:
            return None
        wq_n, ws_n, wz_n = w_dq.args[:3]
        wq, wz = _attr_tensor(self.gm, wq_n), _attr_tensor(self.gm, wz_n)
        if wq is None or wz is None or wq.dtype is not torch.int8 or bool(wz.ne(0).any()):
            return None
        if bias is not None and _attr_tensor(self.gm, bias) is None:
            return None
        s, z, lo, hi, _ = _q_params(q)
        xs, xz = _dq_params(x_dq)
        common = dict(x_scale=xs, x_zp=xz, out_scale=s, out_zp=z, qmin=lo, qmax=hi, post=post, backend=self.backend)
        with self.g.inserting_before(q):
            if is_conv:
                _, _, _, stride, padding, dilation, groups = cur.args
                kw = dict(stride=tuple(stride), padding=tuple(padding), dilation=tuple(dilation), groups=groups,
                          **common)
                if other is not None:
                    as_, az = _dq_params(other)
                    kw.update(accum=other.args[0], accum_scale=as_, accum_zp=az, accum_inplace=False)
                new = self.g.call_function(int8_conv2d, (x_dq.args[0], wq_n, ws_n, bias), kw)
            else:
                new = self.g.call_function(int8_linear, (x_dq.args[0], wq_n, ws_n, bias), common)
        new.meta["quant_layer"] = cur.meta.get("quant_layer")
        self.count(("int8_conv2d" if is_conv else "int8_linear") + ("+add" if other is not None else "")
                   + ("+relu" if post == "relu" else ""))
        return new

    # --- single ops in the int8 domain -----------------------------------------------------
    def single(self, q: Node) -> Optional[Node]:
        v = q.args[0]
        s, z, lo, hi, dt = _q_params(q)
        if _is(v, dequantize_per_tensor):  # q(dq(x))
            xs, xz = _dq_params(v)
            x = v.args[0]
            if (xs, xz) == (s, z):
                self.count("q(dq) removed")
                return x
            with self.g.inserting_before(q):
                self.count("requantize")
                return self.g.call_function(requantize_per_tensor, (x, xs, xz, s, z, lo, hi, dt))
        if type(v) is not Node or v.op not in ("call_function", "call_method"):
            return None
        kind = op_kind(self.gm, v)
        if kind is None and not (v.op == "call_function" and v.target in _LUT_FUNCS):
            return None
        first = v.args[0] if v.args else None
        with self.g.inserting_before(q):
            if kind == "add" and len(v.args) == 2 and not v.kwargs and all(_is(a, dequantize_per_tensor) for a in v.args):
                a, b = v.args
                self.count("int8_add")
                return self.g.call_function(int8_add, (a.args[0], *_dq_params(a), b.args[0], *_dq_params(b)),
                                            dict(out_scale=s, out_zp=z, qmin=lo, qmax=hi, dtype=dt))
            if kind == "cat":
                seq = v.args[0] if v.args else v.kwargs.get("tensors")
                dim = v.args[1] if len(v.args) > 1 else v.kwargs.get("dim", 0)
                if isinstance(seq, (list, tuple)) and seq and all(_is(a, dequantize_per_tensor) for a in seq):
                    self.count("int8_cat")
                    return self.g.call_function(int8_cat, ([a.args[0] for a in seq], [_dq_params(a) for a in seq],
                                                           dim), dict(out_scale=s, out_zp=z, qmin=lo, qmax=hi, dtype=dt))
                return None
            if not _is(first, dequantize_per_tensor) or _dq_params(first) != (s, z) and \
                    not (v.op == "call_function" and v.target in _LUT_FUNCS):
                return None
            x = first.args[0]
            if kind in _VIEWLIKE:
                args = (x,) + tuple(v.args[1:])
                self.count(kind)
                if v.op == "call_method":
                    return self.g.call_method(v.target, args, dict(v.kwargs))
                return self.g.call_function(v.target, args, dict(v.kwargs))
            if kind == "max_pool2d":
                self.count("int8_max_pool2d")
                return self.g.call_function(int8_max_pool2d, (x,) + tuple(v.args[1:]), dict(v.kwargs))
            if kind == "relu":
                self.count("int8_relu")
                return self.g.call_function(int8_relu, (x, z))
            if kind == "avg_pool2d":
                self.count("int8_avg_pool2d")
                return self.g.call_function(int8_avg_pool2d, (x, s, z) + tuple(v.args[1:]),
                                            dict(v.kwargs, qmin=lo, qmax=hi))
            if kind == "adaptive_avg_pool2d":
                self.count("int8_adaptive_avg_pool2d")
                return self.g.call_function(int8_adaptive_avg_pool2d, (x, s, z) + tuple(v.args[1:]),
                                            dict(v.kwargs, qmin=lo, qmax=hi))
            if v.op == "call_function" and v.target in _LUT_FUNCS and len(v.args) == 1 and not v.kwargs:
                xs, xz = _dq_params(first)
                return self.lut(x, v.target, xs, xz, s, z, lo, hi, dt, q)
        return None

    def lut(self, x: Node, fn, xs, xz, s, z, lo, hi, dt, q: Node) -> Optional[Node]:
        tm = x.meta.get("tensor_meta")
        in_dtype = getattr(tm, "dtype", None) or torch.uint8
        codes = torch.arange(-128, 128) if in_dtype is torch.int8 else torch.arange(0, 256)
        precision = self.gm.meta.get("quant_precision", torch.float64)
        table = quantize_per_tensor(fn(dequantize_per_tensor(codes, xs, xz, precision)), s, z, lo, hi, dt)
        name = _free_attr(self.gm, f"{q.meta.get('quant_of', q.name)}_lut")
        self.gm.register_buffer(name, table)
        self.gm.meta.setdefault("quant_buffers", []).append(name)
        t = self.g.get_attr(name)
        self.count(f"int8_lut({fn.__name__})")
        return self.g.call_function(int8_lut, (x, t))

    # --- graph edges into int8_linear --------------------------------------------------------
    def fuse_edges(self) -> None:
        """``int8_linear(quantize(x))`` -> ``int8_linear(x, x_range=...)`` and
        ``dequantize(int8_linear(...))`` -> ``int8_linear(..., dequantize_out=True)`` where the
        quantize/dequantize has no other user and the same parameters."""
        for n in self.g.find_nodes(op="call_function", target=int8_linear):
            kw = n.kwargs
            q = n.args[0]
            if _is(q, quantize_per_tensor) and _single_user(q) and len(q.args) == 6 and not q.kwargs \
                    and kw.get("x_range") is None:
                s, z, lo, hi, dt = _q_params(q)
                if (s, z) == (kw["x_scale"], kw["x_zp"]) and dt is (torch.int8 if lo < 0 else torch.uint8):
                    n.args = (q.args[0],) + tuple(n.args[1:])
                    n.kwargs = dict(n.kwargs, x_range=(lo, hi))
                    self.g.erase_node(q)
                    self.count("input quantize fused")
            if not _single_user(n) or kw.get("dequantize_out"):
                continue
            dq = next(iter(n.users))
            dtype = dq.args[3] if len(dq.args) > 3 else dq.kwargs.get("dtype", torch.float32)
            if _is(dq, dequantize_per_tensor) and dq.args[0] is n and dtype is torch.float32 \
                    and set(dq.kwargs) <= {"dtype"} and _dq_params(dq) == (kw["out_scale"], kw["out_zp"]):
                dq.replace_all_uses_with(n)
                self.g.erase_node(dq)
                n.kwargs = dict(n.kwargs, dequantize_out=True)
                tm = n.meta.get("tensor_meta")
                if tm is not None and dataclasses.is_dataclass(tm):  # float now; qparams kept: on their grid
                    n.meta["tensor_meta"] = dataclasses.replace(tm, dtype=torch.float32)
                self.count("output dequantize fused")

    # --- driver ----------------------------------------------------------------------------
    def run(self) -> None:
        for q in list(self.g.nodes):
            if q._erased or not _is(q, quantize_per_tensor):
                continue
            new = self.fused(q) or self.single(q)
            if new is None:
                continue
            if new is not q.args[0] and type(new) is Node:
                layer = new.meta.get("quant_layer")
                new.meta.update(q.meta)
                if layer is not None:
                    new.meta["quant_layer"] = layer
            q.replace_all_uses_with(new)
            self.dce()
        self.dce()
        self.mark_inplace_accumulators()
        self.drop_unused_attrs()

    def dce(self) -> None:
        for n in reversed(list(self.g.nodes)):
            if not n.users and not n._erased and n.op in ("call_function", "call_method", "get_attr") \
                    and not is_impure(n, self.gm):
                self.g.erase_node(n)

    def mark_inplace_accumulators(self) -> None:
        """oneDNN writes a residual's result into the accumulator tensor: allow it only when
        nothing reads that tensor afterwards and it is a fresh int8 result."""
        pos = self.g.positions()
        for n in self.g.find_nodes(op="call_function", target=int8_conv2d):
            acc = n.kwargs.get("accum")
            if type(acc) is not Node:
                continue
            fresh = acc.op == "call_function" and acc.target in _FRESH
            later = any(pos[u] > pos[n] for u in acc.users if u is not n)
            ok = fresh and not later and acc is not n.args[0] and acc.op != "placeholder"
            if ok != n.kwargs.get("accum_inplace"):
                n.kwargs = dict(n.kwargs, accum_inplace=ok)

    def drop_unused_attrs(self) -> None:
        """Buffers conversion made that no node reads any more (weight zero points: all 0)."""
        used = {n.target for n in self.g.nodes if n.op in ("get_attr", "call_module")}
        made = self.gm.meta.get("quant_buffers", [])
        for name in list(made):
            if name not in used and name in self.gm._buffers:
                delattr(self.gm, name)
                made.remove(name)


def lower(ref: GraphModule, backend: str = "auto", *, inplace: bool = False, fuse_edges: bool = True) -> GraphModule:
    """Fuse a reference graph (from :func:`to_reference`) into int8 kernel calls; returns a
    new module (``inplace`` to change ``ref``). ``backend``: ``"auto"``, ``"onednn"``,
    ``"portable"`` or a registered one (``"c"``). ``fuse_edges``: fold the graph's input
    quantize / output dequantize into an adjacent int8 Linear (same results).
    ``gm.meta["quant_lowering"]`` counts what was fused."""
    if ref.meta.get("quant_stage") != "reference":
        raise ValueError("lower expects the output of to_reference(prepared) (a q/dq reference module)")
    backend = resolve_backend(backend)
    gm = ref if inplace else copy.deepcopy(ref)
    lw = _Lowerer(gm, backend)
    lw.run()
    if fuse_edges:
        lw.fuse_edges()
    gm.graph.lint()
    gm.graph.created_by = f"lower(backend={backend!r})"
    gm.meta["quant_stage"] = "lowered"
    gm.meta["quant_backend"] = backend
    gm.meta["quant_lowering"] = dict(lw.stats)
    gm.recompile()
    return gm


def quantize_dynamic(gm: GraphModule, backend: str = "auto", *, keep_float: Iterable[str] = (),
                     weight_observer=PerChannelSymmetricObserver, inplace: bool = False) -> GraphModule:
    """Dynamic int8 Linear: every ``nn.Linear`` (``call_module``, not under a ``keep_float``
    name) becomes ``int8_dynamic_linear`` with int8 per-channel weights; activations are
    quantized per call from their own min/max, results are float. A ReLU right after is fused.
    No calibration needed."""
    backend = resolve_backend(backend)
    gm = gm if inplace else copy.deepcopy(gm)
    canonicalize(gm)
    g = gm.graph
    keep = tuple(keep_float)
    n_done = 0
    for node in list(g.nodes):
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            continue
        mod = gm.get_submodule(node.target)
        if type(mod) is not nn.Linear or runs_forward_hooks(mod):
            continue
        if any(node.target == k or node.target.startswith(k + ".") for k in keep):
            continue
        wq, qp = quantize_weight(mod.weight, weight_observer())
        wq_name = _free_attr(gm, node.target + "_weight_int8")
        gm.register_buffer(wq_name, wq)
        ws_name = _free_attr(gm, node.target + "_weight_scale")
        gm.register_buffer(ws_name, qp.scale.to(torch.float32).clone())
        b_name = None
        if mod.bias is not None:
            b_name = _free_attr(gm, node.target + "_bias")
            gm.register_buffer(b_name, mod.bias.detach().float().clone())
        post, last = "none", node
        if len(node.users) == 1:
            u = next(iter(node.users))
            if op_kind(gm, u) == "relu" and u.op == "call_function" and u.args == (node,) and not u.kwargs:
                post, last = "relu", u
        with g.inserting_before(node):
            args = (node.args[0], g.get_attr(wq_name), g.get_attr(ws_name), g.get_attr(b_name) if b_name else None)
            new = g.call_function(int8_dynamic_linear, args, dict(post=post, backend=backend), meta=dict(last.meta))
        new.meta["quant_layer"] = node.target
        last.replace_all_uses_with(new)
        if last is not node:
            g.erase_node(last)
        target = node.target
        g.erase_node(node)
        _delete_module(gm, target)
        n_done += 1
    g.lint()
    g.created_by = f"quantize_dynamic(backend={backend!r})"
    gm.meta["quant_stage"] = "dynamic"
    gm.meta["quant_backend"] = backend
    gm.meta["quant_lowering"] = {"int8_dynamic_linear": n_done}
    gm.recompile()
    return gm
