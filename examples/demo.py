"""symtrace demo: trace two bundled models, look at the graph three ways, edit it, check it.

Run with ``make demo``. Writes pictures under ``out/``.
"""
from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import operator  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import symtrace  # noqa: E402
from symtrace.graph.drawing import draw  # noqa: E402
from examples.models import build, example_inputs  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "out")


def banner(text: str) -> None:
    print(f"\n{'=' * 78}\n{text}\n{'=' * 78}")


def relu_to_relu6(gm: symtrace.GraphModule) -> int:
    """The small edit: after every ReLU module call, insert ``clamp_max(6)`` (ReLU -> ReLU6)."""
    edited = 0
    for node in gm.graph.find_nodes(op="call_module"):
        if isinstance(gm.get_submodule(node.target), nn.ReLU):
            with gm.graph.inserting_after(node):
                clamp = gm.graph.call_method("clamp_max", (node, 6.0), meta=dict(node.meta))
            node.replace_all_uses_with(clamp, delete_user_cb=lambda user: user is not clamp)
            edited += 1
    gm.graph.lint()
    return edited


def resnet_demo() -> None:
    model, (x,) = build("resnet"), example_inputs("resnet")
    banner("1. Trace SmallResNet with an example input")
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    gm.print_tabular()
    os.makedirs(OUT, exist_ok=True)
    picture = draw(gm, os.path.join(OUT, "resnet.svg"))
    print(f"\nPicture of the graph: {picture}")

    banner("2. Edit the graph: ReLU -> ReLU6, then look at the generated code")
    n = relu_to_relu6(gm)
    print(f"inserted {n} clamp_max nodes\n")
    print(gm.code)

    reference = build("resnet")
    for name, module in list(reference.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.ReLU):
                setattr(module, child_name, nn.ReLU6())
    x_big = torch.randn(2, 3, 32, 32) * 50  # large activations so ReLU6 actually clips
    with torch.no_grad():
        ok = torch.allclose(gm(x_big), reference(x_big), atol=1e-5, rtol=1e-4)
    print(f"edited graph == eager model with nn.ReLU6: {ok}")
    if not ok:
        raise SystemExit("demo check failed: the edited graph does not match eager")


def transformer_demo() -> None:
    model, (x,) = build("transformer"), example_inputs("transformer")
    banner("3. Trace a transformer block: shape-dependent Python resolves, guarded")
    print(symtrace.explain(model, x))
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    x2 = torch.randn(5, 11, 64)  # another batch and sequence length: no re-trace needed
    with torch.no_grad():
        same = torch.allclose(gm(x2), model(x2), atol=1e-5)
    print(f"\ntraced on {tuple(x.shape)}, replayed on {tuple(x2.shape)}: equal to eager: {same}")
    draw(gm, os.path.join(OUT, "transformer.svg"))
    try:
        gm(x2, mask=torch.zeros(11, 11))
    except symtrace.GuardError as e:
        print(f"\ncalling with a mask it was not traced with -> GuardError:\n  {e}")
    captured = symtrace.capture(model)
    with torch.no_grad():
        for inp, mask in ((x, None), (x2, None), (x2, torch.zeros(11, 11))):
            out = captured(inp, mask)
            assert torch.allclose(out, model(inp, mask), atol=1e-5)
    print(f"\nsymtrace.capture: eager answers for 3 calls using {len(captured.graphs)} captured graphs")
    if not same:
        raise SystemExit("demo check failed: transformer replay differs from eager")


if __name__ == "__main__":
    torch.manual_seed(0)
    resnet_demo()
    transformer_demo()
    print(f"\nPictures written under {OUT}/")
