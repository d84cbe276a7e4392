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

This module holds :class:`Lowering` and :func:`record`; the recorder that runs the graph lives
in :mod:`.recorder`, the on-disk record cache in :mod:`.record_cache`, and the step and report
records the driver produces in :mod:`.steps` (all re-exported here).
"""
from __future__ import annotations

import math
import operator
import types
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..graph.codegen import check_code_names
from ..graph.data_sized import (FULL_REDUCTION_NAMES, data_sized_op, op_name, reads_metadata_only,
                                scalar_operands_only, sizes_of_first_argument)
from ..graph.effects import (aliased_inputs, has_registered_side_effect, is_impure, is_inplace, is_random,
                             is_torch_module, layout_dependent_view, may_keep_arguments, reads_global_state)
from ..graph.graph_module import GraphModule
from ..graph.guards import check_data_guard
from ..graph.node import Node, TensorMeta, format_target, map_aggregate, map_arg
from ..passes.module_hooks import runs_forward_hooks
from ..graph.symbols import sample
from ..graph.tree import tree_iter
from .constant_tensors import ConstantTensors
from .decomp import FUNCTION_RULES, METHOD_RULES, MODULE_RULES, Unsupported, rule_for
from .ir import HALF_DTYPES, SUPPORTED_DTYPES, Affine, Buffer, Kernel, Var
from .schedule import build_kernel, collapse
from .values import (BufferValue, FullReduce, IndexView, LValue, NeedsMaterialize, RowReduce, contiguous_strides,
                     dense_in_order, make_view, strided_probe)
from .record_cache import (_EXTRA_FUNCTIONS, _EXTRA_METHODS, _META_ATTRS, _META_METHODS,  # noqa: F401
                           RECORD_FORMAT, _load_record, _module_key, _NotCacheable, _records, _store_record,
                           record_key)
from .recorder import _copy_keeping_layout, _describe, _record_real, _Recorder  # noqa: F401
from .steps import CCallStep, ExternStep, KernelStep, NodeReport, Runtime

__all__ = ["Lowering", "KernelStep", "ExternStep", "Runtime", "NodeReport"]

#: dtypes eager holds a node's result in while kernels compute it wider (fp32 / int64): kernels
#: round (fp16/bf16) or wrap (int8/uint8/int16/int32) such a value where they read it
_HELD_DTYPES = frozenset(HALF_DTYPES) | {torch.int8, torch.uint8, torch.int16, torch.int32}

_INPLACE_TO_PURE = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
                    operator.itruediv: operator.truediv}


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


def _dense_strides(shape, strides) -> Tuple[int, ...]:
    """``strides`` if they describe a dense, non-overlapping layout (e.g. channels-last),
    else contiguous strides."""
    if strides and len(strides) == len(shape):
        dims = sorted(((s, n) for s, n in zip(strides, shape) if n != 1), key=lambda sn: (sample(sn[0]), sample(sn[1])))
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


#: a lazy value read by several nodes is stored once it reads at least this many buffers ...
REALIZE_READS = 4
#: ... or costs this much to recompute (ir.op_cost-like units: 1 per arithmetic op, 4 per transcendental)
REALIZE_COST = 30
#: a lazy value is also stored when its readers, broadcasting it (RoPE's cos/sin over every
#: head), would redo this much of its work (value.cost * the copies read beyond the first)
REALIZE_BROADCAST_COST = 64
#: ... when it costs at least this much per element (a transcendental)
REALIZE_BROADCAST_MIN = 4


def _written_value(args, kwargs):
    """What an in-place call writes: its ``out=``, else its first argument."""
    out = kwargs.get("out") if isinstance(kwargs, dict) else None
    if isinstance(out, BufferValue):
        return out
    return args[0] if args else None


#: graph ops whose result is always a view of their first argument in eager (``reshape``,
#: ``contiguous``, ``flatten``, ``to`` may copy; a getitem only with basic indices)
_ALWAYS_VIEW_NAMES = frozenset({"view", "t", "transpose", "permute", "unsqueeze", "squeeze", "select", "narrow",
                                "expand", "expand_as", "diagonal", "as_strided", "unfold", "view_as", "movedim",
                                "moveaxis", "swapaxes", "swapdims", "detach", "alias", "T", "mT", "unflatten",
                                "broadcast_to",
                                # (a tuple of views, each taken by a getitem)
                                "chunk", "split", "split_with_sizes", "unbind", "tensor_split", "hsplit",
                                "vsplit", "dsplit", "unsafe_chunk", "unsafe_split"})
#: dropouts, which are their input when not training
_DROPOUTS = frozenset({"dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d"})
#: conversions, which return their input where they convert nothing
_CONVERSIONS = frozenset({"float", "double", "half", "bfloat16", "int", "long", "short", "bool", "byte", "char",
                          "to", "type", "type_as", "cpu"})


def _reads_storage(node: Node) -> bool:
    """Whether the call addresses the storage under its first argument (``as_strided``: strides
    and an offset into the storage, not the view's own elements)."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return node.op in ("call_method", "call_function") and name in ("as_strided", "as_strided_")


def _always_a_view(node: Node) -> bool:
    """Whether eager's result of ``node`` is always a view of (or is) its first argument."""
    if node.op not in ("call_method", "call_function") or not node.args:
        return False
    if node.op == "call_function" and node.target is operator.getitem:
        idx = node.args[1] if len(node.args) > 1 else None
        idx = idx if isinstance(idx, tuple) else (idx,)
        return all(i is None or i is Ellipsis or type(i) is int or (type(i) is slice and all(
            type(b) is int or b is None for b in (i.start, i.stop, i.step))) for i in idx)
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if node.op == "call_function" and not (getattr(node.target, "__module__", "") or "").startswith("torch"):
        return False
    if name in _DROPOUTS:   # (not training: the input itself)
        training = node.kwargs.get("training", node.kwargs.get("train", node.args[2] if len(node.args) > 2 else True))
        return training is False
    return name in _ALWAYS_VIEW_NAMES


def _has_reduction(value: LValue, materialized: dict) -> bool:
    """Whether computing ``value`` reduces (a row or full reduction among its lazy inputs)."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if id(v) in seen or isinstance(v, BufferValue) or id(v) in materialized:
            continue
        seen.add(id(v))
        if isinstance(v, (RowReduce, FullReduce)):
            return True
        stack.extend(getattr(v, "inputs", ()))
    return False


class Lowering:
    """Lower one graph for one input signature. After :meth:`run`: ``steps``, ``kernels``,
    ``buffers``, ``outputs`` (a structure of values), ``reports``. ``device_type``: the device
    kernels run on (backends subclass and set it)."""

    device_type = "cpu"
    record_cache = True   # reuse recorded metadata across processes (see :func:`record`)

    def __init__(self, gm: GraphModule, example_inputs: tuple, dims=None, known=()):
        check_code_names(gm.graph.nodes)  # names become code in the wrapper and kernels
        self.gm = gm
        self.example_inputs = tuple(example_inputs)
        #: ``{(input position, dim): Sym}`` of a size-generic lowering (:mod:`.dynamic`), else {}
        self.dims = dict(dims or {})
        #: the size symbols' names, in order (kernels take their values as arguments)
        self.symbols: Tuple[str, ...] = tuple(sorted({s.name for s in self.dims.values()}))
        self._known = known   # records of other sizes of the class (see dynamic.symbolic_record)
        self.seen: Dict[Node, Any] = {}
        self.env: Dict[Node, Any] = {}
        #: nodes whose value this variant fixes: computed from shapes, dtypes and constants
        self._shape_constants: set = set()
        self.steps: List[Any] = []
        self.kernels: List[Kernel] = []
        self.buffers: List[Buffer] = []
        self.materialized: Dict[int, BufferValue] = {}
        self._keep: List[Any] = []
        self.alias_of: Dict[int, List[Buffer]] = {}
        # a torch call's non-tensor result (a Runtime: a dict, a list, an object) -> the buffers
        # its arguments reached: memory the result may hold (its tensors are not buffers)
        self._runtime_bufs: Dict[str, List[Buffer]] = {}
        self._data_values: set = set()   # Runtime names of values whose sizes/value come from data
        self._data_tensors: set = set()  # those of them that are tensors (or tuples of tensors)
        self._escaped: set = set()   # ids of arena buffers _escape made outputs
        self._kept: List[Buffer] = []   # arguments of calls that may keep a reference (may_keep_arguments)
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
        self._node_of: Dict[int, Node] = {}               # id(lazy value) -> the node it computes
        self._alias: Any = None   # the graph's AliasAnalysis, made when first asked (alias_analysis)
        #: tensors computed once from sizes and constants (none in a size-generic lowering)
        self.constants: Optional[ConstantTensors] = None if self.dims else ConstantTensors(gm, self.device_type,
                                                                                          self.alias_analysis)

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

    def result_buffer(self, node) -> Buffer:
        """A new temp buffer for ``node``'s recorded tensor result, in eager's layout where that
        is dense (channels-last), else contiguous: for rules that store their result piecewise."""
        m = self.meta_of(node)
        if not isinstance(m, TensorMeta):
            raise Unsupported("result is not a single tensor")
        if m.dtype not in SUPPORTED_DTYPES:
            raise Unsupported(f"dtype {m.dtype}")
        shape = tuple(m.shape)
        return self.new_buffer(m.dtype, shape, _dense_strides(shape, m.stride), "temp")

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
        if strides is None and all(type(d) is int for d in value.shape):
            # the first to store a value fixes its layout for every reader: eager's (channels-last
            # between convolutions), not contiguous, which made oneDNN convert it on every call
            strides = self.eager_layout(value)
        strides = tuple(strides) if strides is not None else contiguous_strides(value.shape)
        buf = self.new_buffer(value.dtype, value.shape, strides, role)
        target = BufferValue(buf)
        self.store(value, target)
        self.materialized[id(value)] = target
        return target

    def store(self, value: LValue, target: BufferValue, nodes=()) -> None:
        """Add the kernel that stores ``value`` into ``target``: a whole buffer, or a view of one
        (``cat`` stores each input into its slice of the result), after the kernels of what it
        must read from memory. ``nodes``: graph nodes the kernel also computes (reports)."""
        if value.dtype not in SUPPORTED_DTYPES:
            raise Unsupported(f"dtype {value.dtype}")
        name = self.fresh("k")
        for _ in range(10000):
            # (again after each materialisation: a reduction stored by its own kernel no longer
            # keeps the loops in logical order)
            built, into = _in_memory_order(value, target, self.materialized)
            try:
                kernel = build_kernel(built, into, name, self.materialized)
                break
            except NeedsMaterialize as e:
                if e.value is value:
                    raise AssertionError(f"{value!r} cannot be stored by its own kernel")
                self.materialize(e.value)
        else:  # pragma: no cover
            raise AssertionError("kernel formation did not converge")
        kernel = collapse(kernel)
        kernel.symbols = self.symbols
        kernel.nodes.extend(n for n in nodes if n not in kernel.nodes)
        self.kernels.append(kernel)
        self.steps.append(KernelStep(kernel))
        self._keep.append(value)   # (values are known by id while lowering)

    def extern(self, node, fn, args, kwargs, label: str = "", bias_arg: Optional[int] = None) -> BufferValue:
        """Run ``fn(*args, **kwargs)`` through torch (rules use this for matmul/conv before a
        fused epilogue); returns its (single tensor) result as a buffer value. ``bias_arg``: where
        ``fn`` takes a bias (:attr:`ExternStep.bias_arg`), for :meth:`_fold_bias`."""
        m = self.meta_of(node)
        if not isinstance(m, TensorMeta):
            raise Unsupported("result is not a single tensor")
        args = map_aggregate(args, self._arg_for_extern)
        kwargs = map_aggregate(kwargs, self._arg_for_extern)
        name = self.fresh("ext")
        buf = self.new_buffer(m.dtype, m.shape, _dense_strides(m.shape, m.stride), "extern", name)
        self.alias_of[id(buf)] = []
        step = ExternStep(node, "function", fn, args, kwargs, name, [(name, buf)], label, bias_arg)
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
        args, i = step.args, step.bias_arg
        if i is None:
            return False
        if len(args) == i:
            new_args = (*args, bias)
        elif len(args) > i and args[i] is None:
            new_args = (*args[:i], bias, *args[i + 1:])
        else:
            return False
        if any(y.buffer is b for k in self.kernels for b in k.buffers()):
            return False
        step.args = new_args
        owner = step.target.__self__ if isinstance(step.target, types.MethodType) else step.target
        fn = getattr(owner, "__name__", "torch call")
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
        if isinstance(v, LValue) and not isinstance(v, BufferValue):
            done = self.materialized.get(id(v))
            if done is not None and getattr(v, "bias_fold", None) is not None:
                return done   # (folded, or stored, for an earlier view: every view reads that)
            if self._fold_bias(v):
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
        if self.dims:
            from .dynamic import symbolic_record
            self.seen = symbolic_record(self.gm, self.example_inputs, self.dims, self.record_cache, self._known,
                                        record)
        else:
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
        if self.constants is not None:
            if self._constants_escape():
                # (a folded tensor reaches the caller through an alias the effect model does not
                # know: lower again, computing every value per call, rather than share one copy)
                Lowering.__init__(self, self.gm, self.example_inputs, self.dims, self._known)   # (a subclass's
                self.constants = None                                                           # own state stays)
                return self.run()
            self._drop_unread_constants()
        for name, label in self._folded.items():
            r = self.reports.get(name)
            if r is not None:
                self.reports[name] = NodeReport(r.node, r.op, r.target, "torch", label)
        return self

    def _constant_buffers(self) -> Dict[int, Tuple[Buffer, torch.Tensor]]:
        """``id(buffer) -> (buffer, tensor)`` of the tensors computed at compile time."""
        out = {}
        for t in self.constants.values.values():
            bv = self._param_values.get(id(t))
            if bv is not None:
                out[id(bv.buffer)] = (bv.buffer, t)
        return out

    def _constants_escape(self) -> bool:
        """Whether memory the caller gets back (or code keeps) may be a folded tensor's."""
        folded = self._constant_buffers()
        return bool(folded) and any(folded.keys() & self._alias_closure(b) for b in self.returned_buffers())

    def _drop_unread_constants(self) -> None:
        """Folded tensors only other folded tensors were made from: no buffer, nothing kept."""
        folded = self._constant_buffers()
        read: set = set()
        for step in self.steps:
            if isinstance(step, KernelStep):
                read.update(id(b) for b in step.kernel.buffers())
                continue
            ext = step.extern if isinstance(step, CCallStep) else step
            read.update(id(v.buffer) for v in tree_iter((ext.args, ext.kwargs)) if isinstance(v, BufferValue))
        read.update(id(v.buffer) for v in tree_iter(self.outputs) if isinstance(v, BufferValue))
        unread = {k for k in folded if k not in read}
        self.buffers = [b for b in self.buffers if id(b) not in unread]
        for k in unread:
            self.param_exprs.pop(k, None)
        self.constants.release({id(t) for k, (_, t) in folded.items() if k not in unread})

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

    def _settled_guard(self, node: Node) -> bool:
        """A data guard whose value is computed from shapes and dtypes only (which the
        variant's own guards fix) and holds for them: checking it per call cannot fail."""
        if node.op != "call_function" or node.target is not check_data_guard:
            return False
        if not node.all_input_nodes or not all(i in self._shape_constants for i in node.all_input_nodes):
            return False
        try:
            check_data_guard(*map_arg(node.args, lambda n: self.env[n]), **map_arg(node.kwargs, lambda n: self.env[n]))
        except Exception:   # (it held when recorded; if not, it stays a per-call check)
            return False
        return True

    @staticmethod
    def _metadata_read(node: Node) -> bool:
        if node.op == "call_method" and node.target in _META_METHODS:
            return True
        return node.op == "call_function" and node.target is getattr and len(node.args) > 1 and node.args[1] in _META_ATTRS

    def _static(self, node: Node) -> bool:
        """Whether a non-tensor result depends only on metadata (so it can be specialised)."""
        if any(self._is_data(self.env.get(i)) for i in node.all_input_nodes):
            return False   # (the size of a data-sized value: known per call only)
        if self._metadata_read(node):
            return True
        if is_random(node) or is_inplace(node) or has_registered_side_effect(node) or reads_global_state(node):
            return False  # (a print, a guard, a replayed side effect, grad mode: they run every call)
        inputs = node.all_input_nodes
        for i in inputs:
            m = self.seen.get(i)
            if not (isinstance(m, tuple) and m and m[0] == "py") or isinstance(self.env.get(i), Runtime):
                return False
        return node.op == "call_function"

    def _static_length(self, node: Node) -> Optional[int]:
        """``len(v)`` where the variant fixes it: ``v`` a tensor of static first size, or the
        tuple of tensors a rule made (``q, k, v = qkv.unbind(0)``: the unpacking's ``len`` and
        its guard would otherwise run through torch on every call)."""
        if node.op != "call_function" or node.target is not len or len(node.args) != 1 or node.kwargs:
            return None
        src = node.args[0]
        if not isinstance(src, Node):
            return None
        v = self.env.get(src)
        made = self.reports.get(src.name)
        n = None
        if isinstance(v, LValue) and v.shape and type(v.shape[0]) is int:
            n = v.shape[0]
        elif (isinstance(v, tuple) and all(isinstance(a, LValue) for a in v)
              and made is not None and made.where != "torch"):
            n = len(v)
        m = self.seen.get(node)
        if n is None or not (isinstance(m, tuple) and m and m[0] == "py" and m[1] == n):
            return None
        return n

    def _call(self, node: Node) -> None:
        m = self.seen.get(node)
        if isinstance(m, tuple) and m and m[0] == "py" and self._static(node):
            self.env[node] = m[1]
            if self._metadata_read(node) or all(i in self._shape_constants for i in node.all_input_nodes):
                self._shape_constants.add(node)   # (not a module attribute's value: that may change)
            self._report(node, "constant", "computed from shapes, specialised")
            return
        n = self._static_length(node)
        if n is not None:
            self.env[node] = n
            self._shape_constants.add(node)
            self._report(node, "constant", "a length fixed by shapes, specialised")
            return
        if self._settled_guard(node):
            self.env[node] = None
            self._report(node, "constant", "a data guard on a value this variant fixes: holds on every call")
            return
        if self.constants is not None:
            name = self.constants.fold(node, m, self._shape_constants.__contains__, self.env)
            if name is not None:
                self.env[node] = self._tensor_attr(self.constants.holder, name, self.constants.values[node])
                self._report(node, "constant", "a tensor made from sizes and constants: computed once, at compile time")
                return
        field = self._result_field(node)
        if field is not None:   # (`x.topk(3).values`: torch's named result, kept as a tuple here)
            self.env[node] = field
            self._report(node, "view", "a field of a torch call's named result")
            return
        if self._sized_by_data(node):   # (a rule would take the recorded sizes: `x.reshape(t, -1)`)
            self.env[node] = self._extern_node(node, "sized by a tensor's value")
            return
        try:
            value = self._lower(node)
        except Unsupported as e:
            self.env[node] = self._extern_node(node, str(e))
            return
        self.env[node] = value
        if isinstance(value, LValue):
            self._node_of.setdefault(id(value), node)
            self._maybe_realize(node, value)
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, LValue) and not isinstance(v, BufferValue) and v.dtype in _HELD_DTYPES:
                v.held_in_dtype = True
        where = "view" if isinstance(value, LValue) and value.is_view else "fused"
        self._report(node, where)

    def _maybe_realize(self, node: Node, value: LValue) -> None:
        """Store a lazy value read by several nodes when inlining it into each would read many
        buffers or redo much work (a transformer's residual stream: each layer's sum would
        otherwise be recomputed from every earlier layer's output in every later kernel)."""
        if isinstance(value, BufferValue) or value.is_view or id(value) in self.materialized:
            return
        several = sum(1 for u in node.users if u.op != "output") >= 2
        if not (several and (value.cost >= REALIZE_COST or self._buffers_read(value) >= REALIZE_READS)) \
                and not self._broadcast_recompute(node, value):
            return
        try:
            self.materialize(value)
        except Unsupported:
            pass

    def _broadcast_recompute(self, node: Node, value: LValue) -> bool:
        """Whether readers broadcasting an elementwise value that costs at least
        REALIZE_BROADCAST_MIN per element (no reduction inside: a row kernel computes those once
        per row) would redo at least REALIZE_BROADCAST_COST of its work."""
        if value.cost < REALIZE_BROADCAST_MIN:
            return False   # (a load costs about what an add or two does)
        return (value.cost * (self._copies_read(node, value) - 1) >= REALIZE_BROADCAST_COST
                and not _has_reduction(value, self.materialized))

    def _copies_read(self, node: Node, value: LValue) -> float:
        """How many times over the graph's readers of ``node`` (through views of it) read its
        elements: a reader 16 times its size, broadcasting it, counts 16 (shapes from the
        recorded metadata; 0 where a size is unknown or symbolic)."""
        n = value.numel
        if type(n) is not int or n == 0:
            return 0.0
        total, stack, seen = 0.0, [node], set()
        while stack:
            cur = stack.pop()
            for u in cur.users:
                if u in seen or u.op == "output":
                    continue
                seen.add(u)
                if not is_inplace(u) and cur in aliased_inputs(u, self.gm) and u.op != "call_module":
                    stack.append(u)   # a view of it: follow to its readers
                    continue
                m = self.seen.get(u)
                shape = getattr(m, "shape", None)
                if shape is None or not all(type(d) is int for d in shape):
                    return 0.0
                total += max(1.0, math.prod(shape) / n)
        return total

    def _buffers_read(self, value: LValue) -> int:
        seen, bufs, stack = set(), set(), [value]
        while stack:
            v = stack.pop()
            if id(v) in seen:
                continue
            seen.add(id(v))
            if isinstance(v, BufferValue):
                bufs.add(id(v.buffer))
                continue
            done = self.materialized.get(id(v))
            if done is not None:
                bufs.add(id(done.buffer))
                continue
            stack.extend(getattr(v, "inputs", ()))
        return len(bufs)

    def _lower(self, node: Node):
        args = map_arg(node.args, lambda n: self.env[n])
        kwargs = map_arg(node.kwargs, lambda n: self.env[n])
        if _contains(args, Runtime) or _contains(kwargs, Runtime):
            raise Unsupported("reads a value known only at run time")
        inplace = self._inplace(node)
        if inplace and not self._can_functionalize(node):
            raise Unsupported("in-place op on a value others can see (runs through torch)")
        if is_random(node):
            raise Unsupported("draws random numbers")
        if node.op == "call_module":
            mod = self.gm.get_submodule(node.target)
            rule = MODULE_RULES.get(type(mod))
            if rule is None:
                raise Unsupported(f"no lowering rule for {type(mod).__name__}")
            if runs_forward_hooks(mod):
                raise Unsupported("the module's call runs forward hooks (its own or global ones)")
            value = rule(self, node, mod, args, kwargs)
        else:
            rule = rule_for(node)
            if rule is None and inplace:
                rule = _pure_rule(node)
            if rule is None:
                raise Unsupported(getattr(node.target, "extern_reason", None)
                                  or f"no lowering rule for {format_target(node.target)}")
            kwargs = {k: v for k, v in kwargs.items() if k != "inplace"}
            value = rule(self, node, args, kwargs)
        self._check_matches(node, value)
        return value

    def _inplace(self, node: Node) -> bool:
        """:func:`is_inplace`, and a call of a module that runs in place (``nn.ReLU(inplace=True)``
        writes its input) where the write can be seen: the input is a graph input or attribute,
        has another reader, or shares memory with a value that has one. (Where it cannot be
        seen, the call is lowered as the pure op it equals.)"""
        if node.op == "call_module":
            try:
                if getattr(self.gm.get_submodule(node.target), "inplace", False) is not True:
                    return False
            except AttributeError:
                return False
            t = node.args[0] if node.args and isinstance(node.args[0], Node) else None
            return t is None or len(t.users) != 1 or not self._read_only_through(t)
        return is_inplace(node)

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
        # a view of another node's value (an identity view shares its lazy value): an out-of-place
        # result would not reach that value, so every node it shares memory with must have no
        # reader but the view
        return len(target.users) == 1 and self._read_only_through(target)

    def _read_only_through(self, node: Node) -> bool:
        """Whether no value ``node`` may share memory with (through views, to any depth) has a
        reader besides the next one on the way, or is a graph input or attribute (whose
        memory the caller sees)."""
        stack, seen = [node], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op in ("placeholder", "get_attr"):
                return False
            for a in aliased_inputs(n, self.gm):
                if len(a.users) != 1:
                    return False
                stack.append(a)
        return True

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
                got = self._view_over_fold(v) or self.view_in_memory(v)
                if got is not None:
                    return got
            return self.materialize(v, strides=self.eager_layout(v))
        return v

    def view_in_memory(self, v: LValue, always: bool = False) -> Optional[BufferValue]:
        """A lazy view (slice, permute...) that a torch call or a reshape needs in memory, as a
        view of its value stored, where that value may be written later (a copy of the view's
        elements would then go stale, as it never does in eager); None where a copy of its own
        is as good (nothing writes the value). ``always``: whether or not the value is written
        (a call that addresses the storage under the view)."""
        if not isinstance(v, IndexView):
            return None
        chain, root = [], v
        while isinstance(root, IndexView):
            # (only views eager takes too, of graph values: a rule's own permuted view of a value
            # it made inside, softmax over another dim, is no view of memory in eager)
            node = self._node_of.get(id(root))
            if node is None or self.env.get(node) is not root or not _always_a_view(node):
                return None
            chain.append(root)
            root = root.base
        node = self._node_of.get(id(root))
        if not isinstance(root, LValue) or node is None or self.env.get(node) is not root \
                or not (always or self.alias_analysis().is_written(node)):
            return None
        out = self.materialize(root, strides=self.eager_layout(root))
        try:
            for view in reversed(chain):
                out = make_view(out, view.shape, view.index_map, view.nodes)
        except Exception:   # (an index map that is not affine: a copy, as before)
            return None
        return out if isinstance(out, BufferValue) else None

    def alias_analysis(self):
        """The graph's :class:`~symtrace.passes.alias.AliasAnalysis`, made once, when first asked."""
        if self._alias is None:
            from ..passes.alias import AliasAnalysis
            self._alias = AliasAnalysis(self.gm.graph, self.gm)
        return self._alias

    def _write_target(self, written: Node) -> BufferValue:
        """The memory an in-place torch op writes for the graph value ``written``. Where eager's
        ``written`` is a view (slice, permute, select...: always a view there) of another node's
        value, the view is taken of that value stored, so the write reaches it and every later
        reader of it. Otherwise (``contiguous()``, ``reshape`` may copy) ``written``'s own value
        is stored and written; if another node shares that lazy value (a copy that returned its
        input's value), as a buffer of its own, which only ``written``'s later readers see."""
        v = self.env[written]
        base, path = written, []
        while (_always_a_view(base) or self._returns_its_input(base) or self._eager_view(base)) \
                and isinstance(base.args[0], Node):
            path.append(base)
            base = base.args[0]
        if base is not written:
            chain, cur = [], v
            while isinstance(cur, IndexView) and cur is not self.env.get(base):
                chain.append(cur)
                cur = cur.base
            if cur is self.env.get(base) and isinstance(cur, LValue):
                out = self.materialize(cur, strides=self.eager_layout(cur))
                for view in reversed(chain):
                    out = make_view(out, view.shape, view.index_map, view.nodes)
                return out
            stored = self.env.get(base)
            if isinstance(stored, LValue) and not (isinstance(v, BufferValue) and isinstance(stored, BufferValue)
                                                   and v.buffer is stored.buffer):
                # a view on the way was stored as a copy of its own (a lazy slice that a reshape
                # needed in memory): store the base and take eager's views of it in torch
                out = self.materialize(stored, strides=self.eager_layout(stored))
                for n in reversed(path):   # (later readers of each view read the written memory)
                    out = self.env[n] = self._torch_view_of(n, out)
                if not isinstance(out, BufferValue):
                    raise Unsupported("an in-place write through a view that is not a tensor")
                return out
        if isinstance(v, BufferValue) or self._node_of.get(id(v), written) is written:
            return self.materialize(v, strides=self.eager_layout(v))
        own = BufferValue(self.new_buffer(v.dtype, v.shape, contiguous_strides(v.shape), "temp"))
        self.store(v, own)
        self.env[written] = own
        return own

    def _eager_view(self, node: Node) -> bool:
        """``reshape``, ``flatten``, ``reshape_as`` or ``contiguous`` where eager returned a view of
        its input (or the input itself): the recorded input's strides allow it."""
        if not layout_dependent_view(node):
            return False
        a, b = self.seen.get(node.args[0]), self.seen.get(node)
        if not (isinstance(a, TensorMeta) and isinstance(b, TensorMeta)) or len(a.stride) != len(a.shape):
            return False
        probe = strided_probe(a)
        if probe is None or not all(type(d) is int for d in b.shape):
            if dense_in_order(a.shape, a.stride, tuple(range(len(a.shape)))[::-1]):
                return True   # (a contiguous input: eager's reshape, flatten, contiguous are views at every size)
            from .dynamic import NotGeneric   # (whether eager copies may depend on the sizes: a static variant)
            raise NotGeneric(f"{node.name}: whether eager's {node.target} returns a view that an in-place op "
                             "writes through depends on the sizes")
        if node.target == "contiguous":
            fmt = node.kwargs.get("memory_format", node.args[1] if len(node.args) > 1 else torch.contiguous_format)
            return isinstance(fmt, torch.memory_format) and probe.is_contiguous(memory_format=fmt)
        try:
            probe.view(tuple(b.shape))
        except RuntimeError:
            return False
        return True

    def _torch_view_of(self, node: Node, src: Any) -> Any:
        """``node`` (a view op) applied by torch to ``src`` in place of its first argument's value:
        a real alias of ``src``'s memory (a tuple of them for ``chunk``/``split``), for an
        in-place op to write through."""
        prev = node.args[0]
        saved, report = self.env[prev], self.reports.get(node.name)
        self.env[prev] = src
        try:
            out = self._extern_node(node, "a view an in-place op writes through")
        finally:
            self.env[prev] = saved
            if report is not None:
                self.reports[node.name] = NodeReport(report.node, report.op, report.target, report.where,
                                                     (report.reason + "; " if report.reason else "")
                                                     + "also taken by torch for an in-place write through it")
        if not (isinstance(out, BufferValue) or isinstance(out, tuple) and all(isinstance(o, BufferValue) for o in out)):
            raise Unsupported("an in-place write through a view that is not a tensor")
        return out

    def _returns_its_input(self, node: Node) -> bool:
        """``x.float()``, ``x.to(dtype)``, ``x.type_as(y)``... that convert nothing: eager returns
        ``x`` itself (dtype and device as recorded for both, no ``copy=True``/memory format)."""
        if node.op != "call_method" or node.target not in _CONVERSIONS or not node.args:
            return False
        if node.kwargs.get("copy") or node.kwargs.get("memory_format") is not None:
            return False
        a, b = self.seen.get(node.args[0]) if isinstance(node.args[0], Node) else None, self.seen.get(node)
        return (isinstance(a, TensorMeta) and isinstance(b, TensorMeta) and a.dtype == b.dtype
                and a.device == b.device and tuple(a.shape) == tuple(b.shape))

    def _forget_view_copies(self, written) -> None:
        """After an in-place write to ``written``'s memory: copies stored of lazy views of that
        memory (for a torch call that read them) are stale; their later readers read the view
        again, of the written memory."""
        if not isinstance(written, BufferValue):
            return
        targets = self._alias_closure(written.buffer)

        def over_targets(v) -> bool:
            while isinstance(v, IndexView):
                v = v.base
            v = self.materialized.get(id(v), v)
            return isinstance(v, BufferValue) and id(v.buffer) in targets

        for value in list(self.env.values()):
            for leaf in (value if isinstance(value, tuple) else (value,)):
                if isinstance(leaf, IndexView) and id(leaf) in self.materialized and over_targets(leaf.base):
                    del self.materialized[id(leaf)]

    def eager_layout(self, v: LValue) -> Optional[Tuple[int, ...]]:
        """The strides eager gives the node ``v`` stands for, when they are dense but not
        contiguous (channels-last between convolutions): a torch call then gets its argument
        in the layout it would have had in eager. None: contiguous."""
        node = self._node_of.get(id(v))
        m = self.seen.get(node) if node is not None else None
        if not isinstance(m, TensorMeta) or tuple(m.shape) != tuple(v.shape) or not m.stride:
            return None
        dense = _dense_strides(v.shape, m.stride)
        return dense if dense != contiguous_strides(v.shape) else None

    def _extern_node(self, node: Node, reason: str):
        args = map_arg(node.args, lambda n: self.env[n])
        kwargs = map_arg(node.kwargs, lambda n: self.env[n])
        inplace = self._inplace(node)
        out_node = node.kwargs.get("out")
        if inplace and isinstance(out_node, Node) and isinstance(kwargs.get("out"), LValue):
            kwargs = dict(kwargs, out=self._write_target(out_node))
        elif inplace and args and isinstance(args[0], LValue) and isinstance(node.args[0], Node):
            args = (self._write_target(node.args[0]),) + tuple(args[1:])   # (a buffer: passed as it is below)
        if _reads_storage(node) and args and isinstance(args[0], IndexView):
            # (as_strided addresses the storage under a view: eager's view of the value, not a copy)
            args = (self.view_in_memory(args[0], always=True) or args[0],) + tuple(args[1:])
        args = map_aggregate(args, self._arg_for_extern)
        kwargs = map_aggregate(kwargs, self._arg_for_extern)
        if inplace:
            self._forget_view_copies(_written_value(args, kwargs))
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
        arg_bufs = [v.buffer for v in tree_iter((args, kwargs)) if isinstance(v, BufferValue)]
        arg_bufs += [b for v in tree_iter((args, kwargs)) if isinstance(v, Runtime) for b in self._runtime_bufs.get(v.name, ())]
        arg_bufs = list({id(b): b for b in arg_bufs}.values())   # (chains of runtime values: no doubling)
        if may_keep_arguments(kind, target):
            self._kept += arg_bufs
        outs: List[Tuple[str, Buffer]] = []
        data_sized = self._data_sized(node, kind, target, args, kwargs, m)
        if data_sized:   # (its sizes may differ per call: what reads it runs through torch too)
            self._data_values.add(name)
            if isinstance(m, TensorMeta) or isinstance(m, tuple) and any(isinstance(x, TensorMeta) for x in m):
                self._data_tensors.add(name)
            value = Runtime(name)
            self._runtime_bufs[name] = arg_bufs
        elif isinstance(m, TensorMeta) and m.dtype in SUPPORTED_DTYPES and m.device.type == self.device_type:
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
            self._runtime_bufs[name] = arg_bufs
        self.steps.append(ExternStep(node, kind, target, args, kwargs, name, outs))
        self._report(node, "torch", reason + ("; its result's size depends on the data, so what reads it runs "
                                              "through torch" if data_sized else ""))
        return value

    def _result_field(self, node: Node) -> Any:
        """``getattr(r, name)`` of a torch call's named result (``torch.return_types``: ``topk``'s
        ``values``, ``max``'s ``indices``), which the lowering holds as a tuple: the field's value;
        None for anything else."""
        if node.op != "call_function" or node.target is not getattr or len(node.args) != 2 or node.kwargs:
            return None
        src, name = node.args
        value = self.env.get(src) if isinstance(src, Node) else None
        if not isinstance(name, str) or not isinstance(value, tuple) or src.op not in ("call_function", "call_method"):
            return None
        fields = getattr(getattr(torch.return_types, op_name(src.target), None), "__match_args__", None)
        if not fields or name not in fields or len(fields) != len(value):
            return None
        return value[fields.index(name)]

    def _is_data(self, v) -> bool:
        """Whether ``v`` is a value whose sizes (or Python value) come from data."""
        return isinstance(v, Runtime) and v.name in self._data_values

    def _sized_by_data(self, node: Node) -> bool:
        """Whether a call that a rule could lower takes a size (or a dim) from a tensor's value,
        or is a data-sized op (:func:`~symtrace.graph.data_sized.data_sized_op`)."""
        if node.op not in ("call_function", "call_method"):
            return False
        try:
            args = map_arg(node.args, lambda n: self.env[n])
            kwargs = map_arg(node.kwargs, lambda n: self.env[n])
        except KeyError:
            return False
        return data_sized_op("method" if node.op == "call_method" else "function", node.target, args, kwargs,
                             lambda v: v.dtype if isinstance(v, LValue) else None,
                             lambda v: tuple(v.shape) if isinstance(v, LValue) else None)

    def _data_sized(self, node: Node, kind: str, target, args, kwargs, recorded) -> bool:
        """Whether a torch call's result may have other sizes than the recorded ones for inputs of
        the same sizes (or is a Python value read from tensor data, which may size what follows):
        see :mod:`symtrace.graph.data_sized`. A tensor argument whose sizes came from data makes
        the result data-sized, except where the result's sizes are those of another argument
        (``index_add``, ``scatter``, in-place ops: of the first) or a full reduction's ``()``; a
        Python value read from data does, except as a scalar operand of pointwise arithmetic
        (``x / t.max().item()``). Such a value is never given fixed sizes: a variant is chosen by
        its inputs' sizes only."""
        is_data = self._is_data
        data = [v.name for v in tree_iter((args, kwargs)) if is_data(v)]
        name = op_name(target)
        if data and isinstance(recorded, TensorMeta):
            if tuple(recorded.shape) == () and name in FULL_REDUCTION_NAMES:
                return False
            if sizes_of_first_argument(kind, target):
                return bool(args) and is_data(args[0])
        if any(n in self._data_tensors for n in data):
            return True
        if data:
            return not (isinstance(recorded, TensorMeta) and scalar_operands_only(kind, target))
        tensor_arg = any(isinstance(v, LValue) for v in tree_iter((args, kwargs)))
        if tensor_arg and isinstance(recorded, tuple) and len(recorded) == 2 and recorded[0] == "py" \
                and isinstance(recorded[1], (bool, int, float, complex, list)) and not reads_metadata_only(target):
            return True   # (a number or list read from a tensor: .item(), math.ceil(t), a user function)
        return data_sized_op(kind, target, args, kwargs, lambda v: v.dtype if isinstance(v, LValue) else None,
                             lambda v: tuple(v.shape) if isinstance(v, LValue) else None)

    def _protect_before_write(self, node: Node, args, kwargs) -> None:
        """Before an in-place torch op writes its first argument, materialise every live lazy
        value that reads the written memory (they must see the data as it was)."""
        written = _written_value(args, kwargs)
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

        def note(values):
            for v in tree_iter(values):
                if isinstance(v, BufferValue):
                    live.add(id(v.buffer))
                elif isinstance(v, LValue):
                    m = self.materialized.get(id(v))
                    if m is not None:
                        live.add(id(m.buffer))
        note(self.outputs)
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
                note((step.args, step.kwargs))
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
        for b in self.returned_buffers():
            self._escape(b)
        self._report(node, "output")

    def returned_buffers(self) -> List[Buffer]:
        """The buffers the outputs are views of, those the arguments of calls whose
        non-tensor results are returned reached (such an object may hold tensors made from them),
        and the arguments of calls that may keep a reference (a replayed store into Python state,
        ``self.last = x * 2``: the caller keeps the tensor past the call)."""
        found: List[Buffer] = list(self._kept)
        for v in tree_iter(self.outputs):
            if isinstance(v, BufferValue):
                found.append(v.buffer)
            elif isinstance(v, Runtime):
                found += self._runtime_bufs.get(v.name, ())
        return found

    def _escape(self, buf: Buffer) -> None:
        """``buf`` (or memory it may alias) reaches the caller: never use the arena for it."""
        closure = self._alias_closure(buf)
        for b in self.buffers:
            if b.role == "temp" and id(b) in closure:
                b.role = "output"
                self._escaped.add(id(b))

    def escape_again(self) -> None:
        """Decide again which arena buffers reach the caller, after the alias edges changed
        (calls bound into C: :mod:`.c_calls`): those :meth:`_escape` took out of the arena go
        back to it unless they still may alias what is returned."""
        for b in self.buffers:
            if id(b) in self._escaped:
                b.role = "temp"
        self._escaped.clear()
        for b in self.returned_buffers():
            self._escape(b)

    def _report(self, node: Node, where: str, reason: str = "") -> None:
        self.reports[node.name] = NodeReport(node.name, node.op, format_target(node.target) if node.op != "output" else "",
                                             where, reason)


def _dense_or_real(m: TensorMeta):
    return tuple(m.stride) if m.stride else contiguous_strides(m.shape)


def _in_memory_order(value: LValue, target: BufferValue, materialized) -> Tuple[LValue, BufferValue]:
    """``(value, target)`` to build a kernel from. When ``target``'s strides are a dense
    permutation of contiguous ones (channels-last), or ``target`` is a slice of such a buffer
    (a ``cat`` input's place), and ``value`` is pointwise (no reduction in it), both are seen
    through that permutation, so the kernel's loops run in memory order."""
    strides, shape = target.strides, target.shape
    if len(shape) < 2 or strides == contiguous_strides(shape):
        return value, target
    if _dense_strides(shape, strides) != strides and not _slice_of_dense(target):
        return value, target
    perm = sorted(range(len(shape)), key=lambda d: (-sample(strides[d]), d))
    if perm == sorted(perm):
        return value, target
    pshape = tuple(shape[d] for d in perm)
    pstrides = tuple(strides[d] for d in perm)
    inv = [0] * len(perm)
    for i, d in enumerate(perm):
        inv[d] = i
    view = IndexView(value, pshape, lambda idx: tuple(idx[inv[d]] for d in range(len(inv))), value.nodes)
    if _has_reduction(value, materialized):
        # (a permuted view of a value with reductions, stored in the value's own order: a
        # layer norm stored transposed is the layer norm, stored as it is, in one row kernel)
        base = _undone_views(view, pshape)
        if base is None:
            return value, target
        view = base
    return view, BufferValue(target.buffer, pshape, pstrides, target.offset)


def _undone_views(view: IndexView, shape) -> Optional[LValue]:
    """The value under ``view``'s chain of index views where reading ``view`` at an index reads
    it at the same index (the views cancel out: a transpose read back transposed), else None."""
    loop = [Var(f"u{i}", n) for i, n in enumerate(shape)]
    idx: Any = tuple(Affine.of(v) for v in loop)
    v: LValue = view
    while isinstance(v, IndexView):
        try:
            idx = tuple(v.index_map(idx))
        except Exception:   # (an index map that is not affine in these variables)
            return None
        v = v.base
        if tuple(v.shape) == tuple(shape) and len(idx) == len(loop) \
                and all(isinstance(a, Affine) and a.is_var(u) for a, u in zip(idx, loop)):
            return v
    return None


def _slice_of_dense(target: BufferValue) -> bool:
    """Whether ``target`` is a slice of a dense buffer along one dimension (``cat`` stores each
    input into one): same rank and strides as the buffer, smaller in that dimension only."""
    buf = target.buffer
    if len(buf.shape) != len(target.shape) or tuple(buf.strides) != tuple(target.strides) \
            or _dense_strides(buf.shape, buf.strides) != tuple(buf.strides):
        return False
    return sum(1 for a, b in zip(target.shape, buf.shape) if a != b) <= 1


def _has_reduction(value: LValue, materialized) -> bool:
    """Whether a row or full reduction is computed inside ``value`` (not read from memory)."""
    from .values import FullReduce, RowReduce
    seen, stack = set(), [value]
    while stack:
        v = stack.pop()
        if id(v) in seen or isinstance(v, BufferValue) or id(v) in materialized and v is not value:
            continue
        seen.add(id(v))
        if isinstance(v, (RowReduce, FullReduce)):
            return True
        stack.extend(x for x in getattr(v, "inputs", ()) if isinstance(x, LValue))
    return False


def _contains(a, cls) -> bool:
    return any(isinstance(x, cls) for x in tree_iter(a, subclasses=True))


def _pure_rule(node: Node):
    if node.op == "call_method" and isinstance(node.target, str) and node.target.endswith("_"):
        return METHOD_RULES.get(node.target[:-1])
    if node.op == "call_function":
        pure = _INPLACE_TO_PURE.get(node.target)
        if pure is not None:
            return FUNCTION_RULES.get(pure)
    return None
