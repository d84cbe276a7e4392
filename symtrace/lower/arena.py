"""Arena memory shared between intermediate buffers whose lifetimes do not overlap.

The wrapper allocates each ``temp`` buffer once and reuses it on every call (no allocation,
no page faults). :func:`arena_tensors` makes buffers that are never live at the same time
share storage, as a caching allocator would: a model's intermediates then occupy a few
blocks that stay in cache instead of one block per intermediate (a ResNet's activations,
layer after layer).

A buffer is live from the first step that uses it to the last one, through every buffer that
may alias it (torch ops returning views of it: ``Lowering.alias_of``). Two buffers share a
block only when one's last step comes strictly before the other's first, so no kernel or
torch call ever reads and writes the same block through two names. Greedy, in order of first
use: a buffer takes a free block (the smallest large enough, else the largest, which grows)
or a new one. Switch: ``SYMTRACE_ARENA_SHARING=0`` (one block per buffer).
"""
from __future__ import annotations

import os
from typing import Dict, List

import torch

from ..graph.node import map_aggregate
from ..graph.code_text import check_identifier
from ..graph.symbols import SizeExpr, sample
from .ir import Buffer
from .steps import CCallStep, KernelStep
from .values import BufferValue

__all__ = ["arena_tensors", "lifetimes", "plan_blocks", "GrowingArena"]


def _nbytes(buf: Buffer) -> int:
    if any(s == 0 for s in buf.shape):
        return 0
    extent = 1 + sum((n - 1) * s for n, s in zip(buf.shape, buf.strides))
    return extent * torch.empty((), dtype=buf.dtype).element_size()


def lifetimes(lw) -> Dict[int, List[int]]:
    """``id(temp buffer) -> [first step, last step]`` using it or anything that may alias it."""
    temps = [b for b in lw.buffers if b.role == "temp"]
    owner: Dict[int, List[int]] = {}
    for t in temps:
        for other in lw._alias_closure(t):
            owner.setdefault(other, []).append(id(t))
    span: Dict[int, List[int]] = {}

    def mark(buf: Buffer, i: int) -> None:
        for t in owner.get(id(buf), ()):
            s = span.get(t)
            if s is None:
                span[t] = [i, i]
            else:
                s[1] = i
    for i, step in enumerate(lw.steps):
        if isinstance(step, KernelStep):
            for b in step.kernel.buffers():
                mark(b, i)
        elif isinstance(step, CCallStep):
            for b in step.buffers():
                mark(b, i)
        else:
            map_aggregate((step.args, step.kwargs),
                          lambda v: mark(v.buffer, i) if isinstance(v, BufferValue) else None)
            for _, b in step.out_buffers:
                mark(b, i)
    return span


def plan_blocks(lw):
    """``(number of blocks, {id(temp buffer): block})``: the greedy sharing described in the
    module doc. Sizes of a size-generic lowering are compared at a sample size (the choice only
    affects how much memory is shared; lifetimes alone make sharing correct)."""
    temps = [b for b in lw.buffers if b.role == "temp"]
    if os.environ.get("SYMTRACE_ARENA_SHARING", "1") == "0":
        return len(temps), {id(b): k for k, b in enumerate(temps)}
    span = lifetimes(lw)
    order = sorted((b for b in temps if id(b) in span), key=lambda b: span[id(b)][0])
    blocks: List[List[int]] = []          # [bytes, last step of its current buffer]
    where: Dict[int, int] = {}
    for b in order:
        first, last = span[id(b)]
        need = sample(_nbytes(b))
        free = [k for k, blk in enumerate(blocks) if blk[1] < first]
        fits = [k for k in free if blocks[k][0] >= need]
        if fits:
            k = min(fits, key=lambda k: blocks[k][0])
        elif free:
            k = max(free, key=lambda k: blocks[k][0])
        else:
            blocks.append([0, -1])
            k = len(blocks) - 1
        blocks[k][0] = max(blocks[k][0], need)
        blocks[k][1] = last
        where[id(b)] = k
    return len(blocks), where


class GrowingArena:
    """The arena of a size-generic variant: block ``k`` must hold every buffer assigned to it,
    whose byte sizes are expressions of the symbols; :meth:`fit` (once per call, with the
    symbols' values) grows blocks that are too small and returns the blocks' addresses.
    Memory is only ever grown, so a call after a larger one allocates nothing.

    A decoder's step calls with a new size every time (its cache grows by one position), so the
    per-call work is kept small: the blocks' sizes are computed by one generated function of
    the symbols (blocks of fixed size are allocated once), a block that must grow takes
    :data:`GROWTH` times what it needs (a cache growing one position a step reallocates it
    rarely), and :meth:`view` hands out one tensor per (block, shape, strides, dtype) while the
    block stays where it is."""

    #: a block that must grow is allocated this many times its need (at most 1 MiB more)
    GROWTH = 1.25

    def __init__(self, symbols, need, device="cpu"):
        self.symbols = tuple(symbols)
        self.device = device
        self.need = [list(n) for n in need]     # per block: byte sizes (ints or SizeExprs)
        self.blocks = [torch.empty(0, dtype=torch.uint8) for _ in need]
        self.ptrs = [b.data_ptr() for b in self.blocks]
        self._last = None
        self._views: Dict[tuple, torch.Tensor] = {}
        fixed = {k: max([_int(n) for n in sizes] + [1]) for k, sizes in enumerate(self.need)
                 if not any(_symbolic(n) for n in sizes)}
        for k, nbytes in fixed.items():
            self._grow(k, nbytes, exact=True)
        self._growing = [k for k in range(len(self.need)) if k not in fixed]
        self._sizes = _size_function(self.symbols, [self.need[k] for k in self._growing])

    def fit(self, *values) -> List[int]:
        if values == self._last:
            return self.ptrs
        blocks = self.blocks
        for k, nbytes in zip(self._growing, self._sizes(*values)):
            if blocks[k].numel() < nbytes:
                self._grow(k, nbytes)
        self._last = values
        return self.ptrs

    def _grow(self, k: int, nbytes: int, exact: bool = False) -> None:
        if not exact:
            nbytes = min(int(nbytes * self.GROWTH), nbytes + (1 << 20))
        self.blocks[k] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)   # (64-byte aligned)
        self.ptrs[k] = self.blocks[k].data_ptr()
        self._views.clear()

    def tensor(self, k: int, shape, strides, dtype) -> torch.Tensor:
        """Block ``k`` seen as a tensor (for torch calls reading or writing an arena buffer)."""
        t = torch.empty(0, dtype=dtype, device=self.device)
        t.set_(self.blocks[k].untyped_storage(), 0, shape, strides)
        return t

    def view(self, k: int, shape: tuple, strides: tuple, dtype) -> torch.Tensor:
        """:meth:`tensor` for a buffer of fixed shape, made once per block placement and
        inference-mode state (a torch call that changed its shape in place gets a new one)."""
        key = (k, shape, strides, dtype, torch.is_inference_mode_enabled())
        t = self._views.get(key)
        if t is None or t.shape != shape or t.stride() != strides or t.storage_offset():
            t = self._views[key] = self.tensor(k, shape, strides, dtype)
        return t


def _symbolic(n) -> bool:
    return isinstance(n, SizeExpr) and n.constant is None


def _int(n) -> int:
    return n.constant if isinstance(n, SizeExpr) else int(n)


def _size_function(symbols, needs):
    """``f(*symbol values) -> (bytes of each block)``: generated from the blocks' size
    expressions (symbol names are identifiers, the expressions symtrace's own)."""
    terms = []
    for sizes in needs:
        exprs = sorted({str(n) for n in sizes if _symbolic(n)})
        ints = [_int(n) for n in sizes if not _symbolic(n)]
        terms.append("max(" + ", ".join([f"({e})" for e in exprs] + [str(max(ints + [1]))]) + ")")
    for name in symbols:
        check_identifier(name, "a size symbol")
    src = f"def sizes({', '.join(symbols)}):\n    return ({', '.join(terms)}{',' if len(terms) == 1 else ''})\n"
    g: dict = {}
    exec(compile(src, "<symtrace-arena-sizes>", "exec"), g)
    return g["sizes"]


def growing_arena(lw):
    """``(GrowingArena, {id(temp buffer): block})`` for a size-generic lowering."""
    n, where = plan_blocks(lw)
    need: List[list] = [[] for _ in range(n)]
    for b in lw.buffers:
        if b.role == "temp":
            if id(b) not in where:
                where[id(b)] = len(need)
                need.append([])
            need[where[id(b)]].append(_nbytes(b))
    return GrowingArena(lw.symbols, need), where


def arena_tensors(lw) -> Dict[int, torch.Tensor]:
    """``id(temp buffer) -> tensor`` with its shape, strides and dtype, on shared blocks."""
    temps = [b for b in lw.buffers if b.role == "temp"]
    out: Dict[int, torch.Tensor] = {}
    if os.environ.get("SYMTRACE_ARENA_SHARING", "1") == "0":
        for b in temps:
            out[id(b)] = torch.empty_strided(b.shape, b.strides, dtype=b.dtype)
        return out
    n, where = plan_blocks(lw)
    sizes = [0] * n
    for b in temps:
        if id(b) in where:
            sizes[where[id(b)]] = max(sizes[where[id(b)]], _nbytes(b))
    storage = [torch.empty((max(n, 1) + 63) // 64, dtype=torch.float64).view(torch.uint8) for n in sizes]
    for b in temps:
        k = where.get(id(b))
        if k is None:   # (a temp no step uses)
            out[id(b)] = torch.empty_strided(b.shape, b.strides, dtype=b.dtype)
            continue
        t = torch.empty(0, dtype=b.dtype)
        t.set_(storage[k].untyped_storage(), 0, b.shape, b.strides)
        out[id(b)] = t
    return out
