"""Rule tables: fixed-point application, skipping, limits, definition sites, debug output."""
import operator

import pytest
import torch

import symtrace
from symtrace.passes.rules import Rule, RuleLimitError, RuleTable

RELU_RELU = Rule("relu_relu", lambda x: torch.relu(torch.relu(x)), lambda m: lambda x: torch.relu(x))
RELU_RELU_LINE = RELU_RELU.site.lineno
MUL_ONE = Rule("mul_one", lambda x: x * 1, lambda m: lambda x: x)


def f(x):
    a = torch.relu(torch.relu(x))
    b = a * 1  # mul_one fires here
    return torch.relu(torch.relu(torch.relu(b)))


def test_fixed_point_and_counts():
    gm = symtrace.symbolic_trace(f)
    x = torch.randn(6)
    table = RuleTable([RELU_RELU, MUL_ONE])
    counts = table.apply(gm)
    # mul_one removes the multiply; relu chains then collapse across it, one pair at a time
    assert counts["mul_one"] == 1 and counts["relu_relu"] >= 4
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops == [torch.relu]
    assert torch.equal(gm(x), f(x))
    gm.graph.lint()
    assert table.apply(gm) == {"relu_relu": 0, "mul_one": 0}  # already at the fixed point


def test_rewrite_may_decline():
    def only_floats(m):
        k = m.literals["lit0"]
        return (lambda x, lit0: x * lit0) if isinstance(k, int) else None

    double = Rule("mul_int", lambda x: x * 2, only_floats, literals="capture")
    gm = symtrace.symbolic_trace(lambda x: x * 2.0)
    assert RuleTable([double]).apply(gm) == {"mul_int": 0}
    gm.graph.lint()


def test_rules_that_undo_each_other_hit_the_limit():
    to_sub = Rule("neg_to_sub", lambda x: torch.neg(x), lambda m: lambda x: torch.sub(0.0, x))
    to_neg = Rule("sub_to_neg", lambda x: torch.sub(0.0, x), lambda m: lambda x: torch.neg(x))
    gm = symtrace.symbolic_trace(lambda x: torch.neg(x))
    with pytest.raises(RuleLimitError, match="after 5 rounds"):
        RuleTable([to_sub, to_neg]).apply(gm, max_iterations=5)
    gm.graph.lint()


def test_table_is_indexed_by_anchor():
    table = RuleTable([RELU_RELU, MUL_ONE])
    assert table.by_anchor[("call_function", torch.relu)] == [RELU_RELU]
    assert table.by_anchor[("call_function", operator.mul)] == [MUL_ONE]
    gm = symtrace.symbolic_trace(lambda x: torch.sigmoid(x) * 2)
    assert table.applicable(gm) == [MUL_ONE]
    with pytest.raises(ValueError, match="unique"):
        RuleTable([RELU_RELU, RELU_RELU])


def test_rule_records_its_definition_site():
    assert RELU_RELU.site.filename == __file__
    assert RELU_RELU.site.lineno == RELU_RELU_LINE
    assert "relu_relu" in repr(RELU_RELU) and "test_rules.py" in repr(RELU_RELU)


def test_debug_output(capsys):
    gm = symtrace.symbolic_trace(f)
    RuleTable([RELU_RELU, MUL_ONE]).apply(gm, debug=True)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines, "debug printed nothing"
    first_mul = next(line for line in lines if line.startswith("rule 'mul_one'"))
    assert "test_rules.py:" in first_mul and "%mul" in first_mul
    assert "b = a * 1  # mul_one fires here" in first_mul  # the user's source line
    relu_line = next(line for line in lines if line.startswith("rule 'relu_relu'"))
    assert f"test_rules.py:{RELU_RELU_LINE}" in relu_line


def test_debug_from_environment(capsys, monkeypatch):
    gm = symtrace.symbolic_trace(lambda x: x * 1)
    monkeypatch.setenv("SYMTRACE_DEBUG_RULES", "1")
    RuleTable([MUL_ONE]).apply(gm)
    assert "rule 'mul_one'" in capsys.readouterr().out
    monkeypatch.setenv("SYMTRACE_DEBUG_RULES", "0")
    RuleTable([MUL_ONE]).apply(symtrace.symbolic_trace(lambda x: x * 1))
    assert capsys.readouterr().out == ""


def test_rewrite_must_be_callable():
    with pytest.raises(TypeError, match="rewrite must be a callable"):
        Rule("bad", lambda x: x * 1, None)
