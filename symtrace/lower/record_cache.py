"""The record cache of the lowering: the key under which a graph's recorded metadata may be
reused (only for graphs of shape-deterministic ops) and its encoding, loading and storing in the
kernel cache directory."""
from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from ..graph.effects import GRAD_MODE_SWITCHES, reads_global_state
from ..graph.graph_module import GraphModule
from ..graph.node import Node, TensorMeta, format_target, iter_nodes
from ..serialize.errors import Unencodable
from ..serialize.values import Decoder, Encoder
from ..passes.quant.kernels import woq_linear
from ..passes.module_hooks import global_forward_hooks, runs_forward_hooks
from .cache_dir import digest
from .decomp import FUNCTION_RULES, METHOD_RULES, MODULE_RULES

_META_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad", "is_sparse"})
_META_METHODS = frozenset({"size", "dim", "numel", "stride", "is_contiguous", "element_size", "nelement",
                           "ndimension", "is_floating_point", "is_complex", "get_device", "storage_offset"})


# ------------------------------------------------------------------ record cache
# A record may be reused when it is a function of what the key holds: every call is a torch op
# with a lowering rule (or a listed extern) whose result metadata follows from its inputs'
# metadata and constant arguments, modules are of exactly a type with a rule (their repr,
# training flag and tensors' metadata enter the key) and carry no hooks. Ops whose result
# shape depends on data (boolean-mask indexing, one-argument ``where``, ``tensor_split`` by a
# tensor) and anything else (user functions, ``.item()``, data guards) are recorded each time.
RECORD_FORMAT = "3"  # 2: entries in the saved-graph value codec (serialize.values); 3: key by cache_dir.digest
#: tensor factories: their result's metadata is a function of their arguments, which must be
#: sizes or constants (``torch.arange(x.shape[1])``; never a tensor's data)
_FACTORIES = frozenset((torch.arange, torch.zeros, torch.ones, torch.full, torch.empty))
#: symtrace's own ops whose result metadata follows from their inputs' (each has a ``fake_call``)
_OWN_OPS = frozenset((woq_linear,))
_EXTRA_FUNCTIONS = frozenset((
    operator.floordiv, operator.mod, operator.matmul, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    len, getattr, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.cat, torch.stack, torch.einsum,
    torch.nn.functional.scaled_dot_product_attention, torch.nn.functional.embedding, torch.nn.functional.pad,
    # torch ops whose result metadata is a function of their inputs' (a torch call where no rule applies)
    torch.nn.functional.max_pool1d, torch.nn.functional.max_pool2d, torch.nn.functional.max_pool3d,
    torch.nn.functional.avg_pool1d, torch.nn.functional.avg_pool2d, torch.nn.functional.avg_pool3d,
    torch.nn.functional.adaptive_max_pool1d, torch.nn.functional.adaptive_max_pool2d,
    torch.nn.functional.adaptive_avg_pool3d, torch.nn.functional.interpolate, torch.nn.functional.conv1d,
    torch.nn.functional.conv3d, torch.nn.functional.conv_transpose1d, torch.nn.functional.conv_transpose2d,
    torch.nn.functional.group_norm, torch.nn.functional.instance_norm, torch.nn.functional.pixel_shuffle)) \
    | _FACTORIES | _OWN_OPS | GRAD_MODE_SWITCHES   # (grad-mode switches: no result, no shape)
#: torch.nn layers (exactly these classes) whose result metadata is a function of their
#: input's (a torch call in a size-generic variant, where no rule applies)
_SHAPE_MODULES = frozenset((
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d, nn.AdaptiveAvgPool3d, nn.Upsample, nn.ZeroPad2d, nn.ConstantPad1d, nn.ConstantPad2d,
    nn.ReflectionPad2d, nn.ReplicationPad2d, nn.PixelShuffle, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.Conv1d,
    nn.Conv3d, nn.GroupNorm, nn.InstanceNorm2d, nn.Embedding))
_EXTRA_METHODS = frozenset({"matmul", "__matmul__", "bmm", "mm"}) | _META_METHODS - {"get_device", "storage_offset"}
_records: Dict[str, list] = {}   # key -> encoded record (this process)


class _NotCacheable(Exception):
    pass


def _function_name(fn, also=()) -> str:
    try:
        known = fn in FUNCTION_RULES or fn in _EXTRA_FUNCTIONS or isinstance(fn, also)
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
    try:
        parts = _key_parts(gm, inputs)
    except (_NotCacheable, AttributeError, KeyError):
        return None
    return digest(*parts)


def shape_deterministic(gm: GraphModule, inputs: tuple) -> Optional[str]:
    """None when every node's result metadata is a function of the inputs' metadata (the ops
    :func:`record_key` accepts, and the inference pipeline's packed oneDNN layers), else the
    first op that may not be (size-generic variants need this, :mod:`.dynamic`)."""
    from .attention_cpu import DecodeAttention
    from .kv_append import AppendCat
    from .onednn import PackedConv, PackedLinear
    from .layout_ops import ChannelShuffle, ShuffleCat
    try:
        _key_parts(gm, inputs, (PackedConv, PackedLinear, ChannelShuffle, ShuffleCat, DecodeAttention, AppendCat),
                   ignore=_guard_only_nodes(gm))
    except (_NotCacheable, AttributeError, KeyError) as e:
        return str(e) or type(e).__name__
    return None


def _guard_only_nodes(gm: GraphModule) -> set:
    """Nodes that only check what the graph assumed: data guards (they return None; a failing
    one raises each call) and closure reads whose value only a data guard looks at. They shape
    no tensor, so they do not keep a graph from being size-generic."""
    from ..graph.guards import check_data_guard
    from ..graph.replay import read_cell
    out = set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is check_data_guard:
            out.add(n)
        elif n.target is read_cell and n.users and all(u.target is check_data_guard for u in n.users):
            out.add(n)
    return out


def _key_parts(gm: GraphModule, inputs: tuple, also: tuple = (), ignore: frozenset = frozenset()) -> List[str]:
    from .toolchain import cpu_signature
    if global_forward_hooks():
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
        if n in ignore:
            continue
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
        elif _is_state_query(n):
            parts.append(f"state {format_target(n.target)} = {n.target()!r}")
            shape_only[n] = True
            continue
        else:
            parts.append(f"function {_function_name(n.target, also)} {args}")
            if n.target is getattr:
                shape_only[n] = len(n.args) > 1 and n.args[1] in _META_ATTRS
                if not shape_only[n] and not (len(n.args) > 1 and n.args[1] in ("T", "mT")):
                    raise _NotCacheable("getattr")
            else:
                shape_only[n] = all(shape_only.get(i, False) for i in n.all_input_nodes)
        _refuse_data_dependent(n, shape_only)
    return parts


def _is_state_query(n: Node) -> bool:
    """A read of torch's global state (grad mode): shape-free; its answer goes in the key."""
    return reads_global_state(n) and not n.args and not n.kwargs


def _refuse_data_dependent(n: Node, shape_only: Dict[Node, bool]) -> None:
    """Ops whose result shape depends on tensor data are never cached."""
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    if name in ("getitem", "__getitem__", "tensor_split") and len(n.args) > 1:
        if not all(shape_only.get(i, False) for i in iter_nodes((n.args[1:], n.kwargs))):
            raise _NotCacheable("indexing by a tensor")
    if name == "where" and len(n.args) + len(n.kwargs) < 3:
        raise _NotCacheable("where(condition)")
    if n.op == "call_function" and n.target in _FACTORIES and not all(
            shape_only.get(i, False) for i in n.all_input_nodes):
        raise _NotCacheable(f"{name} of a tensor's data")


def _module_key(mod: nn.Module) -> str:
    if type(mod) not in MODULE_RULES and type(mod) not in _SHAPE_MODULES:
        raise _NotCacheable(type(mod).__name__)
    tensors = []
    for sub in mod.modules():
        if runs_forward_hooks(sub):
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
