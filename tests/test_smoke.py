import torch

import symtrace
from examples.models import build, example_inputs


def test_trace_examples_match_eager():
    for name in ("resnet", "transformer"):
        model, x = build(name), example_inputs(name)
        for gm in (symtrace.symbolic_trace(model), symtrace.symbolic_trace(model, example_inputs=x)):
            torch.testing.assert_close(gm(*x), model(*x))
