"""A decoder's growing cache appended in place (a step of the inference pipeline, :mod:`.pipeline`).

Hugging Face's ``DynamicCache`` grows each layer's keys and values by one position per decode
step with ``torch.cat([past, new], dim=-2)``, and the step hands the result back to the cache.
The cat copies the whole cache: a step costs O(context) per layer in memory traffic, and at
batch 1 that traffic comes from DRAM (the weights streamed by the step evict it).

:func:`kv_append` rewrites such a cat — two tensors, the result a graph output (the caller keeps
it), the first operand a graph input or an empty tensor — into an :class:`AppendCat` call. Its
result has eager's values, dtype, device and shape; what differs is where they live:

* **Layout.** The result is laid out with the cat dimension outermost in memory (size-1
  dimensions before it stay in front, the others keep their order): ``(1, 8, L, 64)`` has
  strides ``(512 L, 64, 512, 1)``. Appending along that dimension then only writes past the end.
* **Capacity.** Its storage has room for more positions (half as many again, at least 32);
  the next call whose ``past`` is this result writes ``new`` there and returns a longer view of
  the same storage, copying nothing else.

The in-place append is taken when ``past`` (on the CPU) is a view, made by :class:`AppendCat`,
of the whole written prefix of its storage (its length is the storage's high-water mark, so no
view handed out can see the positions written; the positions are reserved under a lock), there
is room, and neither operand requires grad while autograd records. The new positions are
written by a plain memory copy, so no tensor's version counter moves (an earlier step's cache
tensor that autograd saved still reads the same values). Otherwise a fresh storage with
capacity is allocated and both operands copied (``past`` empty, or one of this op's results).
A ``past`` of the caller's in this layout gets the values in this layout with no spare storage
(an ordinary ``cat`` along a leading dimension, where this layout is the contiguous one, gets
eager's result), and a ``past`` in any other layout gets exactly ``torch.cat``; the result's
layout is a function of ``past``'s, as recording requires.

What a user can observe: values are always eager's, but the returned tensors are not
contiguous (``.view`` may refuse where ``reshape`` works), their storage is larger, and
successive results share storage: an in-place write into one step's cache tensor shows in the
prefix of the others (eager's are separate copies; transformers' caches never write into
tensors they concatenated). ``crop``, beam reordering and a retry from an earlier, shorter
cache tensor copy (the high-water mark). Switch: ``InferenceOptions(kv_append=False)``.

:meth:`AppendCat.reserve` is the same op before ``new``'s values exist: it returns the result
with the new positions left for the caller to write (a C entry point that computes ``new``
writes them before anything reads the result: :mod:`.c_calls`).
"""
from __future__ import annotations

import ctypes
import threading
from typing import List, Optional, Sequence, Tuple

import torch

from ..graph import replay
from ..graph.effects import may_alias_inputs, written_inputs
from ..graph.graph_module import GraphModule
from ..graph.node import Node

__all__ = ["AppendCat", "kv_append", "append_layout_strides", "written_in_graph"]

#: spare positions a fresh storage gets: ``max(MIN_SPARE, need // 2)``
MIN_SPARE = 32
#: taken while a call checks a storage's high-water mark and reserves the positions it writes
#: (two threads appending to one cache: the second copies)
_RESERVE = threading.Lock()


class _Tail:
    """What a storage made by :class:`AppendCat` holds (kept on its base tensor): the cat
    dimension, the high-water mark ``end``, the capacity, the other dimensions' sizes, and for
    the fast path (:meth:`AppendCat.__call__`) the newest view handed out (``shape``,
    ``strides``, ``dtype``), the last appended operand's ``new_shape``, and ``new_plain``:
    whether a row-major tensor of that shape is already in the append order (its size > 1
    dimensions in the same order), so a contiguous operand is copied as it is."""

    __slots__ = ("dim", "end", "capacity", "sizes", "front", "shape", "strides", "dtype", "new_shape", "new_plain")

    def __init__(self, dim: int, end: int, capacity: int, sizes: tuple):
        self.dim, self.end, self.capacity, self.sizes = dim, end, capacity, sizes
        self.front = tuple(i for i in range(dim) if sizes[i] == 1)   # (their stride is the whole length's)
        self.shape = self.strides = self.dtype = self.new_shape = None
        self.new_plain = False

    def handed_out(self, shape: Sequence[int], strides: Tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape, self.strides, self.dtype = tuple(shape), strides, dtype

    def appended(self, new: torch.Tensor) -> None:
        self.appended_shape(new.shape)

    def appended_shape(self, shape) -> None:
        if self.new_shape != tuple(shape):
            shape = tuple(shape)
            self.new_shape = shape
            self.new_plain = [i for i in _memory_order(shape, self.dim) if shape[i] != 1] == \
                [i for i in range(len(shape)) if shape[i] != 1]


def _write_past_end(base: torch.Tensor, new: torch.Tensor, offset: int, d: int, plain: bool) -> None:
    """Copy ``new`` into ``base``'s storage from element ``offset`` on, in the append order.
    The new positions are one run of memory past every view handed out, written with a plain
    copy (no tensor op), so no version counter moves: autograd may have saved an earlier step's
    cache tensor, and nothing it can see changes. ``plain``: ``new``'s shape is one whose
    row-major order is the append order, so a contiguous ``new`` is copied as it is."""
    src = new if plain and new.is_contiguous() else new.permute(_memory_order(new.shape, d)).contiguous()
    size = new.element_size()
    ctypes.memmove(base.data_ptr() + offset * size, src.data_ptr(), new.numel() * size)


def _memory_order(shape: Sequence[int], d: int) -> List[int]:
    """Dimensions outermost first: size-1 dimensions before ``d``, ``d``, then the rest in order."""
    front = [i for i in range(d) if shape[i] == 1]
    return front + [d] + [i for i in range(len(shape)) if i != d and i not in front]


def append_layout_strides(shape: Sequence[int], d: int) -> Tuple[int, ...]:
    """The strides of :class:`AppendCat`'s result of ``shape`` appended along ``d`` (dense in
    :func:`_memory_order`; a size-1 dimension's stride as a dense tensor of ``shape`` has it)."""
    strides = [0] * len(shape)
    acc = 1
    for i in reversed(_memory_order(shape, d)):
        strides[i] = acc
        n = shape[i]
        acc = acc * (max(n, 1) if isinstance(n, int) else n)   # (a symbolic size is >= 2)
    return tuple(strides)


class AppendCat:
    """``torch.cat([past, new], dim)`` with the result in the append layout and spare capacity
    behind it (see the module doc)."""

    #: what the report says of its calls (they run as one call, not as generated kernels)
    extern_reason = "symtrace's in-place cache append (one call)"

    def __init__(self, dim: int):
        self.dim = int(dim)
        self.__name__ = "append_cat"

    def _dims(self, past: torch.Tensor, new: torch.Tensor, fake: bool = False) -> Optional[int]:
        """The cat dimension (non-negative) where this op's layout applies, else None."""
        if not fake and type(new) is not torch.Tensor or past.device != new.device or new.is_quantized \
                or new.layout != torch.strided or new.is_conj() or new.is_neg() \
                or torch.is_grad_enabled() and new.requires_grad:
            return None
        return self._reserve_dim(past, tuple(new.shape), new.dtype, exact_type=not fake)

    def __call__(self, past: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        base = past._base if type(past) is torch.Tensor else None
        tail = getattr(base, "_st_tail", None) if base is not None else None
        if tail is not None and type(new) is torch.Tensor:
            out = self._next_step(past, new, base, tail)
            if out is not None:
                return out
        d = self._dims(past, new)
        if d is None:
            return torch.cat([past, new], self.dim)
        if tail is not None:
            out = self._in_place(past, new, d, base, tail)
            if out is not None:
                return out
        # a tensor of someone else's in this layout (a contiguous one where the leading
        # dimensions have size 1, a probe while recording) gets torch.cat's values in this
        # layout, with no spare storage: it is not a cache this op grows
        return self._fresh(past, new, d, spare=tail is not None or past.numel() == 0)

    def _next_step(self, past: torch.Tensor, new: torch.Tensor, base: torch.Tensor, tail: _Tail) -> Optional[torch.Tensor]:
        """The decode step's append with few checks: ``past`` is the newest view this storage
        handed out (same shape, strides, dtype, offset 0), ``new`` has the shape the last append
        had, and the rest of what :meth:`_dims` and :meth:`_in_place` require holds; None where
        anything differs (the general path then decides)."""
        if not new.is_cpu or new.layout is not torch.strided or new.is_conj() or new.is_neg() \
                or torch.is_grad_enabled() and new.requires_grad:
            return None
        got = self._reserve_next(past, new.shape, new.dtype, base, tail)
        if got is None:
            return None
        out, plain = got
        d = tail.dim
        _write_past_end(base, new, past.shape[d] * past.stride(d), d, plain)
        return out

    def _in_place(self, past: torch.Tensor, new: torch.Tensor, d: int, base: torch.Tensor,
                  tail: _Tail) -> Optional[torch.Tensor]:
        n = new.shape[d]
        sizes = tuple(past.shape[:d]) + tuple(past.shape[d + 1:])
        if not past.is_cpu or tail.dim != d or past.storage_offset() != 0 or sizes != tail.sizes:
            return None
        with _RESERVE:
            start = tail.end
            if past.shape[d] != start or start + n > tail.capacity:
                return None
            tail.end = start + n   # (reserved: a concurrent call from the same past now copies)
            shape = list(past.shape)
            shape[d] += n
            strides = append_layout_strides(shape, d)
            tail.handed_out(shape, strides, past.dtype)
            tail.appended(new)
            plain = tail.new_plain
        _write_past_end(base, new, start * strides[d], d, plain)
        return base.as_strided(shape, strides, 0)

    def _fresh(self, past: torch.Tensor, new: torch.Tensor, d: int, spare: bool) -> torch.Tensor:
        out = self._fresh_for(past, new.shape, new.dtype, new.device, d, spare)
        out.narrow(d, out.shape[d] - new.shape[d], new.shape[d]).copy_(new)
        return out

    def reserve(self, past: torch.Tensor, new_shape: Tuple[int, ...], dtype: torch.dtype) -> Optional[torch.Tensor]:
        """What :meth:`__call__` returns for ``past`` and a ``new`` of ``new_shape`` and
        ``dtype`` on ``past``'s device, before ``new``'s values are known: the result in this
        op's layout, ``past``'s positions in place (the same storage where :meth:`__call__` would
        append in place, else a fresh one), and the new positions, from ``past.shape[dim]`` on,
        left for the caller to write before anyone reads the result (a C entry point that
        computes ``new``: :mod:`.c_calls`). None where :meth:`__call__` would not give this
        layout (it returns ``torch.cat``'s result there)."""
        new_shape = tuple(new_shape)
        base = past._base if type(past) is torch.Tensor else None
        tail = getattr(base, "_st_tail", None) if base is not None else None
        if tail is not None:   # (the decode step: past is the newest view handed out, as _next_step checks)
            got = self._reserve_next(past, new_shape, dtype, base, tail)
            if got is not None:
                return got[0]
        d = self._reserve_dim(past, new_shape, dtype)
        if d is None:
            return None
        if past.dim() == 1 and past.numel() == 0:   # (the first step of an empty cache)
            return self._fresh_for(None, new_shape, dtype, past.device, d, spare=True)
        if tail is not None and past.is_cpu and tail.dim == d and past.storage_offset() == 0 \
                and tuple(past.shape[:d]) + tuple(past.shape[d + 1:]) == tail.sizes:
            n = new_shape[d]
            with _RESERVE:
                start = tail.end
                if past.shape[d] == start and start + n <= tail.capacity:
                    tail.end = start + n
                    shape = list(past.shape)
                    shape[d] += n
                    strides = append_layout_strides(shape, d)
                    tail.handed_out(shape, strides, past.dtype)
                    tail.appended_shape(new_shape)
                    return base.as_strided(shape, strides, 0)
        return self._fresh_for(past, new_shape, dtype, past.device, d, spare=tail is not None)

    def _reserve_next(self, past, new_shape, dtype, base, tail) -> Optional[Tuple[torch.Tensor, bool]]:
        """The positions of a ``new`` of ``new_shape`` and ``dtype`` reserved behind ``past``
        when ``past`` is the newest view this storage handed out and ``new`` has the last
        append's shape (:meth:`_next_step`'s checks, on ``past``): ``(result, whether a
        contiguous new is already in the append order)``; None where anything differs."""
        d = tail.dim
        if (past.shape != tail.shape or new_shape != tail.new_shape or self.dim not in (d, d - len(tail.shape))
                or past.stride() != tail.strides or past.dtype is not tail.dtype or dtype is not tail.dtype
                or past.storage_offset() != 0 or not past.is_cpu or past.is_conj() or past.is_neg()
                or torch.is_grad_enabled() and past.requires_grad):
            return None
        # (from the caller's tensor, not from tail: another thread may have moved tail since)
        shape, strides = list(past.shape), list(past.stride())
        start, n = shape[d], new_shape[d]
        shape[d] = start + n
        inner = strides[d]
        for i in tail.front:
            strides[i] = shape[d] * inner
        with _RESERVE:
            if tail.end != start or start + n > tail.capacity:
                return None
            tail.end = start + n
            tail.handed_out(shape, tuple(strides), past.dtype)
            plain = tail.new_plain and tail.new_shape == tuple(new_shape)
        return base.as_strided(shape, strides, 0), plain

    def _reserve_dim(self, past: torch.Tensor, new_shape: Tuple[int, ...], dtype: torch.dtype,
                     exact_type: bool = True) -> Optional[int]:
        """:meth:`_dims` for a ``new`` known by its shape and dtype only (on ``past``'s device,
        a plain strided tensor that does not require grad): what ``past`` must be.
        ``exact_type=False``: fake tensors (metadata) are taken too."""
        if exact_type and type(past) is not torch.Tensor or not new_shape:
            return None
        n = len(new_shape)
        d = self.dim + n if self.dim < 0 else self.dim
        if not 0 <= d < n or past.dtype != dtype or past.is_quantized or past.layout != torch.strided \
                or past.is_conj() or past.is_neg() or torch.is_grad_enabled() and past.requires_grad:
            return None
        if any(n == 0 for n in new_shape):
            return None
        if past.dim() == 1 and past.numel() == 0:
            return d
        if past.dim() != n or tuple(past.shape[:d]) != new_shape[:d] or tuple(past.shape[d + 1:]) != new_shape[d + 1:]:
            return None
        if past.numel() == 0 or past.stride() != append_layout_strides(past.shape, d):
            return None
        return d

    def _fresh_for(self, past: Optional[torch.Tensor], new_shape, dtype, device, d: int, spare: bool) -> torch.Tensor:
        """:meth:`_fresh` before ``new``'s values are known (its positions left unwritten)."""
        kept = past.shape[d] if past is not None and past.dim() == len(new_shape) else 0
        shape = list(new_shape)
        shape[d] = kept + new_shape[d]
        capacity = shape[d] + max(MIN_SPARE, shape[d] // 2) if spare else shape[d]
        order = _memory_order(shape, d)
        base = torch.empty([capacity if i == d else shape[i] for i in order], dtype=dtype, device=device)
        out = base.as_strided(shape, append_layout_strides(shape, d), 0)
        if kept:
            out.narrow(d, 0, kept).copy_(past)
        if spare:
            tail = _Tail(d, shape[d], capacity, tuple(shape[:d]) + tuple(shape[d + 1:]))
            tail.handed_out(shape, out.stride(), out.dtype)
            tail.appended_shape(new_shape)
            base._st_tail = tail
        return out

    def fake_call(self, past: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """The result's metadata on fake tensors (see :mod:`symtrace.graph.symbolic_shapes`)."""
        d = self._dims(past, new, fake=True)
        if d is None:
            return torch.cat([past, new], self.dim)
        shape = list(new.shape)
        shape[d] = (past.shape[d] if past.dim() == new.dim() else 0) + new.shape[d]
        return torch.empty_strided(shape, append_layout_strides(shape, d), dtype=new.dtype, device=new.device)

    def __repr__(self) -> str:
        return f"<append_cat dim={self.dim}>"


def _cat_operands(node: Node) -> Optional[Tuple[Node, Node, int]]:
    """``(past, new, dim)`` of a ``torch.cat([past, new], dim)`` node, else None."""
    if node.op != "call_function" or node.target is not torch.cat:
        return None
    args, kwargs = list(node.args), dict(node.kwargs)
    tensors = args.pop(0) if args else kwargs.pop("tensors", None)
    dim = args.pop(0) if args else kwargs.pop("dim", 0)
    if args or kwargs or not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or type(dim) is not int:
        return None
    if not all(isinstance(t, Node) for t in tensors):
        return None
    return tensors[0], tensors[1], dim


def _empty_or_input(node: Node) -> bool:
    if node.op == "placeholder":
        return True
    meta = node.meta.get("tensor_meta")
    shape = getattr(meta, "shape", None)
    return shape is not None and len(shape) == 1 and shape[0] == 0


def written_in_graph(gm: GraphModule, node: Node) -> bool:
    """Whether the graph may write into ``node``'s result or a view of it (``c.add_(1)``): the
    in-place append would then write into the caller's ``past``."""
    aliases, stack = {node}, [node]
    while stack:
        for user in stack.pop().users:
            if user not in aliases and user.op != "output" and may_alias_inputs(user, gm):
                aliases.add(user)
                stack.append(user)
    return any(w in aliases for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")
               and n.target not in _STORES for w in written_inputs(n, gm))


#: the replay helpers that store a value into Python state (a reference: its memory is not written)
_STORES = frozenset((replay.assign_attribute, replay.assign_global, replay.replace_contents, replay.refill,
                     replay.set_attributes, replay.set_class_attributes, replay.set_cell))


def kv_append(gm: GraphModule) -> List[str]:
    """Rewrite ``gm``'s growing-cache concatenations (see the module doc), in place; the
    names of the rewritten nodes."""
    if gm.meta.get("results_written_in_place"):   # (a region whose caller writes into its results)
        return []
    outputs = set()
    for out in gm.graph.find_nodes(op="output"):
        outputs.update(out.all_input_nodes)
    notes = []
    for node in list(gm.graph.nodes):
        found = _cat_operands(node)
        if found is None or node not in outputs:
            continue
        past, new, dim = found
        if not _empty_or_input(past) or written_in_graph(gm, node):
            continue
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(AppendCat(dim), (past, new))
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        notes.append(node.name)
    return notes
