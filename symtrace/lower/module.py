"""``LoweredModule``: a graph whose fused regions call generated kernels.

It owns the original :class:`~symtrace.graph.GraphModule` (so parameters are shared and
``state_dict`` works) and one compiled *variant* per input signature (shapes, strides, dtypes
and Python-valued inputs), or, for sizes that change between calls, *size-generic* variants
that serve every size of a shape class (``dynamic``, :mod:`.dynamic`): inputs that fit no
variant are lowered again (up to ``max_variants``, a generic variant counting once), after that
they run the graph through torch with a warning. Calls with
autograd needs (grad mode on and an input or parameter requiring grad) also run through torch,
since kernels record no gradients. Without a C compiler the module runs through torch; when the
compiler rejects the source generated for a signature, that signature does (one warning naming
the graph, the kernels and the compiler's first error lines).
"""
from __future__ import annotations

import ctypes
import re
import threading
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..graph.dynamic_spec import normalize_dynamic_shapes
from ..graph.graph_module import GraphModule
from ..graph.guard_expr import GExpr
from ..graph.symbols import Sym, SymbolicSizeError
from ..passes.module_hooks import global_forward_hooks
from .dynamic import NotGeneric, all_dims, changed_dims, shape_class
from . import c_calls
from .codegen_c import CCall, kernel_source, translation_unit
from .lowering import Lowering, NodeReport
from .toolchain import CompileError, CompilerUnavailable
from ..trace.values import _holds
from .input_tree import bind_inputs
from .wrapper import generate

__all__ = ["LoweredModule", "KernelInfo", "Variant"]


class KernelInfo:
    """One generated kernel: ``name``, ``kind`` (pointwise/row/full), the graph ``nodes`` fused
    into it and its C ``source``."""

    def __init__(self, kernel):
        self.name = kernel.name
        self.kind = kernel.kind
        self.nodes = list(kernel.nodes)
        self.source = kernel_source(kernel)
        self.kernel = kernel

    def __repr__(self):
        return f"KernelInfo({self.name}, {self.kind}, nodes={self.nodes})"


#: what a size-generic variant's ``try_call`` returns for inputs outside its class
NO_MATCH = object()


def _no_match(*args):
    return NO_MATCH


class Variant:
    """The lowered form of the graph for one input signature, or, when ``lowering.symbols`` is
    not empty, for a shape class (a *size-generic* variant: see :mod:`.dynamic`). ``call``
    passes inputs its guards refuse to ``miss``; ``try_call`` returns :data:`NO_MATCH` for them.
    ``entry_guards``: the graph's own guards, checked on every call of a generic variant."""

    def __init__(self, lowering: Lowering, miss, library_loader, entry_guards=None):
        self.lowering = lowering
        self.symbols = tuple(lowering.symbols)
        self.kernels = [KernelInfo(k) for k in lowering.kernels]
        ws = generate(lowering, entry_guards=bool(self.symbols and entry_guards is not None))
        self.c_source = (translation_unit(lowering.kernels, library_loader.prelude(), ws.entries)
                         if lowering.kernels or ws.entries else "")
        self.wrapper_code = ws.source
        g = dict(ws.globals)
        g["_miss"] = miss
        g["_nthreads"] = torch.get_num_threads
        if self.c_source:
            lib = library_loader.load(self.c_source)
            nbuf = {k.name: len(k.buffers()) for k in lowering.kernels}
            for name in ws.kernel_names:
                g[f"_{name}"] = _c_function(lib, name, nbuf[name], len(self.symbols))
            for e in ws.entries:
                g[f"_{e.name}"] = _c_function(lib, e.name, e.nargs, len(self.symbols),
                                              resumable=any(isinstance(c, CCall) for c in e.calls))
            self.library = lib
        if entry_guards is not None:
            g["_entry_guards"] = entry_guards
        code = compile(self.wrapper_code, f"<symtrace-lowered {lowering.gm.__class__.__name__}>", "exec")
        exec(code, g)
        self.call = g["call"]
        if self.symbols:
            g2 = dict(g, _miss=_no_match)
            exec(code, g2)
            self.try_call = g2["call"]
        self.reports: Dict[str, NodeReport] = lowering.reports


def _c_function(lib, name: str, nbuf: int, nsym: int = 0, resumable: bool = False):
    """``lib.name`` typed once as ``void name(void *, ... (nbuf), int64_t, ... (nsym), int)``:
    ctypes then converts Python ints (addresses, sizes) without looking anything up per call.
    ``resumable``: an entry point making weight-only linears (``int name(..., int nt, int
    start)``: see :func:`~symtrace.lower.codegen_c.entry_point`)."""
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.c_void_p] * nbuf + [ctypes.c_int64] * nsym + [ctypes.c_int] * (2 if resumable else 1)
    fn.restype = ctypes.c_int if resumable else None
    return fn


def _compile_error_summary(e: CompileError, lw: Lowering, gm: GraphModule, lines: int = 6) -> str:
    """One paragraph for the user: which graph and kernels, the compiler's first error lines,
    where the source is."""
    kernels = ", ".join(f"{k.name} ({', '.join(k.nodes[:4])}{' ...' if len(k.nodes) > 4 else ''})"
                        for k in lw.kernels[:6]) + (" ..." if len(lw.kernels) > 6 else "")
    text = e.stderr or str(e)
    if e.c_path:
        text = text.replace(str(e.c_path), "source")
    errs = [ln for ln in text.splitlines() if ln.strip()]
    first = [ln for ln in errs if "error" in ln.lower()][:lines] or errs[:lines]
    where = f" (source: {e.c_path})" if e.c_path else ""
    return (f"the C compiler rejected the kernels generated for {_graph_label(gm)} [{kernels}]{where}:\n  "
            + "\n  ".join(first))


def _graph_label(gm: GraphModule) -> str:
    """``graph <class> (traced from <function> at <file>:<line>)`` for messages."""
    name = getattr(gm, "_class_name", None) or type(gm).__name__
    for n in gm.graph.nodes:
        src = n.meta.get("source")
        if src is not None and getattr(src, "filename", None):
            return f"graph {name} (traced from {src.function} at {src.filename}:{src.lineno})"
    return f"graph {name}"


class _CLibraryLoader:
    def prelude(self) -> str:
        from . import toolchain
        return toolchain.prelude_source()

    def load(self, source: str):
        from . import toolchain
        return toolchain.load_library(source)


def _partition(dims) -> frozenset:
    """The grouping of dims into symbols, whatever the symbols' names."""
    by: Dict[str, set] = {}
    for k, name in dims.items():
        by.setdefault(name, set()).add(k)
    return frozenset(frozenset(v) for v in by.values())


_OWN_SYMBOL = re.compile(r"s[0-9]+")


def _code_symbols(dims: Dict[Tuple[int, int], Sym], taken: set) -> Dict[Tuple[int, int], Sym]:
    """``dims`` with symbols named for code: they become variables of the wrapper and parameters
    of the C and Triton kernels, so a user's Dim name (``torch``, ``x``, ``nt``, a C keyword)
    must never reach that code. Names of symtrace's own form (``s0``, ``s1``...) are kept unless
    an input has that name; any other becomes ``_sz0``, ``_sz1``...; equal symbols stay equal.
    ``taken``: the graph's input names, which the wrapper also binds."""
    renamed: Dict[str, Sym] = {}
    out = {}
    for key, s in dims.items():
        new = renamed.get(s.name)
        if new is None and _OWN_SYMBOL.fullmatch(s.name) and s.name not in taken:
            new = renamed[s.name] = s
            taken = taken | {s.name}
        if new is None:
            i = len(renamed)
            while f"_sz{i}" in taken:
                i += 1
            taken = taken | {f"_sz{i}"}
            new = renamed[s.name] = Sym(f"_sz{i}", s.lo, s.hi)
        out[key] = new
    return out


_METADATA_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_cuda", "is_sparse",
                             "is_quantized", "is_meta", "is_mkldnn", "itemsize", "is_cpu"})
_METADATA_METHODS = frozenset({"is_contiguous", "is_floating_point", "is_complex", "stride", "size", "dim",
                               "ndimension", "nelement", "numel", "element_size", "get_device"})


def _reads_input(expr: "GExpr", names: set) -> bool:
    """Whether a guard expression reads one of the inputs ``names`` other than through its
    metadata (``k == 2``, ``a is b``; not ``k.shape[0]``)."""
    from ..graph.guard_expr import Attr, Input, Method
    if type(expr) is Attr and expr.name in _METADATA_ATTRS or type(expr) is Method and expr.name in _METADATA_METHODS:
        return False   # (a variant's signature fixes them: shape, strides, dtype, device)
    if type(expr) is Input:
        return expr.name in names
    return any(_reads_input(c, names) for c in expr.children())


def _is_tensor(v) -> bool:
    return isinstance(v, torch.Tensor)


def signature(args) -> tuple:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((tuple(a.shape), tuple(a.stride()), a.dtype, a.device.type))
        else:
            try:
                hash(a)
                out.append(("py", type(a), a))
            except TypeError:
                out.append(("py", type(a), id(a)))
    return tuple(out)


class LoweredModule(nn.Module):
    """The result of :func:`symtrace.lower.compile`. Call it like the graph module.

    * ``kernels`` — :class:`KernelInfo` per generated kernel (first variant);
    * ``source()`` — the C translation unit; ``wrapper_code`` — the generated Python;
    * ``report()`` — a table of every node: fused into which kernel, run by torch (and why);
    * ``to_dot()`` / ``draw(path)`` — the graph with one cluster per kernel;
    * ``compiles``, ``compile_seconds``, ``torch_calls`` — variants compiled (static and
      size-generic, see ``dynamic``), the seconds that took, calls run through torch.
    """

    def __init__(self, gm: GraphModule, example_inputs: tuple, target: str = "cpu", max_variants: int = 8,
                 library_loader=None, *, eager_gm: Optional[GraphModule] = None, state_check=None,
                 pipeline_notes=(), dynamic: Any = "auto", dynamic_shapes: Any = None, check_state: bool = False):
        super().__init__()
        if dynamic not in ("auto", True, False):
            raise ValueError(f"symtrace.lower.compile: dynamic must be 'auto', True or False, got {dynamic!r}")
        self.dynamic = dynamic
        self._first: Optional[Variant] = None
        #: how many variants were compiled (static and size-generic), and the seconds it took
        self.compiles = 0
        self.compile_seconds = 0.0
        #: calls that ran the graph through torch instead of kernels (any reason)
        self.torch_calls = 0
        self._generic: List[Variant] = []
        self._generic_failed: Dict[tuple, str] = {}   # shape class -> why no generic variant
        self._static_shapes: Dict[tuple, list] = {}   # shape class -> input shapes of static variants
        self.gm = gm
        # the inference pipeline (pipeline.py) lowers its own copy of the graph: ``eager_gm``
        # is the caller's graph, run through torch when autograd is needed or when
        # ``state_check()`` says the weights it folded changed
        # (kept out of the submodules: state_dict() lists the lowered graph's tensors once)
        self.__dict__["_eager"] = eager_gm if eager_gm is not None else gm
        self._state_check = state_check
        # ``check_state`` (lower.compile's inference pipeline): a state check over the tensors of
        # ``eager_gm`` and ``gm`` is made once the first variant is built (its recording run may
        # restore buffers in place) and runs before every call; the tensors it covers
        # (``_checked``: every one the graph reads) are those variants may bind into C calls
        self._checked: Optional[frozenset] = None
        if check_state:
            self._checked = frozenset(id(t) for root in (self._eager, gm) for m in root.modules()
                                      for d in (m._parameters, m._buffers) for t in d.values() if t is not None)
        self._c_calls = c_calls.enabled()   # (for every variant of this module)
        #: positions of inputs that must hold no NaN/Inf for the pipeline's fused activations
        #: to give eager's answer (checked per call; else the caller's graph runs in torch)
        self._finite_inputs: tuple = ()
        self.pipeline_notes = list(pipeline_notes)
        self.torch_reason: Optional[str] = None   # set by use_torch
        self.target = target
        self.max_variants = max_variants
        self._loader = library_loader or _CLibraryLoader()
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._guard_cache: Dict[str, Any] = {}
        self._variants: Dict[tuple, Variant] = {}
        self._failed: set = set()   # signatures whose kernels the C compiler rejected
        self._warned = set()
        self._params = [p for p in self._eager.parameters()]
        self.eager_reason: Optional[str] = None
        self._placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if any(n.target.startswith("*") for n in self._placeholders):
            raise ValueError("LoweredModule takes a graph whose inputs are one value each; lower a graph with "
                             "*args/**kwargs inputs through symtrace.lower.compile, which binds them")
        from ..graph.guards import LIVE_GUARD_KINDS
        # guards the variants' input checks do not cover: a live model's, and the identity of
        # globals a captured function compared (`MODE is FAST`), checked at every call
        self._live_guards = getattr(gm, "guard_root", None) is not None or any(
            g.kind in LIVE_GUARD_KINDS and not g.reads_root() for g in gm.graph.guards)
        #: guards on module globals (``SCALE == 2.0``): a global can change between any two calls,
        #: and no input check shows it, so they are checked at every call
        self._global_guards = [g for g in gm.graph.guards if g.kind == "global" and not g.reads_root()]
        #: with global module hooks registered, lowering left every module call a call (they run
        #: the hooks); without, a hook registered later would be skipped by the kernels
        self._hooks_when_lowered = global_forward_hooks()
        self._global_guard_cache: Dict[str, Any] = {}
        #: the grad mode the graph assumed (a guard of kind grad_mode), checked at every call:
        #: a variant is chosen by its inputs, which do not show it
        self._grad_mode = next((g.expected for g in gm.graph.guards if g.kind == "grad_mode"), None)
        example_inputs = tuple(example_inputs)
        if len(example_inputs) < len(self._placeholders):   # (defaults: calls are compared with them bound)
            example_inputs = self._bind(example_inputs, {})
        # guards on a tensor input's value (`operator.index(k)` specialised to `k == 2`), or on
        # two inputs being one tensor: no size or dtype check shows them, so every call checks them
        tensors = {n.name for n, a in zip(self._placeholders, example_inputs) if isinstance(a, torch.Tensor)}
        self._global_guards += [g for g in gm.graph.guards if g.kind == "value" and g not in self._global_guards
                                and isinstance(g.expr, GExpr) and _reads_input(g.expr, tensors)]
        held = next(((n.target, a) for n, a in zip(self._placeholders, example_inputs)
                     if not isinstance(a, torch.Tensor) and _holds(a, _is_tensor)), None)
        if held is not None:   # (a variant would read the example's tensors as constants)
            self.eager_reason = (f"the input {held[0]!r} holds tensors in a {type(held[1]).__name__}; kernels take "
                                 "tensors as arguments of their own, so the graph runs through torch (pass the "
                                 "tensors as separate arguments to lower it)")
            self._fast = None
            return
        first = None
        if dynamic_shapes is not None:
            first = self._build_declared(example_inputs, dynamic_shapes)
        elif dynamic is True:
            dims = all_dims(example_inputs)
            if dims:
                first = self._build_generic(example_inputs, dims)
        if first is None:
            first = self._build(example_inputs)
        if check_state:
            from .pipeline import state_check as make_check
            self._state_check = make_check(self._eager, also=gm)
        self._first = first
        self._fast = first.call if first is not None else None

    # ------------------------------------------------------------- building
    def _build(self, inputs: tuple) -> Optional[Variant]:
        """Lower and compile a variant for ``inputs``; None (after a warning) when the C
        toolchain cannot build it, and the graph runs through torch for these inputs."""
        t0 = time.perf_counter()
        try:
            return self._build_static(inputs)
        finally:
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - t0

    def _build_static(self, inputs: tuple) -> Optional[Variant]:
        lw = self._lowering_class(self.gm, inputs).run()
        cls = shape_class(inputs)
        if cls is not None:
            self._static_shapes.setdefault(cls, []).append(
                ([tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in inputs], lw.seen))
        try:
            variant = self._make_variant(lw)
        except CompilerUnavailable as e:
            self.eager_reason = str(e)
            warnings.warn(f"symtrace.lower: {e}; the module runs through torch (no kernels).", stacklevel=3)
            return None
        except CompileError as e:
            reason = _compile_error_summary(e, lw, self.gm)
            if not self._variants:
                self.eager_reason = reason
            self._failed.add(signature(inputs))
            warnings.warn(f"symtrace.lower: {reason}\nThe graph runs through torch for these inputs (no kernels). "
                          "With gcc or clang this is a symtrace bug: please report it with the source file above.",
                          stacklevel=3)
            return None
        self._variants[signature(inputs)] = variant
        return variant

    # ------------------------------------------------------------- size-generic variants
    def _build_generic(self, inputs: tuple, dims, declared: bool = False, known=()) -> Optional[Variant]:
        """Lower and compile a size-generic variant for the class of ``inputs`` with ``dims``
        (``{(input position, dim): Sym}``) symbolic (:mod:`.dynamic`); None when the graph
        cannot have one (the reason is kept for ``report()``; ``declared``: raise instead)."""
        cls = shape_class(inputs)
        t0 = time.perf_counter()
        try:
            code_dims = _code_symbols(dims, {n.name for n in self._placeholders})
            lw = self._lowering_class(self.gm, inputs, code_dims, known).run()
            if not lw.symbols:
                raise NotGeneric("no symbolic dimension")
            variant = self._make_variant(
                lw, entry_guards=(lambda *a: self._check_entry_guards(a)) if self._needs_entry_guards() else None)
            self.compiles += 1
        except (NotGeneric, SymbolicSizeError, TypeError, ValueError, NotImplementedError, CompileError) as e:
            # (SymbolicSizeError/TypeError: a lowering rule needed a concrete size: compare,
            # a float from a size; every such case gets static variants instead)
            self._last_generic_error = e
            reason = f"{type(e).__name__}: {e}" if not isinstance(e, NotGeneric) else str(e)
            if isinstance(e, CompileError):   # (the same compiler would reject the static kernels too)
                reason = _compile_error_summary(e, lw, self.gm)
                self._failed.add(signature(inputs))
                if not declared:
                    warnings.warn(f"symtrace.lower: {reason}\nThe graph runs through torch for these inputs (no "
                                  "kernels). With gcc or clang this is a symtrace bug: please report it with the "
                                  "source file above.", stacklevel=4)
            if declared:
                raise ValueError(f"symtrace.lower.compile: the declared dynamic_shapes cannot be served by one "
                                 f"size-generic variant: {reason}") from e
            self._generic_failed[cls] = reason
            return None
        finally:
            self.compile_seconds += time.perf_counter() - t0
        variant.shape_class = cls
        variant.dims = dict(dims)
        self._generic.append(variant)
        if self._first is not None and self.torch_reason is None:
            self._fast = variant.call   # most later calls are of new sizes
        return variant

    def _needs_entry_guards(self) -> bool:
        """Whether the graph has guards a generic variant's input checks do not imply (shape
        decisions, values): they must then be checked on every call, as sizes vary."""
        names = {n.name for n in self._placeholders}
        for g in self.gm.graph.guards:
            text = g.expr.shown() if hasattr(g.expr, "shown") else str(g.expr)
            head = text.split(".", 1)[0].split("[", 1)[0].split("(", 1)[-1]
            if g.kind not in ("type", "dtype", "device", "ndim") or head not in names:
                return True
        return False

    def _lowering_class(self, gm, inputs, dims=None, known=()):
        return Lowering(gm, inputs, dims, known)

    def _make_variant(self, lw, entry_guards=None):
        self._hooks_when_lowered = self._hooks_when_lowered and global_forward_hooks()
        return self._variant(lw, entry_guards)

    def _variant(self, lw, entry_guards):
        if self._checked is not None and self.target == "cpu" and self._c_calls:
            c_calls.bind_c_calls(lw, self._checked)
        return Variant(lw, self._miss, self._loader, entry_guards)

    def _build_declared(self, inputs: tuple, spec) -> Optional[Variant]:
        names = [str(n.target) for n in self._placeholders]   # (the forward's parameter names,
        if isinstance(spec, dict):                               # or the graph's: `input_1`)
            by_node = {n.name: str(n.target) for n in self._placeholders if n.name != n.target}
            spec = {by_node.get(k, k) if k not in names else k: v for k, v in spec.items()}
        declared = normalize_dynamic_shapes(spec, names, inputs)
        # a declared minimum of 0 is served from 1 up by the generic variant; size 0 (no work,
        # and no size-generic layout: a stride may be max(size, 1)) gets a static variant
        dims = {(pos, d): Sym(dim.name, max(dim.min, 1), dim.max) for pos, per in declared.items()
                for d, dim in per.items()}
        return self._build_generic(inputs, dims, declared=True) if dims else None

    def _auto_generic(self, args) -> Optional[Variant]:
        """``dynamic="auto"``: when ``args`` differ from a compiled static variant only in sizes,
        compile one generic variant with exactly the changed dims symbolic. When the class has
        one already and its guards refused ``args`` because dims it holds equal (one symbol)
        now differ, or other dims changed too, a second, wider one (at most two per class)."""
        cls = shape_class(args)
        if cls is None or cls in self._generic_failed or cls not in self._static_shapes:
            return None
        base = self._static_shapes[cls][-1][0]
        dims = changed_dims(base, args)
        existing = [g for g in self._generic if getattr(g, "shape_class", None) == cls]
        if existing:
            prev = existing[-1].dims
            if len(existing) >= 2 or any(args[p].shape[d] < 2 for p, d in prev):
                return None   # (a size 0/1 where the generic variant has a symbol: a static variant)
            groups: Dict[tuple, str] = {}
            dims = {}
            for p, d in sorted(set(prev) | set(changed_dims(base, args))):
                key = (prev[(p, d)].name if (p, d) in prev else None, base[p][d], args[p].shape[d])
                dims[(p, d)] = groups.setdefault(key, f"s{len(groups)}")
            if _partition(dims) == _partition({k: s.name for k, s in prev.items()}):
                return None
        if not dims:
            return None
        # (a wider variant starts from the ranges its predecessor had to be narrowed to)
        lo = max((s.lo for g in existing for s in g.dims.values()), default=2)
        syms = {name: Sym(name, lo) for name in set(dims.values())}
        for attempt in range(6):   # (each comparison narrows the ranges once at most)
            if attempt:
                self._generic_failed.pop(cls, None)
            self._last_generic_error = None
            variant = self._build_generic(tuple(args), {k: syms[v] for k, v in dims.items()},
                                          known=self._static_shapes[cls])
            if variant is not None:
                return variant
            # a rule could not decide a size comparison over the symbols' whole ranges (a pooled
            # map of (s + 31)//32 squared may be 1 or more): narrow them to sizes where it is
            # decided, if the sizes seen so far are all in there; smaller ones get static variants
            narrowed = _narrowed(getattr(self._last_generic_error, "undecided", None), syms,
                                 self._seen_sizes(cls, args, dims))
            if narrowed is None:
                break
            syms = narrowed
        return None   # (the reason stays in _generic_failed: no more attempts for this class)

    def _seen_sizes(self, cls, args, dims) -> Dict[str, int]:
        """The smallest size each symbol's dims had so far (static variants of ``cls``, ``args``)."""
        shapes = [s for s, _ in self._static_shapes.get(cls, [])] + [[tuple(a.shape) if isinstance(a, torch.Tensor)
                                                                      else None for a in args]]
        out: Dict[str, int] = {}
        for (p, d), name in dims.items():
            for sh in shapes:
                if sh[p] is not None:
                    out[name] = min(out.get(name, sh[p][d]), sh[p][d])
        return out

    def _check_entry_guards(self, args) -> None:
        """The graph's own entry guards (raise GuardError as the graph module would)."""
        from ..graph.guards import check_entry_guards, needs_live_root
        live_root = getattr(self.gm, "guard_root", None)
        guards = [g for g in self.gm.graph.guards if live_root is not None or not needs_live_root(g)]
        check_entry_guards(guards, self._guard_env(args), self._guard_cache)

    def _check_global_guards(self, args) -> None:
        """The graph's guards on module globals (raise GuardError as the graph module would)."""
        from ..graph.guards import check_entry_guards
        check_entry_guards(self._global_guards, self._guard_env(args), self._global_guard_cache)

    def _guard_env(self, args) -> Dict[str, Any]:
        env = {n.name: a for n, a in zip(self._placeholders, args)}
        env["root"] = getattr(self.gm, "guard_root", None) or self.gm
        return env

    def _miss(self, *args):
        self._check_entry_guards(args)
        if any(isinstance(a, torch.Tensor) and a.is_neg() for a in args):
            return self._through_torch(self.gm, args)   # (a negative view: kernels would read -x)
        sig = signature(args)
        v = self._variants.get(sig)
        if v is None:
            for g in self._generic:
                out = g.try_call(*args)
                if out is not NO_MATCH:
                    return out
        if v is not None:
            if getattr(self._tls, "in_miss", False):  # its guard refused inputs of its own signature
                self._warn("refused", "symtrace.lower: a compiled variant refused inputs matching its signature; "
                                      "running through torch (please report this)")
                return self._through_torch(self.gm, args)
            self._tls.in_miss = True
            try:
                return v.call(*args)
            finally:
                self._tls.in_miss = False
        if self.eager_reason is not None or sig in self._failed:
            return self._through_torch(self.gm, args)
        if self.dynamic is not False and self._fast is not None:
            g = self._auto_generic(args)
            if g is not None:
                return g.call(*args)
            if sig in self._failed:
                return self._through_torch(self.gm, args)
        if len(self._variants) + len(self._generic) >= self.max_variants:
            self._warn("variants", f"symtrace.lower: {self.max_variants} input signatures are compiled and these inputs "
                                   "fit none; running through torch for them. Pass max_variants=... to compile more.")
            return self._through_torch(self.gm, args)
        v = self._build(tuple(args))
        return v.call(*args) if v is not None else self.gm(*args)

    def _through_torch(self, gm, args):
        self.torch_calls += 1
        return gm(*args)

    def use_torch(self, reason: str, runner=None) -> None:
        """Run every call through torch from now on: the caller's graph, or ``runner`` (the
        inference pipeline's graph, with the same checks before it); ``report()`` starts with
        ``reason``."""
        self.torch_reason = reason
        self.__dict__["_fast"] = runner   # (not registered as a submodule: no state_dict entries)

    def _warn(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, stacklevel=4)

    # ------------------------------------------------------------- calling
    def forward(self, *args, **kwargs):
        signature = self.__dict__.get("_signature")
        if signature is not None:
            args, kwargs = bind_inputs(signature, args, kwargs), {}
        tree = self.__dict__.get("_input_tree")
        if tree is not None:
            args = bind_inputs(tree.placeholders, args, kwargs)
            flat = tree.flatten(args)
            if flat is None:   # (another structure: the original graph's guards decide)
                return self._through_torch(tree.original, args)
            args, kwargs = flat, {}
        if kwargs or len(args) != len(self._placeholders):
            args = self._bind(args, kwargs)
        if self._fast is None:
            return self._through_torch(self._eager, args)
        grad = torch.is_grad_enabled()
        if grad and (any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
                     or any(p.requires_grad for p in self._params)):
            self._warn("grad", "symtrace.lower: kernels record no gradients; with grad mode on and tensors that "
                               "require grad the graph runs through torch. Call it under torch.no_grad() or "
                               "torch.inference_mode() to use the kernels.")
            return self._through_torch(self._eager, args)
        if self._state_check is not None and not self._state_check():
            self._warn("stale", "symtrace.lower: parameters or buffers that the inference pipeline folded or "
                                "packed changed since lowering (or a module left eval mode); running the graph "
                                "through torch. Call symtrace.lower.compile again to use the new weights.")
            return self._through_torch(self._eager, args)
        if self._finite_inputs and not _all_finite(args, self._finite_inputs):
            return self._through_torch(self._eager, args)
        if global_forward_hooks() and not self._hooks_when_lowered:
            self._warn("hooks", "symtrace.lower: global module forward hooks were registered after lowering; "
                                "kernels would skip them, so the graph runs through torch while they are")
            return self._through_torch(self._eager, args)
        if self._live_guards or (self._grad_mode is not None and grad is not self._grad_mode):
            self._check_entry_guards(args)   # (a failing one raises GuardError, as the graph module would)
        elif self._global_guards:
            self._check_global_guards(args)
        with self._lock:
            try:
                return self._fast(*args)
            except Exception:   # (a failing data guard inside the program's `with torch.no_grad()`)
                if torch.is_grad_enabled() != grad:
                    torch.set_grad_enabled(grad)
                raise

    def _bind(self, args, kwargs) -> tuple:
        """The call's arguments in placeholder order (see :func:`.input_tree.bind_inputs`)."""
        return bind_inputs(self._placeholders, args, kwargs)

    def take_inputs_as(self, tree, signature=None) -> "LoweredModule":
        """Calls take the inputs of ``tree.original`` (containers of tensors), flattened per
        call onto this module's graph (:mod:`.input_tree`); an input of another structure runs
        ``tree.original`` through torch. None: as they are. ``signature``: the placeholders of
        a graph with ``*args``/``**kwargs`` inputs, which bind a call's arguments first (this
        module's graph takes the tuple and the dict as one input each, see
        :func:`.input_tree.plain_placeholders`)."""
        self.__dict__["_input_tree"] = tree
        self.__dict__["_signature"] = signature
        return self

    # ------------------------------------------------------------- inspection
    @property
    def kernels(self) -> List[KernelInfo]:
        return self._first.kernels if self._first is not None else []

    @property
    def wrapper_code(self) -> str:
        return self._first.wrapper_code if self._first is not None else ""

    def source(self) -> str:
        """The C source of the kernels of the first compiled input signature."""
        return self._first.c_source if self._first is not None else ""

    @property
    def captured_graph(self) -> GraphModule:
        """The caller's graph this module computes (what ``capture`` inspects for effects and
        data guards)."""
        return self.__dict__["_eager"]

    def report(self) -> str:
        """Which node went where: fused into a kernel, a view, a torch call (with the reason)."""
        from tabulate import tabulate
        if self._first is None:
            return f"not lowered: {self.eager_reason}"
        head = "".join(f"inference pipeline: {n}\n" for n in self.pipeline_notes)
        head += "".join(f"{line}\n" for line in self.dynamic_notes())
        if self.torch_reason:
            head = f"not used: {self.torch_reason}\n" + head
        where_kernel: Dict[str, List[str]] = {}
        for k in self.kernels:
            for n in k.nodes:
                where_kernel.setdefault(n, []).append(k.name)
        rows = []
        for r in self._first.reports.values():
            where = r.where
            if r.node in where_kernel:
                ks = where_kernel[r.node]
                where = ("kernel " if len(ks) == 1 else "kernels ") + ", ".join(ks)
            elif where == "fused":
                where = "fused (dead or inlined)"
            rows.append([r.node, r.op, r.target, where, r.reason])
        return head + tabulate(rows, headers=["node", "opcode", "target", "runs in", "why"])

    def dynamic_notes(self) -> List[str]:
        """One line per size-generic variant (which dims are symbolic, with their ranges) and
        per shape class that could not get one (why), plus the compile count."""
        names = [n.name for n in self._placeholders]
        out = []
        for g in self._generic:
            dims = ", ".join(f"{s.name} = {names[p]}.shape[{d}] ({s.lo}..{'inf' if s.hi == float('inf') else s.hi})"
                             for (p, d), s in sorted(g.dims.items()))
            first = " (the first variant)" if g is self._first else ""
            out.append(f"size-generic variant{first}: {dims}; one compiled library serves every size of this class")
        for why in self._generic_failed.values():
            out.append(f"no size-generic variant (one variant per input size instead): {why}")
        if self.compiles > 1 or self._generic:
            out.append(f"compiled {self.compiles} variant(s) in {self.compile_seconds:.2f} s")
        return out

    def to_dot(self) -> str:
        from .report import lowered_dot
        return lowered_dot(self)

    def draw(self, path: str, format: Optional[str] = None) -> str:
        from .report import draw_lowered
        return draw_lowered(self, path, format)


def _all_finite(args: tuple, positions: tuple) -> bool:
    """Whether the floating-point tensors at ``positions`` hold no NaN or Inf (one sum each)."""
    from ..passes.finite_values import tensor_is_finite
    return all(tensor_is_finite(args[i]) for i in positions
               if i < len(args) and isinstance(args[i], torch.Tensor))


def _narrowed(undecided, syms: Dict[str, Sym], seen: Dict[str, int]) -> Optional[Dict[str, Sym]]:
    """The symbols with lower bounds raised (to powers of two, at most the smallest size seen)
    so that ``undecided`` (a SizeExpr a rule compared with 0) has a decided sign; None when no
    such bounds cover the sizes seen."""
    from ..graph.symbols import SizeExpr, bounds
    if not isinstance(undecided, SizeExpr):
        return None
    names = [s.name for s in undecided.free_symbols() if s.name in syms]
    if not names:
        return None
    smallest = min(seen.get(n, 2) for n in names)
    candidates = sorted({2 ** k for k in range(1, 31) if 2 ** k <= smallest} | {smallest})
    for lo in candidates:
        new = dict(syms)
        env = {}
        for n in names:
            if syms[n].lo >= lo:
                continue
            new[n] = Sym(n, lo, syms[n].hi)
            env[n] = SizeExpr([(((new[n], 1),), 1)])
        if not env:
            continue
        lo_b, hi_b = bounds(undecided.subs(env))
        if lo_b > 0 or hi_b <= 0:
            return new
    return None

