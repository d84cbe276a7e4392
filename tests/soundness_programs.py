"""The programs of the soundness acceptance suite (tests/test_soundness.py) and the harness
they share: each row of PROGRAMS is one tricky program, the inputs it is traced and replayed
on, an optional state flip, and the tests in which it hits a known symtrace bug.

Kept apart from the tests so that pytest's failure reports (which re-parse the file of every
traceback frame) stay cheap.
"""
from __future__ import annotations

import collections
import copy
import functools
import inspect
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from symtrace import GuardError

PROGRAMS_FILE = os.path.basename(__file__)


# ---------------------------------------------------------------------------------------------
# harness
# ---------------------------------------------------------------------------------------------
class In:
    """One call: positional and keyword arguments."""

    def __init__(self, *args, **kwargs):
        self.args = args
        self.kwargs = kwargs

    def __repr__(self):
        return f"In({len(self.args)} args, {sorted(self.kwargs)})"


# what a state flip must do to the GraphModule from symbolic_trace when applied to it
GUARD, FOLLOW, SKIP = "guard", "follow", "skip"

# the test kinds a case can mark as a known bug: {kind: reason}
UNCHANGED, REPLAY, CAPTURE, SYMBOLIC, EXPLAIN = "unchanged", "replay", "capture", "symbolic", "explain"


@dataclass
class Case:
    name: str
    make: Callable[[], Any]  # a fresh model (nn.Module) or function
    inputs: List[In]  # inputs[0] is the example the traced module is specialised on
    # state change applied after a first round of calls (model.eval(), an attribute, a global);
    # ``unflip`` undoes anything not owned by the module (globals, torch state)
    flip: Optional[Callable[[Any], None]] = None
    unflip: Optional[Callable[[], None]] = None
    # applied to the GraphModule: GUARD (the first input must now raise GuardError, e.g.
    # gm.eval()), FOLLOW (the graph reads the new state, e.g. a leaf submodule's mode), SKIP
    gm_flip: str = GUARD
    replay: Sequence[int] = ()  # inputs that must replay through the traced module without GuardError
    symbolic: str = "any"  # "ok": symbolic trace must replay all inputs; "error": must raise TraceError
    random: bool = False  # results compared under torch.manual_seed, and must vary without it
    stateful: bool = False  # buffers compared with an eager copy after every call
    explain: Optional[str] = None  # marker comment on the line that explain() must name
    bugs: dict = field(default_factory=dict)  # {test kind: "bug: ..."} -> strict xfail

    def __repr__(self):
        return self.name


def _clone(a: Any, memo: Optional[dict] = None) -> Any:
    """Fresh copies of nested inputs; aliasing between tensors is kept."""
    memo = {} if memo is None else memo
    if isinstance(a, torch.Tensor):
        if id(a) not in memo:
            c = a.detach().clone()
            memo[id(a)] = c.requires_grad_(a.requires_grad) if a.is_leaf else c
        return memo[id(a)]
    if isinstance(a, tuple) and hasattr(a, "_fields"):
        return type(a)(*[_clone(x, memo) for x in a])
    if isinstance(a, (tuple, list)):
        return type(a)(_clone(x, memo) for x in a)
    if isinstance(a, dict):
        return {k: _clone(v, memo) for k, v in a.items()}
    return a


def _call(fn, inp: In):
    """Call fn on fresh copies of the inputs; returns (output, the arguments after the call)."""
    args, kwargs = _clone((inp.args, inp.kwargs))
    out = fn(*args, **kwargs)
    return out, (args, kwargs)


def _example(model, inp: In):
    args, kwargs = _clone((inp.args, inp.kwargs))
    if not kwargs:
        return args
    if not args:
        return kwargs
    fwd = model.forward if isinstance(model, nn.Module) else model
    params = list(inspect.signature(fwd).parameters.values())
    d = {p.name: a for p, a in zip(params, args)}
    d.update(kwargs)
    return d


def assert_same(got: Any, ref: Any, path: str = "out") -> None:
    """Exact (NaN-aware) equality of nested outputs, including dtype, shape and requires_grad."""
    if isinstance(ref, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: {type(got).__name__} instead of a tensor"
        torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{path}: {m}")
        assert got.requires_grad == ref.requires_grad, f"{path}: requires_grad {got.requires_grad} != {ref.requires_grad}"
        return
    assert type(got) is type(ref), f"{path}: {type(got).__name__} != {type(ref).__name__}"
    if isinstance(ref, (tuple, list)):
        assert len(got) == len(ref), f"{path}: length {len(got)} != {len(ref)}"
        for i, (g, r_) in enumerate(zip(got, ref)):
            assert_same(g, r_, f"{path}[{i}]")
    elif isinstance(ref, dict):
        assert list(got) == list(ref), f"{path}: keys {list(got)} != {list(ref)}"
        for k in ref:
            assert_same(got[k], ref[k], f"{path}[{k!r}]")
    elif isinstance(ref, float) and math.isnan(ref):
        assert math.isnan(got), path
    else:
        assert got == ref, f"{path}: {got!r} != {ref!r}"


def _state(model) -> dict:
    """Everything tracing must leave alone: tensors bitwise, plain attributes, training flags."""
    if not isinstance(model, nn.Module):
        return {}
    snap = {"sd": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}}
    for mname, m in model.named_modules():
        snap[f"training:{mname}"] = m.training
        for k, v in vars(m).items():
            if not k.startswith("_") and k != "training" and not isinstance(v, (nn.Module, torch.Tensor)):
                snap[f"attr:{mname}.{k}"] = copy.deepcopy(v)
        snap[f"keys:{mname}"] = sorted(vars(m))
        snap[f"hooks:{mname}"] = (len(m._forward_hooks), len(m._forward_pre_hooks))
    return snap


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(-1).view(torch.uint8) if x.numel() else x


def assert_no_proxies(obj: Any, what: str) -> None:
    """No traced value (symtrace's Proxy) left in ``obj``: a model and its modules' attributes,
    or a dict of globals, walked into containers and plain objects a few levels deep."""
    seen, stack = set(), [(obj, "", 0)]
    while stack:
        x, path, depth = stack.pop()
        if id(x) in seen or depth > 5:
            continue
        seen.add(id(x))
        assert type(x).__module__ != "symtrace.proxy", f"{what}: a traced value is left at {path or 'top'}"
        if isinstance(x, nn.Module):
            stack.extend((v, f"{path}.{k}", depth + 1) for k, v in vars(x).items())
        elif isinstance(x, dict):
            stack.extend((v, f"{path}[{k!r}]", depth + 1) for k, v in list(x.items())
                         if not (isinstance(v, type(os)) or isinstance(v, type)))
        elif isinstance(x, (list, tuple, set)):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(x))
        elif hasattr(x, "__dict__") and not isinstance(x, type) and not callable(x):
            stack.extend((v, f"{path}.{k}", depth + 1) for k, v in vars(x).items())


def assert_state_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        if k == "sd":
            assert a[k].keys() == b[k].keys(), f"{what}: state_dict keys changed"
            for name in a[k]:
                x, y = a[k][name], b[k][name]
                assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: {name} changed shape/dtype"
                assert torch.equal(_bits(x), _bits(y)), f"{what}: {name} changed"
        else:
            assert a[k] == b[k], f"{what}: {k} changed from {b[k]!r} to {a[k]!r}"


def _buffers_equal(mod, eager, what: str) -> None:
    """The state of ``mod`` (a model or GraphModule) equals the eager copy's, key by key."""
    if isinstance(mod, nn.Module) and isinstance(eager, nn.Module):
        sd_e = eager.state_dict()
        for k, v in mod.state_dict().items():
            torch.testing.assert_close(v, sd_e[k], rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m, k=k: f"{what}: buffer {k}: {m}")


def _eager_copy(model):
    return copy.deepcopy(model) if isinstance(model, nn.Module) else model


def _resync(mod, eager) -> None:
    """After a GuardError part-way through a graph (documented: earlier in-place buffer
    updates are not undone), put the module back in the eager copy's state."""
    if isinstance(mod, nn.Module) and isinstance(eager, nn.Module):
        sd_e = eager.state_dict()
        with torch.no_grad():
            for k, v in mod.state_dict().items():
                v.copy_(sd_e[k])


def _two_unseeded(fn, inp: In):
    """Two outputs of unseeded calls (retrying calls that a data guard refuses)."""
    outs = []
    for _ in range(40):
        try:
            outs.append(_call(fn, inp)[0])
        except GuardError:
            continue
        if len(outs) == 2:
            return outs
    raise AssertionError("the traced module refused almost every call")


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return _first_tensor(out[0])
    if isinstance(out, dict):
        return _first_tensor(next(iter(out.values())))
    raise AssertionError(type(out))



# ---------------------------------------------------------------------------------------------
# the programs
# ---------------------------------------------------------------------------------------------
def t(*vals, dtype=torch.float32):
    return torch.tensor(vals, dtype=dtype)


def r(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


# --- data-dependent branches and loops ---------------------------------------------------------
class DataBranch(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # DECISION data_branch
            return x * 2
        return x - 1


class WhileNorm(nn.Module):
    def forward(self, x):
        while x.norm() > 1:
            x = x / 2
        return x


class DataAndOr(nn.Module):
    def forward(self, x):
        if x.max() > 0 and x.min() < 0:
            return x.abs()
        return -x


class AnyBranch(nn.Module):
    def forward(self, x):
        if (x > 2).any():
            return x.clamp(max=2)
        return x + 1


class ItemArith(nn.Module):
    def forward(self, x):
        s = x.sum().item()
        return x * s + (s * 2 - 1)


class ItemBranch(nn.Module):
    def forward(self, x):
        s = x.mean().item()
        if s > 0:
            return x - s
        return x + s


class FloatArith(nn.Module):
    def forward(self, x):
        m = float(x.max())
        return x / m


class TolistArith(nn.Module):
    def forward(self, x):
        a, b = x[0].tolist()
        return x * a + b


class TolistLoop(nn.Module):
    def forward(self, x):
        acc = x.new_zeros(())
        for v in x.tolist():
            acc = acc + v * v
        return acc


class ItemFactory(nn.Module):
    def forward(self, x):
        n = int(x.sum().item())
        return torch.arange(n, dtype=torch.float32) * x.mean()


class WhereNoGuard(nn.Module):
    def forward(self, x):
        return torch.where(x > 0, x, x * 0.1) + x.sum()


# --- shape-dependent loops and arithmetic -----------------------------------------------------
class RangeLoop(nn.Module):
    def forward(self, x):
        acc = torch.zeros_like(x[0])
        for i in range(x.shape[0]):
            acc = acc + x[i] * i
        return acc


class ViewStar(nn.Module):
    def forward(self, x):
        return x.view(*x.shape[:-1], 2, -1).sum(-1)


class BTCView(nn.Module):
    def forward(self, x):
        B, T, C = x.shape
        h = x.view(B, T, 2, C // 2).transpose(1, 2)
        return h.reshape(B, T, C) * 2


class SizeHalf(nn.Module):
    def forward(self, x):
        h = x.size(1) // 2
        return x[:, :h] * x[:, h:]


class LenInput(nn.Module):
    def forward(self, x):
        return x * len(x)


class IntSize(nn.Module):
    def forward(self, x):
        n = int(x.size(1))
        return x.sum(1) / n


class Factories(nn.Module):
    def forward(self, x):
        n, m = x.shape
        z = torch.zeros(n, m) + torch.arange(m)
        o = torch.ones(x.shape[0], 3)
        return x + z, o * x.sum(), torch.full((n,), 2.0)


class ShapeBranch(nn.Module):
    def forward(self, x):
        if x.shape[0] > 2:
            return x[:2]
        return x * 3


class ShapeTupleEq(nn.Module):
    def forward(self, x):
        if x.shape == (2, 3):
            return x.t()
        return x.flatten()


class MaxOfShape(nn.Module):
    def forward(self, x):
        k = max(x.shape)
        return x.sum() * k + x.numel()


class HalfSlice(nn.Module):
    def forward(self, x):
        return x[: x.shape[0] // 2] + 1


class NewZeros(nn.Module):
    def forward(self, x):
        return x.new_zeros(x.shape) + x.new_ones(x.size(0), 1)


class AssertShape(nn.Module):
    def forward(self, x):
        assert x.shape[-1] == 4, "last dim must be 4"
        return x.reshape(-1, 2, 2)


# --- dtype / device / ndim --------------------------------------------------------------------
class DtypeBranch(nn.Module):
    def forward(self, x):
        if x.dtype == torch.float16:  # DECISION dtype_branch
            return x.float() * 2
        return x + 1


class NdimBranch(nn.Module):
    def forward(self, x):
        if x.ndim == 3:
            return x.mean(0)
        return x * 2


class IsFloating(nn.Module):
    def forward(self, x):
        if x.is_floating_point():
            return x * 0.5
        return x // 2


class DeviceUse(nn.Module):
    def forward(self, x):
        z = torch.ones(3, device=x.device, dtype=x.dtype)
        if x.device.type == "cpu":
            return x + z
        return x - z


# --- isinstance / None on inputs --------------------------------------------------------------
class IsTensorArg(nn.Module):
    def forward(self, x, y):
        if isinstance(y, torch.Tensor):
            return x + y
        return x * y


class MaskNone(nn.Module):
    def forward(self, x, mask=None):  # DECISION mask_none (`is None` cannot be seen: the guard names the signature)
        if mask is not None:
            x = x.masked_fill(mask, 0.0)
        return x.sum(-1)


class ScaleDefault(nn.Module):
    def forward(self, x, scale=2.0):
        return x * scale


# --- module state: training, plain attributes, globals ----------------------------------------
class TrainingBranch(nn.Module):
    def forward(self, x):
        if self.training:  # DECISION training
            return x * 2
        return x


class FlagAttr(nn.Module):
    def __init__(self):
        super().__init__()
        self.flag = True

    def forward(self, x):
        return x.relu() if self.flag else x.sigmoid()


class ScaleAttr(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = 2.0
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x) * self.scale


class ModeAttr(nn.Module):
    def __init__(self):
        super().__init__()
        self.mode = "relu"

    def forward(self, x):
        return getattr(torch, self.mode)(x)


class _Child(nn.Module):
    def __init__(self):
        super().__init__()
        self.use_bias = True
        self.b = nn.Parameter(torch.tensor([0.5, -0.5, 1.0]))

    def forward(self, x):
        if self.training:
            x = x * 3
        if self.use_bias:
            x = x + self.b
        return x


class NestedState(nn.Module):
    def __init__(self):
        super().__init__()
        self.child = _Child()

    def forward(self, x):
        return self.child(x) + 1


SOUND_SCALE = 2.0
SOUND_ENABLED = True


class GlobalRead(nn.Module):
    def forward(self, x):
        if SOUND_ENABLED:
            return x * SOUND_SCALE
        return x


def _set_globals(scale, enabled):
    global SOUND_SCALE, SOUND_ENABLED
    SOUND_SCALE, SOUND_ENABLED = scale, enabled


def fn_global(x):
    return x * SOUND_SCALE + 1


# --- grad mode --------------------------------------------------------------------------------
class NoGradInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x):
        with torch.no_grad():
            y = x * self.w
        return y + x * self.w, y


class RequiresGradBranch(nn.Module):
    def forward(self, x):
        if x.requires_grad:
            return x * 2
        return x.detach() + 1


# --- __setitem__ -------------------------------------------------------------------------------
class SetItemClone(nn.Module):
    def forward(self, x):
        x = x.clone()
        x[0] = 1.0
        return x * 2


class SetItemMask(nn.Module):
    def forward(self, x):
        y = x.clone()
        y[y < 0] = 0.0
        return y


class SetItemInput(nn.Module):
    def forward(self, x):
        x[:, 0] = x[:, 1]
        return x.sum(0)


# --- varargs / kwargs / containers ------------------------------------------------------------
class VarArgs(nn.Module):
    def forward(self, *xs):
        out = xs[0]
        for t_ in xs[1:]:
            out = out + t_
        return out * len(xs)


class KwArgs(nn.Module):
    def forward(self, x, **kw):
        if "bias" in kw:
            x = x + kw["bias"]
        return x * kw.get("scale", 1.0)


class DictInOut(nn.Module):
    def forward(self, d):
        return {"s": d["a"] + d["b"], "p": d["a"] * d["b"]}


class ListIn(nn.Module):
    def forward(self, xs):
        return torch.stack([x * i for i, x in enumerate(xs)]).sum(0)


Pair = collections.namedtuple("Pair", ["lo", "hi"])


class NamedTupleOut(nn.Module):
    def forward(self, x):
        return Pair(x.min(0).values, x.max(0).values)


class TupleWithInt(nn.Module):
    def forward(self, pair):
        x, k = pair
        return x.roll(k, 0)


# --- buffer mutation --------------------------------------------------------------------------
class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.count += 1
        return x * self.count


class EMA(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(()))

    def forward(self, x):
        self.buf.mul_(0.9).add_(x.mean())
        return x - self.buf


class BufferAssign(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("run", torch.zeros(3))

    def forward(self, x):
        self.run = self.run + x.mean(0)
        return x + self.run


class BatchNormModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):
        return self.bn(x) * 2


# --- random -----------------------------------------------------------------------------------
class RandnAdd(nn.Module):
    def forward(self, x):
        return x + torch.randn(3)


class DropoutFn(nn.Module):
    def forward(self, x):
        return F.dropout(x, 0.5, training=self.training)


class DropoutModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.drop(self.lin(x))


class RandLike(nn.Module):
    def forward(self, x):
        return x * (torch.rand_like(x) > 0.5)


# --- in-place ops on inputs -------------------------------------------------------------------
class IaddInput(nn.Module):
    def forward(self, x):
        x += 1
        return x * 2


class MulInplaceInput(nn.Module):
    def forward(self, x):
        x.mul_(2)
        torch.relu_(x)
        return x.sum()


# --- structure --------------------------------------------------------------------------------
def _logged(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        return fn(self, *args, **kwargs)
    return wrapper


class WrapsForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    @_logged
    def forward(self, x):
        if x.shape[0] > 1:
            return self.lin(x).relu()
        return self.lin(x)


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x) * 2


class SuperForward(_Base):
    def forward(self, x):
        return super().forward(x) + x


class SubmoduleTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(self.lin(x).tanh())


class ModuleListModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(3, 3) for _ in range(3)])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i % 2 == 0:
                x = x.relu()
        return self.layers[-1](x) + self.layers[0](x)


class SequentialSlice(nn.Module):
    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))

    def forward(self, x):
        return self.seq[:2](x).sum(-1, keepdim=True) + self.seq(x)


class ModuleDictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleDict({"a": nn.Linear(3, 1), "b": nn.Linear(3, 2)})

    def forward(self, x):
        return [self.heads[k](x) for k in self.heads]


def fn_data_branch(x, y):
    if (x * y).sum() > 0:
        return x + y
    return x - y


# --- more: Python-level reads the tracer must see ---------------------------------------------
class ContigBranch(nn.Module):
    def forward(self, x):
        if x.is_contiguous():
            return x.view(-1)
        return x.reshape(-1) * 2


class AttentionLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(4, 12)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C)
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        return (att @ v).view(B, T, 2, C // 2).flatten(2)


class GluChunk(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return a * b.sigmoid()


class ListAttr(nn.Module):
    def __init__(self):
        super().__init__()
        self.dims = [0, 1]

    def forward(self, x):
        return x.sum(self.dims)


class NoGradDecorated(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))

    @torch.no_grad()
    def forward(self, x):
        return x * self.w


class StrShapeKey(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleDict({"2": nn.Linear(3, 1), "3": nn.Linear(3, 1)})

    def forward(self, x):
        return self.heads[str(x.shape[0])](x)


class FormatItem(nn.Module):
    def forward(self, x):
        n = x.sum().item()
        return x * float(f"{n:.1f}")


class SetMembership(nn.Module):
    def forward(self, x):
        if x.shape[0] in {2, 4}:
            return x * 2
        return x


class TypeIsTensor(nn.Module):
    def forward(self, x):
        if type(x) is torch.Tensor:
            return x * 2
        return x


class GradEnabledRead(nn.Module):
    def forward(self, x):
        if torch.is_grad_enabled():
            return x * 2
        return x


class DefaultDtypeRead(nn.Module):
    def forward(self, x):
        if torch.get_default_dtype() == torch.float64:
            return x * 2
        return x


class ShapeUnpackReshape(nn.Module):
    def forward(self, x):
        B, T, C = x.shape
        return x.reshape(B * T, -1) + C


class UnpackRows(nn.Module):
    def forward(self, x):
        a, b = x
        return a - b


# --- hooks --------------------------------------------------------------------------------------
def _times2_hook(mod, inp, out):
    return out * 2


def _pre_hook(mod, inp):
    return (inp[0] + 1,)


class LeafHook(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.lin.register_forward_hook(_times2_hook)

    def forward(self, x):
        return self.lin(x)


class LeafPreHook(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.lin.register_forward_pre_hook(_pre_hook)

    def forward(self, x):
        return self.lin(x)


class _Plain(nn.Module):
    def forward(self, x):
        return x + 1


class ChildHook(nn.Module):
    def __init__(self):
        super().__init__()
        self.child = _Plain()
        self.child.register_forward_hook(_times2_hook)

    def forward(self, x):
        return self.child(x)


class RootHook(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_forward_hook(_times2_hook)

    def forward(self, x):
        return x + 1


# --- module state replaced after capture ------------------------------------------------------
class ParamModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x):
        return x * self.w


class TensorAttr(nn.Module):
    def __init__(self):
        super().__init__()
        self.offset = torch.ones(3)

    def forward(self, x):
        return x + self.offset


class SwapAct(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(x) + 1


class CallableAttr(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = torch.relu

    def forward(self, x):
        return self.act(x) + 1


class GrowList(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(3, 3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _append_layer(m):
    torch.default_generator.manual_seed(7)
    m.layers.append(nn.Linear(3, 3))


# --- side effects before a data-dependent decision ----------------------------------------------
class CountThenBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        if x.sum() > 0:
            return x * self.count
        return x - self.count


class IaddThenBranch(nn.Module):
    def forward(self, x):
        x += 1
        if x.sum() > 0:
            return x * 2
        return x


class RandomBranch(nn.Module):
    def forward(self, x):
        if torch.rand(()) > 0.5:
            return x * 2 + torch.randn(3)
        return x + torch.randn(3)


class AliasInplace(nn.Module):
    def forward(self, x, y):
        x.add_(1)
        if y.sum() > 0:
            return y * 2
        return y - 1


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------
def _eval(m):
    m.eval()


def _train(m):
    m.train()


def _setattr(path, value=None, make=None):
    """A flip setting ``path`` to ``value``, or to a fresh ``make()`` for each module flipped."""
    def flip(m):
        obj = m
        *parents, last = path.split(".")
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, last, make() if make is not None else value)
    return flip


def _flip_globals(m):
    _set_globals(3.0, False)


def _flip_global_scale(m):
    _set_globals(5.0, True)


def _unflip_globals():
    _set_globals(2.0, True)


def _no_grad_flip(m):
    torch.set_grad_enabled(False)


def _grad_unflip():
    torch.set_grad_enabled(True)


def _f64_flip(m):
    torch.set_default_dtype(torch.float64)


def _f64_unflip():
    torch.set_default_dtype(torch.float32)


X3 = [r(3, seed=1).abs() + 0.1, r(3, seed=2).abs() + 0.2, -r(3, seed=3).abs() - 0.1]
_ALIAS = t(-0.5, -0.5)

B_FACTORY = ("bug (over-guarding): torch factories with traced sizes (torch.zeros(n, m), torch.ones(T, T)) "
             "specialise the first size: torch's argument parser calls Proxy.__index__ on it, which "
             "Tracer.force guards, so a new batch size/sequence length raises GuardError")
B_VARARGS_MSG = ("bug (minor): the TraceError for forward(self, *xs) without example inputs names no "
                 "file:line (Tracer._make_inputs)")
B_UNPACK_SYM = ("bug: symbolic trace of `a, b = x` / `B, T, C = x.shape` records the items without a "
                "length guard (Tracer.proxy_iter, NO_VALUE branch): an input of another length/rank "
                "gives a value where eager raises ValueError")
B_STR = ("bug: str()/format() of a traced value reads its example value without a guard "
         "(Proxy.__str__/__format__): silent specialisation")
B_TYPE = ("limitation (documented in explain's LIMITS): type(proxy) is Proxy, so `type(x) is torch.Tensor` "
          "takes the other branch; isinstance works")
B_GRAD_READ = ("bug: torch.is_grad_enabled() read in forward is not guarded (only grad-mode switches "
               "are): calling under no_grad silently runs the grad-enabled branch")
B_DTYPE_READ = "bug: torch.get_default_dtype() read in forward is not guarded"
B_LEAF_HOOK = ("bug: hooks of leaf modules run twice: Tracer.call_module records the hook's ops on "
               "proxies and the generated code calls the real module, whose __call__ runs them again")
B_ROOT_HOOK = "bug: hooks registered on the root module are ignored (the tracer calls type(root).forward)"
B_STALE = ("bug: capture keeps the objects the graph was traced with: a buffer/parameter/tensor attribute/"
           "submodule/callable replaced on the model afterwards is not seen (no guard, GraphModule holds "
           "the old references)")
B_CALLABLE = ("by design: a GraphModule keeps the function it recorded (self.act = torch.relu); rebinding "
              "gm.act afterwards does not change the graph. capture guards the live model's attribute")
B_PARTIAL = ("bug: capture re-runs a call whose data guard failed part-way, so side effects before the "
             "guard (buffer updates, in-place input ops, RNG draws) happen twice (Captured.__call__)")
B_ALIAS = ("bug: aliased inputs (m(a, a)) are cloned separately for tracing, so decisions see the wrong "
           "values; the new graph's data guard fails and capture raises GuardError")
B_SYM_GLOBALS = ("bug: symbolic mode does not guard module globals read by forward "
                 "(Tracer._guard_code_globals returns early without example inputs): stale answer")

PROGRAMS: List[Case] = [
    # --- data-dependent branches and loops
    Case("data_branch", DataBranch, [In(X3[0]), In(X3[1]), In(X3[2])], replay=(1,), symbolic="error",
         explain="data_branch"),
    Case("while_norm", WhileNorm, [In(t(3.0, 4.0)), In(t(4.0, 3.0)), In(t(0.1, 0.2)), In(t(30.0, 40.0))],
         replay=(1,), symbolic="error"),
    Case("data_and_or", DataAndOr, [In(t(1.0, -1.0)), In(t(2.0, -3.0)), In(t(1.0, 2.0))], replay=(1,),
         symbolic="error"),
    Case("any_branch", AnyBranch, [In(t(1.0, 3.0)), In(t(5.0, 0.0)), In(t(1.0, 1.0))], replay=(1,),
         symbolic="error"),
    Case("item_arith", ItemArith, [In(t(1.0, 2.0)), In(t(3.0, -1.0)), In(t(0.5, 0.25))], replay=(1, 2)),
    Case("item_branch", ItemBranch, [In(t(1.0, 2.0)), In(t(3.0, 1.0)), In(t(-3.0, 1.0))], replay=(1,),
         symbolic="error"),
    Case("float_arith", FloatArith, [In(t(1.0, 2.0)), In(t(3.0, 4.0)), In(t(-1.0, -2.0))]),
    Case("tolist_arith", TolistArith, [In(t(1.0, 2.0, 3.0, 4.0).view(2, 2)), In(t(1.0, 2.0, 5.0, 6.0).view(2, 2)),
                                       In(t(2.0, 2.0, 3.0, 4.0).view(2, 2))], replay=(1,)),
    Case("tolist_loop", TolistLoop, [In(t(1.0, 2.0)), In(t(3.0, 4.0)), In(t(1.0, 2.0, 3.0))]),
    Case("item_factory", ItemFactory, [In(t(1.0, 2.0)), In(t(2.0, 1.0)), In(t(3.0, 2.0))], replay=(1,)),
    Case("where_no_guard", WhereNoGuard, [In(X3[0]), In(X3[2]), In(r(5, seed=4))], replay=(1,), symbolic="ok"),
    Case("random_branch", RandomBranch, [In(r(3, seed=1)), In(r(3, seed=2))], random=True),
    # --- shape-dependent loops and arithmetic
    Case("range_loop", RangeLoop, [In(r(3, 2, seed=1)), In(r(3, 2, seed=2)), In(r(5, 2, seed=3))], replay=(1,)),
    Case("view_star", ViewStar, [In(r(2, 4, seed=1)), In(r(3, 4, seed=2)), In(r(2, 3, 6, seed=3))], replay=(1,)),
    Case("btc_view", BTCView, [In(r(2, 3, 4, seed=1)), In(r(5, 3, 4, seed=2)), In(r(1, 7, 6, seed=3))],
         replay=(1, 2), symbolic="ok"),
    Case("attention_like", AttentionLike, [In(r(2, 3, 4, seed=1)), In(r(5, 3, 4, seed=2)), In(r(1, 6, 4, seed=3))],
         replay=(1, 2)),
    Case("size_half", SizeHalf, [In(r(2, 4, seed=1)), In(r(3, 4, seed=2)), In(r(2, 6, seed=3))], replay=(1, 2),
         symbolic="ok"),
    Case("glu_chunk", GluChunk, [In(r(2, 4, seed=1)), In(r(5, 4, seed=2)), In(r(2, 6, seed=3))], replay=(1, 2)),
    Case("len_input", LenInput, [In(r(2, 3, seed=1)), In(r(2, 3, seed=2)), In(r(4, 3, seed=3))], replay=(1,)),
    Case("int_size", IntSize, [In(r(2, 4, seed=1)), In(r(3, 4, seed=2)), In(r(2, 5, seed=3))], replay=(1,)),
    Case("factories", Factories, [In(r(2, 3, seed=1)), In(r(2, 3, seed=2)), In(r(4, 5, seed=3))], replay=(1, 2)),
    Case("shape_branch", ShapeBranch, [In(r(4, 2, seed=1)), In(r(3, 2, seed=2)), In(r(2, 2, seed=3))],
         replay=(1,)),
    Case("shape_tuple_eq", ShapeTupleEq, [In(r(2, 3, seed=1)), In(r(2, 3, seed=2)), In(r(3, 2, seed=3))],
         replay=(1,)),
    Case("max_of_shape", MaxOfShape, [In(r(2, 3, seed=1)), In(r(2, 3, seed=2)), In(r(5, 3, seed=3))], replay=(1,)),
    Case("half_slice", HalfSlice, [In(r(4, 2, seed=1)), In(r(6, 2, seed=2)), In(r(5, 2, seed=3))],
         replay=(1, 2), symbolic="ok"),
    Case("new_zeros", NewZeros, [In(r(2, 3, seed=1)), In(r(4, 3, seed=2)), In(r(2, 5, seed=3))], replay=(1, 2)),
    Case("assert_shape", AssertShape, [In(r(2, 4, seed=1)), In(r(3, 4, seed=2)), In(r(2, 3, seed=2))],
         replay=(1,)),
    Case("unpack_rows", UnpackRows, [In(r(2, 3, seed=1)), In(r(2, 3, seed=2)), In(r(3, 3, seed=3))], replay=(1,)),
    Case("shape_unpack_reshape", ShapeUnpackReshape, [In(r(2, 3, 4, seed=1)), In(r(5, 1, 4, seed=2)),
                                                      In(r(2, 3, 4, 2, seed=3))], replay=(1,)),
    Case("str_shape_key", StrShapeKey, [In(r(2, 3, seed=1)), In(r(2, 3, seed=2)), In(r(3, 3, seed=3))],
         replay=(1,)),
    Case("set_membership", SetMembership, [In(r(2, 3, seed=1)), In(r(4, 3, seed=2)), In(r(3, 3, seed=3))],
         ),
    # --- dtype / device / ndim / layout
    Case("dtype_branch", DtypeBranch, [In(r(3, seed=1)), In(r(3, seed=2)), In(r(3, seed=3, dtype=torch.float16)),
                                       In(r(3, seed=4, dtype=torch.float64))],
         replay=(1,), explain="dtype_branch"),
    Case("ndim_branch", NdimBranch, [In(r(2, 3, seed=1)), In(r(2, 3, seed=2)), In(r(2, 2, 3, seed=3))],
         replay=(1,)),
    Case("is_floating", IsFloating, [In(r(3, seed=1)), In(r(3, seed=2)), In(t(3, 5, 8, dtype=torch.long))],
         replay=(1,)),
    Case("device_use", DeviceUse, [In(r(3, seed=1)), In(r(3, seed=2)), In(r(3, seed=3, dtype=torch.float64))],
         replay=(1,)),
    Case("contig_branch", ContigBranch, [In(r(2, 3, seed=1)), In(r(2, 3, seed=2)), In(r(3, 2, seed=3).t())],
         replay=(1,)),
    Case("format_item", FormatItem, [In(t(1.0, 2.0)), In(t(2.0, 2.0))]),
    # --- isinstance / is None / Python values on inputs
    Case("is_tensor_arg", IsTensorArg, [In(r(3, seed=1), r(3, seed=2)), In(r(3, seed=3), r(3, seed=4)),
                                        In(r(3, seed=5), 2.0)], replay=(1,)),
    Case("type_is_tensor", TypeIsTensor, [In(r(3, seed=1)), In(r(3, seed=2))], replay=(1,),
         bugs={REPLAY: B_TYPE, CAPTURE: B_TYPE, SYMBOLIC: B_TYPE}),
    Case("mask_none", MaskNone, [In(r(2, 3, seed=1)), In(r(2, 3, seed=2)),
                                 In(r(2, 3, seed=3), t(1, 0, 1, dtype=torch.bool))], replay=(1,),
         explain="mask_none"),
    Case("mask_given", MaskNone, [In(r(2, 3, seed=3), t(1, 0, 1, dtype=torch.bool)),
                                  In(r(2, 3, seed=4), t(0, 0, 1, dtype=torch.bool)), In(r(2, 3, seed=1))],
         replay=(1,)),
    Case("scale_default", ScaleDefault, [In(r(3, seed=1)), In(r(3, seed=2)), In(r(3, seed=2), scale=3.0),
                                         In(r(3, seed=2), 3)], replay=(1,)),
    # --- module state: training flag, plain attributes, globals
    Case("training_branch", TrainingBranch, [In(r(3, seed=1)), In(r(3, seed=2))], flip=_eval, replay=(1,),
         explain="training"),
    Case("eval_then_train", lambda: TrainingBranch().eval(), [In(r(3, seed=1)), In(r(3, seed=2))], flip=_train,
         replay=(1,)),
    Case("flag_attr", FlagAttr, [In(r(3, seed=1)), In(r(3, seed=2))], flip=_setattr("flag", False), replay=(1,)),
    Case("scale_attr", ScaleAttr, [In(r(2, 3, seed=1)), In(r(4, 3, seed=2))], flip=_setattr("scale", 3.0),
         replay=(1,)),
    Case("mode_attr", ModeAttr, [In(r(3, seed=1)), In(r(3, seed=2))], flip=_setattr("mode", "tanh"), replay=(1,)),
    Case("list_attr", ListAttr, [In(r(2, 3, seed=1)), In(r(2, 3, seed=2))], flip=_setattr("dims", make=lambda: [1]),
         replay=(1,)),
    Case("nested_training", NestedState, [In(r(3, seed=1)), In(r(3, seed=2))], flip=_eval, replay=(1,)),
    Case("nested_attr", NestedState, [In(r(3, seed=1)), In(r(3, seed=2))], flip=_setattr("child.use_bias", False),
         replay=(1,)),
    Case("global_read", GlobalRead, [In(r(3, seed=1)), In(r(3, seed=2))], flip=_flip_globals,
         unflip=_unflip_globals, replay=(1,)),
    Case("fn_global", lambda: fn_global, [In(r(3, seed=1)), In(r(3, seed=2))], flip=_flip_global_scale,
         unflip=_unflip_globals, replay=(1,)),
    # --- grad mode
    Case("no_grad_inside", NoGradInside, [In(r(3, seed=1).requires_grad_()), In(r(3, seed=2).requires_grad_()),
                                          In(r(3, seed=3))], replay=(1, 2), flip=_no_grad_flip, unflip=_grad_unflip,
         gm_flip=FOLLOW),  # the graph restores whatever grad mode it is called in
    Case("no_grad_decorated", NoGradDecorated, [In(r(3, seed=1).requires_grad_()), In(r(3, seed=2))],
         replay=(1,), symbolic="ok"),
    Case("requires_grad_branch", RequiresGradBranch, [In(r(3, seed=1).requires_grad_()),
                                                      In(r(3, seed=2).requires_grad_()), In(r(3, seed=3))],
         replay=(1,)),
    Case("grad_enabled_read", GradEnabledRead, [In(r(3, seed=1)), In(r(3, seed=2))], replay=(1,),
         flip=_no_grad_flip, unflip=_grad_unflip),
    Case("default_dtype_read", DefaultDtypeRead, [In(r(3, seed=1)), In(r(3, seed=2))], replay=(1,),
         flip=_f64_flip, unflip=_f64_unflip),
    # --- __setitem__
    Case("setitem_clone", SetItemClone, [In(r(3, seed=1)), In(r(3, seed=2))], replay=(1,), symbolic="ok"),
    Case("setitem_mask", SetItemMask, [In(r(5, seed=1)), In(r(5, seed=2)), In(r(7, seed=3))], replay=(1,),
         symbolic="ok"),
    Case("setitem_input", SetItemInput, [In(r(2, 3, seed=1)), In(r(2, 3, seed=2))], replay=(1,), symbolic="ok"),
    # --- varargs / kwargs / containers
    Case("varargs", VarArgs, [In(r(3, seed=1), r(3, seed=2)), In(r(3, seed=3), r(3, seed=4)),
                              In(r(3, seed=5), r(3, seed=6), r(3, seed=7)), In(r(3, seed=8))], replay=(1,)),
    Case("kwargs", KwArgs, [In(r(3, seed=1), bias=r(3, seed=2)), In(r(3, seed=3), bias=r(3, seed=4)),
                            In(r(3, seed=5)), In(r(3, seed=6), bias=r(3, seed=7), scale=2.0)], replay=(1,)),
    Case("dict_in_out", DictInOut, [In({"a": r(3, seed=1), "b": r(3, seed=2)}), In({"a": r(3, seed=3), "b": r(3, seed=4)}),
                                    In({"b": r(3, seed=3), "a": r(3, seed=4)})], replay=(1,)),
    Case("list_in", ListIn, [In([r(3, seed=1), r(3, seed=2)]), In([r(3, seed=3), r(3, seed=4)]),
                             In([r(3, seed=5), r(3, seed=6), r(3, seed=7)]), In((r(3, seed=1), r(3, seed=2)))],
         replay=(1,)),
    Case("namedtuple_out", NamedTupleOut, [In(r(3, 2, seed=1)), In(r(5, 2, seed=2))], replay=(1,), symbolic="ok"),
    Case("tuple_with_int", TupleWithInt, [In((r(4, seed=1), 1)), In((r(4, seed=2), 1)), In((r(4, seed=3), 2))],
         replay=(1,)),
    # --- buffer mutation
    Case("counter", Counter, [In(r(3, seed=1)), In(r(3, seed=2)), In(r(3, seed=3))], replay=(1, 2),
         stateful=True, symbolic="ok"),
    Case("ema", EMA, [In(r(3, seed=1)), In(r(3, seed=2)), In(r(4, seed=3))], replay=(1, 2), stateful=True,
         symbolic="ok"),
    Case("buffer_assign", BufferAssign, [In(r(2, 3, seed=1)), In(r(2, 3, seed=2)), In(r(5, 3, seed=3))],
         replay=(1, 2), stateful=True, symbolic="ok"),
    Case("batchnorm_train", BatchNormModel, [In(r(4, 3, seed=1)), In(r(4, 3, seed=2)), In(r(6, 3, seed=3))],
         flip=_eval, replay=(1, 2), stateful=True, gm_flip=FOLLOW),
    Case("batchnorm_eval", lambda: BatchNormModel().eval(), [In(r(4, 3, seed=1)), In(r(6, 3, seed=3))],
         flip=_train, replay=(1,), stateful=True, gm_flip=FOLLOW, symbolic="ok"),
    Case("count_then_branch", CountThenBranch, [In(t(1.0, 2.0)), In(t(3.0, 1.0)), In(t(-3.0, 1.0)), In(t(1.0, 1.0))],
         replay=(1,), stateful=True),
    # --- random
    Case("randn_add", RandnAdd, [In(r(3, seed=1)), In(r(3, seed=2))], random=True, replay=(1,), symbolic="ok"),
    Case("dropout_fn", DropoutFn, [In(r(8, seed=1)), In(r(8, seed=2))], random=True, flip=_eval, replay=(1,)),
    Case("dropout_module", DropoutModule, [In(r(2, 4, seed=1)), In(r(3, 4, seed=2))], random=True, flip=_eval,
         replay=(1,), gm_flip=FOLLOW, symbolic="ok"),
    Case("rand_like", RandLike, [In(r(8, seed=1)), In(r(8, seed=2))], random=True, replay=(1,), symbolic="ok"),
    # --- in-place ops on inputs
    Case("iadd_input", IaddInput, [In(r(3, seed=1)), In(r(3, seed=2))], replay=(1,), symbolic="ok"),
    Case("mul_inplace_input", MulInplaceInput, [In(r(4, seed=1)), In(r(4, seed=2))], replay=(1,), symbolic="ok"),
    Case("iadd_then_branch", IaddThenBranch, [In(t(1.0, 2.0)), In(t(2.0, 2.0)), In(t(-3.0, -3.0))], replay=(1,)),
    Case("alias_inplace", AliasInplace, [In(_ALIAS, _ALIAS), In(t(1.0, 1.0), t(-2.0, -2.0))]),
    # --- hooks
    Case("leaf_hook", LeafHook, [In(r(2, 3, seed=1)), In(r(2, 3, seed=2))], replay=(1,)),
    Case("leaf_pre_hook", LeafPreHook, [In(r(2, 3, seed=1)), In(r(2, 3, seed=2))], replay=(1,)),
    Case("child_hook", ChildHook, [In(r(2, 3, seed=1)), In(r(2, 3, seed=2))], replay=(1,), symbolic="ok"),
    Case("root_hook", RootHook, [In(r(2, 3, seed=1)), In(r(2, 3, seed=2))], replay=(1,)),
    # --- module state replaced after tracing (capture must follow the model)
    Case("param_replaced", ParamModel, [In(r(3, seed=1)), In(r(3, seed=2))], replay=(1,), gm_flip=FOLLOW,
         flip=_setattr("w", make=lambda: nn.Parameter(torch.tensor([2.0, 2.0, 2.0])))),
    Case("buffer_replaced", EMA, [In(r(3, seed=1)), In(r(3, seed=2))], replay=(1,), stateful=True, gm_flip=FOLLOW,
         flip=_setattr("buf", make=lambda: torch.tensor(5.0))),
    Case("tensor_attr_replaced", TensorAttr, [In(r(3, seed=1)), In(r(3, seed=2))], replay=(1,), gm_flip=FOLLOW,
         flip=_setattr("offset", make=lambda: torch.zeros(3))),
    Case("submodule_swapped", SwapAct, [In(r(3, seed=1)), In(r(3, seed=2))], replay=(1,), gm_flip=FOLLOW,
         flip=_setattr("act", make=nn.Tanh), symbolic="ok"),
    Case("module_list_grown", GrowList, [In(r(2, 3, seed=1)), In(r(2, 3, seed=2))], replay=(1,), gm_flip=SKIP,
         flip=_append_layer, symbolic="ok"),
    Case("callable_attr", CallableAttr, [In(r(3, seed=1)), In(r(3, seed=2))], replay=(1,),
         flip=_setattr("act", torch.tanh), bugs={REPLAY: B_CALLABLE, SYMBOLIC: B_CALLABLE}),
    # --- structure
    Case("wraps_forward", WrapsForward, [In(r(2, 3, seed=1)), In(r(4, 3, seed=2)), In(r(1, 3, seed=3))],
         replay=(1,)),
    Case("super_forward", SuperForward, [In(r(2, 3, seed=1)), In(r(4, 3, seed=2))], replay=(1,), symbolic="ok"),
    Case("submodule_twice", SubmoduleTwice, [In(r(2, 3, seed=1)), In(r(4, 3, seed=2))], replay=(1,),
         symbolic="ok"),
    Case("module_list", ModuleListModel, [In(r(2, 3, seed=1)), In(r(4, 3, seed=2))], replay=(1,), symbolic="ok"),
    Case("sequential_slice", SequentialSlice, [In(r(2, 3, seed=1)), In(r(4, 3, seed=2))], replay=(1,),
         symbolic="ok"),
    Case("module_dict", ModuleDictModel, [In(r(2, 3, seed=1)), In(r(4, 3, seed=2))], replay=(1,), symbolic="ok"),
    Case("fn_data_branch", lambda: fn_data_branch, [In(t(1.0, 2.0), t(1.0, 1.0)), In(t(3.0, 2.0), t(1.0, 1.0)),
                                                    In(t(1.0, 2.0), t(-1.0, -1.0))], replay=(1,), symbolic="error"),
]

assert len({c.name for c in PROGRAMS}) == len(PROGRAMS)
