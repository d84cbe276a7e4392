"""Programs from PyTorch's test/test_fx.py (TestFX): the modules and functions those tests
trace with ``torch.fx.symbolic_trace`` and check against eager."""
from __future__ import annotations

from collections import namedtuple
from typing import List, Tuple

import torch

from . import In, program, r, t


class MySub(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(4, 3))

    def forward(self, x):
        return self.w + x


# pytorch test/test_fx.py::TestFX::test_graph_module
@program(In(r(4, 3, seed=1).abs() + 0.5, r(4, 3, seed=2), r(4, 4, seed=3)),
         In(r(1, 3, seed=4).abs() + 0.5, r(4, 3, seed=5), r(4, 4, seed=6, requires_grad=True)))
class MyModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.sub_mod = MySub()
        self.w = torch.nn.Parameter(torch.rand(3))

    def forward(self, A, B, c):
        t = torch.sigmoid(A) + self.lin(c)
        return self.sub_mod(t.data + self.w + t + 1 - A + B // A + -A + A.add(B, alpha=3))


# pytorch test/test_fx.py::TestFX::test_graph_module (M2)
@program(In(r(5, 3, seed=1)), In(r(2, seed=2)))
class M2(torch.nn.Module):
    def forward(self, A):
        m, idx = torch.max(A, 0)
        return m + 1, idx + 1


# pytorch test/test_fx.py::TestFX::test_graph_module (T)
@program(In(r(3, seed=1), 4, r(3, seed=2), **{"3": r(3, seed=3)}), In(r(3, seed=4), 2, 7.0, r(1, seed=5), **{"3": 1.5}),
         In(r(2, seed=6), 4, r(2, seed=7), c=1, **{"3": r(2, seed=8)}))
class T(torch.nn.Module):
    def forward(self, A, b=4, *args, c=5, **kwargs):
        x = A + 1 + args[0] + kwargs["3"]
        return x


# pytorch test/test_fx.py::TestFX::test_args_kwargs
@program(In(r(1, seed=1), r(1, seed=2), foo=r(1, seed=3)), In(r(3, seed=4), foo=r(3, seed=5)))
class ArgsKwargs(torch.nn.Module):
    def forward(self, *args, **kwargs):
        x = args[0] + kwargs["foo"]
        return x


# pytorch test/test_fx.py::TestFX::test_fx_shifts
@program(In(torch.arange(10, dtype=torch.long) * 97 % 1024), In(torch.arange(3, dtype=torch.int32) + 1000))
class Shifts(torch.nn.Module):
    def forward(self, x):
        return x << 3, x >> 3


# pytorch test/test_fx.py::TestFX::test_dict
@program(In({"3": r(3, 4, seed=1)}), In({"3": r(2, seed=2), "4": r(2, seed=3)}))
class MyDictMod(torch.nn.Module):
    def forward(self, d):
        return d["3"].relu(), {"4": d["3"].neg()}


_const = r(3, seed=11)


# pytorch test/test_fx.py::TestFX::test_matmul_tracing (rmatmul_f)
@program(In(r(3, seed=1)), In(r(3, 2, seed=2)))
def rmatmul_f(x):
    return _const @ x


# pytorch test/test_fx.py::TestFX::test_disallow_override (MyInplaceMod)
@program(In(r(3, seed=1)), In(r(2, 2, seed=2)), In(r(3, seed=3, dtype=torch.float64)))
class MyInplaceMod(torch.nn.Module):
    def forward(self, x):
        x.add_(3.0)
        return x


# pytorch test/test_fx.py::TestFX::test_disallow_override (MyInplaceMod3)
@program(In(r(3, 4, seed=1)), In(r(4, seed=2)))
class MyInplaceMod3(torch.nn.Module):
    def forward(self, x):
        y = torch.ones(3, 4)
        y.add_(x)
        return x, y


def a_lifted_leaf(a, b):
    return a[0] + a[1] + b


# pytorch test/test_fx.py::TestFX::test_wrap
@program(In(2), In(r(3, seed=1)), In(2.5))
def to_trace(y):
    return a_lifted_leaf((4, y), 3) + a_lifted_leaf((3, 4), 5) + a_lifted_leaf((y, y), y)


def wrapped_with_submodule(x: torch.Tensor, batchnorm1d: torch.nn.BatchNorm1d):
    return batchnorm1d(x)


# pytorch test/test_fx.py::TestFX::test_wrap_with_submodule
@program(In(r(3, 2, seed=1)), In(r(5, 2, seed=2)), flip="eval")
class WrapWithSubmodule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.batchnorm1d = torch.nn.BatchNorm1d(2, affine=False)

    def forward(self, x: torch.Tensor):
        return wrapped_with_submodule(x, self.batchnorm1d)


class TensorPair(metaclass=torch.fx.ProxyableClassMeta):
    def __init__(self, left, right):
        self.left, self.right = left, right

    def add(self, other):
        l = self.left + other.left  # noqa: E741
        r = self.right + other.right
        return TensorPair(l, r)

    def mul(self, other):
        l = self.left * other.left  # noqa: E741
        r = self.right * other.right
        return TensorPair(l, r)


# pytorch test/test_fx.py::TestFX::test_custom_proxy_dynamic_value
@program(In(TensorPair(r(5, 3, seed=1), r(5, 3, seed=2)), r(5, 3, seed=3)),
         In(TensorPair(r(2, seed=4), r(2, seed=5)), r(2, seed=6)))
def use_tensor_pair_ctor(x: TensorPair, y: torch.Tensor):
    s = x.add(TensorPair(y, y))
    return s.mul(x)


class ZeroTensor(metaclass=torch.fx.ProxyableClassMeta):
    def __init__(self, inp):
        if inp.sum() == 0:
            self.is_zero = True
            self.tensor = torch.tensor([])
        else:
            self.is_zero = False
            self.tensor = inp

    def add(self, other):
        if self.is_zero:
            return ZeroTensor(other.tensor)
        elif other.is_zero:
            return self


# pytorch test/test_fx.py::TestFX::test_custom_proxy_input_dependent_control_flow
@program(In(r(5, 3, seed=1), r(5, 3, seed=2)), In(t(1.0, -2.0), t(-1.0, 2.0)), In(r(2, seed=3), r(2, seed=4)))
def use_zero_tensor(x: torch.Tensor, y: torch.Tensor):
    return ZeroTensor(x + y)


# pytorch test/test_fx.py::TestFX::test_symbolic_trace_assert
@program(In(r(4, 5, seed=1)), In(r(2, 6, seed=2)), In(r(4, 3, seed=3)))
class AssertsTensorShape(torch.nn.Module):
    def forward(self, x):
        torch._assert(x.shape[1] > 4, "assert_foobar")
        return x


class CustomArgObject:
    def __init__(self, x, y):
        self.x = x
        self.y = y


class HasCustomArgObjectWhenLeaf(torch.nn.Module):
    def forward(self, o: CustomArgObject):
        for x in o.x:
            o.y += x
        return o.y


# pytorch test/test_fx.py::TestFX::test_fx_create_arg
@program(In(r(3, 2, seed=1), r(2, seed=2)), In(r(1, 2, seed=3), r(2, seed=4)), In(r(4, 2, seed=5), r(2, seed=6)))
class Root(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = HasCustomArgObjectWhenLeaf()

    def forward(self, x, y):
        o = CustomArgObject(x, y)
        return self.inner(o)


class ReturnTwo(torch.nn.Module):
    def forward(self, x):
        return (3, torch.sum(x))


# pytorch test/test_fx.py::TestFX::test_shape_prop_aggregate
@program(In(r(3, 4, seed=1)), In(r(2, seed=2)))
class UnderTest(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rt = ReturnTwo()

    def forward(self, x):
        return self.rt(x)


class _A(torch.nn.Module):
    def forward(self, t):
        return t + t


class _B(torch.nn.Module):
    def __init__(self):
        super(type(self), self).__init__()
        self.calling = False
        self.called = False

    def forward(self, t):
        if self.calling:
            return t - t
        else:
            return t + t

    def __call__(self, *args):
        self.called = True
        self.calling = True
        return super(type(self), self).__call__(*args)
        self.calling = False


# pytorch test/test_fx.py::TestFX::test_tracing_graphmodules_as_leaf_submodules
@program(In(r(3, seed=1)), In(r(2, 2, seed=2)))
class M(torch.nn.Module):
    def __init__(self, a=None, b=None):
        super().__init__()
        self.a = a if a is not None else _A()
        self.b = b if b is not None else _B()

    def forward(self, t):
        x = self.a(t)
        y = self.b(t)
        return x + y


class _CallableA:
    def __call__(self, x: torch.Tensor):
        return torch.add(x, x)


# pytorch test/test_fx.py::TestFX::test_annotations_with_non_torch_reference_and_no_internal_forward_references
@program(In([r(2, 3, seed=1)], _CallableA()), In([r(3, seed=2), r(1, seed=3)], torch.neg))
class AnnotatedCallableArg(torch.nn.Module):
    def forward(self, x: List[torch.Tensor], a: _CallableA) -> torch.Tensor:
        return a(x[0])


# pytorch test/test_fx.py::TestFX::test_annotations_empty_tuple
@program(In((), ("bar", ())), In((), ("baz", ())))
class EmptyTupleAnnotations(torch.nn.Module):
    def forward(self, x: Tuple[()], y: Tuple[str, Tuple[()]]):
        return "foo"


# pytorch test/test_fx.py::TestFX::test_randn
@program(In(), In(), random=True)
def randn_f():
    return torch.randn(3, 3)


# pytorch test/test_fx.py::TestFX::test_pytree (f_sum)
@program(In([r(3, seed=1), r(3, seed=2), r(3, seed=3)]), In([]), In([r(3, seed=4)]))
def f_sum(x):
    return sum(x)


# pytorch test/test_fx.py::TestFX::test_pytree (f_dict_list_map)
@program(In({"a": (r(3, seed=1), r(3, seed=2)), "b": [r(3, seed=3)], "c": []}), In({5: (r(3, seed=4),) * 3}))
def f_dict_list_map(x):
    new_dict = {}
    for k, v in x.items():
        new_dict[k] = [i + 1 for i in v]
    return new_dict


class PyFoo(object):  # noqa: B209 - ``Foo`` of test_fx.py
    def __init__(self, a, b):
        self.a = a
        self.b = b


# pytorch test/test_fx.py::TestFX::test_pytree (f_custom)
@program(In(PyFoo(r(3, seed=1), r(3, seed=2))), In(PyFoo(r(3, seed=3), 3)))
def f_custom(x):
    return x.a + x.b


Point = namedtuple("Point", ["x", "y"])


# pytorch test/test_fx.py::TestFX::test_pytree (f_namedtuple_add)
@program(In(Point(r(3, seed=1), r(3, seed=2))), In(Point(r(2, seed=3), 4)))
def f_namedtuple_add(x):
    return x.x + x.y


# pytorch test/test_fx.py::TestFX::test_pytree_concrete
@program(In(True, {"a": r(3, seed=1), "z": r(3, seed=2)}), In(False, {"a": r(3, seed=3), "z": r(3, seed=4)}))
def pytree_concrete(b, a):
    if b:
        return a["a"]
    else:
        return a["z"]
