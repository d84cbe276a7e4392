"""Module calls that run forward hooks (the module's own, or torch's global module hooks) are
never replaced by what a pass or the lowering would put there: eager runs the hooks around
every such call, so folding, packing, expanding, kernels or merging would skip them or show
them another module's result."""
import pytest
import torch
from torch import nn

import symtrace
from symtrace.lower import compile as lower
from symtrace.passes.cse import common_subexpression_elimination as cse
from symtrace.passes.fold_bn import fold_batch_norm
from symtrace.passes.module_hooks import global_forward_hooks, runs_forward_hooks
from kernel_tests import needs_c_compiler


def _scale_convs_and_linears(mod, inputs, out):
    return out * 2 if isinstance(mod, (nn.Conv2d, nn.Linear, nn.ReLU)) else None


def _model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).eval()
    with torch.no_grad():   # statistics that make the hooked and the folded results differ
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2)
        m[1].weight.uniform_(0.5, 2)
        m[1].bias.uniform_(-1, 1)
    return m


@pytest.fixture
def global_hook():
    h = nn.modules.module.register_module_forward_hook(_scale_convs_and_linears)
    yield
    h.remove()


def test_global_hooks_are_seen(global_hook):
    assert global_forward_hooks() and runs_forward_hooks(nn.ReLU())


def test_own_hooks_are_seen():
    m = nn.ReLU()
    assert not runs_forward_hooks(m) or global_forward_hooks()
    h = m.register_forward_pre_hook(lambda mod, args: None)
    assert runs_forward_hooks(m)
    h.remove()


@needs_c_compiler
@pytest.mark.usefixtures("session_kernel_cache")
@pytest.mark.parametrize("inference", [True, False])
def test_lowering_keeps_module_calls_with_global_hooks(global_hook, inference):
    m, x = _model(), torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        want = m(x)
        low = lower(m, (x,), speed_check=False, inference=inference)
        torch.testing.assert_close(low(x), want)


@needs_c_compiler
@pytest.mark.usefixtures("session_kernel_cache")
def test_lowering_keeps_a_module_call_hooked_after_tracing():
    # (tracing runs a module's own hooks as part of the program; a hook added to the traced
    # graph's module afterwards runs when the graph calls it)
    m, x = _model(), torch.randn(2, 3, 8, 8)
    gm = symtrace.symbolic_trace(m, example_inputs=(x,))
    gm.get_submodule("2").register_forward_hook(lambda mod, i, out: out + 1)   # the ReLU
    with torch.no_grad():
        want = gm(x)
        low = lower(gm, (x,), speed_check=False, inference=False)
        torch.testing.assert_close(low(x), want)
    assert "forward hooks" in low.report()


def test_fold_batch_norm_leaves_a_hooked_convolution(global_hook):
    m, x = _model(), torch.randn(2, 3, 8, 8)
    gm = symtrace.symbolic_trace(m, example_inputs=(x,))
    assert fold_batch_norm(gm) == 0
    with torch.no_grad():
        torch.testing.assert_close(gm(x), m(x))


def test_cse_keeps_both_calls_of_a_hooked_module():
    calls = []

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.relu = nn.ReLU()

        def forward(self, x):
            return self.relu(x) + self.relu(x)

    x = torch.randn(3)
    gm = symtrace.symbolic_trace(Twice(), example_inputs=(x,))
    gm.get_submodule("relu").register_forward_hook(lambda mod, i, out: calls.append(1))
    cse(gm)
    calls.clear()
    gm(x)
    assert len(calls) == 2


@needs_c_compiler
@pytest.mark.usefixtures("session_kernel_cache")
def test_a_global_hook_registered_after_lowering_runs():
    # the kernels were built without it: while it is registered the graph runs through torch
    m, x = _model(), torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        low = lower(m, (x,), speed_check=False)
        plain = low(x)
        h = nn.modules.module.register_module_forward_hook(_scale_convs_and_linears)
        try:
            with pytest.warns(UserWarning, match="registered after lowering"):
                got = low(x)
            torch.testing.assert_close(got, m(x))
        finally:
            h.remove()
        torch.testing.assert_close(low(x), plain)
        assert low.torch_calls == 1
