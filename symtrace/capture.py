"""``capture``: the flip-switch form. Trace on first call, re-capture when guards fail.

``capture(model, passes=[...])(*inputs)`` gives the eager answer for every input: each call
checks the entry guards of the cached graphs (most recently used first) and runs the first
whose guards hold; when none does, it traces the model again on these inputs, applies the
passes, and caches the new specialisation (at most ``cache_size`` of them; beyond that it warns
once and runs the model eagerly for inputs no cached graph accepts).

Automatic dynamic shapes (as Inductor's; on by default, ``automatic_dynamic=False`` turns them
off): when a re-capture is needed and the tensor inputs differ
from the previous capture's only in sizes, the dimensions that changed are captured as symbols
(``s0``, ``s1``...; sizes 0 and 1 stay static), so a growing sequence length costs at most two
captures. A dimension the program needs as one value (``range(n)``) stays static. Python int
inputs likewise: one whose value guard failed (``cache.layers[0].cumulative_length == 7``) is
traced as a value from the next capture on (``captured.dynamic_values``).
"""
from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from .errors import GuardError, SpecializedDimError, UninitializedModuleError
from .graph.graph_module import GraphModule
from .graph.guard_expr import GExpr
from .graph.symbols import Dim
from .rollback import Snapshot, UndoLog, effects_before_data_guard, plan_rollback
from .trace import CallArgs, symbolic_trace
from .trace.inputs import dynamic_value_key
from .trace.tracer import module_of_method

__all__ = ["capture", "Captured"]

Pass = Callable[[GraphModule], Optional[GraphModule]]


class Captured:
    """A callable standing in for ``model``; see :func:`capture`."""

    def __init__(self, model: Any, passes: Sequence[Pass] = (), cache_size: int = 8,
                 leaf_modules: Sequence[type] = (), dynamic_shapes: Any = None, automatic_dynamic: bool = True):
        self.model = model
        self.dynamic_shapes = dynamic_shapes
        self.automatic_dynamic = automatic_dynamic
        #: the dimensions made symbolic automatically: {input name: {dim: symbol name}}
        self.dynamic_dims: Dict[str, Dict[int, str]] = {}
        self._static_dims: Set[Tuple[str, int]] = set()  # pinned by the program: never symbolic
        #: int inputs (guard expressions, e.g. ``cache.layers[0].cumulative_length``) whose value
        #: changed between calls: traced as values from the next capture on, not specialised
        self.dynamic_values: Set[str] = set()
        self._last_sizes: Optional[Dict[str, tuple]] = None
        self.passes = list(passes)
        self.cache_size = cache_size
        self.leaf_modules = tuple(leaf_modules)
        #: the captured graphs, most recently used first
        self.graphs: List[GraphModule] = []
        self.captures = 0
        #: calls answered by running the model eagerly (cache full, or a new graph refused its inputs)
        self.eager_calls = 0
        self._warned = False
        self._warned_self = False

    def __call__(self, *args, **kwargs):
        graphs = self.graphs
        changed_ints = []
        for i, gm in enumerate(graphs):
            plan = plan_rollback(gm)
            undo = UndoLog() if plan == "log" else Snapshot(_owner(self.model), args, kwargs) \
                if plan == "snapshot" else None
            try:
                if plan == "log":
                    with undo:
                        out = gm(*args, **kwargs)
                else:
                    out = gm(*args, **kwargs)
            except GuardError as e:
                if undo is not None and e.guard is not None and e.guard.kind == "data":
                    undo.restore()  # undo what ran before the data guard failed part-way
                if _int_value_guard(e.guard):
                    changed_ints.append(dynamic_value_key(e.guard.expr))
                continue
            if i:
                graphs.insert(0, graphs.pop(i))
            return out
        if len(graphs) >= self.cache_size:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"symtrace.capture: {self.cache_size} specialisations of "
                    f"{type(self.model).__name__} are cached and these inputs fit none; running "
                    "eagerly from now on for such inputs. Raise cache_size, or look at "
                    "symtrace.explain(model, ...) to see which guards keep failing.", stacklevel=2)
            self.eager_calls += 1
            return self.model(*args, **kwargs)
        if self.automatic_dynamic:   # ints that changed since a capture are traced as values
            self.dynamic_values.update(changed_ints)
        try:
            gm = self._capture(args, kwargs)
        except UninitializedModuleError:  # a lazy module initialises itself on its first call
            self.eager_calls += 1
            return self.model(*args, **kwargs)
        snapshot = Snapshot(_owner(self.model), args, kwargs)
        try:
            out = gm(*args, **kwargs)
        except GuardError as e:
            # the new graph refuses the very inputs it was captured on (a decision the trace
            # could not reproduce, e.g. on random data): undo its partial run, answer eagerly
            snapshot.restore()
            self.eager_calls += 1
            if not self._warned_self:
                self._warned_self = True
                warnings.warn(f"symtrace.capture: the graph captured from {type(self.model).__name__} "
                              f"failed its own guard on the inputs it was captured with ({e}); this call "
                              "runs eagerly, and the graph stays cached for other inputs.", stacklevel=2)
            graphs.insert(0, gm)
            return self.model(*args, **kwargs)
        graphs.insert(0, gm)
        return out

    def _capture(self, args, kwargs) -> GraphModule:
        example = CallArgs(args, kwargs)
        sizes = _tensor_sizes(self.model, args, kwargs) if self.automatic_dynamic else None
        if sizes is not None and self._last_sizes is not None:
            self._grow_dynamic(self._last_sizes, sizes)
        gm = self._trace(example, sizes)
        for n, d in gm.meta.get("pinned_dims", ()):  # the program needs one value there: static
            if d in self.dynamic_dims.get(n, {}):
                self._make_static(n, d)
            elif (n, d) not in self._static_dims:  # declared by the user: refuse as symbolic_trace does
                raise SpecializedDimError(f"capture: the dimension {n}.shape[{d}] declared dynamic is "
                                          "needed as one value by the program (symbolic_trace with the same "
                                          "dynamic_shapes names the line)", {(n, d)})
        if sizes is not None:
            self._last_sizes = sizes
        owner = _owner(self.model)
        if owner is not None:   # guards read the live model (a bound method's module, too)
            gm.guard_root = owner
        for p in self.passes:
            result = p(gm)
            if isinstance(result, GraphModule):
                result.guard_root = gm.guard_root
                gm = result
        self.captures += 1
        return gm

    def _trace(self, example: CallArgs, sizes) -> GraphModule:
        """Trace with the current symbolic dimensions; automatic ones that torch's kernels
        cannot keep symbolic (a size broadcast against 1, say) become static and it traces again."""
        while True:
            try:
                return symbolic_trace(self.model, example_inputs=example, leaf_modules=self.leaf_modules,
                                      dynamic_shapes=self._spec(sizes), _live=True, _specialise_pinned=True,
                                      _dynamic_values=self.dynamic_values)
            except SpecializedDimError as e:
                automatic = [(n, d) for n, d in e.pinned if d in self.dynamic_dims.get(n, {})]
                if not automatic:
                    raise
                for n, d in automatic:
                    self._make_static(n, d)

    def _make_static(self, name: str, dim: int) -> None:
        self._static_dims.add((name, dim))
        del self.dynamic_dims[name][dim]
        if not self.dynamic_dims[name]:
            del self.dynamic_dims[name]

    def _grow_dynamic(self, before: Dict[str, tuple], now: Dict[str, tuple]) -> None:
        """Tensor inputs that differ from the last capture's only in sizes: the changed
        dimensions (both sizes >= 2) become symbolic from now on."""
        if before.keys() != now.keys():
            return
        changed = []
        for name, (sig, shape) in now.items():
            old_sig, old_shape = before[name]
            if sig != old_sig:
                return  # dtype, device or rank changed: a new specialisation, not a new size
            changed += [(name, d) for d, (a, b) in enumerate(zip(old_shape, shape)) if a != b]
        n = sum(len(d) for d in self.dynamic_dims.values())
        for name, d in changed:
            if (name, d) in self._static_dims or before[name][1][d] < 2 or now[name][1][d] < 2:
                continue
            dims = self.dynamic_dims.setdefault(name, {})
            if d not in dims:
                dims[d], n = f"s{n}", n + 1

    def _spec(self, sizes: Optional[Dict[str, tuple]]) -> Any:
        """The dynamic_shapes of the next capture: the user's, plus the automatic dimensions
        whose sizes are >= 2 in these inputs (0 and 1 specialise)."""
        auto = {}
        for name, dims in self.dynamic_dims.items():
            keep = {d: Dim(sym) for d, sym in dims.items() if sizes is not None and name in sizes
                    and sizes[name][1][d] >= 2}
            if keep:
                auto[name] = keep
        if not auto:
            return self.dynamic_shapes
        user = self.dynamic_shapes
        if user is None:
            return auto
        if not isinstance(user, dict):
            return user  # declared by position: the user's declaration wins
        merged = {k: dict(v or {}) for k, v in user.items()}
        for name, dims in auto.items():
            merged.setdefault(name, {})
            for d, dim in dims.items():
                merged[name].setdefault(d, dim)
        return merged

    @property
    def __signature__(self) -> Optional[inspect.Signature]:
        """The captured model's signature: callers that inspect it to choose their arguments
        (Hugging Face's ``generate`` passes ``position_ids`` and ``logits_to_keep`` only to a
        forward that takes them) see the model's, not ``(*args, **kwargs)``."""
        try:
            return inspect.signature(self.model.forward if isinstance(self.model, nn.Module) else self.model)
        except (TypeError, ValueError):
            return None

    def __repr__(self) -> str:
        return f"Captured({type(self.model).__name__}, {len(self.graphs)} graphs, passes={len(self.passes)})"


#: (the names tests and older code import from here)
_effects_before_data_guard = effects_before_data_guard


def _int_value_guard(guard) -> bool:
    """An entry guard that an int input equals its traced value (not a bool, not a size)."""
    return guard is not None and guard.kind == "value" and guard.check == "eq" \
        and type(guard.expected) is int and isinstance(guard.expr, GExpr)


def _owner(model: Any) -> Optional[nn.Module]:
    """The module whose state a captured ``model`` reads: itself, or a bound method's module."""
    return model if isinstance(model, nn.Module) else module_of_method(model)


def _tensor_sizes(model: Any, args: tuple, kwargs: dict) -> Optional[Dict[str, tuple]]:
    """``{input name: ((dtype, device, rank), shape)}`` for the top-level tensor inputs."""
    fn = model.forward if isinstance(model, nn.Module) else model
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    out = {}
    for name, v in bound.arguments.items():
        if isinstance(v, torch.Tensor) and v.layout is torch.strided:
            out[name] = ((v.dtype, v.device, v.ndim), tuple(v.shape))
    return out


def capture(model: Any, passes: Sequence[Pass] = (), cache_size: int = 8,
            leaf_modules: Sequence[type] = (), dynamic_shapes: Any = None,
            automatic_dynamic: bool = True) -> Captured:
    """Wrap ``model`` (a module or function) so that calls run captured graphs.

    ``passes``: functions ``GraphModule -> GraphModule | None`` applied to each new capture
    (return a new module, or edit in place and return None). Module state is read live from
    ``model``: ``model.eval()`` or changing an attribute the graph depends on triggers a new
    capture instead of a wrong answer.

    ``dynamic_shapes``: dimensions every capture treats as symbolic (as for
    :func:`~symtrace.symbolic_trace`). ``automatic_dynamic``: on a re-capture caused by new
    sizes, make the dimensions that changed symbolic (see the module doc); ``captured.captures``
    counts captures, ``captured.dynamic_dims`` lists the automatic symbols and
    ``captured.dynamic_values`` the int inputs traced as values. A lowering pass
    (:func:`symtrace.lower.lowering_pass`) then compiles size-generic kernels over those symbols.
    """
    return Captured(model, passes, cache_size, leaf_modules, dynamic_shapes, automatic_dynamic)
