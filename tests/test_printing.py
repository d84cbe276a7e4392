import io
import operator

import pytest
import torch

import symtrace
from examples.models import build, example_inputs
from symtrace.graph.graph import Graph
from symtrace.graph.node import format_target
from symtrace.graph.tabular import HEADERS, format_tabular, print_tabular


@pytest.fixture(scope="module", params=["resnet", "transformer"])
def gm(request):
    return symtrace.symbolic_trace(build(request.param), example_inputs=example_inputs(request.param))


def _body(text):
    """The node rows of a table: drop the optional 'made by' line, the header and the rule."""
    lines = text.splitlines()
    if lines[0].startswith("#"):
        lines = lines[1:]
    assert lines[0].split() == list(HEADERS)
    assert set(lines[1]) <= {"-", " "}
    return lines[2:]


def test_one_row_per_node_with_shapes_and_sources(gm):
    nodes = list(gm.graph.nodes)
    rows = _body(format_tabular(gm))
    assert len(rows) == len(nodes)
    with_meta = 0
    for node, row in zip(nodes, rows):
        op, name = row.split()[:2]
        assert (op, name) == (node.op, node.name)
        assert node.format_target() in row
        if node.tensor_meta is not None:
            with_meta += 1
            assert str(node.tensor_meta) in row  # e.g. float32[2, 3, 32, 32]
        if node.source is not None:
            assert row.rstrip().endswith(str(node.source))
    assert with_meta > len(nodes) // 2
    assert "float32[" in rows[0]  # the input's shape


def test_graph_module_and_graph_give_the_same_table(gm):
    assert format_tabular(gm) == format_tabular(gm.graph)


def test_made_by_line():
    g = Graph()
    x = g.placeholder("x")
    g.output(x)
    assert format_tabular(g).splitlines()[0].split()[0] == "opcode"
    g.created_by = "fuse_conv_bn"
    first = format_tabular(g).splitlines()[0]
    assert first.startswith("#") and "fuse_conv_bn" in first


def test_args_kwargs_show_nodes_by_name():
    g = Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.add, (x, 1), {"alpha": 2})
    z = g.call_method("view", (y, [x, -1]))
    g.output((z, {"k": y}))
    rows = _body(format_tabular(g))
    assert "(x, 1)" in rows[1] and "{'alpha': 2}" in rows[1]
    assert "(add, [x, -1])" in rows[2]
    assert "((view, {'k': add}),)" in rows[3]
    # no tensor_meta and no source recorded: those cells stay empty
    assert "float" not in "\n".join(rows) and ".py:" not in "\n".join(rows)


def test_multiline_constant_stays_on_one_row():
    g = Graph()
    x = g.placeholder("x")
    g.output(g.call_function(operator.add, (x, torch.ones(2, 2))))
    rows = _body(format_tabular(g))
    assert len(rows) == 3 and "tensor([[1., 1.], [1., 1.]])" in rows[1]


def test_print_tabular_to_file_and_stdout(gm, capsys):
    buf = io.StringIO()
    print_tabular(gm, file=buf)
    assert buf.getvalue() == format_tabular(gm) + "\n"
    gm.graph.print_tabular()  # Graph.print_tabular delegates here
    assert capsys.readouterr().out == format_tabular(gm) + "\n"
    gm.graph.print_tabular(file=buf)
    assert buf.getvalue() == 2 * (format_tabular(gm) + "\n")


def test_rejects_other_objects():
    with pytest.raises(TypeError, match="Graph or GraphModule"):
        format_tabular(torch.nn.Linear(2, 2))


def test_format_target_of_torch_builtins():
    assert format_target(torch.add) == "torch.add"


def test_aten_targets_print_as_torch_ops():
    # graphs from torch.export call OpOverloads; they print as torch.export shows them
    from symtrace.graph.node import format_target
    assert format_target(torch.ops.aten.add.Tensor) == "torch.ops.aten.add.Tensor"
    assert format_target(torch.ops.aten.sum.default) == "torch.ops.aten.sum.default"
    assert format_target(torch.ops.aten.add) == "torch.ops.aten.add"
