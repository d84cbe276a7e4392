"""The generated Python that runs a lowered graph: guards, allocation, kernel and torch calls.

The source is meant to be read (``LoweredModule.wrapper_code``)::

    def call(x, y):
        if not (x.shape == _shape0 and x.stride() == _stride0 and x.dtype is torch.float32 ...):
            return _miss(x, y)
        nt = _nthreads()
        buf0 = _empty((4096, 4096), (4096, 1), torch.float32)
        _k0(x.data_ptr(), y.data_ptr(), buf0.data_ptr(), nt)   # k0 (row): softmax
        return buf0

``nt`` is ``torch.get_num_threads()`` at call time: kernels' OpenMP regions use torch's thread
count, on the thread pool torch's own ops use (``docs/lowering.md``). Kernels that follow each
other with no torch call between them run through one C entry point (``pointers=True``):
``_run0(...)`` calls them in order, so the Python-side cost of a call (ctypes, argument
conversion) is paid once per run of kernels, not once per kernel. The runs are listed in
:attr:`WrapperSource.entries` for the C target to generate
(:func:`~symtrace.lower.codegen_c.entry_point`).

Intermediate buffers (role ``temp``) are allocated once, when the module is built, and reused
by every call (the arena): no allocation and no page faults after the first call; buffers
never live at the same time share blocks (:mod:`.arena`), and kernels get their addresses as
constants (``_ptr_buf1``). Buffers a
caller can see are allocated per call; those of at least :data:`HUGE_PAGE_MIN_BYTES` use
``_empty_huge``, which asks Linux for transparent huge pages on the buffer
(``madvise(MADV_HUGEPAGE)`` on its 2 MiB-aligned interior) before the kernel first writes it:
a fresh 64 MiB output then takes 32 page faults instead of 16384 (about 2x faster to fill
when THP is in ``madvise`` mode). The result is an ordinary tensor. Switch it off with
``SYMTRACE_HUGE_PAGES=0`` or ``symtrace.lower.wrapper.HUGE_PAGES = False``; elsewhere than
Linux it does nothing.
"""
from __future__ import annotations

import math
import mmap
import os
import re
import sys
from itertools import groupby
from types import FunctionType
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from ..graph.code_text import attr_access, check_identifier, comment_text, is_identifier
from ..graph.node import importable_name
from ..graph.replay import ROOT_HELPERS
from ..graph.symbols import SizeExpr, bounds, is_symbolic
from ..graph.tree import tree_iter
from ..passes.quant.kernels import woq_linear
from .arena import arena_tensors, growing_arena
from .codegen_c import CCall
from .lowering import ExternStep, KernelStep, Lowering, Runtime
from .steps import CCallStep
from .values import BufferValue
from .woq_cpu import WoqSite

__all__ = ["WrapperSource", "Entry", "generate", "empty_huge", "advise_huge_pages", "HUGE_PAGES", "HUGE_PAGE_MIN_BYTES"]

#: whether large outputs get transparent huge pages (read at each allocation)
HUGE_PAGES = os.environ.get("SYMTRACE_HUGE_PAGES", "1").strip().lower() not in ("0", "false", "no", "off")
#: outputs at least this large (bytes) are allocated by :func:`empty_huge`
HUGE_PAGE_MIN_BYTES = 4 << 20
#: most buffers one C entry point takes (a ctypes function takes at most 1024 arguments)
MAX_ENTRY_ARGS = 200


def _huge_page_size() -> int:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 2 << 20


def _load_madvise():
    """``(madvise, MADV_HUGEPAGE, huge page size)`` from libc, or None where unavailable."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if not sys.platform.startswith("linux") or advice is None:
        return None
    try:
        import ctypes
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn, advice, _huge_page_size()


_madvise: List[Optional[tuple]] = []


def advise_huge_pages(ptr: int, nbytes: int) -> bool:
    """``madvise(MADV_HUGEPAGE)`` on the huge-page-aligned interior of ``[ptr, ptr + nbytes)``;
    False when nothing was advised (no such interior, not Linux, or the kernel refused)."""
    if not _madvise:
        _madvise.append(_load_madvise())
    got = _madvise[0]
    if got is None:
        return False
    fn, advice, page = got
    start = (ptr + page - 1) // page * page
    stop = (ptr + nbytes) // page * page
    return stop > start and fn(start, stop - start, advice) == 0


def empty_huge(shape, strides, dtype) -> torch.Tensor:
    """``torch.empty_strided`` for a large output, with huge pages requested when
    :data:`HUGE_PAGES` is on (see the module doc)."""
    t = torch.empty_strided(shape, strides, dtype=dtype)
    if HUGE_PAGES:
        advise_huge_pages(t.data_ptr(), t.untyped_storage().nbytes())
    return t


#: device type -> its check in the input guards (``x.device`` builds a device object: 10x slower)
_DEVICE_CHECKS = {"cpu": "{}.is_cpu", "cuda": "{}.is_cuda"}


class Entry(NamedTuple):
    """A C entry point that runs kernels in order: ``name(p0, ..., p{nargs-1}, nt)`` calls each
    kernel of ``calls`` (its name, the indices of the parameters it gets) with ``nt``."""

    name: str
    calls: Tuple[Tuple[str, Tuple[int, ...]], ...]
    nargs: int
    symbols: Tuple[str, ...] = ()   # size symbols passed on to the kernels (size-generic variants)


class WrapperSource:
    """The generated ``call`` source and the globals it needs: ``kernel_names`` are the kernels
    the source calls directly (``_k0``), ``entries`` the C entry points it calls (``_run0``)."""

    def __init__(self, source: str, globals_: Dict[str, Any], kernel_names: List[str],
                 entries: Optional[List[Entry]] = None):
        self.source = source
        self.globals = globals_
        self.kernel_names = kernel_names
        self.entries = entries or []


class _Gen:
    def __init__(self, lw: Lowering, device_type: str, pointers: bool):
        self.lw = lw
        self.device_type = device_type
        self.pointers = pointers
        self.g: Dict[str, Any] = {"torch": torch, "_empty": torch.empty_strided, "_empty_huge": empty_huge}
        self.lines: List[str] = []
        self._const_ids: Dict[int, str] = {}
        self.py: Dict[int, str] = {}   # id(buffer) -> python expression of the tensor
        self._allocated: set = set()   # output buffers already allocated
        self.kernel_names: List[str] = []   # kernels called directly
        self.entries: List[Entry] = []   # C entry points running several kernels
        self._addresses: Dict[int, str] = {}   # address -> the global holding it (woq calls)
        self._viewed: set = set()   # ids of a growing arena's buffers given a view per call
        self._sized_reads = _sized_reads(lw)   # ids of buffers read at their recorded sizes

    def const(self, obj: Any, stem: str = "_c") -> str:
        key = id(obj)
        name = self._const_ids.get(key)
        if name is None:
            name = f"{stem}{len(self._const_ids)}"
            self._const_ids[key] = name
            self.g[name] = obj
        return name

    def lit(self, v: Any) -> str:
        if isinstance(v, BufferValue):
            return self.tensor(v)
        if isinstance(v, Runtime):
            return v.name
        if v is None or isinstance(v, (bool, str)) or v is Ellipsis:
            return repr(v)
        if isinstance(v, int):
            return repr(v)
        if isinstance(v, SizeExpr):   # a size of a size-generic variant: bound at entry
            return f"({v})"
        if isinstance(v, float):
            return repr(v) if math.isfinite(v) else f"float({str(v)!r})"
        if isinstance(v, torch.dtype):
            return str(v)
        if isinstance(v, torch.Size):
            return f"torch.Size({self.lit(tuple(v))})"
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            inner = ", ".join(self.lit(x) for x in v)
            return f"({inner},)" if len(v) == 1 else f"({inner})"
        if isinstance(v, list):
            return "[" + ", ".join(self.lit(x) for x in v) + "]"
        if isinstance(v, dict) and all(isinstance(k, str) for k in v):
            return "{" + ", ".join(f"{k!r}: {self.lit(x)}" for k, x in v.items()) + "}"
        if isinstance(v, slice):
            return f"slice({self.lit(v.start)}, {self.lit(v.stop)}, {self.lit(v.step)})"
        return self.const(v)

    def tensor(self, bv: BufferValue) -> str:
        base = self.py[id(bv.buffer)]
        if bv.is_whole():
            return base
        strides = _size1_strides(bv.shape, bv.strides)
        return f"{base}.as_strided({_tup(bv.shape)}, {_tup(strides)}, {base}.storage_offset() + {_py(bv.offset)})"

    def w(self, text: str, depth: int = 1) -> None:
        self.lines.append("    " * depth + text)

    def generate(self) -> WrapperSource:
        lw = self.lw
        params = [name for name, _ in lw.inputs]
        self.lines.append(f"def call({', '.join(params)}):")
        checks = []
        bound: set = set()
        for pos, (name, m) in enumerate(lw.inputs):
            if hasattr(m, "shape"):
                device = _DEVICE_CHECKS.get(self.device_type, "{}.device.type == " + repr(self.device_type))
                binds = ""
                if is_symbolic(m.shape) or is_symbolic(m.stride):
                    # bind each symbol from the first input dimension that is it, in its range
                    binds = f"{name}.dim() == {len(m.shape)} and "
                    for (p, d), s in sorted(lw.dims.items()):
                        if p == pos and s.name not in bound:
                            bound.add(s.name)
                            rng = f"{s.lo} <= ({s.name} := {name}.shape[{d}])" + (f" <= {s.hi}" if s.hi != math.inf else "")
                            binds += rng + " and "
                # (a negative view, torch._neg_view, holds -x in memory: the kernels read memory)
                checks.append(f"isinstance({name}, _Tensor) and {binds}{name}.shape == {_tup(m.shape)} and "
                              f"{name}.stride() == {_tup(m.stride)} and {name}.dtype is {m.dtype} and "
                              + device.format(name) + f" and not {name}.is_neg()")
            else:
                val = m[1] if isinstance(m, tuple) and m and m[0] == "py" else m
                if val is None or isinstance(val, bool):
                    checks.append(f"{name} is {val!r}")
                elif isinstance(val, (int, float, str)):
                    checks.append(f"type({name}) is {type(val).__name__} and {name} == {self.lit(val)}")
                else:
                    checks.append(f"{name} == {self.lit(val)}")
        self.g["_Tensor"] = torch.Tensor
        if checks:
            self.w("if not (" + "\n            and ".join(checks) + "):")
            self.w(f"return _miss({', '.join(params)})", 2)
        if lw.symbols and self.entry_guards:
            self.w(f"_entry_guards({', '.join(params)})")
        self.w("nt = _nthreads()")
        if lw.symbols:   # sizes change between calls: the arena grows to fit (arena.GrowingArena)
            arena_obj, self.block_of = growing_arena(lw)
            arena = {}
            self.g["_arena"] = arena_obj
            if any(b.role == "temp" for b in lw.buffers):
                self.w(f"_blocks = _arena.fit({', '.join(lw.symbols)})")
            extern_reads = self._temps_torch_sees()
            for buf in lw.buffers:
                if buf.role == "temp" and (id(buf) in extern_reads or not self.pointers):
                    self.w(f"_arena_{buf.name} = {self._arena_view(buf)}")
                    self._viewed.add(id(buf))
        else:
            arena = arena_tensors(lw)   # temps whose lifetimes do not overlap share blocks
        for buf in lw.buffers:
            if buf.role == "input":
                self.py[id(buf)] = buf.name
            elif buf.role == "param":
                owner, attr = lw.param_exprs[id(buf)]
                read = attr_access(self.const(owner, '_mod'), attr)
                table = _tensor_table(owner, attr)
                if table is not None:   # (nn.Module.__getattr__ costs a Python frame per read)
                    name, key = self.const(table, "_tab"), self.lit(attr)
                    read = f"{name}[{key}] if {key} in {name} else {read}"
                self.w(f"{buf.name} = {read}")
                self.py[id(buf)] = buf.name
            elif buf.role == "temp":
                if not lw.symbols:
                    self.g[f"_arena_{buf.name}"] = arena[id(buf)]
                self.py[id(buf)] = f"_arena_{buf.name}"
            else:
                self.py[id(buf)] = buf.name
        for is_kernel, steps in groupby(lw.steps, key=lambda step: isinstance(step, (KernelStep, CCallStep))):
            if is_kernel:
                self.kernels([step.kernel if isinstance(step, KernelStep) else step for step in steps])
            else:
                for step in steps:
                    self.extern(step)
        self.w(f"return {self.lit(lw.outputs)}")
        results = {s.result for s in lw.steps if isinstance(s, ExternStep)}
        results |= {e for s in lw.steps if isinstance(s, ExternStep) for e, _ in s.out_buffers}
        _free_dead_results(self.lines, results)
        return WrapperSource("\n".join(self.lines) + "\n", self.g, self.kernel_names, self.entries)

    def kernels(self, kernels: list) -> None:
        """Kernels (and calls into symtrace's other kernels: :class:`CCallStep`) with no torch
        call between them: their outputs are allocated, then one call runs them (a C entry point
        for several kernels or any :class:`CCallStep`, else each kernel's own)."""
        for k in kernels:
            for b in [k.out] if isinstance(k, CCallStep) else [s.buffer for s in k.stores]:
                if b.role == "output" and b.name not in self._allocated:
                    nbytes = _extent_bytes(b)
                    if isinstance(nbytes, SizeExpr):   # decided per call where the range allows both
                        lo, hi = bounds(nbytes)
                        nbytes = lo if lo >= HUGE_PAGE_MIN_BYTES else hi if hi < HUGE_PAGE_MIN_BYTES else None
                    alloc = "_empty_sized" if nbytes is None else "_empty_huge" if nbytes >= HUGE_PAGE_MIN_BYTES else "_empty"
                    self.w(f"{b.name} = {alloc}({_tup(b.shape)}, {_tup(b.strides)}, dtype={b.dtype})")
                    self._allocated.add(b.name)
        if not self.pointers:
            runs = [[k] for k in kernels]
        else:
            runs = _runs(kernels, MAX_ENTRY_ARGS)
        for run in runs:
            if len(run) == 1 and not isinstance(run[0], CCallStep):
                k = run[0]
                self.kernel_names.append(k.name)
                self.w(f"_{k.name}({', '.join([self.arg(b) for b in k.buffers()] + list(self.lw.symbols))}, nt)  "
                       f"# {_describe(k)}")
                continue
            params = _params(run)
            slot = {id(b): i for i, b in enumerate(params)}
            addresses: List[str] = []   # globals holding the C calls' constant addresses

            def param(obj) -> str:   # (a buffer's or a constant address's parameter)
                if isinstance(obj, int):
                    name = self._address(obj)
                    if name not in addresses:
                        addresses.append(name)
                    return f"p{len(params) + addresses.index(name)}"
                return f"p{slot[id(obj)]}"
            calls = []
            for k in run:
                if isinstance(k, CCallStep):
                    self.g[f"_keep_{k.name}"] = k.keep
                    calls.append(CCall(k.kind, k.c_call(param), k.refuses))
                else:
                    calls.append((k.name, tuple(slot[id(b)] for b in k.buffers())))
            entry = Entry(f"run{len(self.entries)}", tuple(calls), len(params) + len(addresses), tuple(self.lw.symbols))
            self.entries.append(entry)
            args = ", ".join([self.arg(b) for b in params] + addresses + list(self.lw.symbols) + ["nt"])
            refusable = [(i, k) for i, k in enumerate(run) if isinstance(k, CCallStep) and k.refuses]
            resumable = any(isinstance(k, CCallStep) for k in run)
            if not refusable:
                self.w(f"_{entry.name}({args}{', 0' if resumable else ''})  # runs, in order:")
                for k in run:
                    self.w(f"#   {_describe(k)}")
                continue
            self.w(f"_e = _{entry.name}({args}, 0)  # runs, in order:")
            for k in run:
                self.w(f"#   {_describe(k)}")
            # a call a kernel refused (integer activations meeting NaN or an infinity, no memory)
            # runs in torch into its output, then the rest of the run (one line: a `del` of a
            # name the call reads goes after it, not inside the loop)
            # (a growing arena's buffers torch does not otherwise see get their views here: the
            # expressions are evaluated only when a call is refused)
            saved = dict(self.py)
            if self.lw.symbols:
                for _, k in refusable:
                    for b in k.buffers():
                        if b.role == "temp" and id(b) not in self._viewed:
                            self.py[id(b)] = self._arena_view(b)
            redo = ", ".join(f"{i + 1}: ({self.py[id(k.out)]}, {self.const(k.extern.target, '_fn')}, "
                             f"{self.lit(tuple(k.extern.args))}, {self.lit(k.extern.kwargs)})" for i, k in refusable)
            self.py = saved
            self.w(f"while _e: _e = _{entry.name}({args}, _in_torch(_e, {{{redo}}}))")

    def _address(self, value: int) -> str:
        """The global holding ``value`` (a C address an entry point takes as a parameter)."""
        name = self._addresses.get(value)
        if name is None:
            name = self._addresses[value] = f"_addr{len(self._addresses)}"
            self.g[name] = value
        return name

    def _arena_view(self, buf) -> str:
        """The expression of a growing arena's tensor view of ``buf``, for this call's sizes."""
        sized = is_symbolic(buf.shape) or is_symbolic(buf.strides)   # (a fixed shape: one view)
        return (f"_arena.{'tensor' if sized else 'view'}({self.block_of[id(buf)]}, {_tup(buf.shape)}, "
                f"{_tup(buf.strides)}, {buf.dtype})")

    def _temps_torch_sees(self) -> set:
        """ids of arena buffers that torch calls read or write (they need tensor views; a C call
        refused and run in torch makes its own, only then: see :meth:`kernels`)."""
        out: set = set()
        for step in self.lw.steps:
            if isinstance(step, ExternStep):
                for v in tree_iter((step.args, step.kwargs)):
                    if isinstance(v, BufferValue) and v.buffer.role == "temp":
                        out.add(id(v.buffer))
                for _, b in step.out_buffers:
                    if b.role == "temp":
                        out.add(id(b))
        return out

    def arg(self, buf) -> str:
        """A kernel argument: the buffer's address (C kernels) or its tensor (Triton)."""
        if not self.pointers:
            return self.py[id(buf)]
        if buf.role == "temp" and self.lw.symbols:   # a growing arena's block
            return f"_blocks[{self.block_of[id(buf)]}]"
        if buf.role == "temp":   # an arena buffer: its address does not change
            name = f"_ptr_{buf.name}"
            self.g.setdefault(name, self.g[self.py[id(buf)]].data_ptr())
            return name
        return f"{self.py[id(buf)]}.data_ptr()"

    _done: set

    def _woq_site(self, step: ExternStep) -> bool:
        """A CPU wrapper's ``woq_linear`` call on the ``"c"`` backend, by position and keyword."""
        return (step.target is woq_linear and self.device_type == "cpu" and len(step.args) == 5
                and step.kwargs.get("backend") == "c"
                and all(is_identifier(k) and (v is None or type(v) in (int, str)) for k, v in step.kwargs.items()))

    def extern(self, step: ExternStep) -> None:
        args = [self.lit(a) for a in step.args]
        odd = [f"{self.lit(k)}: {self.lit(v)}" for k, v in step.kwargs.items() if not is_identifier(k)]
        args += [f"{k}={self.lit(v)}" for k, v in step.kwargs.items() if is_identifier(k)]
        if odd:  # keys that are not identifiers: passed by a dict literal
            args.append("**{" + ", ".join(odd) + "}")
        where = step.node.meta.get("source")
        comment = "  # " + comment_text(f"{step.label or 'torch'}: {step.node.name}" + (f"  ({where})" if where else ""))
        if step.kind == "function" and self._woq_site(step):   # (the weight's plan bound once: woq_cpu.WoqSite)
            call = f"{self.const(WoqSite(**step.kwargs), '_woq')}({', '.join(args[:5])})"
        elif step.kind == "function":
            name = importable_name(step.target)
            fn = name if name and name.split(".")[0] in ("torch", "operator") else self.const(step.target, "_fn")
            if name and name.startswith("operator."):
                self.g["operator"] = __import__("operator")
            if type(step.target) is FunctionType and step.target in ROOT_HELPERS:  # a replayed side effect
                gm = self.const(self.lw.gm, "_mod")
                args = [f"{gm}.guard_root or {gm}"] + args
            call = f"{fn}({', '.join(args)})"
        elif step.kind == "method":
            call = f"{args[0]}.{check_identifier(step.target, 'a method name')}({', '.join(args[1:])})"
        elif step.kind == "module":
            call = f"{self.const(step.target, '_mod')}({', '.join(args)})"
        else:  # attr
            owner, _, attr = step.target.rpartition(".")
            mod = self.lw.gm.get_submodule(owner) if owner else self.lw.gm
            call = attr_access(self.const(mod, '_mod'), attr)
        self.w(f"{step.result} = {call}{comment}")
        for expr_name, buf in step.out_buffers:
            if expr_name != step.result:
                idx = expr_name.rsplit("_", 1)[1]
                self.w(f"{expr_name} = {step.result}[{idx}]")
            if buf.role == "extern":
                # (a result only returned or handed whole to torch calls is used at any size: a
                # user function's `x[x > 0]` stays correct; read by kernels or as a view, its
                # sizes must be the recorded ones)
                fix = "_fix_sized" if self.lw.symbols else "_fix" if id(buf) in self._sized_reads else "_fix_layout"
                self.w(f"{expr_name} = {fix}({expr_name}, {_tup(buf.shape)}, {_tup(buf.strides)})")
            self.py[id(buf)] = expr_name


def _tensor_table(owner: Any, attr: str) -> Optional[dict]:
    """The dict an ``nn.Module`` keeps ``attr`` in (its parameters' or buffers'), read directly
    by the wrapper while it holds the name; None for other owners."""
    cls = type(owner)
    if isinstance(owner, torch.nn.Module) and cls.__getattr__ is torch.nn.Module.__getattr__ \
            and cls.__getattribute__ is object.__getattribute__ and attr not in owner.__dict__ \
            and not hasattr(cls, attr):   # (a class attribute or property of that name would answer first)
        for table in (owner._parameters, owner._buffers):
            if type(table) is dict and attr in table:
                return table
    return None


def _py(x) -> str:
    """A size in the wrapper: an int, or a size expression over the symbols bound at entry."""
    return f"({x})" if isinstance(x, SizeExpr) else repr(x)


def _tup(xs) -> str:
    """A shape or strides tuple in the wrapper (sizes may be expressions)."""
    xs = tuple(xs)
    return "(" + ", ".join(map(_py, xs)) + ("," if len(xs) == 1 else "") + ")"


def _params(kernels) -> list:
    """The buffers ``kernels`` use, each once, in first-use order (an entry point's parameters)."""
    seen: Dict[int, Any] = {}
    for k in kernels:
        for b in k.buffers():
            seen.setdefault(id(b), b)
    return list(seen.values())


def _runs(kernels, max_args: int) -> List[list]:
    """``kernels`` cut, in order, into runs whose entry points take at most ``max_args``
    buffers (a kernel that alone takes more runs by itself)."""
    runs: List[list] = []
    for k in kernels:
        if runs and len(_params(runs[-1] + [k])) <= max_args:
            runs[-1].append(k)
        else:
            runs.append([k])
    return runs


def _describe(k) -> str:
    nodes = ", ".join(k.nodes[:6]) + (" ..." if len(k.nodes) > 6 else "")
    return f"{k.name} ({k.kind}): {nodes}"


def _in_torch(e: int, calls: dict) -> int:
    """Run the call ``calls[e]`` (``(out, function, args, kwargs)``) that a C entry point's
    kernel refused in torch, into ``out``; returns ``e`` (where the entry point goes on)."""
    out, fn, args, kwargs = calls[e]
    out.copy_(fn(*args, **kwargs).reshape(out.shape))
    return e


def _free_dead_results(lines: List[str], names: set) -> None:
    """After the last line that reads a torch call's result, ``del`` it (in place on ``lines``),
    so its memory goes back to the allocator while the call goes on, as in eager, where a
    layer's output is freed once the next layer has read it: the next results then reuse
    memory that is still in cache instead of growing the process's footprint."""
    if not names:
        return
    word = re.compile(r"[A-Za-z_]\w*")
    last: Dict[str, int] = {}
    for i, ln in enumerate(lines):
        code = ln.split("  # ", 1)[0]
        for w in word.findall(code):
            if w in names:
                last[w] = i
    ret = len(lines) - 1
    after: Dict[int, List[str]] = {}
    for name, i in last.items():
        if i != ret:
            after.setdefault(i, []).append(name)
    for i in sorted(after, reverse=True):
        indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
        lines.insert(i + 1, f"{indent}del {', '.join(sorted(after[i]))}")


def _extent_bytes(buf) -> int:
    if any(n == 0 for n in buf.shape):
        return 0
    elems = 1 + sum((n - 1) * (s if isinstance(s, SizeExpr) else abs(s)) for n, s in zip(buf.shape, buf.strides))
    return elems * buf.dtype.itemsize


def _size1_strides(shape, strides):
    """``strides`` where a size-1 dimension has stride 0 (an index map that never moves along
    it) given the stride torch's own views give it (the next dimension's stride times its size;
    1 for the last). It never addresses an element, but torch's overlap checks compare it: an
    ``out=`` tensor and an input viewing the same element with stride 0 there count as a
    partial overlap, which eager's own views of one tensor never are."""
    if not all(type(d) is int for d in tuple(shape) + tuple(strides)):
        return tuple(strides)
    out = list(strides)
    for i in range(len(shape) - 1, -1, -1):
        if shape[i] == 1 and out[i] == 0:
            out[i] = out[i + 1] * max(shape[i + 1], 1) if i + 1 < len(shape) else 1
    return tuple(out)


def _fix(t, shape, strides):
    """Torch ops normally return the layout recorded when lowering; if one does not, copy into
    that layout (kernels index with the recorded strides), on the result's device. Other sizes
    than the recorded ones (a call whose sizes depend on data in a way the lowering did not
    see, such as a user function returning ``x[x > 0]``) raise: the kernels after it were
    built for the recorded sizes."""
    if isinstance(t, torch.Tensor) and t.shape != shape:
        raise RuntimeError(
            f"symtrace.lower: a torch call returned sizes {tuple(t.shape)} where {tuple(shape)} were recorded "
            "when lowering: its sizes depend on the data (not only on the inputs' sizes), which the kernels "
            "after it cannot follow. Run this graph without lowering, or give the call a fixed-size result; "
            "please report the call, so that symtrace can recognise it")
    if isinstance(t, torch.Tensor) and t.stride() != strides and t.numel() and any(
            a != b for a, b, n in zip(t.stride(), strides, t.shape) if n != 1):
        # (only where a stride is used: a copy of a view would miss later writes to its base)
        out = torch.empty_strided(shape, strides, dtype=t.dtype, device=t.device)
        out.copy_(t)
        return out
    return t


def _fix_layout(t, shape, strides):
    """:func:`_fix` for a result that nothing reads at its recorded sizes (only returned, or
    passed whole to torch calls): other sizes are kept as torch gave them."""
    if isinstance(t, torch.Tensor) and t.shape != shape:
        return t
    return _fix(t, shape, strides)


def _sized_reads(lw) -> set:
    """Ids of the buffers something reads at their recorded sizes: kernels and symtrace's C
    calls, and views (``as_strided`` with the recorded shape) given to torch calls or returned."""
    out: set = set()

    def views(value, every: bool) -> None:
        for v in tree_iter(value):
            if isinstance(v, BufferValue) and (every or not v.is_whole()):
                out.add(id(v.buffer))

    for step in lw.steps:
        if isinstance(step, KernelStep):
            out.update(id(b) for b in step.kernel.loaded())
        elif isinstance(step, CCallStep):
            views((step.extern.args, step.extern.kwargs), True)
        elif isinstance(step, ExternStep):
            views((step.args, step.kwargs), False)
    views(lw.outputs, False)
    return out


def _fix_sized(t, shape, strides):
    """:func:`_fix` for a size-generic variant, which also checks the shape a torch call
    returned against the one the lowering derived (a mismatch is a symtrace bug: never used
    silently)."""
    if isinstance(t, torch.Tensor):
        if t.shape != shape:
            raise RuntimeError(f"symtrace.lower: a torch call in a size-generic variant returned shape "
                               f"{tuple(t.shape)}, where {shape} was derived; please report this")
        if t.stride() != strides:
            return _fix(t, shape, strides)
    return t


def _empty_sized(shape, strides, dtype) -> torch.Tensor:
    """A fresh output whose size is known only per call: :func:`empty_huge` when large."""
    t = torch.empty_strided(shape, strides, dtype=dtype)
    if HUGE_PAGES and t.untyped_storage().nbytes() >= HUGE_PAGE_MIN_BYTES:
        advise_huge_pages(t.data_ptr(), t.untyped_storage().nbytes())
    return t


def generate(lw: Lowering, device_type: str = "cpu", pointers: bool = True, entry_guards: bool = False) -> WrapperSource:
    """The wrapper ``call(...)`` for ``lw``: its input guards check ``device_type``; kernels get
    data pointers (the C kernels) or the tensors themselves (``pointers=False``: Triton's
    launchers). A size-generic lowering (``lw.symbols``) binds its symbols from the inputs'
    shapes in the guards, passes them to every kernel, sizes outputs and the arena per call;
    with ``entry_guards`` it calls ``_entry_guards(...)`` (the graph's own guards, which a new
    size may break) after its input guards."""
    gen = _Gen(lw, device_type, pointers)
    gen.entry_guards = entry_guards
    gen._done = set()
    src = gen.generate()
    src.globals.update(_fix=_fix, _fix_layout=_fix_layout, _fix_sized=_fix_sized, _empty_sized=_empty_sized,
                       _in_torch=_in_torch)
    return src
