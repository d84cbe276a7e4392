"""The shared kernel renderer (symtrace/lower/render.py) and its per-target op tables: what each
target can render, and the one error for what it cannot. The generated sources themselves are
pinned by tests/test_kernel_goldens.py."""
from __future__ import annotations

import pytest
import torch

from symtrace.errors import SymtraceError
from symtrace.lower import codegen_c, codegen_triton
from symtrace.lower.ir import BINARY_OPS, UNARY_OPS, Affine, Buffer, Expr, ExprBuilder, Kernel, Store, Var
from symtrace.lower.render import NoKernelForm, expand, template

TARGETS = [("C", codegen_c.kernel_source, codegen_c.CRenderer),
           ("Triton", codegen_triton.kernel_source, codegen_triton.TritonRenderer)]


def kernel_of(make, dtype=torch.int64, out_dtype=None):
    """A pointwise kernel storing ``make(eb, x, y)`` for two loaded buffers of ``dtype``."""
    eb, v = ExprBuilder(), Var("i0", 8)
    idx = Affine.of(v)
    x = eb.load(Buffer("x", dtype, (8,), (1,), "input"), idx)
    y = eb.load(Buffer("y", dtype, (8,), (1,), "input"), idx)
    value = make(eb, x, y)
    out = Buffer("out", out_dtype or dtype, (8,), (1,), "output")
    return Kernel("k0", "pointwise", [], v, [], [Store(out, idx, value)], ["test"])


@pytest.mark.parametrize("target, source, renderer", TARGETS)
def test_an_op_missing_from_a_table_raises_one_error_naming_op_and_target(target, source, renderer):
    k = kernel_of(lambda eb, x, y: eb.binary("pow", x, y))   # integer pow: lowered through torch
    with pytest.raises(NoKernelForm) as info:
        source(k)
    err = info.value
    assert isinstance(err, SymtraceError) and isinstance(err, TypeError)
    assert (err.op, err.ty, err.target) == ("pow", "i64", target)
    assert "'pow'" in str(err) and f"the {target} kernel renderer" in str(err)


@pytest.mark.parametrize("target, source, renderer", TARGETS)
def test_an_unknown_op_raises_the_same_error(target, source, renderer):
    def make(eb, x, y):
        return Expr("frobnicate", "i64", (x,), None, 999)
    with pytest.raises(NoKernelForm, match=f"the {target} kernel renderer has no form for 'frobnicate' on i64"):
        source(kernel_of(make))


def test_integer_division_is_rendered_by_triton_only():
    k = kernel_of(lambda eb, x, y: eb.binary("div", x, y))
    assert "t2 = (t0 // t1)" in codegen_triton.kernel_source(k)
    with pytest.raises(NoKernelForm, match="'div' on i64"):
        codegen_c.kernel_source(k)


@pytest.mark.parametrize("target, source, renderer", TARGETS)
def test_every_ir_op_has_a_float_form_and_logic_ops_a_bool_form(target, source, renderer):
    ops = renderer.ops
    logic = ("and", "or", "xor")
    for op in list(UNARY_OPS) + [op for op in BINARY_OPS if op not in logic] + ["where"]:
        assert {"f32", "f64"} <= set(ops[op]), (target, op)
    for op in logic + ("not", "eq", "ne", "lt", "le", "gt", "ge", "where"):
        assert "b" in ops[op], (target, op)
    for op in ("add", "sub", "mul", "neg", "abs", "max", "min", "eq", "lt", "where"):
        assert "i64" in ops[op], (target, op)


@pytest.mark.parametrize("target, source, renderer", TARGETS)
def test_one_op_renders_through_the_table(target, source, renderer):
    k = kernel_of(lambda eb, x, y: eb.binary("max", x, y), torch.float32)
    want = {"C": "st_maxf(b0[(i0)], b1[(i0)])", "Triton": "st_max(t0, t1)"}[target]
    assert want in source(k)


def test_expand_spells_out_type_groups_and_the_float_suffix():
    table = expand({"neg": {"all": "(-{0})", "i64": "st_negi({0})"}, "exp": {"float": "st_exp{f}({0})"},
                    "abs": {"int": "{0}", "b": "({0} != 0)"}}, f32="f")
    assert {ty: form("x") for ty, form in table["neg"].items()} == {"f32": "(-x)", "f64": "(-x)", "i64": "st_negi(x)",
                                                                     "b": "(-x)"}
    assert {ty: form("x") for ty, form in table["exp"].items()} == {"f32": "st_expf(x)", "f64": "st_exp(x)"}
    assert {ty: form("x") for ty, form in table["abs"].items()} == {"i64": "x", "b": "(x != 0)"}


def test_templates_take_operands_in_any_order_and_keep_percent_signs():
    assert template("({0} > {1} ? {0} : {1})")("a", "b") == "(a > b ? a : b)"
    assert template("tl.where({0}, {1}, {2})")("c", "x", "y") == "tl.where(c, x, y)"
    assert template("({0} % 2)")("n") == "(n % 2)"
