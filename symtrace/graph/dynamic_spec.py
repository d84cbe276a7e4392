"""The user's declaration of dynamic dimensions, as ``symbolic_trace``, ``capture`` and
``lower.compile`` accept it (``dynamic_shapes=``), in one normalised form.

Accepted, per input (a dict keyed by argument name, or a tuple/list by position, as
``torch.export``'s ``dynamic_shapes``): ``None`` (all static) or ``{dim_index: d}`` where ``d``
is a :class:`~symtrace.graph.symbols.Dim`, a name (``"seq"`` -> ``Dim("seq")``) or ``True``
(a fresh name). One ``Dim`` object (or one name) used in several places declares those
dimensions equal. :func:`normalize_dynamic_shapes` returns ``{position: {dim: Dim}}``.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

from .symbols import Dim

__all__ = ["normalize_dynamic_shapes", "DynamicShapes"]

DynamicShapes = Dict[int, Dict[int, Dim]]


def normalize_dynamic_shapes(spec: Any, arg_names: Sequence[str],
                             example_inputs: Optional[Sequence[Any]] = None) -> DynamicShapes:
    """``spec`` as ``{input position: {dim index: Dim}}`` (negative dims made positive when
    ``example_inputs`` give the rank); raises ``ValueError`` naming the offending entry."""
    if spec is None:
        return {}
    names = list(arg_names)
    if isinstance(spec, Mapping):
        unknown = [k for k in spec if k not in names]
        if unknown:
            raise ValueError(f"dynamic_shapes names {unknown[0]!r}, which is not an input; "
                             f"the inputs are {', '.join(names) or '(none)'}")
        per_input = {names.index(k): v for k, v in spec.items()}
    elif isinstance(spec, (tuple, list)):
        if len(spec) > len(names):
            raise ValueError(f"dynamic_shapes has {len(spec)} entries but there are only "
                             f"{len(names)} inputs ({', '.join(names)})")
        per_input = dict(enumerate(spec))
    else:
        raise TypeError("dynamic_shapes must be a dict keyed by input name or a tuple by position, "
                        f"got {type(spec).__name__}")
    out: DynamicShapes = {}
    by_name: Dict[str, Dim] = {}
    fresh = 0
    for pos, dims in sorted(per_input.items()):
        if dims is None:
            continue
        where = f"dynamic_shapes[{names[pos]!r}]"
        if not isinstance(dims, Mapping):
            raise TypeError(f"{where} must be None or a dict {{dim index: Dim}}, got {type(dims).__name__}")
        rank = _rank(example_inputs, pos)
        entry: Dict[int, Dim] = {}
        for i, d in dims.items():
            if not isinstance(i, int) or isinstance(i, bool):
                raise TypeError(f"{where}: dimension indices are ints, got {i!r}")
            if rank is not None:
                if not -rank <= i < rank:
                    raise ValueError(f"{where}: dimension {i} is out of range for a tensor of rank {rank}")
                i %= rank
            if d is None:
                continue
            if d is True:
                d = Dim(f"d{fresh}")
                fresh += 1
            elif isinstance(d, str):
                d = by_name.get(d) or Dim(d)
            elif not isinstance(d, Dim):
                raise TypeError(f"{where}[{i}]: expected a Dim, a name or True, got {d!r}")
            seen = by_name.setdefault(d.name, d)
            if seen != d:
                raise ValueError(f"{where}[{i}]: two different Dims are named {d.name!r} ({seen} and {d})")
            size = _size(example_inputs, pos, i)
            if size is not None and not d.min <= size <= d.max:
                raise ValueError(f"{where}[{i}]: the example input has size {size} there, outside {d}")
            entry[i] = d
        if entry:
            out[pos] = entry
    return out


def _rank(example_inputs, pos: int) -> Optional[int]:
    if example_inputs is None or pos >= len(example_inputs):
        return None
    shape = getattr(example_inputs[pos], "shape", None)
    return None if shape is None else len(shape)


def _size(example_inputs, pos: int, dim: int) -> Optional[int]:
    if example_inputs is None or pos >= len(example_inputs):
        return None
    shape = getattr(example_inputs[pos], "shape", None)
    return None if shape is None else int(shape[dim])
