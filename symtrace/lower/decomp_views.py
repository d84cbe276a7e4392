"""View and indexing decomposition rules: permute/transpose, expand, (un)squeeze, reshape,
narrow/select, ``__getitem__`` and split/chunk; and their inverse, ``cat``, which stores each
input into its slice of one result buffer; and constant padding (``F.pad``), which reads its
input through a masked load."""
from __future__ import annotations

import math
import operator
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from ..graph.symbols import SymbolicSizeError, as_expr, bounds, is_symbolic
from .ir import Affine, compute_type
from .values import BufferValue, LValue, Pointwise, broadcast_to, make_view
from .decomp_registry import Unsupported, _arg, _reg, _tensor
from .decomp_pointwise import copy_value


# --------------------------------------------------------------------------- views

def _norm_dim(d: int, n: int) -> int:
    if not isinstance(d, int):
        raise Unsupported(f"dimension {d!r}")
    if n == 0 and d in (0, -1):
        return 0
    if d < -n or d >= n:
        raise Unsupported(f"dimension {d} out of range for rank {n}")
    return d % n


def _view_of(lw, node, a: LValue, shape, index_map) -> LValue:
    return make_view(a, shape, index_map, (node.name,))


def permuted(lw, node, a: LValue, perm) -> LValue:
    """``a.permute(perm)`` as a view (no copy)."""
    inv = [0] * len(perm)
    for i, d in enumerate(perm):
        inv[d] = i
    return _view_of(lw, node, a, tuple(a.shape[d] for d in perm),
                    lambda idx: tuple(idx[inv[k]] for k in range(len(perm))))


@_reg([torch.permute], ["permute"])
def _permute(lw, node, args, kwargs):
    a = _tensor(args[0])
    dims = args[1:] if len(args) > 2 or (len(args) == 2 and isinstance(args[1], int)) else (args[1] if len(args) > 1 else kwargs["dims"])
    return permuted(lw, node, a, [_norm_dim(d, len(a.shape)) for d in dims])


@_reg([torch.transpose, torch.swapaxes, torch.swapdims], ["transpose", "swapaxes", "swapdims"])
def _transpose(lw, node, args, kwargs):
    a = _tensor(args[0])
    n = len(a.shape)
    if n == 0:   # (eager takes dims 0 and -1 of a 0-d tensor: the tensor itself)
        return a
    d0, d1 = _norm_dim(_arg(args, kwargs, 1, "dim0"), n), _norm_dim(_arg(args, kwargs, 2, "dim1"), n)
    perm = list(range(n))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permute(lw, node, (a, *perm), {})


@_reg([torch.t], ["t"])
def _t(lw, node, args, kwargs):
    a = _tensor(args[0])
    if len(a.shape) < 2:
        return a
    return _permute(lw, node, (a, 1, 0), {})


@_reg([], ["expand"])
def _expand(lw, node, args, kwargs):
    a = _tensor(args[0])
    sizes = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else args[1:]
    lead = len(sizes) - len(a.shape)
    shape = tuple(a.shape[k - lead] if s == -1 else s for k, s in enumerate(sizes))
    if tuple(shape) != tuple(lw.shape_of(node)):
        raise Unsupported("expand sizes do not match the recorded shape")
    return broadcast_to(a, shape, (node.name,))


@_reg([], ["expand_as"])
def _expand_as(lw, node, args, kwargs):
    return broadcast_to(_tensor(args[0]), _tensor(args[1]).shape, (node.name,))


@_reg([torch.broadcast_to], [])
def _broadcast_to(lw, node, args, kwargs):
    return broadcast_to(_tensor(args[0]), tuple(lw.shape_of(node)), (node.name,))


@_reg([torch.unsqueeze], ["unsqueeze"])
def _unsqueeze(lw, node, args, kwargs):
    a = _tensor(args[0])
    d = _norm_dim(_arg(args, kwargs, 1, "dim"), len(a.shape) + 1)
    shape = a.shape[:d] + (1,) + a.shape[d:]
    return _view_of(lw, node, a, shape, lambda idx: tuple(idx[:d]) + tuple(idx[d + 1:]))


@_reg([torch.squeeze], ["squeeze"])
def _squeeze(lw, node, args, kwargs):
    a = _tensor(args[0])
    target = tuple(lw.shape_of(node))
    return _reshape_unit_dims(lw, node, a, target)


def _reshape_unit_dims(lw, node, a: LValue, shape) -> Optional[LValue]:
    """A reshape that only adds or removes size-1 dimensions, as an index map."""
    src = [(k, s) for k, s in enumerate(a.shape) if s != 1]
    dst = [(k, s) for k, s in enumerate(shape) if s != 1]
    if [s for _, s in src] != [s for _, s in dst]:
        raise Unsupported("not a size-1 reshape")
    zero = Affine(0)
    pos = {sk: dk for (sk, _), (dk, _) in zip(src, dst)}

    def index_map(idx):
        return tuple(idx[pos[k]] if k in pos else zero for k in range(len(a.shape)))
    return _view_of(lw, node, a, shape, index_map)


def _less(a, b) -> bool:
    """``a < b`` for sizes that may be symbolic (decided over the symbols' whole ranges)."""
    if not is_symbolic(a) and not is_symbolic(b):
        return a < b
    if a == b:
        return False
    lo, hi = bounds(as_expr(b) - a)
    if lo > 0:
        return True
    if hi <= 0:
        return False
    err = SymbolicSizeError(f"cannot decide {a} < {b} for every size")
    err.undecided = as_expr(b) - a   # (> 0 or not: a caller may narrow the symbols' ranges until it is decided)
    raise err


def view_strides_of(shape, strides, new_shape):
    """The strides of ``new_shape`` viewing memory laid out as ``shape``/``strides`` (sizes may
    be symbolic), or None when no view exists: groups of old dims that are contiguous with each
    other are split into new dims of the same total size (the rule ``Tensor.view`` follows)."""
    if not shape:
        return tuple(1 for _ in new_shape)
    out = [0] * len(new_shape)
    vd = len(new_shape) - 1
    base = strides[-1]
    t_numel, v_numel = 1, 1
    for td in range(len(shape) - 1, -1, -1):
        t_numel = t_numel * shape[td]
        if td == 0 or (shape[td - 1] != 1 and strides[td - 1] != t_numel * base):
            while vd >= 0 and (_less(v_numel, t_numel) or new_shape[vd] == 1):
                out[vd] = v_numel * base
                v_numel = v_numel * new_shape[vd]
                vd -= 1
            if v_numel != t_numel:
                return None
            if td > 0:
                base = strides[td - 1]
                t_numel, v_numel = 1, 1
    return tuple(out) if vd == -1 else None


def _meta_view(a: BufferValue, shape):
    if is_symbolic(a.shape) or is_symbolic(a.strides) or is_symbolic(shape):
        if any(n == 0 for n in a.shape):
            raise Unsupported("symbolic view of an empty tensor")
        st = view_strides_of(a.shape, a.strides, shape)
        if st is None:
            raise RuntimeError("not viewable")
        return st
    base = torch.empty(0, dtype=torch.uint8, device="meta").as_strided(a.shape, a.strides, 0)
    return tuple(base.view(shape).stride())


def reshape_value(lw, node, a: LValue, shape) -> LValue:
    shape = tuple(shape)
    if shape == a.shape:
        return a
    try:
        return _reshape_unit_dims(lw, node, a, shape)
    except Unsupported:
        pass
    if not isinstance(a, BufferValue):
        # (a view of a torch call's result plus its bias: the call takes the bias, no copy)
        a = lw._view_over_fold(a) or lw.view_in_memory(a) or lw.materialize(a)
    try:
        st = _meta_view(a, shape)
    except RuntimeError:
        if node.op == "call_method" and node.target == "view":
            raise Unsupported("view of a non-viewable layout")
        a = lw.materialize(copy_value(lw, node, a))
        st = _meta_view(a, shape)
    return BufferValue(a.buffer, shape, st, a.offset, (node.name,))


@_reg([torch.reshape], ["view", "reshape"])
def _reshape(lw, node, args, kwargs):
    a = _tensor(args[0])
    if len(args) > 1 and isinstance(args[1], torch.dtype):
        raise Unsupported("view(dtype)")
    return reshape_value(lw, node, a, lw.shape_of(node))


@_reg([torch.flatten, torch.unflatten], ["flatten", "unflatten"])
def _flatten(lw, node, args, kwargs):
    return reshape_value(lw, node, _tensor(args[0]), lw.shape_of(node))


@_reg([], ["view_as", "reshape_as"])
def _view_as(lw, node, args, kwargs):
    return reshape_value(lw, node, _tensor(args[0]), _tensor(args[1]).shape)


@_reg([torch.narrow], ["narrow"])
def _narrow(lw, node, args, kwargs):
    a = _tensor(args[0])
    d = _norm_dim(_arg(args, kwargs, 1, "dim"), len(a.shape))
    start, length = _arg(args, kwargs, 2, "start"), _arg(args, kwargs, 3, "length")
    if not isinstance(start, int):
        raise Unsupported("narrow with a tensor start")
    start = start % a.shape[d] if start < 0 else start
    return _slice_dim(lw, node, a, d, start, 1, length)


def _slice_dim(lw, node, a, d, start, step, length):
    shape = a.shape[:d] + (length,) + a.shape[d + 1:]

    def index_map(idx):
        return tuple(idx[:d]) + (idx[d].scale(step) + start,) + tuple(idx[d + 1:])
    return _view_of(lw, node, a, shape, index_map)


@_reg([torch.select], ["select"])
def _select(lw, node, args, kwargs):
    a = _tensor(args[0])
    d = _norm_dim(_arg(args, kwargs, 1, "dim"), len(a.shape))
    i = _arg(args, kwargs, 2, "index")
    if not isinstance(i, int):
        raise Unsupported("select with a tensor index")
    i = i % a.shape[d]
    shape = a.shape[:d] + a.shape[d + 1:]
    return _view_of(lw, node, a, shape, lambda idx: tuple(idx[:d]) + (Affine(i),) + tuple(idx[d:]))


@_reg([operator.getitem], ["__getitem__"])
def _getitem(lw, node, args, kwargs):
    a, key = args[0], args[1]
    if isinstance(a, (tuple, list)):
        if isinstance(key, int):
            return a[key]
        raise Unsupported("getitem of a sequence with a non-int key")
    a = _tensor(a)
    if not isinstance(key, tuple):
        key = (key,)
    if any(isinstance(k, (LValue, list)) or (not isinstance(k, (int, slice)) and k is not None and k is not Ellipsis) for k in key):
        raise Unsupported("advanced indexing")
    if any(isinstance(k, slice) and not all(b is None or type(b) is int for b in (k.start, k.stop, k.step))
           for k in key):
        raise Unsupported("a slice bound computed when the graph runs")
    n_real = sum(1 for k in key if k is not None and k is not Ellipsis)
    if Ellipsis in key:
        e = key.index(Ellipsis)
        key = key[:e] + (slice(None),) * (len(a.shape) - n_real) + key[e + 1:]
    key = key + (slice(None),) * (len(a.shape) - sum(1 for k in key if k is not None))
    # build the map: output dims -> input index
    out_shape: List[int] = []
    plan = []  # per input dim: ('int', i) or ('slice', out_pos, start, step)
    for k in key:
        if k is None:
            out_shape.append(1)
            continue
        d = len(plan)
        size = a.shape[d]
        if is_symbolic(size):
            plan.append(_symbolic_key(k, size, len(out_shape)))
            if plan[-1][0] == "slice":
                out_shape.append(size)
            continue
        if isinstance(k, int):
            if not -size <= k < size:
                raise Unsupported("index out of range")
            plan.append(("int", k % size))
        else:
            start, stop, step = k.indices(size)
            if step <= 0:
                raise Unsupported("slice step")
            length = max(0, (stop - start + step - 1) // step)
            plan.append(("slice", len(out_shape), start, step))
            out_shape.append(length)
    if tuple(out_shape) != tuple(lw.shape_of(node)):
        raise Unsupported("indexing result shape differs from the recorded one")

    def index_map(idx):
        out = []
        for p in plan:
            if p[0] == "int":
                out.append(Affine(p[1]))
            else:
                out.append(idx[p[1]].scale(p[3]) + p[2])
        return tuple(out)
    return _view_of(lw, node, a, tuple(out_shape), index_map)


def _symbolic_key(k, size, out_pos):
    """The plan entry of index ``k`` into a dimension of symbolic ``size``: a whole slice, or
    an int that is in range for every size (else the op runs through torch)."""
    lo = bounds(size)[0]
    if isinstance(k, slice):
        if k.step not in (None, 1) or k.start not in (None, 0) or k.stop is not None:
            raise Unsupported("a partial slice of a symbolic dimension")
        return ("slice", out_pos, 0, 1)
    if 0 <= k < lo:
        return ("int", k)
    if -lo <= k < 0:
        return ("int", size + k)
    raise Unsupported("an index that is out of range for some sizes of a symbolic dimension")


def _split_sizes(lw, node):
    metas = lw.meta_of(node)
    if not isinstance(metas, (tuple, list)):
        raise Unsupported("split result was not recorded as a tuple")
    return [m.shape for m in metas]


@_reg([torch.split, torch.chunk, torch.unbind, torch.tensor_split], ["split", "chunk", "unbind", "tensor_split"])
def _split(lw, node, args, kwargs):
    a = _tensor(args[0])
    name = node.target if isinstance(node.target, str) else node.target.__name__
    n = len(a.shape)
    d = _norm_dim(_arg(args, kwargs, 2 if name != "unbind" else 1, "dim", 0), n)
    shapes = _split_sizes(lw, node)
    out = []
    start = 0
    for s in shapes:
        if name == "unbind":
            i = start
            out.append(_view_of(lw, node, a, tuple(s), lambda idx, i=i: tuple(idx[:d]) + (Affine(i),) + tuple(idx[d:])))
            start += 1
        else:
            out.append(_slice_dim(lw, node, a, d, start, 1, s[d]))
            start += s[d]
    return tuple(out)


# --------------------------------------------------------------------------- joins

@_reg([torch.cat, torch.concat, torch.concatenate])
def _cat(lw, node, args, kwargs):
    """``torch.cat``: a kernel per input stores it (computed on the fly: a rotate-half's
    negation, a convolution branch's epilogue) straight into its slice of the result, where
    torch would copy inputs stored first. Static sizes, one dtype (no type promotion), and at
    least one input not yet in memory (else torch's copy is as fast: DenseNet's joins were 5%
    slower as kernels)."""
    if kwargs.get("out") is not None:
        raise Unsupported("cat with out=")
    seq = _arg(args, kwargs, 0, "tensors")
    if not isinstance(seq, (list, tuple)) or not seq:
        raise Unsupported("cat of something other than a list or tuple of tensors")
    parts = [_tensor(t, "a cat input") for t in seq]
    m = lw.meta_of(node)
    shape = tuple(getattr(m, "shape", ()))
    n = len(shape)
    axis = "axis" if node.target is torch.concatenate else "dim"
    d = _norm_dim(_arg(args, kwargs, 1, axis, 0), n)
    if any(type(s) is not int for s in shape):
        raise Unsupported("cat with sizes known only per call")
    # torch skips 1-d empty inputs whatever the rank of the others
    parts = [p for p in parts if not (n != 1 and len(p.shape) == 1 and p.shape[0] == 0)]
    if any(p.dtype != getattr(m, "dtype", None) for p in parts):
        raise Unsupported("cat of tensors of different dtypes (type promotion)")
    if any(len(p.shape) != n or any(p.shape[k] != shape[k] for k in range(n) if k != d) for p in parts) \
            or sum(p.shape[d] for p in parts) != shape[d]:
        raise Unsupported("cat inputs whose shapes do not match the recorded result")
    if not any(p.numel for p in parts):
        raise Unsupported("cat of empty tensors only")
    if all(isinstance(p, BufferValue) for p in parts):
        # nothing to compute on the way: torch's copy (memcpy runs, threads) is as fast or faster
        raise Unsupported("every input is already in memory: torch.cat copies it")
    buf = lw.result_buffer(node)
    offset = 0
    for p in parts:
        if p.numel:
            lw.store(p, BufferValue(buf, p.shape, buf.strides, offset * buf.strides[d]), (node.name,))
        offset += p.shape[d]
    return BufferValue(buf, nodes=(node.name,))


# --------------------------------------------------------------------------- padding

@_reg([F.pad, torch.constant_pad_nd])
def _pad(lw, node, args, kwargs):
    """``F.pad(x, pad, "constant", value)``: each element reads ``x`` at its position minus the
    leading pad of each dimension, through a masked load where that can leave ``x`` (``value``
    there); negative pads crop. ``x`` is stored first if it is not in memory (the masked load
    needs a buffer). Static sizes."""
    a = _tensor(args[0])
    pad = _arg(args, kwargs, 1, "pad")
    mode = _arg(args, kwargs, 2, "mode", "constant") if node.target is F.pad else "constant"
    value = _arg(args, kwargs, 3 if node.target is F.pad else 2, "value", None)
    if mode != "constant":
        raise Unsupported(f"{mode!r} padding")
    n = len(a.shape)
    if not isinstance(pad, (list, tuple)) or len(pad) % 2 or len(pad) // 2 > n \
            or any(type(p) is not int for p in pad):
        raise Unsupported("padding sizes that are not a list of ints (two per dimension)")
    if any(type(s) is not int for s in a.shape):
        raise Unsupported("padding with sizes known only per call")
    ty = compute_type(a.dtype)
    if value is None:
        value = 0
    if type(value) not in (int, float) or (ty not in ("f32", "f64") and not float(value).is_integer()) \
            or (ty == "b" and value not in (0, 1)) or (type(value) is int and abs(value) > 2 ** 53):
        raise Unsupported(f"padding value {value!r} for {a.dtype}")   # (F.pad rounds a large int to a double)
    lead = [0] * n
    shape = list(a.shape)
    for j in range(len(pad) // 2):
        d = n - 1 - j
        lead[d] = pad[2 * j]
        shape[d] += pad[2 * j] + pad[2 * j + 1]
    if tuple(shape) != tuple(lw.shape_of(node)) or min(shape, default=1) < 0:
        raise Unsupported(f"padded shape {tuple(shape)} is not the recorded {tuple(lw.shape_of(node))}")
    if math.prod(shape) == 0 or math.prod(a.shape) == 0:
        raise Unsupported("padding to or from an empty tensor")
    src = a if isinstance(a, BufferValue) else lw.materialize(a)
    # per dimension: whether some output position reads outside x (then it is tested per element)
    masked = [lead[d] > 0 or shape[d] - lead[d] > a.shape[d] for d in range(n)]

    def fn(kb, idx):
        return load_at(kb.eb, src, [idx[d] + (-lead[d]) for d in range(n)], masked, kb.eb.const(value, ty))

    return Pointwise(tuple(shape), a.dtype, fn, [src], (node.name,), 2)


def load_at(eb, src: BufferValue, at: Sequence[Affine], check: Sequence[bool], other):
    """``src``'s element at per-dimension positions ``at`` (affine in the loop variables).
    Where ``check[d]``, position ``d`` may leave ``[0, size)``: the load is masked (``other``
    there) and its safe index reads position 0 of that dimension (padding, pooling windows)."""
    index, safe, mask = Affine(src.offset), Affine(src.offset), None
    for a, stride, size, c in zip(at, src.strides, src.shape, check):
        index = index + a.scale(stride)
        if c:
            test = eb.in_range(a, 0, size)
            mask = test if mask is None else eb.binary("and", mask, test)
        else:
            safe = safe + a.scale(stride)
    return eb.load(src.buffer, index) if mask is None else eb.load(src.buffer, index, mask, other, safe)
