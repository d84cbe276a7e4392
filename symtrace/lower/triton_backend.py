"""The ``cuda`` target of :func:`symtrace.lower.compile`: the same lowering, Triton kernels.

:func:`compile_cuda` reuses :class:`~symtrace.lower.lowering.Lowering` (kernels and steps) and
the generated Python wrapper, and swaps the C translation unit for a Triton module
(:mod:`~symtrace.lower.codegen_triton`) whose kernels are launched with tensors and a grid.
Needs ``triton``; with ``TRITON_INTERPRET=1`` the kernels run in Triton's interpreter on CPU
tensors (slow, but no GPU needed: that is how the tests run).
"""
from __future__ import annotations

import functools
import linecache
import sys
import types
import warnings
from typing import Optional

import torch

from .cache_dir import cache_dir, digest
from .codegen_triton import interpreting, kernel_source, launch_plan, module_source
from .lowering import Lowering
from ..graph.symbols import evaluate
from .module import KernelInfo, LoweredModule, _no_match
from .triton_tuning import Tuning, rerunnable, tune
from .wrapper import generate

__all__ = ["compile_cuda", "TritonLoweredModule", "TritonVariant", "TritonLowering", "triton_available"]


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _device_of(inputs) -> torch.device:
    for a in inputs:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu") if interpreting() else torch.device("cuda")


class TritonLowering(Lowering):
    """:class:`Lowering` for tensors on ``device_type`` (``cuda``; ``cpu`` under the interpreter):
    inputs, parameters and torch results must be on that device."""

    def __init__(self, gm, example_inputs, device_type: str, dims=None, known=()):
        self.device_type = device_type
        super().__init__(gm, example_inputs, dims, known)


class TritonKernelInfo(KernelInfo):
    """A :class:`KernelInfo` whose ``source`` is the kernel's Triton code."""

    def __init__(self, kernel):
        self.name, self.kind, self.nodes, self.kernel = kernel.name, kernel.kind, list(kernel.nodes), kernel
        self.source = kernel_source(kernel)


def _load_module(source: str):
    """Write ``source`` to a file (Triton reads kernels' source through ``inspect``) and import it.

    The file is a cache entry named by the source's SHA-256: one whose bytes differ from
    ``source`` (damaged, truncated, not UTF-8, a directory, ...) is rewritten, never an error.
    The module is compiled from ``source`` itself (no ``__pycache__`` bytecode to go stale or be
    damaged) and ``linecache`` holds its text, so ``inspect`` sees exactly what was compiled even
    if the file changes later."""
    data = source.encode("utf-8")
    key = digest(data)[:24]
    name = f"symtrace_triton_{key}"
    mod = sys.modules.get(name)
    if mod is not None and getattr(mod, "__symtrace_source__", None) == source:
        return mod
    root = cache_dir("triton")
    path = root / f"st_{key}.py"
    try:
        same = path.read_bytes() == data
    except OSError:
        same = False
    if not same:
        from .toolchain import _atomic_write, _ensure_subdir
        _ensure_subdir(root)
        _atomic_write(path, data)
    filename = str(path)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    mod = types.ModuleType(name)
    mod.__file__ = filename
    mod.__symtrace_source__ = source
    sys.modules[name] = mod
    try:
        exec(compile(source, filename, "exec"), mod.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


def _launcher(mod, kernel, tune_key: Optional[tuple] = None, tuning: Optional[dict] = None):
    """``_kN(*tensors, nt)`` as the wrapper calls it: launch the kernel(s) on a grid. With
    ``tune_key``, the first launch picks the warps (:mod:`.triton_tuning`) and records the
    decision in ``tuning[kernel.name]``."""
    plan = launch_plan(kernel)
    nsym = len(kernel.symbols)
    static = not nsym

    def size(n, args):   # a grid or partial count: an int, or per call from the symbols' values
        return n if static else evaluate(n, dict(zip(kernel.symbols, args[len(args) - 1 - nsym:-1])))
    cfg = {"warps": plan.warps, "key": tune_key if (plan.grid or not static) else None}
    if tune_key is not None and kernel.kind != "full" and not rerunnable(kernel):
        # (a full reduction's first stage only writes its own partials: always safe to time)
        cfg["key"] = None
        tuning[kernel.name] = Tuning(plan.warps, {}, "not timed: the kernel writes memory it reads or the caller's")

    def tuned(launch, device) -> None:
        """On the first launch with a tuning key: pick the warps (the caller then launches)."""
        key, cfg["key"] = cfg["key"], None
        t = tune(key + (str(device),), plan.warps, launch, device)
        cfg["warps"] = t.warps
        tuning[kernel.name] = t

    if kernel.kind == "full":
        part_fn = getattr(mod, f"{kernel.name}_part", None)
        final = getattr(mod, kernel.name)

        def launch_full(*args):
            tensors = args[:-1]   # (the buffers, then the size symbols' values)
            parts, grid = size(plan.parts, args), size(plan.grid, args)
            part = torch.empty(max(parts, 1), dtype=plan.part_dtype, device=tensors[0].device)
            if parts:
                if cfg["key"] is not None:
                    tuned(lambda w: part_fn[(grid,)](*tensors, part, num_warps=w), tensors[0].device)
                part_fn[(grid,)](*tensors, part, num_warps=cfg["warps"])
            final[(1,)](*tensors, part, num_warps=4)
        return launch_full
    fn = getattr(mod, kernel.name)

    def launch(*args):
        grid = size(plan.grid, args)
        if grid:
            tensors = args[:-1]
            if cfg["key"] is not None:
                tuned(lambda w: fn[(grid,)](*tensors, num_warps=w), tensors[0].device)
            fn[(grid,)](*tensors, num_warps=cfg["warps"])
    return launch


class TritonVariant:
    """The lowered form of the graph for one input signature, with Triton kernels."""

    def __init__(self, lowering: Lowering, miss, device: torch.device, autotune: bool = False, entry_guards=None):
        self.lowering = lowering
        self.symbols = tuple(lowering.symbols)
        #: kernel name -> :class:`~.triton_tuning.Tuning` (with autotune, once launched)
        self.tuning: dict = {}
        self.kernels = [TritonKernelInfo(k) for k in lowering.kernels]
        self.triton_source = module_source(lowering.kernels) if lowering.kernels else ""
        self.c_source = self.triton_source  # what LoweredModule.source() shows
        ws = generate(lowering, device.type, pointers=False, entry_guards=bool(self.symbols and entry_guards is not None))
        self.wrapper_code = ws.source
        g = dict(ws.globals)
        g["_miss"] = miss
        g["_nthreads"] = lambda: 0
        if entry_guards is not None:
            g["_entry_guards"] = entry_guards
        if "_arena" in g:   # a size-generic variant's growing arena
            g["_arena"].device = device
        if device.type != "cpu":
            g["_empty"] = g["_empty_huge"] = g["_empty_sized"] = functools.partial(torch.empty_strided, device=device)
            for name in list(g):
                if name.startswith("_arena_"):
                    g[name] = g[name].to(device)
        if lowering.kernels:
            self.module = _load_module(self.triton_source)
            for k, info in zip(lowering.kernels, self.kernels):
                key = ("triton", info.source) if autotune else None
                g[f"_{k.name}"] = _launcher(self.module, k, key, self.tuning)
        code = compile(self.wrapper_code, f"<symtrace-lowered-triton {lowering.gm.__class__.__name__}>", "exec")
        exec(code, g)
        self.call = g["call"]
        if self.symbols:
            g2 = dict(g, _miss=_no_match)
            exec(code, g2)
            self.try_call = g2["call"]
        self.reports = lowering.reports


class TritonLoweredModule(LoweredModule):
    """A :class:`LoweredModule` with Triton kernels; ``source()`` is the Triton module.
    ``autotune``: time a few launch configurations per kernel on first launch
    (:mod:`~symtrace.lower.triton_tuning`)."""

    def __init__(self, gm, example_inputs: tuple, target: str = "cuda", max_variants: int = 8,
                 autotune: bool = False, dynamic="auto", dynamic_shapes=None, eager_gm=None, pipeline_notes=()):
        object.__setattr__(self, "autotune", autotune)  # (_build runs inside __init__)
        super().__init__(gm, example_inputs, target, max_variants, dynamic=dynamic, dynamic_shapes=dynamic_shapes,
                         eager_gm=eager_gm, pipeline_notes=pipeline_notes)

    def _lowering_class(self, gm, inputs, dims=None, known=()):
        object.__setattr__(self, "_device", _device_of(inputs))
        return TritonLowering(gm, inputs, self._device.type, dims, known)

    def _variant(self, lw, entry_guards):
        return TritonVariant(lw, self._miss, self._device, self.autotune, entry_guards)


def compile_cuda(gm, example_inputs: tuple, max_variants: int = 8, autotune: bool = False, dynamic="auto",
                 dynamic_shapes=None, inference=None) -> TritonLoweredModule:
    """Lower ``gm`` for ``example_inputs`` to Triton kernels (``symtrace.lower.compile(..., target="cuda")``).
    ``inference`` (:class:`~symtrace.lower.pipeline.InferenceOptions` or None): the pipeline's
    device-independent steps first (batch-norm and constant folding; the oneDNN steps are CPU only)."""
    if not triton_available():
        raise ImportError("symtrace.lower.compile: target='cuda' needs triton: pip install triton")
    device = _device_of(example_inputs)
    if device.type == "cpu" and not interpreting():
        raise ValueError("symtrace.lower.compile: target='cuda' got CPU tensors; move the inputs (and the model) "
                         "to the GPU, or set TRITON_INTERPRET=1 before importing triton to run the Triton kernels "
                         "on CPU tensors in the interpreter")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"symtrace.lower.compile: target='cuda' cannot run on {device} tensors")
    if inference is not None:
        import dataclasses
        from .pipeline import prepare, state_check
        try:
            prepared, _ = prepare(gm, dataclasses.replace(inference, onednn_conv=False, onednn_linear=False,
                                                              merge_linears=False, decode_attention=False))
            if prepared is not None:
                lm = TritonLoweredModule(prepared.gm, tuple(example_inputs), "cuda", max_variants, autotune=autotune,
                                         dynamic=dynamic, dynamic_shapes=dynamic_shapes, eager_gm=gm,
                                         pipeline_notes=prepared.notes)
                lm._state_check = state_check(gm, also=prepared.gm)   # (its folded and merged tensors too)
                return lm
        except Exception as e:   # as on the CPU: the graph as written still lowers
            warnings.warn(f"symtrace.lower: the inference pipeline failed ({type(e).__name__}: {e}); "
                          "lowering the graph as written", stacklevel=3)
    return TritonLoweredModule(gm, tuple(example_inputs), "cuda", max_variants, autotune=autotune, dynamic=dynamic,
                               dynamic_shapes=dynamic_shapes)
