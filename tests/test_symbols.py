"""Symbolic sizes (symtrace/graph/symbols.py): canonical forms, arithmetic, evaluation, ranges."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from symtrace.graph.symbols import (Dim, SizeExpr, SymbolicSizeError, as_expr, bounds, evaluate,
                                    free_symbols, is_symbolic, shape_str, sym)

s0, s1 = sym("s0"), sym("s1", 1, 64)


def test_canonical_form_and_printing():
    assert s0 * 256 == 256 * s0 and hash(s0 * 256) == hash(256 * s0)
    assert str(s0 * 256) == "s0*256"
    assert str(2 * s0 + s1 * s0 - 3) in ("s0*2 + s0*s1 - 3", "s0*s1 + s0*2 - 3")
    assert (s0 + 1) - s0 == 1 and isinstance((s0 + 1) - s0, int)   # constants collapse to ints
    assert s0 * 0 == 0 and isinstance(s0 * 0, int)
    assert str(-s0 + 4) == "-s0 + 4"
    assert str(s0 * s0) == "s0**2"
    assert shape_str((s0, 8, 256)) == "[s0, 8, 256]"


def test_floor_division_and_modulo():
    assert (s0 * 8) // 4 == s0 * 2
    assert (s0 * 8 + 4) // 4 == s0 * 2 + 1
    assert (s0 * 8 + 5) % 4 == 1
    assert (s0 * 8) % 4 == 0
    e = (s0 + 1) // 2
    assert str(e) == "(s0 + 1)//2"
    assert (s0 * 4 + 5) // 4 == s0 + 1
    with pytest.raises(SymbolicSizeError, match="symbolic size"):
        8 // s0
    with pytest.raises(SymbolicSizeError, match="positive"):
        s0 // 0


def test_int_of_a_symbolic_size_is_refused_with_the_symbols_named():
    with pytest.raises(SymbolicSizeError, match="s0"):
        int(s0 * 2)
    with pytest.raises(SymbolicSizeError):
        range(s0)   # __index__
    assert int(as_expr(7)) == 7 and as_expr(7) == 7 and hash(as_expr(7)) == hash(7)


def test_evaluate_subs_and_free_symbols():
    e = (s0 * s1 + 3) // 2
    assert e.evaluate({"s0": 5, "s1": 3}) == 9
    assert evaluate((s0, 4, e), {"s0": 5, "s1": 3}) == (5, 4, 9)
    assert {s.name for s in free_symbols((s0, e))} == {"s0", "s1"}
    assert is_symbolic((1, s0)) and not is_symbolic((1, 2))
    assert e.subs({"s1": 2}) == s0 + 1   # (2*s0 + 3)//2 == s0 + 1
    with pytest.raises(SymbolicSizeError, match="no value bound"):
        e.evaluate({"s0": 1})


def test_bounds_use_symbol_ranges():
    assert bounds(s1 * 2 + 1) == (3, 129)
    assert bounds(s0 - 2) == (0, math.inf)
    assert bounds(s1 % 8) == (0, 7)
    assert bounds(5) == (5, 5)


def test_dim_validates_its_declaration():
    assert Dim("seq", min=1, max=2048).max == 2048
    assert Dim("b").min == 2      # 0 and 1 specialise by default
    for bad in (lambda: Dim("not a name"), lambda: Dim("x", min=-1), lambda: Dim("x", min=4, max=3)):
        with pytest.raises(ValueError):
            bad()


ints = st.integers(-50, 50)


@settings(max_examples=200, deadline=None)
@given(a=ints, b=ints, c=ints, d=st.integers(1, 9), x=st.integers(0, 300), y=st.integers(0, 300))
def test_arithmetic_agrees_with_python_ints(a, b, c, d, x, y):
    env = {"s0": x, "s1": y}
    exprs = {
        "lin": a * s0 + b * s1 + c,
        "poly": (s0 + a) * (s1 - b) + c,
        "div": (a * s0 + c) // d,
        "mod": (b * s1 + c) % d,
        "nested": ((s0 * a + c) // d + s1) * d % (d + 1),
        "negdiv": a - (s0 + c) // d,
        "divprod": (s0 // d) * (s1 % d) * a,
        "divpow": (s0 // d) * (s0 // d) - s1 % d,
    }
    ref = {
        "lin": a * x + b * y + c,
        "poly": (x + a) * (y - b) + c,
        "div": (a * x + c) // d,
        "mod": (b * y + c) % d,
        "nested": ((x * a + c) // d + y) * d % (d + 1),
        "negdiv": a - (x + c) // d,
        "divprod": (x // d) * (y % d) * a,
        "divpow": (x // d) * (x // d) - y % d,
    }
    for k, e in exprs.items():
        got = e.evaluate(env) if isinstance(e, SizeExpr) else e
        assert got == ref[k], (k, str(e))
        # the printed form is a Python expression with the same value
        assert eval(str(e), {}, dict(env)) == ref[k], (k, str(e))


# --- dynamic_shapes declarations (symtrace/graph/dynamic_spec.py) -----------------------------
import torch  # noqa: E402

from symtrace.graph.dynamic_spec import normalize_dynamic_shapes  # noqa: E402


def test_dynamic_shapes_by_name_and_by_position():
    x, m = torch.zeros(2, 8, 4), torch.zeros(2, 8)
    seq = Dim("seq", min=1, max=64)
    by_name = normalize_dynamic_shapes({"x": {1: seq}, "mask": {-1: seq}}, ["x", "mask"], (x, m))
    assert by_name == {0: {1: seq}, 1: {1: seq}}
    by_pos = normalize_dynamic_shapes(({0: "batch", 1: seq}, None), ["x", "mask"], (x, m))
    assert by_pos == {0: {0: Dim("batch"), 1: seq}}
    fresh = normalize_dynamic_shapes({"x": {0: True, 2: True}}, ["x"], (x,))
    assert fresh[0][0].name != fresh[0][2].name


def test_dynamic_shapes_errors_name_the_entry():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="'y', which is not an input; the inputs are x"):
        normalize_dynamic_shapes({"y": {0: True}}, ["x"], (x,))
    with pytest.raises(ValueError, match="dimension 2 is out of range for a tensor of rank 2"):
        normalize_dynamic_shapes({"x": {2: True}}, ["x"], (x,))
    with pytest.raises(ValueError, match="size 8 there, outside Dim\\('s', min=2, max=4\\)"):
        normalize_dynamic_shapes({"x": {1: Dim("s", max=4)}}, ["x"], (x,))
    with pytest.raises(ValueError, match="two different Dims are named 's'"):
        normalize_dynamic_shapes({"x": {0: Dim("s"), 1: Dim("s", max=9)}}, ["x"], (x,))
    with pytest.raises(TypeError, match="expected a Dim"):
        normalize_dynamic_shapes({"x": {0: 3}}, ["x"], (x,))


def test_c_text_at_least_1_and_sample():
    from symtrace.graph.symbols import at_least_1, c_text, sample, SymbolicSizeError
    s, t = sym("s0"), sym("s1", 0, 9)
    assert c_text(s * 256 + 3) == "((int64_t)3 + (int64_t)256*s0)"
    assert c_text(s * s) == "(s0*s0)" and c_text(7) == "7"
    assert c_text((s + 1) // 2, cast="", div="//") == "(((1 + s0) // 2))"
    env = {"s0": 13}
    assert eval(c_text((s + 1) // 2 * 3 + s % 4, cast="", div="//"), {}, env) == ((13 + 1) // 2) * 3 + 13 % 4
    assert at_least_1(s) is s and at_least_1(0) == 1
    with pytest.raises(SymbolicSizeError):
        at_least_1(t)   # its range includes 0
    assert sample(s * 2) == 2 * 4099 and sample(t) == 9 and sample(5) == 5
