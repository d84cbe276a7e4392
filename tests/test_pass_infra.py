"""symtrace.passes.infra: running plain pass functions with lint, timing, dumps, created_by."""
import functools
import operator

import pytest
import torch
from torch import nn

import symtrace
from symtrace.errors import GraphError
from symtrace.graph import Graph, GraphModule
from symtrace.passes.infra import PassContext, PassResult, graph_pass, pass_name, run_passes


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.fc(x * 2)) + 1


def _traced():
    torch.manual_seed(0)
    m = Small().eval()
    x = torch.randn(2, 4)
    return m, x, symtrace.symbolic_trace(m, example_inputs=(x,))


def double_to_add(gm):
    """x * 2 -> x + x (edits in place, returns None)."""
    for n in gm.graph.find_nodes(op="call_function", target=operator.mul):
        if n.args[1] == 2:
            with gm.graph.inserting_before(n):
                new = gm.graph.call_function(operator.add, (n.args[0], n.args[0]))
            n.replace_all_uses_with(new)
            gm.graph.erase_node(n)


def no_change(gm):
    return False


def rebuild(gm):
    """Returns a new GraphModule."""
    import copy
    return GraphModule(gm, copy.deepcopy(gm.graph))


def unchanged_result(gm):
    return PassResult(gm, modified=False)


def test_passes_run_in_order_and_created_by_names_the_last_changing_pass():
    m, x, gm = _traced()
    ctx = PassContext(lint=True)
    out = run_passes(gm, [double_to_add, no_change], ctx)
    assert out is gm
    assert ctx.history == [("double_to_add", None), ("no_change", False)]
    assert str(out.graph).splitlines()[0] == "graph():  # made by double_to_add"
    assert out.print_readable(print_output=False).startswith("# made by double_to_add\n")
    assert not out.graph.find_nodes(op="call_function", target=operator.mul)
    out.graph.lint()
    torch.testing.assert_close(out(x), m(x))


def test_a_pass_may_return_a_new_module_or_a_pass_result():
    m, x, gm = _traced()
    out = run_passes(gm, [rebuild, unchanged_result])
    assert out is not gm and isinstance(out, GraphModule)
    assert out.graph.created_by == "rebuild"  # unchanged_result reported no change
    torch.testing.assert_close(out(x), m(x))


def test_timings_record_every_pass_in_order():
    m, x, gm = _traced()
    ctx = PassContext(time=True)
    run_passes(gm, [double_to_add, no_change, functools.partial(no_change)], ctx)
    assert [name for name, _ in ctx.timings] == ["double_to_add", "no_change", "no_change"]
    assert all(isinstance(s, float) and 0 <= s < 10 for _, s in ctx.timings)
    assert PassContext().timings == []  # time=False records nothing
    run_passes(gm, [no_change], PassContext())


def test_dump_to_a_directory_writes_graph_and_code_after_each_pass(tmp_path):
    m, x, gm = _traced()
    run_passes(gm, [double_to_add, no_change], PassContext(dump=tmp_path / "dumps"))
    files = sorted(p.name for p in (tmp_path / "dumps").iterdir())
    assert files == ["00_input.txt", "01_double_to_add.txt", "02_no_change.txt"]
    first = (tmp_path / "dumps" / "00_input.txt").read_text()
    after = (tmp_path / "dumps" / "01_double_to_add.txt").read_text()
    assert "operator.mul" in first and "operator.mul" not in after
    assert "# made by double_to_add" in after and "def forward(self, x" in after


def test_dump_to_a_callable():
    m, x, gm = _traced()
    seen = []
    run_passes(gm, [double_to_add], PassContext(dump=lambda name, text: seen.append((name, text))))
    assert [name for name, _ in seen] == ["input", "double_to_add"]
    assert seen[1][1].startswith("graph():  # made by double_to_add")


def test_lint_failure_names_the_pass_that_broke_the_graph():
    m, x, gm = _traced()

    def break_order(gm):
        relu = gm.graph.find_nodes(op="call_function", target=torch.relu)[0]
        gm.graph.find_nodes(op="placeholder")[0].prepend(relu)  # relu before its input

    with pytest.raises(GraphError, match=r"pass 'break_order' \(2 of 2\) left an invalid graph"):
        run_passes(gm, [no_change, break_order], PassContext(lint=True))


def test_lint_checks_get_attr_targets_exist():
    m, x, gm = _traced()

    def dangling_attr(gm):
        out = gm.graph.output_node()
        with gm.graph.inserting_before(out):
            gm.graph.get_attr("not_registered")

    with pytest.raises(GraphError, match=r"pass 'dangling_attr'.*'not_registered'"):
        run_passes(gm, [dangling_attr], PassContext(lint=True))
    # without lint the broken pass goes unnoticed
    _, _, gm2 = _traced()
    run_passes(gm2, [dangling_attr])


def test_lint_blames_the_input_when_it_was_already_broken():
    g = Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.relu, (x,))
    g.output(y)
    gm = GraphModule(nn.Module(), g)
    x.prepend(y)
    with pytest.raises(GraphError, match="input of run_passes was already invalid"):
        run_passes(gm, [no_change], PassContext(lint=True))


def test_errors_inside_a_pass_get_a_note_and_bad_results_a_clear_error():
    m, x, gm = _traced()

    def boom(gm):
        raise ValueError("kaboom")

    with pytest.raises(ValueError) as info:
        run_passes(gm, [no_change, boom])
    assert "in pass 'boom' (2 of 2) of run_passes" in info.value.__notes__
    with pytest.raises(TypeError, match="pass 'returns_str' returned a value of type str"):
        run_passes(gm, [lambda_pass(lambda gm: "done", "returns_str")])
    with pytest.raises(TypeError, match="not a callable"):
        run_passes(gm, ["dce"])


def lambda_pass(fn, name):
    fn.__name__ = name
    return fn


def test_graph_pass_decorator_sets_created_by_when_called_directly():
    m, x, gm = _traced()

    @graph_pass(name="twice_to_add")
    def p(gm):
        double_to_add(gm)
        return True

    @graph_pass
    def nothing(gm):
        return False

    assert pass_name(p) == "twice_to_add" and pass_name(functools.partial(nothing)) == "nothing"
    assert nothing(gm) is False and gm.graph.created_by == "symbolic_trace"
    assert p(gm) is True and gm.graph.created_by == "twice_to_add"
    torch.testing.assert_close(gm(x), m(x))


def test_verbose_prints_one_line_per_pass(capsys):
    m, x, gm = _traced()
    run_passes(gm, [double_to_add, no_change], PassContext(verbose=True))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("[symtrace] double_to_add: ran,")
    assert "unchanged" in err[1]


def test_the_cleanup_passes_run_through_run_passes():
    from symtrace.passes.const_fold import constant_folding
    from symtrace.passes.cse import common_subexpression_elimination
    from symtrace.passes.dce import dead_code_elimination
    from symtrace.passes.shape_prop import propagate_shapes

    m, x, gm = _traced()
    ctx = PassContext(lint=True, time=True)
    out = run_passes(gm, [dead_code_elimination, common_subexpression_elimination,
                          functools.partial(constant_folding, max_numel=1000),
                          lambda g: propagate_shapes(g, x, mode="fake")], ctx)
    assert [n for n, _ in ctx.timings] == ["dead_code_elimination", "common_subexpression_elimination",
                                          "constant_folding", "<lambda>"]
    assert all(n.tensor_meta is not None for n in out.graph.nodes if n.op == "call_module")
    out.graph.lint()
    torch.testing.assert_close(out(x), m(x))


def test_a_pass_may_return_a_count_of_changes():
    m, x, gm = _traced()
    ctx = PassContext()
    out = run_passes(gm, [lambda_pass(lambda gm: 0, "counted_none"), lambda_pass(lambda gm: 2, "counted_two")], ctx)
    assert out is gm
    assert gm.graph.created_by == "counted_two"  # a count of 0 is "no change": the pass is not named
