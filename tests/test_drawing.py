import copy
import html
import re
import shutil
import subprocess

import pytest
import torch

import symtrace
from examples.models import build, example_inputs
from symtrace.graph.drawing import OP_COLORS, draw, to_dot
from symtrace.graph.graph import Graph

DOT = shutil.which("dot")
needs_dot = pytest.mark.skipif(DOT is None, reason="graphviz's dot program is not installed")

WEIRD = '{|}<>"\\'  # record-label and quoting metacharacters, and a backslash


@pytest.fixture(scope="module")
def models():
    return {name: symtrace.symbolic_trace(build(name), example_inputs=example_inputs(name))
            for name in ("resnet", "transformer")}


def _svg_text(source):
    """Render DOT with ``dot -Tsvg`` (failing on any error or warning); the drawn text."""
    res = subprocess.run([DOT, "-Tsvg"], input=source.encode(), capture_output=True)
    assert res.returncode == 0 and not res.stderr, res.stderr.decode()
    return html.unescape(res.stdout.decode())


def _declaration(dot, name):
    m = re.search(rf"^\s*{re.escape(name)} \[(.*)\]$", dot, re.M)
    assert m, f"node {name} not declared"
    return m.group(1)


def _escaping_graph():
    """A traced einsum, plus string literals full of DOT metacharacters."""
    gm = symtrace.symbolic_trace(lambda a, b: torch.einsum("a,b->ab", a, b),
                                 example_inputs=(torch.ones(2), torch.ones(3)))
    g = gm.graph
    out = g.output_node()
    with g.inserting_before(out):
        w = g.call_method("weird", (out.args[0], WEIRD), {"end": "tail\\", "nl": "a\nb"})
        w._target = "<b>we\"ird</b>"  # not an identifier (so never code), but a picture still escapes it
        p = g.get_attr("raw\nnewline\\" + "x" * 100)  # a raw newline and an over-long line
    out.args = ((w, p),)
    return g


def test_nodes_coloured_by_opcode_and_labelled(models):
    gm = models["resnet"]
    dot = to_dot(gm)
    for node in gm.graph.nodes:
        decl = _declaration(dot, node.name)
        assert f'fillcolor="{OP_COLORS[node.op]}"' in decl
        assert node.op in decl and node.name in decl
        if node.source is not None:
            assert str(node.source) in decl
    assert len(set(OP_COLORS.values())) == len(OP_COLORS)


def test_module_clusters_are_nested(models):
    dot = to_dot(models["resnet"])
    depth = {}
    for line in dot.splitlines():
        m = re.match(r'^(\t*)subgraph "?cluster_([\w.]+)"? \{', line)
        if m:
            depth[m.group(2)] = len(m.group(1))
    assert depth["stem"] == depth["layer1"] == 1
    assert depth["layer1.0"] == depth["layer2.1"] == 2
    assert depth["layer2.0.downsample"] == 3
    # a leaf module's node sits in its caller's cluster, not one of its own
    assert "layer1.0.conv1" not in depth and "stem.0" not in depth
    stem = dot[dot.index("subgraph cluster_stem"):]
    stem = stem[:stem.index("}")]
    assert all(f"\t\tstem_{i} [" in stem for i in range(3))


def test_edges_labelled_with_producer_types(models):
    gm = models["resnet"]
    dot = to_dot(gm)
    edges = 0
    for node in gm.graph.nodes:
        for inp in node.all_input_nodes:
            edges += 1
            tm = inp.tensor_meta
            if tm is not None:
                label = str(tm).replace(" ", "")
                assert f"\t{inp.name} -> {node.name} [label=\"{label}\"]" in dot
            else:
                assert f"\t{inp.name} -> {node.name}\n" in dot
    assert dot.count(" -> ") == edges
    assert '\tx -> stem_0 [label="float32[2,3,32,32]"]' in dot


def test_dot_is_deterministic(models):
    gm = models["transformer"]
    assert to_dot(gm) == to_dot(gm) == to_dot(gm.graph)
    assert to_dot(copy.deepcopy(gm)) == to_dot(gm)


def test_labels_are_escaped():
    dot = to_dot(_escaping_graph())
    # quotes inside labels are escaped, backslashes doubled, newlines never raw
    assert 'einsum\\l(\'a,b->ab\', a, b)' in dot
    assert "'{|}<>\\\"\\\\\\\\'" in dot
    assert "<b>we\\\"ird</b>" in dot
    assert "get_attr: raw newline\\\\" + "x" * 37 + "…\\l" in dot  # clipped to 60 characters
    assert dot.count("\n") == dot.count("\n\t") + 2  # one statement per line


@needs_dot
def test_dot_renders_escaped_labels_verbatim():
    svg = _svg_text(to_dot(_escaping_graph()))
    assert "('a,b->ab', a, b)" in svg
    assert "'{|}<>\"\\\\'" in svg  # the repr of WEIRD, exactly as printed
    assert "<b>we\"ird</b>" in svg
    assert "end='tail\\\\'" in svg and "nl='a\\nb'" in svg
    assert "raw newline\\xxx" in svg


@needs_dot
def test_dot_accepts_example_models(models):
    for name, cluster in (("resnet", "layer2.0.downsample"), ("transformer", "mlp")):
        svg = _svg_text(to_dot(models[name]))
        assert svg.count('class="cluster"') >= 1 and f">{cluster}</text>" in svg


@needs_dot
def test_draw_renders_by_suffix(models, tmp_path):
    gm = models["transformer"]
    out = draw(gm, tmp_path / "t.svg")
    assert out == str(tmp_path / "t.svg")
    assert "<svg" in (tmp_path / "t.svg").read_text()
    draw(gm, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    draw(gm, tmp_path / "t.img", format="pdf")
    assert (tmp_path / "t.img").read_bytes()[:5] == b"%PDF-"


def test_draw_dot_text(models, tmp_path):
    gm = models["transformer"]
    assert draw(gm, tmp_path / "t.dot") == str(tmp_path / "t.dot")
    assert (tmp_path / "t.dot").read_text() == to_dot(gm)


def test_draw_without_dot_program_writes_dot_and_warns(models, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    gm = models["transformer"]
    with pytest.warns(UserWarning, match="apt-get install graphviz"):
        out = draw(gm, tmp_path / "g.svg")
    assert out == str(tmp_path / "g.dot")
    assert not (tmp_path / "g.svg").exists()
    assert (tmp_path / "g.dot").read_text() == to_dot(gm)


def test_draw_rejects_unknown_formats(tmp_path):
    g = Graph()
    g.output(g.placeholder("x"))
    with pytest.raises(ValueError, match="suffix"):
        draw(g, tmp_path / "noext")
    with pytest.raises(ValueError, match="unsupported format 'bmp'"):
        draw(g, tmp_path / "a.bmp")


def test_symtrace_imports_without_graphviz_and_drawing_says_what_is_missing():
    # Machines without the graphviz Python package (a GPU box, a slim image) still import and
    # trace; only drawing needs it, and it says so.
    import subprocess
    import sys
    code = (
        "import sys; sys.modules['graphviz'] = None\n"
        "import torch, symtrace\n"
        "gm = symtrace.symbolic_trace(lambda x: x.relu() + 1)\n"
        "assert torch.equal(gm(torch.ones(2)), torch.full((2,), 2.0))\n"
        "try:\n"
        "    symtrace.to_dot(gm)\n"
        "except ImportError as e:\n"
        "    assert 'graphviz' in str(e), e\n"
        "    print('refused')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "refused"
