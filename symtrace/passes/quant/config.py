"""What runs in int8: the backend's declarative pattern table and the user's overrides.

A :class:`BackendSpec` is data, not code: which chains of (canonical) ops become one fused
int8 call, which ops pass int8 through unchanged (inheriting their input's parameters), which
compute in int8 with their own output parameters, and which have fixed output parameters.
:class:`QuantConfig` adds the observers to use and per-module overrides (keep a module in
float, or observe it differently). :func:`annotate` applies both to a canonicalized graph and
returns a :class:`Plan`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ...graph.graph_module import GraphModule
from ...graph.node import Node
from .canonicalize import op_kind
from .observers import FixedQParamsObserver, MinMaxObserver, Observer, PerChannelSymmetricObserver

__all__ = ["BackendSpec", "QuantConfig", "Plan", "FusedMatch", "annotate", "BACKEND_SPECS", "get_backend_spec"]


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """Which patterns a backend runs in int8 (see the module docstring).

    ``fused``: chains matched from a root along single-user edges, longest first (``"add"``
    takes the chain value and one other tensor). ``inherit``: ops whose int8 output keeps the
    input's parameters (max/avg pool, flatten, reshape, ...). ``requant``: ops computed in int8
    with their own observed output parameters, run in int8 only when an input already is.
    ``fixed``: ops whose output parameters are fixed ``(scale, zero_point)`` (uint8).
    """

    name: str
    activation_dtype: torch.dtype = torch.uint8
    reduce_range: bool = False
    fused: Tuple[Tuple[str, ...], ...] = (
        ("conv2d", "add", "relu"), ("conv2d", "add"), ("conv2d", "relu"), ("conv2d",),
        ("linear", "relu"), ("linear",))
    inherit: FrozenSet[str] = frozenset({"max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "flatten", "reshape",
                                         "view", "relu", "contiguous", "squeeze", "unsqueeze"})
    requant: FrozenSet[str] = frozenset({"add", "cat"})
    fixed: Tuple[Tuple[str, Tuple[float, int]], ...] = (("sigmoid", (1.0 / 256, 0)), ("tanh", (2.0 / 256, 128)))

    def fixed_qparams(self, kind: str) -> Optional[Tuple[float, int]]:
        return dict(self.fixed).get(kind)

    def table(self) -> List[Tuple[str, str]]:
        """The table as ``(what, ops)`` rows, for printing."""
        return [("fused int8 patterns", ", ".join(" + ".join(p) for p in self.fused)),
                ("int8 in, same params out", ", ".join(sorted(self.inherit))),
                ("int8 with own output params", ", ".join(sorted(self.requant))),
                ("fixed output params", ", ".join(f"{k} (scale {s:.4g}, zp {z})" for k, (s, z) in self.fixed)),
                ("activations / weights", f"{str(self.activation_dtype)[6:]} affine"
                                          f"{' (7-bit, reduce_range)' if self.reduce_range else ''} / "
                                          "int8 symmetric per channel")]


#: ``x86``: oneDNN on VNNI/AMX CPUs (full 8-bit activations). ``fbgemm``: 7-bit activations
#: (``reduce_range``) for kernels that accumulate u8*s8 pairs in int16 (AVX2 without VNNI).
BACKEND_SPECS: Dict[str, BackendSpec] = {
    "x86": BackendSpec("x86"),
    "fbgemm": BackendSpec("fbgemm", reduce_range=True),
}


def get_backend_spec(spec: Union[str, BackendSpec]) -> BackendSpec:
    if isinstance(spec, BackendSpec):
        return spec
    try:
        return BACKEND_SPECS[spec]
    except KeyError:
        raise ValueError(f"unknown backend spec {spec!r}; known: {', '.join(BACKEND_SPECS)} "
                         "(or pass a BackendSpec)") from None


_SKIP = object()


@dataclasses.dataclass
class QuantConfig:
    """Observers and overrides for post-training static quantization.

    ``activation``/``weight`` are zero-argument factories (a class or ``functools.partial``);
    the activation observer's dtype and ``reduce_range`` come from the backend spec.
    ``keep_float(*keys)`` keeps modules (by qualified name prefix, or by type) in float;
    ``override(key, activation=..., weight=...)`` observes them differently. Later overrides
    win. Methods return ``self`` for chaining::

        QuantConfig().keep_float("fc").override(nn.Conv2d, weight=PerTensorSymmetricObserver)
    """

    backend: Union[str, BackendSpec] = "x86"
    activation: Callable[..., Observer] = MinMaxObserver
    weight: Callable[..., Observer] = PerChannelSymmetricObserver
    overrides: List[Tuple[Any, Dict[str, Any]]] = dataclasses.field(default_factory=list)

    @property
    def spec(self) -> BackendSpec:
        return get_backend_spec(self.backend)

    def keep_float(self, *keys: Union[str, type]) -> "QuantConfig":
        for k in keys:
            self._check_key(k)
            self.overrides.append((k, {"skip": True}))
        return self

    def override(self, key: Union[str, type], *, activation: Optional[Callable[..., Observer]] = None,
                 weight: Optional[Callable[..., Observer]] = None) -> "QuantConfig":
        self._check_key(key)
        d: Dict[str, Any] = {}
        if activation is not None:
            d["activation"] = activation
        if weight is not None:
            d["weight"] = weight
        self.overrides.append((key, d))
        return self

    @staticmethod
    def _check_key(k: Any) -> None:
        if not (isinstance(k, str) or (isinstance(k, type) and issubclass(k, nn.Module))):
            raise TypeError(f"override keys are module names (str) or nn.Module types, got {k!r}")

    # --- resolution ---------------------------------------------------------------------
    def settings_for(self, gm: nn.Module, node: Node) -> Dict[str, Any]:
        """The effective settings (``skip``, ``activation``, ``weight``) for ``node``."""
        out: Dict[str, Any] = {"skip": False, "activation": self.activation, "weight": self.weight}
        if not self.overrides:
            return out
        path = _module_path(node)
        mtype = _module_type(gm, node)
        for key, d in self.overrides:
            if isinstance(key, str):
                hit = path is not None and (key == "" or path == key or path.startswith(key + "."))
            else:
                hit = mtype is not None and issubclass(mtype, key)
            if hit:
                out.update(d)
        return out

    def make_activation_observer(self, factory: Callable[..., Observer]) -> Observer:
        spec = self.spec
        try:
            return factory(dtype=spec.activation_dtype, reduce_range=spec.reduce_range)
        except TypeError:
            return factory()


def _module_path(node: Node) -> Optional[str]:
    """The user's name for where ``node`` runs: the traced module path (kept when a pass
    retargets the node, e.g. ``stem.conv`` -> ``stem.conv_bn_folded``), else the target."""
    p = node.meta.get("module_path")
    if isinstance(p, str):
        return p
    return node.target if node.op == "call_module" else None


def _module_type(gm: nn.Module, node: Node) -> Optional[type]:
    path = node.target if node.op == "call_module" else _module_path(node)
    if path is None:
        return None
    try:
        return type(gm.get_submodule(path)) if path else type(gm)
    except AttributeError:
        return None


@dataclasses.dataclass
class FusedMatch:
    """One fused pattern instance: ``nodes`` from the root (conv/linear) to ``output``."""

    kinds: Tuple[str, ...]
    nodes: List[Node]
    input: Node                  # the root's activation input
    other: Optional[Node] = None  # the add's other operand

    @property
    def root(self) -> Node:
        return self.nodes[0]

    @property
    def output(self) -> Node:
        return self.nodes[-1]


@dataclasses.dataclass
class Plan:
    """Where int8 runs. ``observe``: values that get their own observer (node -> settings);
    ``inherit``: value -> the value whose parameters it reuses; ``fixed``: value ->
    (scale, zero_point); ``int8_ops``: standalone nodes computed in int8 (requant ops and
    inherit/fixed ops); ``fused``: matches by root; ``member``: every node of a match."""

    spec: BackendSpec
    fused: Dict[Node, FusedMatch] = dataclasses.field(default_factory=dict)
    member: Dict[Node, FusedMatch] = dataclasses.field(default_factory=dict)
    observe: Dict[Node, Dict[str, Any]] = dataclasses.field(default_factory=dict)
    inherit: Dict[Node, Node] = dataclasses.field(default_factory=dict)
    fixed: Dict[Node, Tuple[float, int]] = dataclasses.field(default_factory=dict)
    int8_ops: Dict[Node, str] = dataclasses.field(default_factory=dict)

    def is_quantized(self, v: Any) -> bool:
        return type(v) is Node and (v in self.observe or v in self.inherit or v in self.fixed)

    def quantized_consumers(self, v: Node) -> List[Node]:
        """Users of ``v`` that read it as int8."""
        out = []
        for u in v.users:
            m = self.member.get(u)
            if m is not None:
                if u is m.root and m.input is v or (m.other is v and u in m.nodes):
                    out.append(u)
            elif u in self.int8_ops:
                out.append(u)
        return out


def _tensor_inputs(node: Node) -> List[Node]:
    if node.op == "call_function" and op_kind(None, node) == "cat":
        seq = node.args[0] if node.args else node.kwargs.get("tensors", ())
        return [a for a in seq if type(a) is Node]
    return [a for a in node.args if type(a) is Node][:1] if node.args else []


def _match_chain(gm: nn.Module, root: Node, kinds: Tuple[str, ...]) -> Optional[FusedMatch]:
    if root.op != "call_module" or len(root.args) != 1 or root.kwargs or type(root.args[0]) is not Node:
        return None
    m = gm.get_submodule(root.target)
    if isinstance(m, nn.Conv2d) and m.padding_mode != "zeros":
        return None
    nodes, other, cur = [root], None, root
    for k in kinds[1:]:
        if len(cur.users) != 1:
            return None
        u = next(iter(cur.users))
        if op_kind(gm, u) != k or u.kwargs:
            return None
        if k == "add":
            if len(u.args) != 2 or not all(type(a) is Node for a in u.args) or u.args[0] is u.args[1]:
                return None
            other = u.args[1] if u.args[0] is cur else u.args[0]
            tm_o, tm_c = other.meta.get("tensor_meta"), cur.meta.get("tensor_meta")
            if tm_o is not None and tm_c is not None and tuple(tm_o.shape) != tuple(tm_c.shape):
                return None  # broadcasting add: not a fusable residual
        elif u.args != (cur,):
            return None
        nodes.append(u)
        cur = u
    return FusedMatch(kinds, nodes, root.args[0], other)


def annotate(gm: GraphModule, config: QuantConfig, skip: Sequence[Node] = ()) -> Plan:
    """Decide, for a canonicalized graph without observers, which values are int8 and how.

    ``skip``: extra pattern roots to keep in float (one-layer-at-a-time sensitivity)."""
    spec = config.spec
    plan = Plan(spec)
    skip = set(skip)
    patterns = sorted(spec.fused, key=len, reverse=True)
    settings: Dict[Node, Dict[str, Any]] = {}

    def cfg(n: Node) -> Dict[str, Any]:
        s = settings.get(n)
        if s is None:
            s = settings[n] = config.settings_for(gm, n)
        return s

    # 1. fused matches, in graph order
    for node in gm.graph.nodes:
        if node in plan.member or node in skip:
            continue
        kind = op_kind(gm, node)
        if kind is None or cfg(node)["skip"]:
            continue
        for pat in patterns:
            if pat[0] != kind:
                continue
            m = _match_chain(gm, node, pat)
            if m is not None and not any(n in plan.member for n in m.nodes):
                plan.fused[node] = m
                for n in m.nodes:
                    plan.member[n] = m
                break

    def want_int8(v: Any, who: Node) -> bool:
        """Make ``v`` an int8 value (observing it if it is float); False if it cannot be."""
        if type(v) is not Node:
            return False
        if plan.is_quantized(v):
            return True
        tm = v.meta.get("tensor_meta")
        if tm is not None and hasattr(tm, "dtype") and not tm.dtype.is_floating_point:
            return False
        plan.observe[v] = cfg(who)
        return True

    # 2. walk in order
    for node in gm.graph.nodes:
        m = plan.member.get(node)
        if m is not None:
            if node is m.root:
                ok = want_int8(m.input, node)
                if m.other is not None:
                    ok = want_int8(m.other, node) and ok
                if not ok:  # e.g. an integer input: leave the whole pattern in float
                    for n in m.nodes:
                        plan.member.pop(n, None)
                    plan.fused.pop(node)
                    continue
            if node is m.output:
                plan.observe[node] = cfg(m.root)
            continue
        kind = op_kind(gm, node)
        if kind is None or node.op == "call_module" or cfg(node)["skip"]:
            continue
        ins = _tensor_inputs(node)
        if not ins:
            continue
        if kind in spec.inherit:
            if plan.is_quantized(ins[0]):
                plan.inherit[node] = ins[0]
                plan.int8_ops[node] = kind
        elif kind in spec.requant:
            if any(plan.is_quantized(a) for a in ins) and all(type(a) is Node for a in ins) and \
                    (kind != "add" or (len(node.args) == 2 and all(type(a) is Node for a in node.args))):
                for a in ins if kind == "cat" else node.args:
                    want_int8(a, node)
                plan.observe[node] = cfg(node)
                plan.int8_ops[node] = kind
        elif spec.fixed_qparams(kind) is not None:
            if plan.is_quantized(ins[0]):
                plan.fixed[node] = spec.fixed_qparams(kind)
                plan.int8_ops[node] = kind
    return plan


def observer_for(config: QuantConfig, plan: Plan, v: Node) -> Observer:
    """A fresh observer for an observed value of ``plan``."""
    if v in plan.fixed:
        s, z = plan.fixed[v]
        return FixedQParamsObserver(s, z, config.spec.activation_dtype)
    return config.make_activation_observer(plan.observe[v]["activation"])
