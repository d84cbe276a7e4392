"""Strings never become code: names, keyword keys, method names and comments in generated
source pass one choke point (symtrace.graph.code_text). Each test uses a payload that would
create a canary file if it ran."""
import operator
import os

import pytest
import torch

import symtrace
from symtrace.graph import Graph, GraphModule
from symtrace.graph.code_text import UnsafeNameError, comment_text, one_line
from symtrace.graph.source import SourceLocation


@pytest.fixture
def canary(tmp_path):
    path = tmp_path / "ran"
    yield str(path), f"open({str(path)!r}, 'w').close()"
    assert not path.exists(), "injected code ran"


@symtrace.leaf_function
def _leaf(x, **kw):
    return x + len(kw)


def test_keyword_keys_are_quoted_not_pasted(canary):
    _, payload = canary
    key = f"a={payload},b"

    def f(x):
        return _leaf(x, **{key: x})

    gm = symtrace.symbolic_trace(f, example_inputs=(torch.randn(2),))
    assert payload not in gm.code.replace(repr(key), "")  # only inside the quoted key
    assert torch.equal(gm(torch.zeros(2)), torch.ones(2))  # the odd key still reaches the function


def test_keyword_keys_through_dict_symbolic(canary):
    _, payload = canary
    key = f"k={payload}"

    def f(x):
        return x + len(dict(**{key: 1}))

    gm = symtrace.symbolic_trace(f)
    assert torch.equal(gm(torch.zeros(2)), torch.ones(2))


def test_source_file_name_with_newline_stays_in_the_comment(canary):
    _, payload = canary
    g = Graph()
    x = g.placeholder("x")
    loc = SourceLocation(f"evil.py\n{payload}\n#", 3, "forward", None)
    y = g.create_node("call_function", torch.relu, (x,), meta={"source": loc})
    g.output(y)
    gm = GraphModule(torch.nn.Module(), g)
    assert all(not line.lstrip().startswith("open(") for line in gm.code.splitlines())
    gm(torch.randn(3))


def test_comment_text_is_one_printable_line():
    for text in ["a\nb", "a\rb", "a\x00b", "a\u2028b", "a\x85b", "a\x0cb"]:
        out = comment_text(text)
        assert len(out.splitlines()) == 1 and "\x00" not in out, repr(out)
    assert len(one_line("x" * 10_000)) <= 4096 and len(comment_text("x" * 10_000)) <= 300


def test_call_method_target_must_be_an_identifier(canary):
    _, payload = canary
    g = Graph()
    x = g.placeholder("x")
    with pytest.raises(UnsafeNameError, match="method name"):
        g.create_node("call_method", f"relu(); {payload}; x.abs", (x,))


def test_edited_node_name_and_method_are_refused_at_codegen(canary):
    _, payload = canary
    g = Graph()
    x = g.placeholder("x")
    y = g.create_node("call_method", "relu", (x,))
    g.output(y)
    gm = GraphModule(torch.nn.Module(), g)
    y._target = f"relu(); {payload}; x.abs"  # bypassing every setter
    with pytest.raises(UnsafeNameError):
        gm.recompile()
        gm(torch.randn(2))
    y._target = "relu"
    y.name = f"y = 1; {payload}; z"
    with pytest.raises(UnsafeNameError, match="node"):
        gm.recompile()
        gm(torch.randn(2))


def test_lowering_refuses_names_lint_rejects(canary):
    _, payload = canary
    from symtrace.lower import compile as lower
    gm = symtrace.symbolic_trace(lambda x: torch.relu(x) * 2, example_inputs=(torch.randn(4),))
    relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
    relu.name = f"r = 0; {payload}; s"
    with pytest.raises(UnsafeNameError):
        lower(gm, (torch.randn(4),))


def test_placeholder_input_name_is_checked(canary):
    _, payload = canary
    g = Graph()
    x = g.placeholder("x")
    g.output(x)
    gm = GraphModule(torch.nn.Module(), g)
    x._target = f"x=0, *, y=({payload})"
    with pytest.raises(UnsafeNameError, match="input name"):
        gm.recompile()
        gm(torch.randn(2))


def test_graph_module_class_name_is_an_identifier():
    with pytest.raises(ValueError):
        GraphModule(torch.nn.Module(), Graph(), class_name="M(object):\n    import os\nclass N")


def test_getattr_of_odd_attribute_names_is_quoted():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.add_module("0", torch.nn.ReLU())

        def forward(self, x):
            return getattr(self, "0")(x)

    gm = symtrace.symbolic_trace(M(), example_inputs=(torch.randn(2),))
    assert "getattr(self, '0')" in gm.code
    assert torch.equal(gm(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))
