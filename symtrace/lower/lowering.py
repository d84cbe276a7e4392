"""The lowering driver: one graph + example inputs -> kernels, torch calls and a wrapper.

:class:`Lowering` runs the graph once on the example inputs to learn every value's shape,
strides and dtype (and the Python values computed from metadata, which it specialises on;
:func:`record`, whose answer is cached on disk for graphs of shape-deterministic ops), then
walks the nodes in order. A node with a rule in :mod:`~symtrace.lower.decomp` becomes a
lazy value; any other node is an *extern*: it runs through torch, in the same order as in the
graph, on materialised arguments. Kernels are formed when values must be materialised (see
:mod:`~symtrace.lower.values`). The result is a list of steps that
:mod:`~symtrace.lower.wrapper` turns into readable Python.

Soundness rules: a node whose lowered shape or dtype disagrees with the recorded one runs
through torch; in-place torch ops first materialise every live value that must see the data
from before the write; arena buffers (reused across calls) never escape to the caller.

Two clean-ups after the walk: a ``linear``/``conv`` whose bias epilogue would be stored by a
kernel doing nothing else (its result feeds torch ops, not a fused kernel) gets its bias back
(``F.linear(x, w, b)``: one pass over the result fewer); torch calls (and kernels) whose
results nothing live reads are dropped when they are pure torch ops (no writes, no
randomness), e.g. the matmul feeding an eval-mode dropout on a dead path.
"""
from __future__ import annotations

import dataclasses
import operator
from types import FunctionType
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..graph.codegen import check_code_names
from ..graph.effects import has_registered_side_effect, is_impure, is_inplace, is_random, is_torch_module
from ..graph.graph_module import GraphModule
from ..graph.interpreter import Interpreter
from ..graph.replay import ROOT_HELPERS
from ..graph.node import Node, TensorMeta, format_target, iter_nodes, map_aggregate, map_arg
from ..serialize.errors import Unencodable
from ..serialize.values import Decoder, Encoder
from .decomp import FUNCTION_RULES, METHOD_RULES, MODULE_RULES, Unsupported, rule_for
from .ir import HALF_DTYPES, SUPPORTED_DTYPES, Buffer, Kernel
from .schedule import build_kernel, collapse
from .values import BufferValue, IndexView, LValue, NeedsMaterialize, contiguous_strides, make_view

__all__ = ["Lowering", "KernelStep", "ExternStep", "Runtime", "NodeReport"]

_META_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad", "is_sparse"})
_META_METHODS = frozenset({"size", "dim", "numel", "stride", "is_contiguous", "element_size", "nelement",
                           "ndimension", "is_floating_point", "is_complex", "get_device", "storage_offset"})

#: dtypes eager holds a node's result in while kernels compute it wider (fp32 / int64): kernels
#: round (fp16/bf16) or wrap (int8/uint8/int16/int32) such a value where they read it
_HELD_DTYPES = frozenset(HALF_DTYPES) | {torch.int8, torch.uint8, torch.int16, torch.int32}

_INPLACE_TO_PURE = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
                    operator.itruediv: operator.truediv}


class Runtime:
    """A non-tensor value known only when the graph runs (e.g. ``x.sum().item()``)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"Runtime({self.name})"


@dataclasses.dataclass(eq=False)
class KernelStep:
    kernel: Kernel


@dataclasses.dataclass(eq=False)
class ExternStep:
    """Run ``kind`` (``function``/``method``/``module``) ``target`` on ``args``/``kwargs``
    (values, materialised) and bind the result to ``result`` (a python name)."""

    node: Node
    kind: str
    target: Any
    args: tuple
    kwargs: dict
    result: str
    out_buffers: List[Tuple[str, Buffer]]  # (python expression, buffer) for tensor results read later
    label: str = ""


@dataclasses.dataclass
class NodeReport:
    node: str
    op: str
    target: str
    where: str   # "kernel k0", "torch", "view", "constant", "input", "output"
    reason: str = ""


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
        if type(target) is FunctionType and target in ROOT_HELPERS:
            return None  # a replayed Python side effect: it runs when the lowered module runs
        return super().call_function(target, args, kwargs)


def _describe(v):
    if isinstance(v, torch.Tensor):
        return TensorMeta.of(v)
    if isinstance(v, (tuple, list)) and v and all(isinstance(x, torch.Tensor) for x in v):
        return tuple(TensorMeta.of(x) for x in v)
    return ("py", v)


def record(gm: GraphModule, inputs: tuple, cache: bool = True) -> Dict[Node, Any]:
    """Every node's value description for ``inputs``: a :class:`TensorMeta`, a tuple of them,
    or ``("py", value)``, found by running ``gm`` on copies of the inputs (with their strides;
    buffers and the CPU RNG state are restored afterwards).

    With ``cache``, graphs made only of ops whose result metadata is a function of their
    inputs' metadata (see :func:`record_key`) keep the answer in the kernel cache directory,
    so lowering the same graph for the same signature again, in any process, runs nothing.
    """
    key = record_key(gm, inputs) if cache else None
    if key is not None:
        seen = _load_record(key, gm)
        if seen is not None:
            return seen
    seen = _record_real(gm, inputs)
    if key is not None:
        _store_record(key, gm, seen)
    return seen


def _record_real(gm: GraphModule, inputs: tuple) -> Dict[Node, Any]:
    inputs = tuple(_copy_keeping_layout(x) if isinstance(x, torch.Tensor) else x for x in inputs)
    saved = [(b, b.detach().clone()) for b in gm.buffers()]
    rng = torch.get_rng_state()
    rec = _Recorder(gm)
    try:
        with torch.no_grad():
            rec.run(*inputs)
    finally:
        with torch.no_grad():
            for b, c in saved:
                b.copy_(c)
        torch.set_rng_state(rng)
    return rec.seen


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


# ------------------------------------------------------------------ record cache
# A record may be reused when it is a function of what the key holds: every call is a torch op
# with a lowering rule (or a listed extern) whose result metadata follows from its inputs'
# metadata and constant arguments, modules are of exactly a type with a rule (their repr,
# training flag and tensors' metadata enter the key) and carry no hooks. Ops whose result
# shape depends on data (boolean-mask indexing, one-argument ``where``, ``tensor_split`` by a
# tensor) and anything else (user functions, ``.item()``, data guards) are recorded each time.
RECORD_FORMAT = "2"  # 2: entries in the saved-graph value codec (serialize.values)
_EXTRA_FUNCTIONS = frozenset((
    operator.floordiv, operator.mod, operator.matmul, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    len, getattr, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.cat, torch.stack, torch.einsum,
    torch.nn.functional.scaled_dot_product_attention, torch.nn.functional.embedding, torch.nn.functional.pad))
_EXTRA_METHODS = frozenset({"matmul", "__matmul__", "bmm", "mm"}) | _META_METHODS - {"get_device", "storage_offset"}
_records: Dict[str, list] = {}   # key -> encoded record (this process)


class _NotCacheable(Exception):
    pass


def _function_name(fn) -> str:
    try:
        known = fn in FUNCTION_RULES or fn in _EXTRA_FUNCTIONS
    except TypeError:  # unhashable callable
        known = False
    if known:
        return f"{getattr(fn, '__module__', None)}:{getattr(fn, '__qualname__', None)}:{format_target(fn)}"
    raise _NotCacheable(format_target(fn))


def _tensor_key(t) -> str:
    if type(t) not in (torch.Tensor, nn.Parameter) or t.layout != torch.strided:
        raise _NotCacheable("tensor subclass or layout")
    return f"T{tuple(t.shape)}{tuple(t.stride())}{t.dtype}{t.device}{int(t.requires_grad)}"


def _const_key(v, index: Dict[Node, int]) -> str:
    if isinstance(v, Node):
        return f"%{index[v]}"
    if v is None or v is Ellipsis or type(v) in (bool, int, float, str):
        return f"{type(v).__name__}:{v!r}"
    if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return f"{type(v).__name__}:{v}"
    if type(v) in (tuple, list, torch.Size):
        return f"{type(v).__name__}(" + ",".join(_const_key(x, index) for x in v) + ")"
    if type(v) is dict and all(type(k) is str for k in v):
        return "{" + ",".join(f"{k!r}:{_const_key(x, index)}" for k, x in v.items()) + "}"
    if type(v) is slice:
        return f"slice({_const_key(v.start, index)},{_const_key(v.stop, index)},{_const_key(v.step, index)})"
    raise _NotCacheable(type(v).__name__)


def record_key(gm: GraphModule, inputs: tuple) -> Optional[str]:
    """The record cache key of ``gm`` for ``inputs``, or None when the record must be computed."""
    import hashlib
    try:
        parts = _key_parts(gm, inputs)
    except (_NotCacheable, AttributeError, KeyError):
        return None
    return hashlib.sha256("\n".join(parts).encode("utf-8", "surrogatepass")).hexdigest()


def _key_parts(gm: GraphModule, inputs: tuple) -> List[str]:
    from torch.nn.modules import module as nn_module
    from .toolchain import cpu_signature
    if any(getattr(nn_module, h, None) for h in ("_global_forward_hooks", "_global_forward_pre_hooks")):
        raise _NotCacheable("global module hooks")
    default_device = torch.get_default_device() if hasattr(torch, "get_default_device") else "?"
    parts = [f"record {RECORD_FORMAT} torch {torch.__version__} {torch.get_default_dtype()} {default_device} "
             f"mkldnn {torch.backends.mkldnn.is_available()} {torch.backends.mkldnn.enabled} {cpu_signature()}"]
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise _NotCacheable("inputs")
    shape_only: Dict[Node, bool] = {}
    for n, x in zip(placeholders, inputs):
        shape_only[n] = not isinstance(x, torch.Tensor)
        parts.append(_tensor_key(x) if isinstance(x, torch.Tensor) else _const_key(x, index))
    for n in nodes:
        args = f"{_const_key(n.args, index)} {_const_key(n.kwargs, index)}"
        if n.op == "placeholder":
            parts.append(f"{n.op} {n.target}")
            continue
        if n.op == "output":
            parts.append(f"output {args}")
            continue
        if n.op == "get_attr":
            owner_path, _, attr = n.target.rpartition(".")
            v = getattr(gm.get_submodule(owner_path) if owner_path else gm, attr)
            parts.append(f"get_attr {_tensor_key(v) if isinstance(v, torch.Tensor) else _const_key(v, index)}")
            shape_only[n] = not isinstance(v, torch.Tensor)
            continue
        if n.op == "call_module":
            parts.append(f"module {_module_key(gm.get_submodule(n.target))} {args}")
            shape_only[n] = False
            continue
        if n.op == "call_method":
            name = n.target
            base = name[:-1] if name.endswith("_") and not name.endswith("__") else name
            if not (name in METHOD_RULES or base in METHOD_RULES or name in _EXTRA_METHODS):
                raise _NotCacheable(name)
            parts.append(f"method {name} {args}")
            shape_only[n] = name in _META_METHODS
        else:
            parts.append(f"function {_function_name(n.target)} {args}")
            if n.target is getattr:
                shape_only[n] = len(n.args) > 1 and n.args[1] in _META_ATTRS
                if not shape_only[n] and not (len(n.args) > 1 and n.args[1] in ("T", "mT")):
                    raise _NotCacheable("getattr")
            else:
                shape_only[n] = all(shape_only.get(i, False) for i in n.all_input_nodes)
        _refuse_data_dependent(n, shape_only)
    return parts


def _refuse_data_dependent(n: Node, shape_only: Dict[Node, bool]) -> None:
    """Ops whose result shape depends on tensor data are never cached."""
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    if name in ("getitem", "__getitem__", "tensor_split") and len(n.args) > 1:
        if not all(shape_only.get(i, False) for i in iter_nodes((n.args[1:], n.kwargs))):
            raise _NotCacheable("indexing by a tensor")
    if name == "where" and len(n.args) + len(n.kwargs) < 3:
        raise _NotCacheable("where(condition)")


def _module_key(mod: nn.Module) -> str:
    if type(mod) not in MODULE_RULES:
        raise _NotCacheable(type(mod).__name__)
    tensors = []
    for sub in mod.modules():
        if sub._forward_hooks or sub._forward_pre_hooks:
            raise _NotCacheable("module hooks")
    for name, t in list(mod.named_parameters()) + list(mod.named_buffers()):
        tensors.append(f"{name}={_tensor_key(t)}")
    return f"{type(mod).__module__}.{type(mod).__qualname__} {mod!r} training={mod.training} {' '.join(tensors)}"


def _is_record_entry(d: Any) -> bool:
    """Whether ``d`` is what a cached record holds for a node: tensor metadata without
    qparams, a tuple of those, or ``("py", value)``."""
    if type(d) is tuple and len(d) == 2 and type(d[0]) is str:
        return d[0] == "py"
    metas = d if type(d) is tuple and d else (d,)
    return all(type(m) is TensorMeta and m.qparams is None for m in metas)


def _encode_record(gm: GraphModule, seen: Dict[Node, Any]) -> list:
    """The JSON form of a record (the saved-graph value codec), one entry per node: tensor
    metadata (a tensor or a tuple of tensors) or ``("py", value)``; None where nothing ran."""
    enc = Encoder()
    out = []
    for n in gm.graph.nodes:
        d = seen.get(n)
        if d is not None and not _is_record_entry(d):
            raise _NotCacheable("record entry")
        try:
            out.append(enc(d, n.name))
        except Unencodable as e:
            raise _NotCacheable(str(e)) from None
    return out


def _decode_record(gm: GraphModule, data: list) -> Dict[Node, Any]:
    nodes = list(gm.graph.nodes)
    if not isinstance(data, list) or len(data) != len(nodes):
        raise ValueError("node count")
    dec = Decoder()
    seen: Dict[Node, Any] = {}
    for n, e in zip(nodes, data):
        d = dec(e, n.name)
        if d is None:
            continue
        if not _is_record_entry(d):
            raise ValueError("record entry")
        seen[n] = d
    return seen


def _load_record(key: str, gm: GraphModule) -> Optional[Dict[Node, Any]]:
    from .toolchain import read_cache_entry
    data = _records.get(key)
    if data is None:
        data = read_cache_entry("records", key)
        if data is None:
            return None
    try:
        seen = _decode_record(gm, data)
    except Exception:   # noqa: BLE001 - any damaged or foreign entry (wrong types, too deep, ...) is a
        return None     # miss: record again (and overwrite it)
    _records[key] = data
    return seen


def _store_record(key: str, gm: GraphModule, seen: Dict[Node, Any]) -> None:
    from .toolchain import write_cache_entry
    try:
        data = _encode_record(gm, seen)
    except _NotCacheable:
        return
    _records[key] = data
    write_cache_entry("records", key, data)


def _dense_strides(shape, strides) -> Tuple[int, ...]:
    """``strides`` if they describe a dense, non-overlapping layout (e.g. channels-last),
    else contiguous strides."""
    if strides and len(strides) == len(shape):
        dims = sorted((s, n) for s, n in zip(strides, shape) if n != 1)
        expect = 1
        ok = True
        for s, n in dims:
            if s != expect:
                ok = False
                break
            expect *= n
        if ok:
            return tuple(strides)
    return contiguous_strides(shape)


class Lowering:
    """Lower one graph for one input signature. After :meth:`run`: ``steps``, ``kernels``,
    ``buffers``, ``outputs`` (a structure of values), ``reports``. ``device_type``: the device
    kernels run on (backends subclass and set it)."""

    device_type = "cpu"
    record_cache = True   # reuse recorded metadata across processes (see :func:`record`)

    def __init__(self, gm: GraphModule, example_inputs: tuple):
        check_code_names(gm.graph.nodes)  # names become code in the wrapper and kernels
        self.gm = gm
        self.example_inputs = tuple(example_inputs)
        self.seen: Dict[Node, Any] = {}
        self.env: Dict[Node, Any] = {}
        self.steps: List[Any] = []
        self.kernels: List[Kernel] = []
        self.buffers: List[Buffer] = []
        self.materialized: Dict[int, BufferValue] = {}
        self._keep: List[Any] = []
        self.alias_of: Dict[int, List[Buffer]] = {}
        self.param_exprs: Dict[int, Tuple[Any, str]] = {}   # id(buffer) -> (owner object, attribute)
        self.reports: Dict[str, NodeReport] = {}
        self.inputs: List[Tuple[str, Any]] = []             # (placeholder name, recorded value or TensorMeta)
        self.outputs: Any = None
        self._names: Dict[str, int] = {}
        self._current: Optional[Node] = None
        self._pos: Dict[Node, int] = {}
        self._param_values: Dict[int, BufferValue] = {}
        self._extern_steps: Dict[int, ExternStep] = {}   # id(result buffer) -> its step (rule externs)
        self._folded: Dict[str, str] = {}                 # node name -> label: bias kept in the torch call

    # ------------------------------------------------------------- helpers used by rules
    def meta_of(self, node) -> Any:
        return self.seen.get(getattr(node, "_node", node))

    def dtype_of(self, node) -> torch.dtype:
        m = self.meta_of(node)
        if not isinstance(m, TensorMeta):
            raise Unsupported("result is not a single tensor")
        return m.dtype

    def shape_of(self, node) -> Tuple[int, ...]:
        m = self.meta_of(node)
        if not isinstance(m, TensorMeta):
            raise Unsupported("result is not a single tensor")
        return tuple(m.shape)

    def fresh(self, stem: str) -> str:
        k = self._names.get(stem, 0)
        self._names[stem] = k + 1
        return f"{stem}{k}"

    def new_buffer(self, dtype, shape, strides, role: str, name: Optional[str] = None) -> Buffer:
        buf = Buffer(name or self.fresh("buf"), dtype, tuple(shape), tuple(strides), role)
        self.buffers.append(buf)
        return buf

    def materialize(self, value: LValue, role: str = "temp", strides=None) -> BufferValue:
        """Store ``value`` into a buffer by a kernel of its own (once)."""
        if isinstance(value, BufferValue):
            return value
        done = self.materialized.get(id(value))
        if done is not None:
            if role == "output":
                self._escape(done.buffer)
            return done
        if value.dtype not in SUPPORTED_DTYPES:
            raise Unsupported(f"dtype {value.dtype}")
        if role in ("temp", "output") and self._fold_bias(value, strides):
            done = self.materialized[id(value)]
            if role == "output":
                self._escape(done.buffer)
            return done
        strides = tuple(strides) if strides is not None else contiguous_strides(value.shape)
        buf = self.new_buffer(value.dtype, value.shape, strides, role)
        target = BufferValue(buf)
        name = self.fresh("k")
        for _ in range(10000):
            try:
                kernel = build_kernel(value, target, name, self.materialized)
                break
            except NeedsMaterialize as e:
                if e.value is value:
                    raise AssertionError(f"{value!r} cannot be stored by its own kernel")
                self.materialize(e.value)
        else:  # pragma: no cover
            raise AssertionError("kernel formation did not converge")
        kernel = collapse(kernel)
        self.kernels.append(kernel)
        self.steps.append(KernelStep(kernel))
        self.materialized[id(value)] = target
        self._keep.append(value)
        return target

    def extern(self, node, fn, args, kwargs, label: str = "") -> BufferValue:
        """Run ``fn(*args, **kwargs)`` through torch (rules use this for matmul/conv before a
        fused epilogue); returns its (single tensor) result as a buffer value."""
        m = self.meta_of(node)
        if not isinstance(m, TensorMeta):
            raise Unsupported("result is not a single tensor")
        args = map_aggregate(args, self._arg_for_extern)
        kwargs = map_aggregate(kwargs, self._arg_for_extern)
        name = self.fresh("ext")
        buf = self.new_buffer(m.dtype, m.shape, _dense_strides(m.shape, m.stride), "extern", name)
        self.alias_of[id(buf)] = []
        step = ExternStep(node, "function", fn, args, kwargs, name, [(name, buf)], label)
        self.steps.append(step)
        self._extern_steps[id(buf)] = step
        return BufferValue(buf, nodes=(node.name,))

    def _fold_bias(self, value: LValue, strides=None) -> bool:
        """When ``value`` is a bias epilogue (``decomp.bias_epilogue``: ``y + b`` over the
        result ``y`` of a torch linear/conv) that would be stored by a kernel of its own, pass
        the bias to the torch call instead and use its result as ``value``'s buffer. Only when
        no kernel read ``y`` already (it would then see the bias twice), the bias is a 1-d
        buffer of ``y``'s dtype, and the wanted strides are ``y``'s."""
        fold = getattr(value, "bias_fold", None)
        if fold is None:
            return False
        y, bias, channel_dim = fold
        step = self._extern_steps.get(id(y.buffer))
        if step is None or step.kwargs or not y.is_whole() or id(value) in self.materialized:
            return False
        if not isinstance(bias, BufferValue) or len(bias.shape) != 1 or bias.dtype != y.dtype:
            return False
        c = len(y.shape) - 1 if channel_dim is None else channel_dim
        if not 0 <= c < len(y.shape) or bias.shape[0] != y.shape[c]:
            return False
        if strides is not None and tuple(strides) != tuple(y.buffer.strides):
            return False
        args = step.args
        if len(args) == 2:
            new_args = (*args, bias)
        elif len(args) > 2 and args[2] is None:
            new_args = (*args[:2], bias, *args[3:])
        else:
            return False
        if any(y.buffer is b for k in self.kernels for b in k.buffers()):
            return False
        step.args = new_args
        fn = getattr(step.target, "__name__", "torch call")
        step.label = f"{fn} with its bias (its result feeds torch ops, no kernel)"
        self._folded[step.node.name] = step.label
        self.materialized[id(value)] = y
        self._keep.append(value)
        return True

    def _view_over_fold(self, v: LValue) -> Optional[BufferValue]:
        """For a torch call's argument that is a view (permute, slice...) of a bias epilogue
        that can be folded: fold it and return the view of the torch call's result (no copy
        kernel); else None."""
        if isinstance(v, IndexView):
            base = self._view_over_fold(v.base)
            return None if base is None else make_view(base, v.shape, v.index_map, v.nodes)
        if isinstance(v, LValue) and not isinstance(v, BufferValue) and self._fold_bias(v):
            return self.materialized[id(v)]
        return None

    def param_value(self, node, module: nn.Module, attr: str) -> Optional[BufferValue]:
        t = getattr(module, attr, None)
        if t is None:
            return None
        if not isinstance(t, torch.Tensor):
            raise Unsupported(f"{attr} is not a tensor")
        return self._tensor_attr(module, attr, t)

    def _tensor_attr(self, owner, attr: str, t: torch.Tensor) -> BufferValue:
        got = self._param_values.get(id(t))
        if got is not None:
            return got
        if t.dtype not in SUPPORTED_DTYPES or t.device.type != self.device_type or t.layout != torch.strided:
            raise Unsupported("parameter layout/device/dtype")
        buf = self.new_buffer(t.dtype, tuple(t.shape), tuple(t.stride()), "param", self.fresh("p"))
        self.param_exprs[id(buf)] = (owner, attr)
        bv = BufferValue(buf)
        self._param_values[id(t)] = bv
        self._keep.append(t)
        return bv

    # ------------------------------------------------------------- main walk
    def run(self) -> "Lowering":
        self.seen = record(self.gm, self.example_inputs, self.record_cache)
        nodes = list(self.gm.graph.nodes)
        self._pos = {n: i for i, n in enumerate(nodes)}
        for node in nodes:
            self._current = node
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op == "get_attr":
                self._get_attr(node)
            elif node.op == "output":
                self._output(node)
            else:
                self._call(node)
        self._drop_dead_steps()
        for name, label in self._folded.items():
            r = self.reports.get(name)
            if r is not None:
                self.reports[name] = NodeReport(r.node, r.op, r.target, "torch", label)
        return self

    def _placeholder(self, node: Node) -> None:
        m = self.seen.get(node)
        self.inputs.append((node.name, m))
        if isinstance(m, TensorMeta):
            if m.dtype not in SUPPORTED_DTYPES or m.device.type != self.device_type:
                raise Unsupported(f"input {node.name}: {m.dtype} on {m.device} is not supported by the "
                                  f"{self.device_type} lowering")
            buf = self.new_buffer(m.dtype, m.shape, m.stride, "input", node.name)
            self.alias_of[id(buf)] = []
            self.env[node] = BufferValue(buf, nodes=(node.name,))
            self._report(node, "input")
        else:
            self.env[node] = m[1] if isinstance(m, tuple) and m and m[0] == "py" else m
            self._report(node, "input", "specialised on its value")

    def _get_attr(self, node: Node) -> None:
        owner_path, _, attr = node.target.rpartition(".")
        owner = self.gm.get_submodule(owner_path) if owner_path else self.gm
        value = getattr(owner, attr)
        if isinstance(value, torch.Tensor):
            try:
                self.env[node] = self._tensor_attr(owner, attr, value)
                self._report(node, "input", "parameter/buffer")
                return
            except Unsupported as e:
                self.env[node] = self._extern_node(node, str(e))
                return
        self.env[node] = value
        self._report(node, "constant")

    def _static(self, node: Node) -> bool:
        """Whether a non-tensor result depends only on metadata (so it can be specialised)."""
        if node.op == "call_method" and node.target in _META_METHODS:
            return True
        if node.op == "call_function" and node.target is getattr and len(node.args) > 1 and node.args[1] in _META_ATTRS:
            return True
        if is_random(node) or is_inplace(node) or has_registered_side_effect(node):
            return False  # (a print, a guard, a replayed side effect: they run every call)
        inputs = node.all_input_nodes
        for i in inputs:
            m = self.seen.get(i)
            if not (isinstance(m, tuple) and m and m[0] == "py") or isinstance(self.env.get(i), Runtime):
                return False
        return node.op == "call_function"

    def _call(self, node: Node) -> None:
        m = self.seen.get(node)
        if isinstance(m, tuple) and m and m[0] == "py" and self._static(node):
            self.env[node] = m[1]
            self._report(node, "constant", "computed from shapes, specialised")
            return
        try:
            value = self._lower(node)
        except Unsupported as e:
            self.env[node] = self._extern_node(node, str(e))
            return
        self.env[node] = value
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, LValue) and not isinstance(v, BufferValue) and v.dtype in _HELD_DTYPES:
                v.held_in_dtype = True
        where = "view" if isinstance(value, LValue) and value.is_view else "fused"
        self._report(node, where)

    def _lower(self, node: Node):
        args = map_arg(node.args, lambda n: self.env[n])
        kwargs = map_arg(node.kwargs, lambda n: self.env[n])
        if _contains(args, Runtime) or _contains(kwargs, Runtime):
            raise Unsupported("reads a value known only at run time")
        inplace = is_inplace(node)
        if inplace and not self._can_functionalize(node):
            raise Unsupported("in-place op on a value others can see (runs through torch)")
        if is_random(node):
            raise Unsupported("draws random numbers")
        if node.op == "call_module":
            mod = self.gm.get_submodule(node.target)
            rule = MODULE_RULES.get(type(mod))
            if rule is None:
                raise Unsupported(f"no lowering rule for {type(mod).__name__}")
            value = rule(self, node, mod, args, kwargs)
        else:
            rule = rule_for(node)
            if rule is None and inplace:
                rule = _pure_rule(node)
            if rule is None:
                raise Unsupported(f"no lowering rule for {format_target(node.target)}")
            kwargs = {k: v for k, v in kwargs.items() if k != "inplace"}
            value = rule(self, node, args, kwargs)
        self._check_matches(node, value)
        return value

    def _can_functionalize(self, node: Node) -> bool:
        """An in-place op can be lowered out of place when it writes a lazy, non-view value
        that nothing else reads."""
        if node.kwargs.get("out") is not None:
            return False
        target = node.args[0] if node.args and isinstance(node.args[0], Node) else None
        if node.op == "call_module" or (target is None and node.kwargs.get("inplace")):
            target = node.args[0] if node.args and isinstance(node.args[0], Node) else None
        if target is None:
            return False
        v = self.env.get(target)
        if not isinstance(v, LValue) or v.is_view or id(v) in self.materialized:
            return False
        return len(target.users) == 1

    def _check_matches(self, node: Node, value) -> None:
        m = self.seen.get(node)
        if isinstance(value, LValue):
            if not isinstance(m, TensorMeta) or tuple(m.shape) != tuple(value.shape) or m.dtype != value.dtype:
                raise Unsupported(f"internal: lowered value {list(value.shape)}/{value.dtype} differs from the recorded "
                                  f"{m}; running through torch")
        elif isinstance(value, tuple):
            if not isinstance(m, tuple) or len(m) != len(value) or not all(
                    isinstance(a, TensorMeta) and isinstance(b, LValue) and tuple(a.shape) == b.shape and a.dtype == b.dtype
                    for a, b in zip(m, value)):
                raise Unsupported("internal: lowered tuple differs from the recorded one; running through torch")
        else:
            raise Unsupported("rule produced no tensor value")

    # ------------------------------------------------------------- externs
    def _arg_for_extern(self, v):
        if isinstance(v, LValue):
            if isinstance(v, IndexView):
                got = self._view_over_fold(v)
                if got is not None:
                    return got
            return self.materialize(v)
        return v

    def _extern_node(self, node: Node, reason: str):
        args = map_arg(node.args, lambda n: self.env[n])
        kwargs = map_arg(node.kwargs, lambda n: self.env[n])
        args = map_aggregate(args, self._arg_for_extern)
        kwargs = map_aggregate(kwargs, self._arg_for_extern)
        if is_inplace(node):
            self._protect_before_write(node, args, kwargs)
        if node.op == "call_module":
            kind, target = "module", self.gm.get_submodule(node.target)
        elif node.op == "call_method":
            kind, target = "method", node.target
        elif node.op == "get_attr":
            kind, target = "attr", node.target
        else:
            kind, target = "function", node.target
        name = self.fresh("r")
        m = self.seen.get(node)
        arg_bufs: List[Buffer] = []
        map_aggregate((args, kwargs), lambda v: arg_bufs.append(v.buffer) if isinstance(v, BufferValue) else None)
        outs: List[Tuple[str, Buffer]] = []
        if isinstance(m, TensorMeta) and m.dtype in SUPPORTED_DTYPES and m.device.type == self.device_type:
            buf = self.new_buffer(m.dtype, m.shape, _dense_or_real(m), "extern", name)
            self.alias_of[id(buf)] = arg_bufs
            outs.append((name, buf))
            value: Any = BufferValue(buf, nodes=(node.name,))
        elif isinstance(m, tuple) and m and isinstance(m[0], TensorMeta) and all(
                x.dtype in SUPPORTED_DTYPES and x.device.type == self.device_type for x in m):
            vals = []
            for i, x in enumerate(m):
                ename = f"{name}_{i}"
                buf = self.new_buffer(x.dtype, x.shape, _dense_or_real(x), "extern", ename)
                self.alias_of[id(buf)] = arg_bufs
                outs.append((ename, buf))
                vals.append(BufferValue(buf, nodes=(node.name,)))
            value = tuple(vals)
        else:
            value = Runtime(name)
        self.steps.append(ExternStep(node, kind, target, args, kwargs, name, outs))
        self._report(node, "torch", reason)
        return value

    def _protect_before_write(self, node: Node, args, kwargs) -> None:
        """Before an in-place torch op writes its first argument, materialise every live lazy
        value that reads the written memory (they must see the data as it was)."""
        written = args[0] if args else None
        if not isinstance(written, BufferValue):
            return
        targets = self._alias_closure(written.buffer)
        here = self._pos[node]
        memo: Dict[int, bool] = {}

        def reaches(v) -> bool:
            v = self.materialized.get(id(v), v)
            if isinstance(v, BufferValue):
                return id(v.buffer) in targets
            if not isinstance(v, LValue):
                return False
            r = memo.get(id(v))
            if r is None:
                memo[id(v)] = False
                r = any(reaches(i) for i in v.inputs)
                memo[id(v)] = r
            return r

        def fix(v):
            v = self.materialized.get(id(v), v)
            if isinstance(v, BufferValue) or not isinstance(v, LValue) or not reaches(v):
                return
            if v.is_view:
                for i in v.inputs:
                    fix(i)
            else:
                self.materialize(v)

        for n, v in list(self.env.items()):
            if any(self._pos.get(u, -1) > here for u in n.users):
                for leaf in (v if isinstance(v, tuple) else (v,)):
                    fix(leaf)

    def _alias_closure(self, buf: Buffer) -> set:
        """ids of the buffers that may share memory with ``buf`` (``alias_of`` edges, both ways)."""
        derived: Dict[int, List[Buffer]] = {}
        for other in self.buffers:
            for x in self.alias_of.get(id(other), []):
                derived.setdefault(id(x), []).append(other)
        out, stack = set(), [buf]
        while stack:
            b = stack.pop()
            if id(b) in out:
                continue
            out.add(id(b))
            stack.extend(self.alias_of.get(id(b), []))
            stack.extend(derived.get(id(b), []))
        return out

    # ------------------------------------------------------------- dead steps
    def _droppable(self, step: ExternStep) -> bool:
        """A torch call that may be left out when nothing reads its result: a torch op,
        operator or tensor method (or torch module) without writes, randomness or other
        effects, with tensor results only. User functions and modules are always run."""
        node = step.node
        if not step.out_buffers or step.kind == "attr":
            return False
        if step.kind == "module":
            if not is_torch_module(step.target):
                return False
        elif step.kind == "function":
            mod = getattr(step.target, "__module__", None) or ""
            if not (mod == "torch" or mod.startswith("torch.") or mod in ("_operator", "operator")):
                return False
        try:
            return not is_impure(node, self.gm)
        except Exception:  # pragma: no cover - an odd target: keep it
            return False

    def _drop_dead_steps(self) -> None:
        """Remove torch calls whose results no later live step and no output reads (only
        pure torch ops, see :meth:`_droppable`), then kernels storing only into buffers
        nobody reads, then arena buffers left unused. One backward sweep."""
        live: set = set()

        def note(v):
            if isinstance(v, BufferValue):
                live.add(id(v.buffer))
            elif isinstance(v, LValue):
                m = self.materialized.get(id(v))
                if m is not None:
                    live.add(id(m.buffer))
            return v
        map_aggregate(self.outputs, note)
        kept: List[Any] = []
        dropped = False
        for step in reversed(self.steps):
            if isinstance(step, KernelStep):
                if not any(id(s.buffer) in live for s in step.kernel.stores):
                    dropped = True
                    continue
                live.update(id(b) for b in step.kernel.buffers())
            else:
                if not any(id(b) in live for _, b in step.out_buffers) and self._droppable(step):
                    dropped = True
                    r = self.reports.get(step.node.name)
                    if r is not None:
                        self.reports[step.node.name] = NodeReport(r.node, r.op, r.target, "dead",
                                                                  "result unused: not run")
                    self._folded.pop(step.node.name, None)
                    continue
                map_aggregate((step.args, step.kwargs), note)
            kept.append(step)
        if not dropped:
            return
        kept.reverse()
        self.steps = kept
        self.kernels = [s.kernel for s in kept if isinstance(s, KernelStep)]
        # (torch calls write "extern" buffers, never arena ones)
        self.buffers = [b for b in self.buffers if b.role != "temp" or id(b) in live]

    # ------------------------------------------------------------- outputs
    def _output(self, node: Node) -> None:
        def out(n: Node):
            v = self.env[n]
            if isinstance(v, LValue):
                if isinstance(v, BufferValue) or id(v) in self.materialized:
                    bv = self.materialized.get(id(v), v)
                    self._escape(bv.buffer)
                    return bv
                m = self.seen.get(n)
                strides = _dense_strides(v.shape, m.stride) if isinstance(m, TensorMeta) else None
                return self.materialize(v, "output", strides)
            if isinstance(v, tuple) and all(isinstance(x, LValue) for x in v):
                return tuple(out_value(x) for x in v)
            return v

        def out_value(v):
            if isinstance(v, BufferValue):
                self._escape(v.buffer)
                return v
            return self.materialize(v, "output")
        self.outputs = map_arg(node.args[0], out)
        self._report(node, "output")

    def _escape(self, buf: Buffer) -> None:
        """``buf`` (or memory it may alias) reaches the caller: never use the arena for it."""
        closure = self._alias_closure(buf)
        for b in self.buffers:
            if b.role == "temp" and id(b) in closure:
                b.role = "output"

    def _report(self, node: Node, where: str, reason: str = "") -> None:
        self.reports[node.name] = NodeReport(node.name, node.op, format_target(node.target) if node.op != "output" else "",
                                             where, reason)


def _dense_or_real(m: TensorMeta):
    return tuple(m.stride) if m.stride else contiguous_strides(m.shape)


def _contains(a, cls) -> bool:
    if isinstance(a, cls):
        return True
    if isinstance(a, (tuple, list)):
        return any(_contains(x, cls) for x in a)
    if isinstance(a, dict):
        return any(_contains(x, cls) for x in a.values())
    return False


def _pure_rule(node: Node):
    if node.op == "call_method" and isinstance(node.target, str) and node.target.endswith("_"):
        return METHOD_RULES.get(node.target[:-1])
    if node.op == "call_function":
        pure = _INPLACE_TO_PURE.get(node.target)
        if pure is not None:
            return FUNCTION_RULES.get(pure)
    return None
