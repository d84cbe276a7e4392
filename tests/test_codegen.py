"""Behaviour tests for code generation: comments, dels, lazy recompile, literals, names."""
import inspect
import math
import operator
import os
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import symtrace
from symtrace import Graph, GraphModule

HERE = os.path.basename(__file__)


def _line_of(fn, text):
    """The absolute line number of the first line of ``fn`` containing ``text``."""
    lines, start = inspect.getsourcelines(fn)
    for i, line in enumerate(lines):
        if text in line:
            return start + i
    raise AssertionError(text)


def _body(code):
    """Generated statements, without comments and the entry-guard prologue."""
    out = []
    for line in code.splitlines()[1:]:
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        out.append(s)
    if "_ok = " in code:
        i = max(k for k, s in enumerate(out) if s.startswith("_raise_guard"))
        out = out[i + 1:]
    return out


def user_fn(x, y):
    a = x + y
    b = torch.relu(a)
    c = b * a
    return c.sum(dim=0)


# --- comments and dels ----------------------------------------------------------------------
@pytest.mark.parametrize("example", [False, True])
def test_code_has_user_line_comments(example):
    args = (torch.randn(3, 2), torch.randn(3, 2))
    gm = symtrace.symbolic_trace(user_fn, example_inputs=args if example else None)
    code = gm.code
    for text in ("a = x + y", "b = torch.relu(a)", "c = b * a", "return c.sum(dim=0)"):
        lineno = _line_of(user_fn, text)
        comment = f"{HERE}:{lineno}"
        assert comment in code, (comment, code)
        # the comment precedes the statement it describes, and shows the source text
        assert re.search(rf"# \S*{re.escape(HERE)}:{lineno}: {re.escape(text)}\n", code)
    # one comment per group, in source order
    comment_lines = [int(m) for m in re.findall(rf"{re.escape(HERE)}:(\d+)", code)]
    assert comment_lines == sorted(comment_lines)
    torch.testing.assert_close(gm(*args), user_fn(*args))


def test_comment_groups_statements_from_one_line():
    def f(x):
        y = torch.relu(x) + torch.neg(x) * 2
        return y

    gm = symtrace.symbolic_trace(f)
    lineno = _line_of(f, "y = torch.relu(x)")
    assert gm.code.count(f"{HERE}:{lineno}") == 1


def test_code_deletes_dead_values():
    gm = symtrace.symbolic_trace(user_fn)
    body = _body(gm.code)
    # x and y die at the add; a dies at the mul; b dies at the mul
    i_add = next(i for i, s in enumerate(body) if s.startswith("add = "))
    assert body[i_add + 1] == "del x, y" or set(body[i_add + 1][4:].split(", ")) == {"x", "y"}
    i_mul = next(i for i, s in enumerate(body) if s.startswith("mul = "))
    assert body[i_mul + 1].startswith("del ")
    assert set(body[i_mul + 1][4:].split(", ")) == {"add", "relu"}
    # values returned are never deleted
    ret = body[-1]
    assert ret.startswith("return ")
    returned = ret[len("return "):]
    for s in body:
        if s.startswith("del "):
            assert returned not in s[4:].split(", ")


def test_every_value_deleted_exactly_once_or_returned():
    def f(x):
        a = x.sin()
        b = x.cos()
        c = a + b
        d = c * x
        return d, a

    gm = symtrace.symbolic_trace(f)
    body = _body(gm.code)
    deleted = [v for s in body if s.startswith("del ") for v in s[4:].split(", ")]
    assert len(deleted) == len(set(deleted))
    assert "a" not in deleted and "sin" not in deleted  # returned
    for n in gm.graph.nodes:
        if n.op != "output" and n.users and all(u.op != "output" for u in n.users):
            assert n.name in deleted, n.name
    # the result is still right, with the deletions
    t = torch.randn(4)
    d, a = gm(t)
    torch.testing.assert_close(d, (t.sin() + t.cos()) * t)
    torch.testing.assert_close(a, t.sin())


def test_unused_result_is_not_assigned():
    def f(x):
        x.add_(1)
        return x

    gm = symtrace.symbolic_trace(f)
    body = _body(gm.code)
    assert "x.add_(1)" in body
    t = torch.zeros(2)
    gm(t)
    assert torch.equal(t, torch.ones(2))


# --- lazy recompilation ----------------------------------------------------------------------
def _add_one():
    def f(x):
        return x + 1

    return symtrace.symbolic_trace(f)


def test_args_edit_recompiles_lazily():
    gm = _add_one()
    t = torch.tensor([2.0])
    assert gm(t).item() == 3.0
    add = gm.graph.find_nodes(op="call_function", target=operator.add)[0]
    add.args = (add.args[0], 5)
    assert "+ 5" in gm.code
    assert gm(t).item() == 7.0
    add.update_arg(1, 10)
    assert gm(t).item() == 12.0
    add.kwargs = {}
    add.update_arg(1, add.args[0])
    assert gm(t).item() == 4.0


def test_insert_and_erase_recompile_lazily():
    gm = _add_one()
    t = torch.tensor([-2.0])
    assert gm(t).item() == -1.0
    g = gm.graph
    add = g.find_nodes(op="call_function", target=operator.add)[0]
    with g.inserting_after(add):
        r = g.call_function(torch.abs, (add,))
    add.replace_all_uses_with(r, delete_user_cb=lambda u: u is not r)
    assert gm(t).item() == 1.0
    assert "torch.abs(add)" in gm.code
    r.replace_all_uses_with(add)
    g.erase_node(r)
    assert "torch.abs" not in gm.code
    assert gm(t).item() == -1.0
    # a move is a structural edit too
    x = g.placeholders()[0]
    with g.inserting_before(g.output_node()):
        n = g.call_function(torch.neg, (x,))
    g.output_node().args = (n,)
    assert gm(t).item() == 2.0
    g.eliminate_dead_code()
    assert "add" not in gm.code
    assert gm(t).item() == 2.0


def test_target_edit_then_recompile():
    gm = _add_one()
    t = torch.tensor([3.0])
    assert gm(t).item() == 4.0
    add = gm.graph.find_nodes(op="call_function", target=operator.add)[0]
    add.target = operator.mul
    gm.recompile()
    assert "x * 1" in gm.code
    assert gm(t).item() == 3.0
    add.target = torch.sub
    code = gm.recompile()
    assert "torch.sub(x, 1)" in code.src
    assert gm(t).item() == 2.0


def test_target_edit_alone_recompiles_lazily():
    gm = _add_one()
    t = torch.tensor([3.0])
    assert gm(t).item() == 4.0
    add = gm.graph.find_nodes(op="call_function", target=operator.add)[0]
    add.target = operator.mul
    assert gm(t).item() == 3.0


def test_recompile_returns_code_and_is_idempotent():
    gm = _add_one()
    c1 = gm.recompile()
    c2 = gm.recompile()
    assert c1.src == c2.src == gm.code
    assert c1.src.startswith("def forward(self, x):")


def test_replace_graph_recompiles():
    gm = _add_one()
    t = torch.tensor([3.0])
    assert gm(t).item() == 4.0
    g = Graph()
    x = g.placeholder("x")
    g.output(g.call_function(operator.mul, (x, 3)))
    old = gm.graph
    gm.graph = g
    assert gm(t).item() == 9.0
    # edits to the old graph no longer affect the module
    add = old.find_nodes(op="call_function", target=operator.add)[0]
    add.args = (add.args[0], 100)
    assert gm(t).item() == 9.0


def test_two_modules_sharing_a_graph_both_see_edits():
    gm1 = _add_one()
    t = torch.tensor([1.0])
    assert gm1(t).item() == 2.0  # compiled
    gm2 = GraphModule(gm1, gm1.graph)
    add = gm1.graph.find_nodes(op="call_function", target=operator.add)[0]
    add.args = (add.args[0], 10)
    assert gm2(t).item() == 11.0
    assert gm1(t).item() == 11.0


# --- literals -----------------------------------------------------------------------------------
ODD_CONSTANTS = [
    float("inf"), -float("inf"), float("nan"), -0.0, 0.0, 1e-300, 1.5e300, math.pi,
    torch.float16, torch.bfloat16, torch.int64, torch.bool,
    torch.device("cpu"), torch.device("meta"),
    slice(None), slice(1, None, 2), slice(-1, None, -1), Ellipsis, None, True, False,
    (), (1,), (1, (2, 3.5), [None, "s"]), [], {"a": -0.0, 1: [None], "b": float("-inf")},
    "it's \"quoted\"\n", 10 ** 30, -7, complex(1, -2), torch.Size([2, 3]), torch.Size([]),
    torch.channels_last, torch.strided,
]


def _same(a, b):
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(b):
            return math.isnan(a)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _roundtrip(values):
    g = Graph()
    x = g.placeholder("x")
    # both as a standalone argument and inside a container argument of a call
    outs = [g.call_function(operator.getitem, ((v,), 0)) for v in values]
    g.output(tuple(outs) + (tuple(values),))
    gm = GraphModule(nn.Module(), g)
    return gm, gm(torch.ones(1))


@pytest.mark.parametrize("value", ODD_CONSTANTS, ids=repr)
def test_odd_constants_round_trip(value):
    gm, res = _roundtrip([value])
    assert _same(res[0], value), (res[0], value, gm.code)
    assert _same(res[1][0], value)


def test_odd_constants_round_trip_together():
    gm, res = _roundtrip(ODD_CONSTANTS)
    for got, want in zip(res, ODD_CONSTANTS):
        assert _same(got, want), (got, want)


@pytest.mark.parametrize("value", [complex(float("inf"), 0), complex(0, float("nan"))], ids=repr)
def test_complex_non_finite_constant_round_trips(value):
    gm, res = _roundtrip([value])
    assert _same(res[0], value) or (value != value and res[0] != res[0])


def test_constants_in_kwargs_and_indexing():
    def f(x):
        y = x[..., ::-1] if False else x[..., 1:]
        z = torch.clamp(y, min=-float("inf"), max=0.5)
        w = z.to(dtype=torch.float64, device=torch.device("cpu"))
        return w[None, 0], torch.full_like(w, float("nan"))

    t = torch.randn(2, 3)
    for gm in (symtrace.symbolic_trace(f), symtrace.symbolic_trace(f, example_inputs=(t,))):
        a, b = gm(t)
        ea, eb = f(t)
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, ea)
        assert torch.isnan(b).all() and b.shape == eb.shape


def test_negative_zero_and_inf_in_arithmetic():
    g = Graph()
    x = g.placeholder("x")
    a = g.call_function(operator.mul, (x, -0.0))
    b = g.call_function(operator.add, (x, -float("inf")))
    c = g.call_function(operator.sub, (x, -1))
    g.output((a, b, c))
    gm = GraphModule(nn.Module(), g)
    t = torch.tensor([2.0])
    a, b, c = gm(t)
    assert torch.signbit(a).item()
    assert b.item() == -float("inf")
    assert c.item() == 3.0


def test_negative_literal_base_of_pow():
    def f(x):
        return (-2.0) ** x

    gm = symtrace.symbolic_trace(f)
    t = torch.tensor([2.0, 3.0])
    torch.testing.assert_close(gm(t), f(t))


def test_non_literal_constant_bound_in_globals():
    class Opaque:
        def __init__(self, k):
            self.k = k

    obj = Opaque(3)
    g = Graph()
    x = g.placeholder("x")
    n = g.call_function(getattr, (obj, "k"))
    m = g.call_function(operator.mul, (x, n))
    g.output(m)
    gm = GraphModule(nn.Module(), g)
    assert gm(torch.ones(1)).item() == 3.0
    assert "_const_" in gm.code


def test_local_function_target():
    def helper(a, b=1):
        return a * 10 + b

    g = Graph()
    x = g.placeholder("x")
    g.output(g.call_function(helper, (x,), {"b": 2}))
    gm = GraphModule(nn.Module(), g)
    assert gm(torch.ones(1)).item() == 12.0


# --- names ------------------------------------------------------------------------------------
def test_builtin_named_inputs_and_calls():
    def f(input, list, sum, max):
        return input + list + sum * max

    gm = symtrace.symbolic_trace(f)
    t = [torch.full((2,), float(i)) for i in range(1, 5)]
    torch.testing.assert_close(gm(*t), f(*t))
    torch.testing.assert_close(gm(input=t[0], list=t[1], sum=t[2], max=t[3]), f(*t))

    def g(x):
        return max(x.shape[0], 2), abs(x), len(x)

    t = torch.randn(3, 2)
    gm = symtrace.symbolic_trace(g, example_inputs=(t,))
    m, a, n = gm(t)
    assert m == 3 and n == 3
    torch.testing.assert_close(a, t.abs())


def test_graph_built_nodes_named_like_builtins():
    g = Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.abs, (x,), name="abs")
    lst = g.call_function(list, ((a, a),), name="list")
    ln = g.call_function(len, (lst,), name="len")
    s = g.call_function(sum, ([1, 2],), name="sum")
    g.output((a, ln, s))
    gm = GraphModule(nn.Module(), g)
    out, n, tot = gm(torch.tensor([-1.0]))
    assert out.item() == 1.0 and n == 2 and tot == 3


def test_input_named_self():
    def f(self, y):
        return self + y

    gm = symtrace.symbolic_trace(f)
    assert gm(torch.ones(1), torch.ones(1)).item() == 2.0


@pytest.mark.parametrize("which", ["torch", "operator"])
def test_input_named_like_codegen_global(which):
    import torch as T

    if which == "torch":
        def f(x, torch):
            return T.relu(x) + torch
    else:
        def f(x, operator):
            x += operator
            return x

    gm = symtrace.symbolic_trace(f)
    a, b = T.tensor([-1.0, 2.0]), T.tensor([1.0, 1.0])
    torch.testing.assert_close(gm(a.clone(), b), f(a.clone(), b))


def test_function_reading_simple_global_with_example_inputs():
    # regression: global guards read sys.modules, which the generated code once lacked
    global SCALE
    t = torch.randn(3)
    gm = symtrace.symbolic_trace(_uses_global, example_inputs=(t,))
    torch.testing.assert_close(gm(t), t * SCALE)
    old = SCALE
    try:
        SCALE = 4.0  # the global guard notices the change
        with pytest.raises(symtrace.GuardError, match="SCALE"):
            gm(t)
    finally:
        SCALE = old
    torch.testing.assert_close(gm(t), t * SCALE)


SCALE = 2.5


def _uses_global_and_sys(x, sys):
    return x * SCALE + sys


def test_input_named_sys_with_global_guard():
    t = torch.ones(2)
    gm = symtrace.symbolic_trace(_uses_global_and_sys, example_inputs=(t, t))
    torch.testing.assert_close(gm(t, t), _uses_global_and_sys(t, t))


def _uses_global(x):
    return x * SCALE


def test_exception_in_generated_code_shows_generated_source_in_traceback():
    import traceback

    def f(x, w):
        return torch.matmul(x, w)

    gm = symtrace.symbolic_trace(f)
    with pytest.raises(RuntimeError) as ei:
        gm(torch.ones(2, 3), torch.ones(4, 5))
    tb = "".join(traceback.format_exception(ei.value))
    assert "torch.matmul(x, w)" in tb  # the generated line is visible through linecache


_Pair = __import__("collections").namedtuple("_Pair", "first second")


@pytest.mark.parametrize("where", ["output", "argument"])
def test_namedtuple_with_nodes_in_args(where):
    g = Graph()
    x = g.placeholder("x")
    r = g.call_function(torch.relu, (x,))
    if where == "output":
        g.output(_Pair(r, 1))
    else:
        g.output(g.call_function(operator.getitem, (_Pair(r, 2), 0)))
    assert r.users  # the IR sees the node inside the namedtuple
    gm = GraphModule(nn.Module(), g)
    out = gm(torch.tensor([-1.0, 2.0]))
    got = out.first if where == "output" else out
    assert torch.equal(got, torch.tensor([0.0, 2.0]))


class _KeywordKeys(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.ModuleDict({"in": nn.Linear(2, 2), "out": nn.Linear(2, 2)})

    def forward(self, x):
        return self.proj["out"](self.proj["in"](x))


def test_submodule_with_numeric_name():
    m = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    gm = symtrace.symbolic_trace(m)
    assert "getattr(self, '0')" in gm.code or "self[0]" in gm.code or "_0" in gm.code
    t = torch.randn(4, 2)
    torch.testing.assert_close(gm(t), m(t))


def test_submodule_named_with_keyword():
    m = _KeywordKeys()
    gm = symtrace.symbolic_trace(m)
    t = torch.randn(3, 2)
    torch.testing.assert_close(gm(t), m(t))


# --- values written inline -------------------------------------------------------------------------
def _one_line(x, w):
    return torch.relu(torch.matmul(x, w) + 1)


def test_single_use_values_of_one_line_are_written_inline_with_the_comment():
    gm = symtrace.symbolic_trace(_one_line)
    lineno = _line_of(_one_line, "return torch.relu")
    lines = gm.code.splitlines()
    i = next(k for k, s in enumerate(lines) if f"{HERE}:{lineno}" in s)
    assert lines[i + 1].strip() == "return torch.relu(torch.matmul(x, w) + 1)" or \
        lines[i + 1].strip() == "relu = torch.relu(torch.matmul(x, w) + 1)", gm.code
    x, w = torch.randn(2, 3), torch.randn(3, 4)
    torch.testing.assert_close(gm(x, w), _one_line(x, w))


def test_values_of_different_lines_stay_statements():
    gm = symtrace.symbolic_trace(user_fn)
    body = _body(gm.code)
    assert any(s.startswith("relu = torch.relu(add)") for s in body), body
    assert any(s.startswith("mul = relu * add") for s in body), body


def test_inlined_operator_expressions_get_parentheses():
    def f(x, y):
        return (x + y) * (x - y), -(x * 2) ** 2, (x + 1).sum(0)

    gm = symtrace.symbolic_trace(f)
    assert "(x + y) * (x - y)" in gm.code
    x, y = torch.randn(3), torch.randn(3)
    for a, b in zip(gm(x, y), f(x, y)):
        torch.testing.assert_close(a, b)


def test_inlining_keeps_the_graph_order_of_random_ops():
    # b is drawn before a, but ``a - b`` evaluates a first: writing both inline would draw the
    # numbers in the other order
    g = Graph()
    x = g.placeholder("x")
    b = g.call_function(torch.rand_like, (x,))
    a = g.call_function(torch.rand_like, (x,))
    g.output(g.call_function(operator.sub, (a, b)))
    gm = GraphModule(nn.Module(), g)
    t = torch.zeros(5)
    torch.manual_seed(0)
    first = torch.rand_like(t)
    second = torch.rand_like(t)
    torch.manual_seed(0)
    torch.testing.assert_close(gm(t), second - first)
    # and where the order allows it, they are written inline
    g2 = Graph()
    x = g2.placeholder("x")
    a = g2.call_function(torch.rand_like, (x,))
    b = g2.call_function(torch.rand_like, (x,))
    g2.output(g2.call_function(operator.sub, (a, b)))
    gm2 = GraphModule(nn.Module(), g2)
    assert "torch.rand_like(x) - torch.rand_like(x)" in gm2.code
    torch.manual_seed(0)
    torch.testing.assert_close(gm2(t), first - second)


def test_long_expressions_are_split_into_statements():
    from symtrace.graph import codegen

    g = Graph()
    x = g.placeholder("x")
    h = x
    for _ in range(40):
        h = g.call_function(torch.neg, (h,))
    g.output(h)
    gm = GraphModule(nn.Module(), g)
    body = _body(gm.code)
    assert 1 < len(body) < 40
    assert all(len(s) <= codegen.MAX_INLINE_CHARS + 40 for s in body), body
    assert gm(torch.ones(1)).item() == 1.0


def test_value_used_twice_by_one_node_is_not_inlined():
    g = Graph()
    x = g.placeholder("x")
    s = g.call_function(torch.sin, (x,))
    g.output(g.call_function(operator.mul, (s, s)))
    gm = GraphModule(nn.Module(), g)
    assert "sin * sin" in gm.code
    torch.testing.assert_close(gm(torch.ones(2)), torch.sin(torch.ones(2)) ** 2)


def test_error_note_names_the_inlined_node_that_failed():
    gm = symtrace.symbolic_trace(_one_line)
    lineno = _line_of(_one_line, "return torch.relu")
    with pytest.raises(RuntimeError) as ei:
        gm(torch.ones(2, 3), torch.ones(4, 5))
    notes = getattr(ei.value, "__notes__", [])
    assert len(notes) == 1 and "'matmul'" in notes[0] and f"{HERE}:{lineno}" in notes[0], notes


def test_error_note_names_the_outer_node_when_it_fails():
    def f(x):
        return x.sin().view(7)

    gm = symtrace.symbolic_trace(f)
    assert "x.sin().view(7)" in gm.code
    with pytest.raises(RuntimeError) as ei:
        gm(torch.ones(3))
    assert "'view'" in ei.value.__notes__[0]


# --- submodule aliases -------------------------------------------------------------------------------
class _Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
                                     for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = b[2](b[1](b[0](x)))
        return x


def test_deep_submodules_are_read_once_through_a_local_name():
    m = _Deep()
    gm = symtrace.symbolic_trace(m)
    code = gm.code
    assert "_m_blocks_0 = getattr(self.blocks, '0')" in code, code
    assert code.count("getattr(self.blocks, '0')") == 1
    t = torch.randn(2, 3)
    torch.testing.assert_close(gm(t), m(t))
    # a submodule replaced later is seen on the next call
    tanh = nn.Tanh()
    setattr(getattr(gm.blocks, "0"), "1", tanh)
    m.blocks[0][1] = tanh
    torch.testing.assert_close(gm(t), m(t))


def test_error_in_aliased_submodule_names_the_node():
    gm = symtrace.symbolic_trace(_Deep())
    with pytest.raises(RuntimeError) as ei:
        gm(torch.randn(2, 4))
    assert "blocks_0_0" in ei.value.__notes__[0]


# --- compiled code cache -------------------------------------------------------------------------------
def test_same_source_compiles_once_and_edits_compile_again(monkeypatch):
    from symtrace.graph import codegen

    calls = []
    real = compile
    monkeypatch.setattr(codegen, "compile", lambda *a, **k: calls.append(1) or real(*a, **k), raising=False)
    codegen.clear_code_cache()
    gm = symtrace.symbolic_trace(user_fn)
    t = torch.randn(2, 3)
    gm(t, t)
    assert len(calls) == 1
    import copy
    import pickle
    for other in (copy.deepcopy(gm), pickle.loads(pickle.dumps(gm)), symtrace.symbolic_trace(user_fn)):
        torch.testing.assert_close(other(t, t), user_fn(t, t))
        assert other.forward.__code__ is gm.forward.__code__
    assert len(calls) == 1  # copies and a re-trace of the same program compile nothing
    add = gm.graph.find_nodes(op="call_function", target=operator.add)[0]
    add.args = (add.args[0], 5)
    torch.testing.assert_close(gm(t, t), (torch.relu(t + 5) * (t + 5)).sum(dim=0))
    assert len(calls) == 2 and "x + 5" in gm.code
    codegen.clear_code_cache()
    gm.recompile()
    assert len(calls) == 2  # recompile() only generates the source ...
    gm(t, t)
    assert len(calls) == 3  # ... the first call compiles it


def test_recompile_is_lazy_about_compiling(monkeypatch):
    """recompile() generates source; reading forward or calling compiles, once; reading code
    does not compile."""
    from symtrace.graph import codegen

    calls = []
    real = compile
    monkeypatch.setattr(codegen, "compile", lambda *a, **k: calls.append(1) or real(*a, **k), raising=False)
    gm = _add_one()
    t = torch.tensor([1.0])
    for first_use in ("call", "forward", "code", "class forward", "signature"):
        codegen.clear_code_cache()
        calls.clear()
        code = gm.recompile()
        assert calls == [] and "forward" not in gm.__dict__
        assert code.src.startswith("def forward(self, x):")
        if first_use == "call":
            assert gm(t).item() == 2.0
        elif first_use == "forward":
            assert gm.forward(t).item() == 2.0
        elif first_use == "code":
            assert gm.code == code.src and calls == []  # reading the source does not compile
            assert gm(t).item() == 2.0
        elif first_use == "class forward":
            assert GraphModule.forward(gm, t).item() == 2.0
        else:
            assert list(inspect.signature(gm.forward).parameters) == ["x"]
        assert len(calls) == 1, first_use
        assert gm.__dict__["forward"].__func__.__code__.co_filename.startswith("<symtrace-")
        gm(t)
        assert gm.forward(t).item() == 2.0 and len(calls) == 1  # compiled once
    # an edit after recompile() but before the first call is what runs
    gm.recompile()
    add = gm.graph.find_nodes(op="call_function", target=operator.add)[0]
    add.args = (add.args[0], 5)
    assert gm(t).item() == 6.0


def test_lazily_compiled_errors_still_name_the_node():
    g = Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.mm, (x, x)))
    gm = GraphModule(nn.Module(), g)
    gm.recompile()
    with pytest.raises(RuntimeError) as ei:
        gm(torch.zeros(2, 3))
    assert any("while running node 'mm'" in note for note in ei.value.__notes__)


def test_code_cache_is_bounded(monkeypatch):
    from symtrace.graph import codegen

    monkeypatch.setattr(codegen, "_CODE_CACHE_MAX_ENTRIES", 2)
    codegen.clear_code_cache()
    gms = []
    for k in range(4):
        g = Graph()
        x = g.placeholder("x")
        g.output(g.call_function(operator.add, (x, k)))
        gm = GraphModule(nn.Module(), g)
        assert gm(torch.zeros(1)).item() == k
        gms.append(gm)
    assert len(codegen._CODE_CACHE) == 2
    assert all(gm(torch.zeros(1)).item() == k for k, gm in enumerate(gms))  # evicted ones still run
    codegen.clear_code_cache()


def test_cached_code_keeps_its_own_constants_and_line_notes():
    class Opaque:
        def __init__(self, k):
            self.k = k

    def build(k):
        g = Graph()
        x = g.placeholder("x")
        g.output(g.call_function(operator.mul, (x, g.call_function(getattr, (Opaque(k), "k")))))
        return GraphModule(nn.Module(), g)

    a, b = build(2), build(3)
    assert a.code == b.code  # same text, different constants bound in each module's globals
    assert a(torch.ones(1)).item() == 2.0 and b(torch.ones(1)).item() == 3.0
    assert a.forward.__code__ is b.forward.__code__


def test_literal_receivers_are_parenthesized():
    g = Graph()
    g.placeholder("x")
    a = g.call_method("bit_length", (5,))
    b = g.call_function(getattr, (-3, "real"))
    g.output((a, b))
    gm = GraphModule(nn.Module(), g)
    assert gm(torch.ones(1)) == (3, -3)


def test_spans_of_inlined_values_are_computed_on_access_and_exact():
    from symtrace.graph.codegen import python_code

    g = Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.add, (x, 1))
    r = g.call_function(torch.relu, (a,))
    m = g.call_function(operator.mul, (r, 2.0))
    g.output(g.call_function(torch.neg, (m,)))
    code = python_code(g)
    lines = code.src.splitlines()
    (line,) = list(code.spans)  # one statement holds the three inlined values
    assert len(code.spans) == 1 and line in code.spans and 999 not in code.spans
    got = {n.name: lines[line - 1][s:e] for s, e, n in code.spans[line]}
    assert got == {"add": "torch.add(x, 1)", "relu": "torch.relu(torch.add(x, 1))",
                   "mul": "torch.relu(torch.add(x, 1)) * 2.0"}
    assert code.spans[line] is code.spans[line]  # worked out once


def _spans_by_name(code):
    lines = code.src.splitlines()
    return {line: {n.name: lines[line - 1][s:e] for s, e, n in code.spans[line]} for line in code.spans}


def test_spans_tell_apart_inlined_values_with_the_same_text():
    from symtrace.graph.codegen import python_code

    class Opaque:  # not a literal: bound as a constant in the globals
        pass

    k = Opaque()
    g = Graph()
    x = g.placeholder("x")
    c = g.call_function(getattr, (k, "__class__"))
    r1 = g.call_function(torch.relu, (x,))
    r2 = g.call_function(torch.relu, (x,))
    s = g.call_function(torch.add, (r1, r2))
    g.output(g.call_function(_pair, (c, s)))
    code = python_code(g)
    (spans,) = _spans_by_name(code).values()
    assert spans == {"relu": "torch.relu(x)", "relu_1": "torch.relu(x)",
                     "add": "torch.add(torch.relu(x), torch.relu(x))", "getattr_1": "_const_0.__class__"}
    (line,) = list(code.spans)
    (first, second) = sorted((s, n.name) for s, _, n in code.spans[line] if n.name.startswith("relu"))
    assert first[1] == "relu" and second[1] == "relu_1" and first[0] < second[0]


def test_spans_of_a_line_edited_since_the_code_was_made_are_left_out():
    from symtrace.graph.codegen import python_code

    g = Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.add, (x, 1))
    r = g.call_function(torch.relu, (a,))
    g.output(g.call_function(torch.neg, (r,)))
    code = python_code(g)
    (line,) = list(code.spans)
    a.args = (x, 2)  # the generated line still reads torch.add(x, 1)
    assert code.spans[line] == []


def _pair(a, b):
    return a, b


# --- inlined values: a property over random graphs -------------------------------------------------
_RANDOM_OPS = (
    ("call_function", torch.neg, 1), ("call_function", torch.sin, 1), ("call_function", torch.add, 2),
    ("call_function", operator.mul, 2), ("call_function", operator.sub, 2), ("call_function", operator.neg, 1),
    ("call_method", "relu", 1), ("call_method", "add", 2), ("call_function", operator.getitem, 1),
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, len(_RANDOM_OPS) - 1), st.integers(0, 10_000), st.integers(0, 10_000)),
                min_size=1, max_size=25))
def test_inlined_values_run_right_and_their_columns_hold_their_expressions(steps):
    import ast

    from symtrace.graph.codegen import python_code

    g = Graph()
    values = [g.placeholder("x"), g.placeholder("y")]
    for k, i, j in steps:
        op, target, arity = _RANDOM_OPS[k]
        a, b = values[i % len(values)], values[j % len(values)]
        args = (a, 1) if target is operator.getitem else (a,) if arity == 1 else (a, b)
        if op == "call_function":
            values.append(g.call_function(target, args))
        else:
            values.append(g.call_method(target, args))
    g.output(values[-1])
    gm = GraphModule(nn.Module(), g)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(gm(x, y), symtrace.Interpreter(gm).run(x, y), equal_nan=True)

    code = python_code(g)
    lines = code.src.splitlines()
    seen = []
    for line in code.spans if code.spans else ():
        spans = code.spans[line]
        assert spans, lines[line - 1]  # an unedited graph: every line with inlined values has columns
        for s, e, n in spans:
            tree = ast.parse(lines[line - 1][s:e], mode="eval").body
            if n.op == "call_method":
                assert isinstance(tree, ast.Call) and tree.func.attr == n.target
            elif n.target is operator.getitem:
                assert isinstance(tree, ast.Subscript)
            elif n.target in (operator.mul, operator.sub):
                assert isinstance(tree, ast.BinOp)
            elif n.target is operator.neg:
                assert isinstance(tree, ast.UnaryOp)
            else:
                assert isinstance(tree, ast.Call) and ast.unparse(tree.func) == f"torch.{n.target.__name__}"
            seen.append(n)
        # columns of one line are nested or disjoint
        for s1, e1, _ in spans:
            for s2, e2, _ in spans:
                assert e1 <= s2 or e2 <= s1 or (s1 <= s2 and e2 <= e1) or (s2 <= s1 and e1 <= e2)
    assert len(seen) == len(set(seen))  # each inlined value is written (and found) once
    assigned = {line.split(" = ")[0].strip() for line in lines if " = " in line}
    deleted = {name for line in lines if line.strip().startswith("del ") for name in line.strip()[4:].split(", ")}
    assert not {n.name for n in seen} & (assigned | deleted)  # inlined values are not variables


def test_a_hand_built_output_nested_too_deep_is_refused_clearly():
    from symtrace.graph.code_text import MAX_NESTING, UnsafeNameError
    g = symtrace.Graph()
    x = g.placeholder("x")
    out = x
    for _ in range(MAX_NESTING + 5):
        out = (out,)
    g.output(out)
    with pytest.raises(UnsafeNameError, match="nests containers more than"):
        symtrace.GraphModule(torch.nn.Module(), g).code
