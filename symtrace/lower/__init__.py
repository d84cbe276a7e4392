"""Lowering: turn (parts of) graphs into fused kernels by code generation.

``symtrace.lower.compile(gm, example_inputs, target="cpu")`` decomposes the graph's ops into a
small primitive set, groups them into fused kernels (pointwise chains, row reductions such as
softmax/layernorm with their prologues and epilogues, whole-tensor reductions), generates one
C translation unit per graph (C99 + OpenMP, inlined vector math), compiles and caches it, and
returns a :class:`LoweredModule` whose generated Python wrapper calls the kernels and runs
everything else (matmul, conv, unsupported ops) through torch. See ``docs/lowering.md``.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from typing import Any, Mapping, Optional, Sequence, Union

from ..passes.fuse_attention import find_attention, fuse_attention as _fuse_attention

from ..errors import GuardError
from .input_tree import plain_placeholders
from .module import KernelInfo, LoweredModule
from .pipeline import InferenceOptions, options_from, prepare

__all__ = ["compile", "LoweredModule", "KernelInfo", "InferenceOptions", "lowering_pass", "TARGETS"]

TARGETS = ("cpu", "cuda")


def compile(model: Any, example_inputs: Union[Sequence[Any], Mapping[str, Any], None] = None, target: str = "cpu",
            max_variants: int = 8, *, fuse_attention: bool = True, autotune: bool = False,
            inference: Any = True, speed_check: Optional[bool] = None, dynamic: Any = "auto",
            dynamic_shapes: Any = None) -> LoweredModule:
    """Lower ``model`` (a symtrace GraphModule, or an ``nn.Module``/function that is traced
    first) for ``example_inputs`` and return a :class:`LoweredModule`.

    A module is traced once, here: the Python values its program read from the module (flags
    such as ``self.use_cache``, config numbers, the keys of a cache dict) stay what they were now,
    as in any traced graph, and the program's stores into Python state replay on the traced copy.
    Module globals it read are checked at every call (a changed one raises GuardError, as the
    graph does). Parameters and buffers are shared and checked (see the inference pipeline). For
    a model whose Python state changes between calls, use ``symtrace.capture(model,
    passes=[lowering_pass()])``, which re-captures when the graph's guards fail.

    ``example_inputs``: positional, or a dict by the forward's parameter names (defaults fill the
    rest). Without them they are made from what tracing with example inputs recorded (random
    tensors of the recorded sizes, the Python values traced; an input it did not see takes its
    default). ``target``: ``"cpu"`` (C kernels) or
    ``"cuda"`` (Triton kernels; needs triton). ``fuse_attention``: first rewrite
    ``softmax(q @ k^T * s) @ v`` into ``F.scaled_dot_product_attention`` (see
    :func:`symtrace.passes.fuse_attention`), on a copy of the graph (a GraphModule passed in
    is never changed); False lowers the graph as written. Chains with an additive mask are
    left alone here: SDPA answers 0 where eager answers NaN for a row masked entirely with
    ``-inf``; run ``symtrace.passes.fuse_attention(gm)`` yourself to accept that.
    ``autotune`` (``target="cuda"``): the first launch of each kernel times a few launch
    configurations and keeps the fastest (cached per kernel and device for the process).
    ``inference``: run the inference pipeline first (batch-norm folding, constant folding and,
    for ``target="cpu"``, oneDNN convolutions and linears with packed weights and fused
    post-ops, channels-last inside; see :mod:`symtrace.lower.pipeline`) when the graph is in
    eval mode and writes no parameter; ``False`` lowers the graph as written; an
    :class:`InferenceOptions` picks the steps.
    ``speed_check`` (default: on unless ``$SYMTRACE_SPEED_CHECK`` is ``0``, and off for Triton's
    interpreter): time the lowered module against the graph through torch on the example
    inputs (bounded, see :mod:`symtrace.lower.speed_guard`; on a GPU each sample ends with
    ``torch.cuda.synchronize()``) and run through torch if it lost.
    ``dynamic`` (``target="cpu"``): ``"auto"`` compiles for the example's sizes first; when a
    call differs from a compiled variant only in some sizes, it compiles one *size-generic*
    variant with exactly those dims symbolic, which serves every later size of that class
    without compiling (``lm.compiles`` counts compilations). ``True``: generic from the start
    over every dim of size >= 2; ``False``: one variant per exact signature.
    ``dynamic_shapes``: declare the symbolic dims (``{"x": {1: Dim("seq", min=2, max=4096)}}``
    or by position, see :func:`symtrace.graph.dynamic_spec.normalize_dynamic_shapes`); the
    ranges are checked per call. See ``docs/lowering.md`` ("Dynamic shapes").
    """
    from ..graph._gc import gc_paused
    from ..graph.graph_module import GraphModule
    if target not in TARGETS:
        raise ValueError(f"unknown lowering target {target!r}; expected one of {', '.join(TARGETS)}")
    if autotune and target != "cuda":
        raise ValueError("symtrace.lower.compile: autotune=True applies to target='cuda' (Triton launch "
                         "configurations); the C kernels of target='cpu' have none to tune")
    with gc_paused():   # (many short-lived objects: collections over a large heap were 10% of a compile)
        if not isinstance(model, GraphModule):
            if example_inputs is None:
                raise ValueError("symtrace.lower.compile: pass example_inputs to lower a model that is not traced yet")
            from ..trace import symbolic_trace
            model = symbolic_trace(model, example_inputs=dict(example_inputs) if isinstance(example_inputs, Mapping)
                                   else tuple(example_inputs))
            if fuse_attention:
                _fuse_attention(model, masks=False)
        elif fuse_attention and find_attention(model, masks=False):
            model = copy.copy(model)   # the caller's module keeps its graph (parameters are shared)
            _fuse_attention(model, masks=False)
        rebuilt = example_inputs is None
        if rebuilt:
            example_inputs = _inputs_from_meta(model)
        else:
            example_inputs = _positional(model, example_inputs)
        signature = None   # (a graph taking *args/**kwargs: a call is bound against its own placeholders)
        plain = plain_placeholders(model)
        if plain is not None:
            model, signature = plain
        try:
            _check_example_inputs(model, tuple(example_inputs))
        except GuardError as e:
            if not rebuilt:
                raise
            raise ValueError("symtrace.lower.compile: example inputs made from the recorded metadata (random data, "
                             f"one tensor per input) do not pass the graph's guards ({e}); pass example_inputs "
                             "that do") from None
        tree, model, example_inputs = _flatten_inputs(model, tuple(example_inputs), dynamic_shapes)
        if tree is not None:
            dynamic_shapes = tree.flat_dynamic_shapes(dynamic_shapes)
        if target == "cuda":
            from .triton_backend import compile_cuda, interpreting
            lm = compile_cuda(model, tuple(example_inputs), max_variants=max_variants, autotune=autotune,
                              dynamic=dynamic, dynamic_shapes=dynamic_shapes, inference=options_from(inference))
            if speed_check is None and interpreting():   # (the interpreter's kernels are slow by design)
                speed_check = False
            return _keep_if_faster(lm, model, example_inputs, speed_check).take_inputs_as(tree, signature)
        lm = None
        options = options_from(inference)
        tries = [] if options is None else [options] + ([dataclasses.replace(options, merge_linears=False)]
                                                        if options.merge_linears else [])
        for opts in tries:
            try:
                prepared = prepare(model, opts)[0]
            except Exception as e:   # e.g. a torch build whose oneDNN ops take other arguments
                warnings.warn(f"symtrace.lower: the inference pipeline failed ({type(e).__name__}: {e}); "
                              "lowering the graph as written", stacklevel=2)
                break
            if prepared is None:
                break
            try:
                lm = LoweredModule(prepared.gm, tuple(example_inputs), target, max_variants, eager_gm=model,
                                   pipeline_notes=prepared.notes, dynamic=dynamic, dynamic_shapes=dynamic_shapes,
                                   check_state=True)   # (over model and the pipeline's copy)
                lm._finite_inputs = prepared.finite_inputs
                break
            except Exception as e:   # the rewritten graph fails where the original may not (a view of a
                # merged projection's slice that needs contiguous memory): without merging, then as written
                warnings.warn(f"symtrace.lower: the inference pipeline's graph failed to lower "
                              f"({type(e).__name__}: {e}); trying {'without merged linears' if opts is tries[0] and len(tries) > 1 else 'the graph as written'}",
                              stacklevel=2)
        if lm is None:
            lm = LoweredModule(model, tuple(example_inputs), target, max_variants, dynamic=dynamic,
                               dynamic_shapes=dynamic_shapes)
        return _keep_if_faster(lm, model, example_inputs, speed_check).take_inputs_as(tree, signature)


def _check_example_inputs(gm, example_inputs: tuple) -> None:
    """The graph's entry guards on the example inputs (a GuardError names the first that fails):
    a variant is lowered for them, so they must be inputs the graph was traced for."""
    from ..graph.guards import check_entry_guards, needs_live_root
    from .input_tree import bind_inputs
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    args = bind_inputs(phs, example_inputs, {}) if len(example_inputs) < len(phs) else example_inputs
    live_root = getattr(gm, "guard_root", None)
    guards = [g for g in gm.graph.guards if live_root is not None or not needs_live_root(g)]
    env = {n.name: a for n, a in zip(phs, args)}
    env["root"] = live_root or gm
    check_entry_guards(guards, env, {})


def _flatten_inputs(gm, example_inputs: tuple, dynamic_shapes=None):
    """``(tree, graph, inputs)``: where inputs hold tensors in tuples, lists or dicts, the graph
    with a placeholder per tensor and the flat example inputs (:mod:`.input_tree`); else
    ``(None, gm, example_inputs)``. A graph whose containers cannot be flattened stays as it is
    (and runs through torch, :class:`LoweredModule` says why)."""
    from .input_tree import InputTree, bind_inputs
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(example_inputs) < len(phs):
        example_inputs = bind_inputs(phs, example_inputs, {})
    tree = InputTree.of(gm, example_inputs)
    if tree is None:
        return None, gm, example_inputs
    tree.check_dynamic_shapes(dynamic_shapes)
    try:
        flat = tree.flat_graph(example_inputs)
    except ValueError as e:
        warnings.warn(f"symtrace.lower: {e}; the graph runs through torch", stacklevel=3)
        return None, gm, example_inputs
    return tree, flat, tree.flatten(example_inputs)


def _keep_if_faster(lm: LoweredModule, model, example_inputs, speed_check: Optional[bool]) -> LoweredModule:
    """The speed check (:mod:`.speed_guard`): ``lm`` runs through torch if its kernels lost."""
    if speed_check is None:
        speed_check = os.environ.get("SYMTRACE_SPEED_CHECK", "1") != "0"
    if speed_check and lm._fast is not None:
        from .speed_guard import clock_for, slower_than_eager
        lost = slower_than_eager(lm, model, tuple(example_inputs), clock=clock_for(example_inputs),
                                 pipeline=lm.gm if lm.gm is not model else None)
        if lost is not None:
            runner, reason = lost
            lm.use_torch(reason, None if runner is model else runner)
    return lm


def _positional(gm, inputs) -> tuple:
    """Example inputs in the graph's placeholder order, bound as a call's arguments are
    (:func:`.input_tree.bind_inputs`: keywords by the forward's parameter names, defaults
    filled, ``*args`` and ``**kwargs`` collecting the rest); a tuple already in that order
    (:func:`_in_placeholder_order`) is kept."""
    from .input_tree import bind_inputs
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not isinstance(inputs, Mapping) and _in_placeholder_order(phs, tuple(inputs)):
        return tuple(inputs)
    args, kwargs = ((), dict(inputs)) if isinstance(inputs, Mapping) else (tuple(inputs), {})
    known = {str(n.target) for n in phs}
    extra = sorted(k for k in kwargs if k not in known)
    if extra and not any(str(n.target).startswith("**") for n in phs):
        raise ValueError(f"symtrace.lower.compile: the model takes no argument named {extra[0]!r}")
    try:
        return bind_inputs(phs, args, kwargs)
    except TypeError as e:
        raise ValueError(f"symtrace.lower.compile: the example inputs do not fit the forward: {e}") from None


def _in_placeholder_order(phs, inputs: tuple) -> bool:
    """Whether a tuple of example inputs is already in placeholder order: one value per
    placeholder, a tuple for ``*args`` and a dict for ``**kwargs`` (else it is bound as a
    call's positional arguments)."""
    if len(inputs) != len(phs):
        return False
    for n, v in zip(phs, inputs):
        target = str(n.target)
        if target.startswith("**") and type(v) is not dict or \
                target.startswith("*") and not target.startswith("**") and type(v) is not tuple:
            return False
    return True


def _inputs_from_meta(gm) -> tuple:
    """Example inputs made from the placeholders' recorded metadata; a symbolic size (a graph
    traced with dynamic dimensions) is given a value inside its symbol's range. An input that was
    not a tensor when traced takes what the tracer recorded of it (``None``, a number, a list of
    tensors...), else its default."""
    import torch
    from ..graph.node import _NO_DEFAULT
    from ..graph.symbols import evaluate, free_symbols
    from ..trace.inputs import EXAMPLE_META_KEY, from_recipe, is_recipe
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        m = n.meta.get("tensor_meta")
        if m is None or not hasattr(m, "shape"):
            recipe = n.meta.get(EXAMPLE_META_KEY)
            if is_recipe(recipe):
                out.append(from_recipe(recipe))
                continue
            if n.default is not _NO_DEFAULT:
                out.append(n.default)
                continue
            raise ValueError(f"symtrace.lower.compile: input {n.target!r} has no recorded tensor metadata; "
                             "pass example_inputs (or trace with example inputs)")
        env = {s.name: int(min(max(s.lo, 8), s.hi)) for s in free_symbols(tuple(m.shape))}
        shape = tuple(evaluate(tuple(m.shape), env)) if env else tuple(m.shape)
        t = torch.randn(shape, dtype=m.dtype) if m.dtype.is_floating_point else torch.zeros(shape, dtype=m.dtype)
        out.append(t)
    return tuple(out)


def _declared_dims(gm) -> Optional[dict]:
    """The dynamic dimensions a graph was traced with, as ``dynamic_shapes`` for compile."""
    from ..graph.symbols import INF, Dim
    inputs = gm.meta.get("dynamic_inputs") if hasattr(gm, "meta") else None
    if not inputs:
        return None
    spec = {}
    for inp in inputs.values():
        spec[inp.name] = {d: Dim(s.name, min=max(s.lo, 2), max=s.hi if s.hi != INF else INF)
                          for d, s in inp.dims.items()}
    return spec


def lowering_pass(target: str = "cpu", *, inference: Any = True):
    """A pass for ``symtrace.capture(model, passes=[..., lowering_pass()])``: it lowers each
    captured graph for the shapes it was captured with and returns a GraphModule whose forward
    calls the lowered module (the capture's guards still apply). ``inference``: as for
    :func:`compile` (``InferenceOptions(...)`` switches single steps of the pipeline).

    A graph that passes Python objects around (a Hugging Face decoder's KV cache, its output
    dataclass) is lowered region by region: the stretches that compute on tensors only
    (:mod:`symtrace.passes.tensor_regions`) become lowered modules, each compiled on its first
    call with that call's tensors; the object reads and writes between them stay Python."""
    def lower(gm):
        from ..passes.tensor_regions import needs_regions
        from .capture_pass import lower_regions, wrap_lowered
        if needs_regions(gm):   # objects in the graph (a KV cache, an output dataclass):
            top = lower_regions(gm, lambda region, inputs: compile(region, inputs, target, inference=inference))
            return gm if top is None else top   # lowered between them, tensor region by region
        # a graph captured with symbolic dimensions gets size-generic kernels over them where
        # they can be (else kernels per signature, "auto" making changed sizes generic later)
        spec = _declared_dims(gm)
        if spec is not None:
            try:
                return wrap_lowered(gm, compile(gm, None, target, inference=inference, dynamic_shapes=spec))
            except ValueError as e:
                if "dynamic_shapes" not in str(e):
                    raise
        return wrap_lowered(gm, compile(gm, None, target, inference=inference))
    lower.__name__ = f"lower_{target}"
    return lower
