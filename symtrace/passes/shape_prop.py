"""Shape propagation: run the graph on example inputs and record every value's
:class:`~symtrace.graph.node.TensorMeta` in ``node.meta["tensor_meta"]``.

Four modes:

* ``"real"`` runs the real ops on the real inputs: always right, costs a forward pass. The
  graph's in-place writes to the inputs, parameters and buffers (batch-norm statistics in
  training mode...) and the CPU RNG state are restored afterwards.
* ``"meta"`` runs on ``device="meta"`` copies: shapes, dtypes and strides without
  computing. Parameters and buffers are converted on copies of the submodules; the model is
  never touched. Recorded devices are the inputs' device, not ``meta``.
* ``"fake"`` runs under ``torch._subclasses.fake_tensor.FakeTensorMode``: like meta, but
  devices are kept and more ops (device copies) work.
* ``"symbolic"`` is fake with symbolic sizes: the dimensions named by ``dynamic_shapes=`` (or,
  without it, those the placeholders' ``tensor_meta`` already shows as symbols, as
  ``symbolic_trace(..., dynamic_shapes=...)`` leaves them) are symbols hinted by the example
  sizes, and every node gets metadata such as ``float32[seq*2, 8]``, computed exactly by torch's
  ``ShapeEnv`` (see :mod:`symtrace.graph.symbolic_shapes` for why this and not fitting sizes seen
  at a few hints). Passing ``dynamic_shapes`` selects this mode. Nodes that cannot run on fake
  tensors, and what depends on them, are left without ``tensor_meta``; ``gm.meta``
  gets ``"shape_notes"`` (which and why) and ``"shape_assumptions"``.

Entry guards are checked on the inputs as given (so pass real tensors, or
``check_guards=False``); data guards (``check_data_guard`` nodes) cannot be evaluated
without data and are skipped under meta/fake. Ops whose output shape depends on data
(``nonzero``, ``masked_select``, ``unique``, ``bincount``, boolean-mask indexing,
``repeat_interleave`` with a tensor) or that read data (``.item()``, ``.tolist()``) fail under meta and fake; so
do device copies (``.cpu()``, ``.to("cuda")``) under meta. The error names the node and
suggests ``mode="real"``.

After ``propagate_shapes(gm, torch.randn(2, 3), mode="meta")`` on ``self.fc(x).chunk(2, dim=1)``,
``gm.print_tabular()`` shows::

    opcode       name    target    args      kwargs      tensor
    -----------  ------  --------  --------  ----------  ------------------------------
    placeholder  x       x         ()        {}          float32[2, 3]
    call_module  fc      fc        (x,)      {}          float32[2, 4]
    call_method  chunk   chunk     (fc, 2)   {'dim': 1}  (float32[2, 2], float32[2, 2])
    output       output  output    (chunk,)  {}          (float32[2, 2], float32[2, 2])
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from ..errors import NodeRunError
from ..graph.graph_module import GraphModule
from ..graph.dynamic_spec import normalize_dynamic_shapes
from ..graph.guards import check_data_guard
from ..graph.symbolic_shapes import input_symbols, symbolic_input_meta, symbolic_metadata
from ..graph.symbols import Sym
from ..graph.interpreter import Interpreter
from ..graph.node import Node, TensorMeta
from ..graph.tree import tree_iter, tree_map
from ..graph.effects import is_impure
from .alias import AliasAnalysis

__all__ = ["ShapeProp", "propagate_shapes", "MODES"]

MODES = ("real", "meta", "fake", "symbolic")


def _fake_mode_class():
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError as e:  # pragma: no cover - every supported torch has it
        raise RuntimeError("mode='fake' needs torch._subclasses.fake_tensor.FakeTensorMode, "
                           f"which this torch ({torch.__version__}) lacks; use mode='meta'") from e
    return FakeTensorMode


class ShapeProp(Interpreter):
    """An :class:`~symtrace.graph.interpreter.Interpreter` that records each node's
    ``tensor_meta`` (a ``TensorMeta``, or a tuple of them for tuples/lists holding tensors;
    removed for non-tensor values). ``run(*inputs)`` returns the graph's result (real, meta or
    fake tensors). Prefer :func:`propagate_shapes`."""

    _verb = "propagating shapes through"

    def __init__(self, gm: GraphModule, mode: str = "real", check_guards: bool = True):
        if mode == "symbolic":
            raise ValueError("ShapeProp runs real, meta or fake tensors; use propagate_shapes(gm, ..., "
                             "mode='symbolic') for symbolic sizes")
        if mode not in MODES:
            raise ValueError(f"unknown shape propagation mode {mode!r}; expected one of {', '.join(MODES)}")
        super().__init__(gm, garbage_collect_values=True, check_guards=check_guards)
        self.mode = mode
        self._memo: Dict[int, Any] = {}
        self._keep: List[torch.Tensor] = []  # originals stay alive while their ids are keys
        self._modules: Dict[str, nn.Module] = {}
        self._fake_mode = _fake_mode_class()(allow_non_fake_inputs=False) if mode == "fake" else None
        self._home: Optional[torch.device] = None

    # --- running -------------------------------------------------------------------------
    def run(self, *args, **kwargs) -> Any:
        if self.mode == "real":
            with _restoring_state(self.module, self.graph, args, kwargs) as (args, kwargs):
                return super().run(*args, **kwargs)
        self._home = _first_device((args, kwargs)) or _first_device(list(self.module.parameters()) +
                                                                    list(self.module.buffers()))
        return super().run(*args, **kwargs)  # entry guards see the inputs as given

    def run_node(self, n: Node) -> Any:
        if self.mode != "real" and n.op == "call_function" and n.target is check_data_guard:
            n.meta.pop("tensor_meta", None)
            return None
        # each node runs under the fake mode, or with meta as the default device (so that
        # factories in the graph, torch.zeros(3), make meta tensors too)
        ctx = (contextlib.nullcontext() if self.mode == "real" else
               self._fake_mode if self._fake_mode is not None else torch.device("meta"))
        try:
            with ctx:
                value = super().run_node(n)
        except Exception as e:
            if self.mode == "real":
                raise
            raise NodeRunError(
                f"cannot run node %{n.name} = {n.op}[{n.format_target()}] on {self.mode} tensors "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Ops whose output "
                "shape depends on data (nonzero, masked_select, unique, boolean-mask indexing) or "
                "that read data (.item(), .tolist()) need mode='real'"
                + ("; device copies (.cpu(), .to(device)) work in mode='fake'" if self.mode == "meta" else "")
            ) from e
        meta = self._meta_of(value)
        n.meta.pop("size", None)  # a symbolic size from an earlier symbolic run
        if meta is None:
            n.meta.pop("tensor_meta", None)
        else:
            n.meta["tensor_meta"] = meta
        return value

    # --- converting values ---------------------------------------------------------------
    def fetch_args_kwargs_from_env(self, n: Node):
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        if self.mode == "real" or n.op == "output":
            return args, kwargs
        return self._convert_tree(args), self._convert_tree(kwargs)  # tensor constants in args

    def placeholder(self, target: str, args: tuple, kwargs: dict) -> Any:
        return self._convert_tree(super().placeholder(target, args, kwargs))

    def fetch_attr(self, qualified: str) -> Any:
        obj = super().fetch_attr(qualified)
        if self.mode == "real":
            return obj
        if isinstance(obj, nn.Module):
            copied = self._modules.get(qualified)
            if copied is None:
                copied = self._modules[qualified] = self._convert_module(obj)
            return copied
        return self._convert_tree(obj)

    def _convert(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "meta" or _is_fake(t):
            return t
        out = self._memo.get(id(t))
        if out is None:
            if self._fake_mode is not None:
                out = self._fake_mode.from_tensor(t)
            else:
                out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                if t.requires_grad:
                    out.requires_grad_(True)
            if isinstance(t, nn.Parameter):
                out = nn.Parameter(out, requires_grad=t.requires_grad)
            self._memo[id(t)] = out
            self._keep.append(t)
        return out

    def _convert_tree(self, v: Any) -> Any:
        if self.mode == "real":
            return v
        return tree_map(lambda x: self._convert(x) if isinstance(x, torch.Tensor) else x, v)

    def _convert_module(self, m: nn.Module) -> nn.Module:
        memo: Dict[int, Any] = {}
        for sub in m.modules():
            for t in list(sub._parameters.values()) + list(sub._buffers.values()) + [
                    v for v in vars(sub).values() if isinstance(v, torch.Tensor)]:
                if t is not None:
                    memo[id(t)] = self._convert(t)
        return copy.deepcopy(m, memo)

    def _meta_of(self, v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            tm = TensorMeta.of(v)
            if tm.device.type == "meta" and self._home is not None:
                tm = dataclasses.replace(tm, device=self._home)
            return tm
        if type(v) in (tuple, list) or isinstance(v, tuple):
            metas = tuple(self._meta_of(x) for x in v)
            return metas if any(m is not None for m in metas) else None
        return None


def propagate_shapes(gm: GraphModule, *example_inputs: Any, mode: str = "real",
                     check_guards: bool = True, dynamic_shapes: Any = None, **example_kwargs: Any) -> None:
    """Fill ``node.meta["tensor_meta"]`` of every node of ``gm`` by running it on
    ``example_inputs`` (positional) and ``example_kwargs``, in ``mode`` ``"real"``, ``"meta"``,
    ``"fake"`` or ``"symbolic"`` (see the module doc; ``dynamic_shapes``, as for
    ``symbolic_trace``, implies ``"symbolic"``). ``gm`` and its parameters are left unchanged.

    ``check_guards``: test the entry guards on the inputs as given first (raises
    :class:`~symtrace.errors.GuardError` when they fail); turn it off to pass meta or fake
    inputs. Edits only ``meta``, so it can run as a pass:
    ``run_passes(gm, [lambda gm: propagate_shapes(gm, x, mode="fake")])``.
    """
    if mode == "symbolic" or dynamic_shapes is not None:
        _propagate_symbolic(gm, example_inputs, example_kwargs, dynamic_shapes, check_guards)
        return
    ShapeProp(gm, mode, check_guards).run(*example_inputs, **example_kwargs)


def _propagate_symbolic(gm: GraphModule, args: tuple, kwargs: dict, dynamic_shapes: Any,
                        check_guards: bool) -> None:
    checker = Interpreter(gm, check_guards=check_guards)
    inputs = checker._bind(args, kwargs, {})
    if check_guards and gm.graph.guards:
        checker._inputs = inputs
        checker._check_entry_guards()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder" and not n.target.startswith("*")]
    names = [n.target for n in placeholders]
    if dynamic_shapes is not None:
        spec = normalize_dynamic_shapes(dynamic_shapes, names, [inputs.get(n) for n in names])
        syms: Dict[str, Sym] = {}
        for pos, n in enumerate(placeholders):
            value = inputs.get(n.target)
            if not isinstance(value, torch.Tensor):
                if pos in spec:
                    raise TypeError(f"propagate_shapes: dynamic_shapes declares dimensions of {n.target!r}, "
                                    f"which is a {type(value).__name__}, not a tensor")
                continue
            dims = {i: syms.setdefault(d.name, Sym(d.name, d.min, d.max)) for i, d in spec.get(pos, {}).items()}
            n.meta["tensor_meta"] = symbolic_input_meta(value, dims, f"the input {n.target!r}") if dims \
                else TensorMeta.of(value)
    elif not any(input_symbols(n.meta.get("tensor_meta")) for n in placeholders):
        raise ValueError("propagate_shapes(mode='symbolic'): no input of the graph has symbolic sizes; pass "
                         "dynamic_shapes={input: {dim: Dim(...)}} to say which dimensions are symbols")
    notes, assumptions = symbolic_metadata(gm, gm.graph, args, kwargs)
    gm.meta["shape_notes"] = notes
    gm.meta["shape_assumptions"] = assumptions


# --- helpers -----------------------------------------------------------------------------
def _is_fake(t: torch.Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover
        return False
    return is_fake(t)


def _first_device(values: Any) -> Optional[torch.device]:
    for v in tree_iter(values):
        if isinstance(v, torch.Tensor):
            return v.device if v.device.type != "meta" else None
    return None


@contextlib.contextmanager
def _restoring_state(gm: GraphModule, graph, args: tuple, kwargs: dict):
    """Run a real forward without lasting effects: clone inputs the graph may write, snapshot
    the parameters and buffers it may write, and keep the CPU RNG state."""
    alias = AliasAnalysis(graph, gm)
    writes_inputs = any(alias.is_written(n) for n in graph.nodes if n.op == "placeholder")
    if writes_inputs:
        args, kwargs = tree_map(_clone, args), tree_map(_clone, kwargs)
    saved: List[tuple] = []
    seen: set = set()
    for n in graph.nodes:
        tensors: List[torch.Tensor] = []
        if n.op == "get_attr" and alias.is_written(n):
            try:
                obj = gm
                for part in n.target.split("."):
                    obj = getattr(obj, part)
            except AttributeError:
                continue
            if isinstance(obj, torch.Tensor):
                tensors.append(obj)
        elif n.op == "call_module" and is_impure(n, gm):
            try:
                sub = gm.get_submodule(n.target)
            except AttributeError:
                continue
            tensors.extend(list(sub.parameters()) + list(sub.buffers()))
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                saved.append((t, t.detach().clone()))
    rng = torch.random.get_rng_state()
    try:
        yield args, kwargs
    finally:
        torch.random.set_rng_state(rng)
        with torch.no_grad():
            for t, copy_ in saved:
                t.copy_(copy_)


def _clone(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        out = v.detach().clone()
        return out.requires_grad_(True) if v.requires_grad else out
    return v
