"""Property tests: random torch programs trace faithfully; random graph edits keep graphs valid
and runnable; copies and pickles are faithful.

Programs are small lists of steps over a pool of tensor values (two inputs and one parameter),
with shapes tracked so every step is valid. They run as a Python closure over the pool, so the
tracer sees ordinary Python (list appends and indexing) around the torch calls.
"""
import copy
import operator
import pickle

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

import symtrace
from symtrace import GraphError
from symtrace.graph.effects import is_impure

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SHAPE = (3, 4)
MAX_NUMEL = 256


# --- the program language --------------------------------------------------------------------
def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


UNARY = {
    "relu": lambda a: torch.relu(a),
    "sigmoid": lambda a: torch.sigmoid(a),
    "tanh": lambda a: a.tanh(),
    "neg": lambda a: -a,
    "abs": lambda a: abs(a),
    "sin": lambda a: torch.sin(a),
    "scale": lambda a: a * 2.5,
    "rsub": lambda a: 1 - a,
    "square": lambda a: a ** 2,
    "clamp": lambda a: a.clamp(min=-1.0, max=1.0),
    "softmax": lambda a: a.softmax(dim=-1),
    "gelu": lambda a: torch.nn.functional.gelu(a),
    "exp": lambda a: torch.exp(a.clamp(max=5.0)),
}
BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "maximum": lambda a, b: torch.maximum(a, b),
    "div": lambda a, b: a / (b.abs() + 1),
    "where": lambda a, b: torch.where(a > 0, a, b),
    "gt": lambda a, b: (a > b).float(),
    "le_and": lambda a, b: ((a <= b) & (b > 0.5)).to(torch.float32),
    "eq_where": lambda a, b: torch.where(a == a, b, a),
    "add_scaled": lambda a, b: torch.add(a, b, alpha=0.5),
}


def _step_fn(kind, p):
    """The Python function computing one step (reads pool values, returns a tensor)."""
    if kind in UNARY:
        return UNARY[kind]
    if kind in BINARY:
        return BINARY[kind]
    if kind == "matmul_t":  # a @ b^T over the last two dims
        return lambda a, b: a @ b.transpose(-2, -1)
    if kind == "matmul_tl":  # a^T @ b
        return lambda a, b: torch.matmul(a.transpose(-2, -1), b)
    if kind == "sum":
        return lambda a: a.sum(dim=p["dim"], keepdim=p["keepdim"])
    if kind == "mean":
        return lambda a: torch.mean(a, p["dim"], keepdim=p["keepdim"])
    if kind == "reshape":
        return lambda a: a.reshape(p["shape"])
    if kind == "flatten":
        return lambda a: torch.flatten(a)
    if kind == "transpose":
        return lambda a: a.transpose(0, -1)
    if kind == "permute":
        return lambda a: a.permute(*p["perm"])
    if kind == "T":
        return lambda a: a.T
    if kind == "cat":
        return lambda a, b: torch.cat([a, b], dim=p["dim"])
    if kind == "stack":
        return lambda a, b: torch.stack((a, b), dim=p["dim"])
    if kind == "index0":
        return lambda a: a[0]
    if kind == "slice":
        return lambda a: a[1:]
    if kind == "step_slice":
        return lambda a: a[..., ::2]
    if kind == "newaxis":
        return lambda a: a[:, None]
    if kind == "neg_index":
        return lambda a: a[-1, ...]
    raise AssertionError(kind)


@st.composite
def programs(draw, max_steps=10):
    """A list of (kind, arg indices, params) steps and the indices of the returned values."""
    shapes = [SHAPE, SHAPE, SHAPE]  # x, y, self.w
    steps = []
    n = draw(st.integers(1, max_steps))
    for _ in range(n):
        i = draw(st.integers(0, len(shapes) - 1))
        a = shapes[i]
        same = [j for j, s in enumerate(shapes) if s == a]
        options = ["unary"] * 3 + ["binary"] * 3 + ["reduce", "reshape", "flatten"]
        if len(a) >= 2:
            options += ["matmul", "matmul", "transpose", "permute", "index0", "neg_index"]
        if len(a) == 2:
            options += ["T"]
        if a[0] >= 2:
            options += ["slice"]
        if a[-1] >= 2:
            options += ["step_slice"]
        if len(a) == 2:
            options += ["newaxis"]
        if 2 * _numel(a) <= MAX_NUMEL:
            options += ["cat"]
            if len(a) <= 2:
                options += ["stack"]
        choice = draw(st.sampled_from(options))
        p = {}
        if choice == "unary":
            kind, args, out = draw(st.sampled_from(sorted(UNARY))), (i,), a
        elif choice == "binary":
            kind, args, out = draw(st.sampled_from(sorted(BINARY))), (i, draw(st.sampled_from(same))), a
        elif choice == "matmul":
            j = draw(st.sampled_from(same))
            if draw(st.booleans()):
                kind, out = "matmul_t", a[:-1] + (a[-2],)
            else:
                kind, out = "matmul_tl", a[:-2] + (a[-1], a[-1])
            args = (i, j)
        elif choice == "reduce":
            if len(a) < 2:
                kind, args, out = "relu", (i,), a
                choice = "unary"
            else:
                kind = draw(st.sampled_from(["sum", "mean"]))
                d = draw(st.integers(-len(a), len(a) - 1))
                keep = draw(st.booleans())
                p = {"dim": d, "keepdim": keep}
                dd = d % len(a)
                out = a[:dd] + ((1,) if keep else ()) + a[dd + 1:]
                args = (i,)
        elif choice == "reshape":
            kind, args = "reshape", (i,)
            target = draw(st.sampled_from(["flat", "reversed", "minus1"]))
            if target == "flat":
                p = {"shape": (_numel(a),)}
                out = (_numel(a),)
            elif target == "reversed":
                p = {"shape": tuple(reversed(a))}
                out = tuple(reversed(a))
            else:
                p = {"shape": (-1,) + a[1:] if len(a) >= 2 else (-1,)}
                out = a
        elif choice == "flatten":
            kind, args, out = "flatten", (i,), (_numel(a),)
        elif choice == "transpose":
            kind, args = "transpose", (i,)
            out = (a[-1],) + a[1:-1] + (a[0],)
        elif choice == "permute":
            perm = draw(st.permutations(range(len(a))))
            kind, args, p = "permute", (i,), {"perm": tuple(perm)}
            out = tuple(a[k] for k in perm)
        elif choice == "T":
            kind, args, out = "T", (i,), (a[1], a[0])
        elif choice == "index0":
            kind, args, out = "index0", (i,), a[1:]
        elif choice == "neg_index":
            kind, args, out = "neg_index", (i,), a[1:]
        elif choice == "slice":
            kind, args, out = "slice", (i,), (a[0] - 1,) + a[1:]
        elif choice == "step_slice":
            kind, args, out = "step_slice", (i,), a[:-1] + ((a[-1] + 1) // 2,)
        elif choice == "newaxis":
            kind, args, out = "newaxis", (i,), (a[0], 1) + a[1:]
        elif choice == "cat":
            d = draw(st.integers(0, len(a) - 1))
            kind, args, p = "cat", (i, draw(st.sampled_from(same))), {"dim": d}
            out = a[:d] + (2 * a[d],) + a[d + 1:]
        elif choice == "stack":
            d = draw(st.integers(0, len(a)))
            kind, args, p = "stack", (i, draw(st.sampled_from(same))), {"dim": d}
            out = a[:d] + (2,) + a[d:]
        else:
            raise AssertionError(choice)
        steps.append((kind, args, p))
        shapes.append(out)
    last = len(shapes) - 1
    extra = draw(st.lists(st.integers(0, last), max_size=2))
    outs = tuple([last] + extra)
    return steps, outs, shapes


class Program(nn.Module):
    def __init__(self, steps, outs):
        super().__init__()
        self.w = nn.Parameter(torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)))
        self.fns = [(_step_fn(kind, p), args) for kind, args, p in steps]
        self.outs = outs

    def forward(self, x, y):
        vals = [x, y, self.w]
        for fn, args in self.fns:
            vals.append(fn(*[vals[i] for i in args]))
        return tuple(vals[i] for i in self.outs)


def _inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen)


def _assert_same(got, want):
    assert isinstance(got, tuple) and len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-5, atol=1e-6)


def _describe(steps):
    return "; ".join(f"{k}{list(a)}{p or ''}" for k, a, p in steps)


# --- (1) random programs trace faithfully --------------------------------------------------------
@SETTINGS
@given(prog=programs(), seed=st.integers(0, 2 ** 16), example=st.booleans())
def test_random_programs_replay_like_eager(prog, seed, example):
    steps, outs, shapes = prog
    for kind, _, _ in steps:
        event(kind)
    model = Program(steps, outs)
    ex = _inputs(seed)
    gm = symtrace.symbolic_trace(model, example_inputs=ex if example else None)
    gm.graph.lint()
    fresh = _inputs(seed + 1)
    with torch.no_grad():
        want = model(*fresh)
        got = gm(*fresh)
    assert [tuple(w.shape) for w in want] == [shapes[i] for i in outs], _describe(steps)
    _assert_same(got, want)
    # the graph holds no more call nodes than the program has torch-level steps could make
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert len(calls) <= 6 * len(steps) + 4


@SETTINGS
@given(prog=programs(max_steps=6), seed=st.integers(0, 2 ** 16))
def test_symbolic_and_example_traces_agree(prog, seed):
    steps, outs, _ = prog
    model = Program(steps, outs)
    ex = _inputs(seed)
    sym = symtrace.symbolic_trace(model)
    exm = symtrace.symbolic_trace(model, example_inputs=ex)
    # same computation: same number of nodes of each op (guards aside)
    def ops(g):
        return sorted((n.op, str(n.target)) for n in g.nodes if "guard" not in n.name)

    assert ops(sym.graph) == ops(exm.graph)
    fresh = _inputs(seed + 7)
    _assert_same(sym(*fresh), exm(*fresh))


# --- an interpreter independent of symtrace's code generation -----------------------------------
def _subst(a, env):
    if isinstance(a, symtrace.Node):
        return env[a]
    if type(a) is tuple:
        return tuple(_subst(x, env) for x in a)
    if type(a) is list:
        return [_subst(x, env) for x in a]
    if type(a) is dict:
        return {k: _subst(v, env) for k, v in a.items()}
    if type(a) is slice:
        return slice(_subst(a.start, env), _subst(a.stop, env), _subst(a.step, env))
    return a


def interpret(gm, *inputs):
    env = {}
    it = iter(inputs)
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = next(it)
        elif n.op == "get_attr":
            obj = gm
            for part in n.target.split("."):
                obj = getattr(obj, part)
            env[n] = obj
        elif n.op == "call_function":
            env[n] = n.target(*_subst(n.args, env), **_subst(n.kwargs, env))
        elif n.op == "call_method":
            args = _subst(n.args, env)
            env[n] = getattr(args[0], n.target)(*args[1:], **_subst(n.kwargs, env))
        elif n.op == "call_module":
            env[n] = gm.get_submodule(n.target)(*_subst(n.args, env), **_subst(n.kwargs, env))
        elif n.op == "output":
            return _subst(n.args[0], env)
    return None


# --- (2) random edits keep graphs valid and runnable --------------------------------------------
EDITS = ["insert_relu", "erase_dead", "replace_uses", "move_earlier", "dce", "insert_relu",
         "replace_uses", "move_earlier"]


def _tensor_nodes(g):
    return [n for n in g.nodes if n.op not in ("placeholder", "output")
            and n.tensor_meta is not None]


def _apply_edit(gm, edit, data):
    """Apply one edit; return whether it must leave the graph's outputs unchanged."""
    g = gm.graph
    if edit == "insert_relu":
        cands = _tensor_nodes(g)
        if not cands:
            return True
        n = data.draw(st.sampled_from(cands), label="relu after")
        users_before = set(n.users)
        with g.inserting_after(n):
            r = g.call_function(torch.relu, (n,))
        r.tensor_meta = n.tensor_meta
        changed = n.replace_all_uses_with(r, delete_user_cb=lambda u: u is not r)
        assert set(changed) == users_before
        assert set(r.users) == users_before and list(n.users) == [r]
        assert r.prev is n
        return False
    if edit == "erase_dead":
        dead = [n for n in g.nodes if not n.users and not is_impure(n, gm)]
        if not dead:
            return True
        n = data.draw(st.sampled_from(dead), label="erase")
        inputs = n.all_input_nodes
        g.erase_node(n)
        assert n not in set(g.nodes)
        assert all(n not in i.users for i in inputs)
        return True
    if edit == "replace_uses":
        pos = g.positions()
        cands = [n for n in _tensor_nodes(g) if n.users]
        pairs = [(n, m) for n in cands for m in g.nodes
                 if pos[m] < pos[n] and m.op != "output" and m.tensor_meta is not None
                 and m.tensor_meta.shape == n.tensor_meta.shape
                 and m.tensor_meta.dtype == n.tensor_meta.dtype]
        if not pairs:
            return True
        n, m = data.draw(st.sampled_from(pairs), label="replace")
        users = set(n.users)
        n.replace_all_uses_with(m)
        assert not n.users and users <= set(m.users)
        return False
    if edit == "move_earlier":
        nodes = list(g.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        n_ph = sum(1 for n in nodes if n.op == "placeholder")
        movable = []
        for n in nodes:
            if n.op in ("placeholder", "output"):
                continue
            lo = max([pos[i] + 1 for i in n.all_input_nodes] + [n_ph])
            if lo < pos[n]:
                movable.append((n, lo))
        if not movable:
            return True
        n, lo = data.draw(st.sampled_from(movable), label="move")
        k = data.draw(st.integers(lo, pos[n] - 1), label="to")
        anchor = nodes[k]
        anchor.prepend(n)
        assert n.next is anchor
        return True
    if edit == "dce":
        g.eliminate_dead_code(module=gm)
        return True
    raise AssertionError(edit)


@SETTINGS
@given(prog=programs(max_steps=8), seed=st.integers(0, 2 ** 16),
       edits=st.lists(st.sampled_from(EDITS), min_size=1, max_size=8), data=st.data())
def test_random_edits_keep_graph_valid(prog, seed, edits, data):
    steps, outs, _ = prog
    model = Program(steps, outs)
    ex = _inputs(seed)
    gm = symtrace.symbolic_trace(model, example_inputs=ex)
    fresh = _inputs(seed + 3)
    with torch.no_grad():
        before = gm(*fresh)
        _assert_same(before, model(*fresh))
        _assert_same(interpret(gm, *fresh), before)
        for edit in edits:
            preserving = _apply_edit(gm, edit, data)
            event(f"edit {edit}: {'kept outputs' if preserving else 'changed'}")
            gm.graph.lint()
            got = gm(*fresh)  # lazily recompiled: no explicit recompile()
            _assert_same(got, interpret(gm, *fresh))
            if preserving:
                _assert_same(got, before)
            before = got
        # and the edited module survives copies
        for clone in (copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))):
            assert str(clone.graph) == str(gm.graph)
            clone.graph.lint()
            _assert_same(clone(*fresh), before)


@SETTINGS
@given(prog=programs(max_steps=8), seed=st.integers(0, 2 ** 16), data=st.data())
def test_illegal_move_is_caught_by_lint(prog, seed, data):
    steps, outs, _ = prog
    gm = symtrace.symbolic_trace(Program(steps, outs))
    g = gm.graph
    nodes = list(g.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    cands = [(n, i) for n in nodes if n.op != "output" for i in n.all_input_nodes if i.op != "placeholder"]
    if not cands:
        return
    n, inp = data.draw(st.sampled_from(cands))
    inp.prepend(n)  # n now before one of its inputs
    with pytest.raises(GraphError) as ei:
        g.lint()
    assert repr(n.name) in str(ei.value) or repr(inp.name) in str(ei.value)


# --- (3) copies ------------------------------------------------------------------------------
@SETTINGS
@given(prog=programs(), seed=st.integers(0, 2 ** 16), example=st.booleans())
def test_round_trips_equal(prog, seed, example):
    steps, outs, _ = prog
    model = Program(steps, outs)
    gm = symtrace.symbolic_trace(model, example_inputs=_inputs(seed) if example else None)
    for n in gm.graph.nodes:
        n.meta["tag"] = n.name
    fresh = _inputs(seed + 5)
    with torch.no_grad():
        want = gm(*fresh)
        for clone in (copy.deepcopy(gm), pickle.loads(pickle.dumps(gm)),
                      pickle.loads(pickle.dumps(copy.deepcopy(gm)))):
            assert str(clone.graph) == str(gm.graph)
            assert clone.code == gm.code
            assert [n.meta.get("tag") for n in clone.graph.nodes] == [n.name for n in gm.graph.nodes]
            _assert_same(clone(*fresh), want)
        # a graph pickled on its own rebuilds the same nodes
        g2 = pickle.loads(pickle.dumps(gm.graph))
        assert str(g2) == str(gm.graph)
        g2.lint()
