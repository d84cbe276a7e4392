"""Programs from PyTorch's test/dynamo/test_modules.py: the ``nn.Module`` classes that
NNModuleTests runs through ``make_test`` (called on (10, 10) inputs there), and modules and
functions from the OptimizedModuleTest / hook tests. Inputs vary the batch size and
requires_grad; flips change the training flag or an attribute the forward reads."""
# ruff: noqa: F841
from __future__ import annotations

import collections
import types
from typing import Tuple

import torch
import torch.nn.functional as F
from torch.nn.modules.lazy import LazyModuleMixin

from . import In, program, r, t

X = [In(r(10, 10, seed=1)), In(r(3, 10, seed=2)), In(r(1, 10, seed=3, requires_grad=True))]
X2 = X[:2]
XB = [In(r(10, 10, seed=1)), In(r(1, 10, seed=2))]  # for forwards that add a (10, 10) tensor


def constant3(a, b):  # test_functions.constant3, used by ViaModuleCall
    return a - b + (1.0 + 2)


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_basicmodule1
@program(*X)
class BasicModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = torch.nn.Linear(10, 10)
        self.scale = torch.randn(1, 10)

    def forward(self, x):
        return F.relu(self.linear1(x)) * self.scale


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_fnmember
@program(*X, flip={"activation": None})
class FnMember(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = torch.nn.Linear(10, 10)
        self.activation = F.relu

    def forward(self, x):
        x = self.linear1(x)
        if self.activation:
            x = self.activation(x)
        return x


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_fnmembercmp1
@program(*X2, flip={"activation": None})
class FnMemberCmp(torch.nn.Module):
    def __init__(self, activation=F.relu):
        super().__init__()
        self.linear1 = torch.nn.Linear(10, 10)
        self.activation = activation

    def forward(self, x):
        x = self.linear1(x)
        if self.activation is not None:
            x = self.activation(x)
        if self.activation is None:
            x = torch.sigmoid(x)
        return x


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_submodules1
@program(*X, flip="eval")
class SubmoduleExample(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = BasicModule()
        self.layer2 = BasicModule()
        self.scale = torch.randn(1, 10)

    def forward(self, x):
        x = self.layer1(x)
        x = self.layer2(x)
        return x * self.scale


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_modulemethod1
@program(*X2)
class ModuleMethodCall(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = BasicModule()
        self.layer2 = BasicModule()
        self.scale = torch.randn(1, 10)

    def call_and_scale(self, mod, x):
        x = mod(x)
        return x * self.scale

    def forward(self, x):
        x1 = self.call_and_scale(self.layer1, x)
        x2 = self.call_and_scale(self.layer2, x)
        return x1 + x2


class ModuleWithStaticForward(torch.nn.Module):
    @staticmethod
    def forward(x):
        return x * torch.sigmoid(x)


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_module_call_module_with_static_forward
@program(*X2)
class ModuleCallModuleWithStaticForward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mod = ModuleWithStaticForward()

    def forward(self, x):
        return self.mod(x)


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_module_static_method
@program(*X2)
class ModuleStaticMethodCall(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = BasicModule()
        self.layer2 = BasicModule()
        self.scale = torch.randn(1, 10)

    @staticmethod
    def call_and_scale(scale, mod, x):
        x = mod(x)
        return x * scale

    def forward(self, x):
        x1 = self.call_and_scale(self.scale, self.layer1, x)
        x2 = self.call_and_scale(self.scale, self.layer2, x)
        return x1 + x2


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_module_class_method
@program(*X2)
class ModuleClassMethodCall(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = BasicModule()
        self.layer2 = BasicModule()
        self.scale = torch.randn(1, 10)

    @classmethod
    def call_and_scale(cls, scale, mod, x):
        x = mod(x)
        return x * scale

    def forward(self, x):
        x1 = self.call_and_scale(self.scale, self.layer1, x)
        x2 = self.call_and_scale(self.scale, self.layer2, x)
        return x1 + x2


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_module_property
@program(*X2, flip={"scale": torch.full((1, 10), 3.0)})
class ModuleProperty(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.randn(1, 10)

    @property
    def scale_alias(self):
        return self.scale

    def forward(self, x):
        return x * self.scale_alias


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_constloop
@program(*X2, flip={"count": 1})
class ConstLoop(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = torch.nn.Linear(10, 10)
        self.count = 3

    def forward(self, x):
        for i in range(self.count):
            x = torch.sigmoid(self.linear1(x))
        return x


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_istraining1
@program(*X, flip="eval")
class IsTrainingCheck(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = torch.nn.Linear(10, 10)
        self.linear2 = torch.nn.Linear(10, 10)
        self.train(True)

    def forward(self, x):
        if self.training:
            mod = self.linear1
        else:
            mod = self.linear2
        return F.relu(mod(x))


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_iseval1
@program(*X2, flip="train")
class IsEvalCheck(IsTrainingCheck):
    def __init__(self) -> None:
        super().__init__()
        self.train(False)


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_viamodulecall
@program(*X2)
class ViaModuleCall(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = torch.nn.Linear(10, 10)

    def forward(self, x):
        return constant3(torch.sigmoid(self.linear1(x)), x)


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_isnonelayer
@program(*X2, flip={"layer2": torch.nn.ReLU})
class IsNoneLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = torch.nn.Linear(10, 10)
        self.layer2 = None
        self.train(True)

    def forward(self, x):
        if self.layer1 is not None:
            x = self.layer1(x)
        if self.layer2 is not None:
            x = self.layer2(x)
        return x


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_layerlist
@program(*X2)
class LayerList(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = [
            torch.nn.Linear(10, 10),
            torch.nn.ReLU(),
            torch.nn.Linear(10, 10),
        ]

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_tensorlist
@program(In(r(10, 10, seed=1)), In(r(10, 1, seed=2)))
class TensorList(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = (
            torch.randn((1, 10)),
            torch.randn((10, 1)),
            torch.randn((1, 10)),
            torch.randn((10, 1)),
        )

    def forward(self, x):
        for layer in self.layers:
            x = x * layer
        return x


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_intarg
@program(In(r(10, 10, seed=1)), In(r(3, 10, seed=2), offset=2), In(r(3, 10, seed=3), 2.5))
class IntArg(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = torch.nn.Linear(10, 10)

    def forward(self, x, offset=1):
        x = F.relu(self.layer1(x)) + offset
        return x


class Cfg:
    def __init__(self) -> None:
        self.val = 0.5
        self.count = 3


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_cfgmod
@program(*X2, flip={"cfg.count": 1, "cfg.val": -0.25})
class CfgModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = Cfg()
        self.layer = torch.nn.Linear(10, 10)

    def forward(self, x):
        for i in range(self.cfg.count):
            x = self.layer(x + self.cfg.val)
        return x


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_stringmember
@program(*X2, flip={"mode": "other_string"})
class StringMember(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = torch.nn.Linear(10, 10)
        self.mode = "some_string"

    def forward(self, x):
        if self.mode == "some_string":
            return F.relu(self.linear1(x))


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_modulelist
@program(*X2)
class ModuleList(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [torch.nn.Linear(10, 10), torch.nn.ReLU(), torch.nn.Linear(10, 10), torch.nn.ReLU()]
        )

    def forward(self, x):
        for i in range(len(self.layers)):
            x = self.layers[i](x)

        for layer in self.layers:
            x = layer(x)

        for layer, val in zip(self.layers, (x, x, x, x)):
            x = layer(x) + val

        for layer, val in zip(self.layers, (1, 2, 3, 4)):
            x = layer(x) + val

        for idx, layer in enumerate(self.layers):
            x = layer(x) * idx

        for idx, layer in enumerate(self.layers[::-1]):
            x = layer(x) * idx

        return x


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_modulelist_custom
@program(*X2)
class CustomGetItemModuleList(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [torch.nn.Linear(10, 10), torch.nn.ReLU(), torch.nn.Linear(10, 10), torch.nn.ReLU()]
        )

    def __getitem__(self, idx: int):
        return self.layers[idx]

    def __len__(self) -> int:
        return len(self.layers)

    def forward(self, x):
        for i in range(len(self)):
            x = self[i](x)
        return x


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_parameterdict_custom
@program(In(r(10, 10, seed=1)), In(r(10, 3, seed=2)))
class CustomGetItemParameterDict(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ParameterDict({"0": torch.nn.Parameter(torch.randn(10, 10))})

    def __getitem__(self, key: str) -> torch.nn.Module:
        return self.layers[key]

    def forward(self, x):
        x = self["0"].mm(x)
        return x


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_super1
@program(*X2)
class SuperModule(BasicModule):
    def forward(self, x):
        x = super().forward(x)
        return x + 10.0


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_super2
@program(*X2)
class SuperModule2(BasicModule):
    def forward(self, x):
        return BasicModule.forward(self, x)


class ComplicatedSuperParent(torch.nn.Module):
    @classmethod
    def custom_add(cls, x):
        x = x + x
        return x


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_super_class_method
@program(*X2)
class SuperChildCallsClassMethod(ComplicatedSuperParent):
    @classmethod
    def child_func(cls, x):
        x = super().custom_add(x)
        return x

    def forward(self, x):
        x = self.child_func(x)
        return x


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_named_children
@program(*X2, flip={"l2": torch.nn.Tanh})
class NamedChildren(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(10, 10)
        self.l2 = torch.nn.ReLU()
        self.l3 = torch.nn.Linear(10, 10)
        self.l4 = torch.nn.ReLU()

    def forward(self, x):
        for _, block in self.named_children():
            x = block(x)
        return x


class _Block(torch.nn.Module):
    def forward(self, x):
        return 1.5 * torch.cat(x, 1)


class _DenseBlock(torch.nn.ModuleDict):
    _version = 2

    def __init__(self, num_layers: int = 3) -> None:
        super().__init__()
        for i in range(num_layers):
            self.add_module(f"denselayer{i + 1:d}", _Block())

    def forward(self, init_features):
        features = [init_features]
        for layer in self.values():
            new_features = layer(features)
            features.append(new_features)
        return torch.cat(features, 1)


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_densenet
@program(*X2)
class DenseNetBlocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = _DenseBlock()

    def forward(self, x):
        return self.layers(x)


def requires_grad1(module: torch.nn.Module, recurse: bool = False) -> bool:
    requires_grad = any(p.requires_grad for p in module.parameters(recurse))
    return requires_grad


def _freeze_params(m):
    for p in m.parameters():
        p.requires_grad_(False)


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_parameters1
@program(*X2, flip=_freeze_params)
class ParametersModule1(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = torch.nn.Linear(10, 10)
        self.scale = torch.nn.Parameter(torch.randn(1, 10))

    def forward(self, x):
        if not requires_grad1(self):
            return F.relu(self.linear1(x)) * self.scale
        else:
            return x + 1


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_parameters3
@program(*X2, flip=lambda m: m.double())
class ParametersModule3(ParametersModule1):
    def forward(self, x):
        ones = torch.ones(10, dtype=next(self.parameters()).dtype)
        return F.relu(self.linear1(x.to(ones.dtype))) * self.scale + ones


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_parameters5
@program(*XB)
class ParametersModule5(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = torch.nn.Linear(10, 10)
        self.scale = torch.nn.Parameter(torch.randn(10, 10))
        self.scale_dup = self.scale

    def forward(self, x):
        counter = 0
        for param in self.parameters():
            counter += 1

        return x * self.scale * counter


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_hasattr
@program(*X2, flip={"scale2": 2.0})
class HasAttrModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(1, 10))

    def forward(self, x):
        x = F.relu(x)
        if hasattr(self, "scale"):
            x *= self.scale
        if hasattr(self, "scale2"):
            x *= self.scale2
        return x


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_access_by_keys
@program(*X2)
class AccessByKeys(torch.nn.ModuleDict):
    def __init__(self, num_layers: int = 3) -> None:
        super().__init__()
        for i in range(num_layers):
            self.add_module(f"denselayer{i + 1:d}", _Block())

    def forward(self, init_features):
        features = [init_features]
        for k in self.keys():
            new_features = self[k](features)
            features.append(new_features)
        return torch.cat(features, 1)


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_forward_directly
@program(*X2)
class CallForwardDirectly(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = BasicModule()
        self.layer2 = torch.nn.Linear(10, 10)

    def forward(self, x):
        x = self.layer1.forward(x)
        x = self.layer2.forward(x)
        return x


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_conv_call_super_forward_directly
@program(In(r(4, 4, seed=1)), In(r(2, 4, 6, seed=2)), factory=True)
def conv_call_super_forward_directly():
    class ConvCallSuperForwardDirectly(torch.nn.Conv1d):
        def __init__(self, in_channels, out_channels, kernel_size, **kwargs):
            super().__init__(in_channels=in_channels, out_channels=out_channels, kernel_size=kernel_size, **kwargs)

        def forward(self, inputs, mask=None):
            outputs = super().forward(inputs)
            return outputs

    return ConvCallSuperForwardDirectly(4, 4, 4)


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_conv_transpose_call_super_forward_directly
@program(In(r(4, 4, 4, seed=1)), In(r(2, 4, 3, 3, seed=2)), factory=True)
def conv_transpose_call_super_forward_directly():
    class ConvTransposeCallSuperForwardDirectly(torch.nn.ConvTranspose2d):
        def __init__(self, in_channels, out_channels, kernel_size, **kwargs):
            super().__init__(in_channels=in_channels, out_channels=out_channels, kernel_size=kernel_size, **kwargs)

        def forward(self, x):
            if x.numel() > 0:
                return super().forward(x)
            output_shape = [
                ((i - 1) * d - 2 * p + (di * (k - 1) + 1) + op)
                for i, p, di, k, d, op in zip(
                    x.shape[-2:], self.padding, self.dilation, self.kernel_size, self.stride, self.output_padding
                )
            ]
            output_shape = [x.shape[0], self.bias.shape[0]] + output_shape
            return x.new_empty(output_shape)  # _NewEmptyTensorOp.apply(x, output_shape) in the test

    return ConvTransposeCallSuperForwardDirectly(4, 4, 4)


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_module_name_string
@program(*X2, flip={"linear1": torch.nn.Identity})
class ModuleNameString(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = torch.nn.Linear(10, 10)

    def forward(self, x):
        if self.__class__.__name__ == "ABC":
            return 10
        if self.linear1.__class__.__name__ == "Linear":
            return F.relu(self.linear1(x) + 10)
        return 11


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_self_mutating1
@program(In(r(10, seed=1)), In(r(10, seed=1)), In(r(10, seed=1)), In(r(3, 10, seed=2)))
class SelfMutatingModule(torch.nn.Module):
    def __init__(self, layer=None):
        super().__init__()
        self.layer = layer if layer is not None else torch.nn.Linear(10, 10)
        self.counter = 0

    def forward(self, x):
        result = self.layer(x) + self.counter
        self.counter += 1
        return F.relu(result)


class ModuleAttributePrecedenceBase(torch.nn.Module):
    def linear(self, x, flag=None):
        if flag:
            return x * 2.0
        return x * 3.0


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_module_attribute_precedence
@program(In(r(10, 10, seed=1)), In(r(10, seed=2)), flip={"scale": 0.25})
class ModuleAttributePrecedence(ModuleAttributePrecedenceBase):
    def __init__(self) -> None:
        super().__init__()
        self.activation = torch.nn.ReLU()
        self.linear = torch.nn.Linear(10, 10)
        self.initializer = torch.ones([10, 10])
        self.scale = 0.5

    def activation(self, x):
        return x * 1.2

    def initializer(self):
        return torch.zeros([10, 10])

    def scale(self):
        return 2.0

    def forward(self, x):
        # object attribute takes precedence unless it's a nn.Module
        return self.activation(self.linear(self.initializer + x)) * self.scale


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_module_forward_has_graph_break
@program(*XB)
class ModuleForwardHasGraphBreak(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = BasicModule()
        self.layer2 = BasicModule()
        self.layer3 = torch.nn.Sequential(BasicModule(), BasicModule())
        self.layer4 = torch.nn.ModuleList(
            [torch.nn.Linear(10, 10), torch.nn.ReLU(), torch.nn.Linear(10, 10), torch.nn.ReLU()]
        )
        self.layer5 = torch.nn.ModuleDict({"0": torch.nn.Linear(10, 10)})
        self.scale = torch.randn(1, 10)

    def forward(self, x):
        x = self.layer1(x)
        params1 = dict(self.named_parameters())
        params2 = list(self.parameters())
        buffers1 = dict(self.named_buffers())
        buffers2 = list(self.buffers())
        modules1 = dict(self.named_modules())
        modules2 = list(self.modules())
        # torch._dynamo.graph_break() in the test
        y = modules2
        y = modules1
        y = buffers2
        y = buffers1
        y = params2
        y = params1
        x = self.layer2(x) + y["layer3.1.linear1.weight"] + y["layer4.2.weight"] + y["layer5.0.weight"]
        return x * self.scale


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_module_guard_name_is_valid
@program(*X2)
class ModuleGuardNameIsValid(torch.nn.ModuleDict):
    def __init__(self) -> None:
        super().__init__()
        for i in range(2):
            self.add_module(f"l@yer-{i + 1:d}", BasicModule())

    def forward(self, x):
        for layer in self.values():
            x = layer(x)
        return x


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_sequential_with_duplicated_module2
@program(*X2)
class SequentialWithDuplicatedModule2(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.relu = torch.nn.ReLU()
        self.layer = torch.nn.Sequential(
            collections.OrderedDict(
                [
                    ("linear1", torch.nn.Linear(10, 20)),
                    ("relu1", self.relu),
                    ("linear2", torch.nn.Linear(20, 20)),
                    ("relu2", self.relu),
                    ("linear3", torch.nn.Linear(20, 10)),
                    ("relu3", self.relu),
                ]
            )
        )

    def forward(self, x):
        return self.layer(x)


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_module_comparison
@program(*X2, flip={"layer0": None})
class ModuleComparison(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer0 = torch.nn.Linear(10, 10)
        self.layer1 = torch.nn.Linear(10, 10)
        self.layer2 = torch.nn.Linear(10, 10)

    @property
    def encoder_layers(self):
        return [self.layer0, self.layer1, self.layer2]

    def forward(self, x):
        for layer in self.encoder_layers:
            output = layer(x)
            if layer is None or layer == self.layer0:
                output = F.relu6(output)
            else:
                output = F.relu(output)
        return output


class UnspecNonInlinableModule(torch.nn.Module):
    torchdynamo_force_dynamic = True  # forced to be a UnspecializedNNModule

    def forward(self, x):
        if x.sum() > 0:
            return x + 1
        else:
            return x - 1


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_unspec_non_inlinable_module
@program(In(t(1.0, 2.0)), In(t(3.0, 1.0)), In(t(-3.0, 1.0)))
class UnspecNonInlinableToplevelModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.m = UnspecNonInlinableModule()

    def forward(self, x):
        return self.m(x)


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_nn_module_unspec_int_attr
@program(In(r(3, 4, seed=1)), In(r(2, 4, seed=2)), flip={"step": 11})
class ModuleWithIntAttr(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)
        self.step = 10

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + 1
        return self.layer(x) + self.step


class _VarMod(torch.nn.Module):
    def __init__(self, var=0):
        super().__init__()
        self.var = var


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_nn_module_setattr
@program(In(torch.ones(3), _VarMod(0)), In(torch.ones(3), _VarMod(1)), In(torch.ones(2), _VarMod(2.5)))
def nn_module_setattr(x, m):
    return x + m.var


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_lazy_module2
@program(In(r(10, 10, seed=1)), In(r(3, 10, seed=2)))
class LazyMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.LazyLinear(10)
        self.relu1 = torch.nn.ReLU()
        self.fc2 = torch.nn.LazyLinear(1)
        self.relu2 = torch.nn.ReLU()

    def forward(self, input):
        x = self.relu1(self.fc1(input))
        y = self.relu2(self.fc2(x))
        return y


class LazyParentModule(LazyModuleMixin, torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def impl(self, x):
        return x.cos() + self._val


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_lazy_module_no_cls_to_become
@program(In(r(2, 2, seed=1)), In(r(2, 2, seed=2)))
class LazyChildModuleNoClsToBecome(LazyParentModule):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, x):
        return super().impl(x.sin())

    def initialize_parameters(self, input):
        self._val = torch.nn.Parameter(torch.ones(2, 2))


class LazyLayerWithInputs(LazyModuleMixin, torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def initialize_parameters(self, x, y):
        with torch.no_grad():
            self._param_x = torch.nn.Parameter(torch.empty(x[0].shape).fill_(0.5))
            self._param_y = torch.nn.Parameter(torch.empty(y[0].shape).fill_(0.5))

    def forward(self, x, y):
        res_x = 0
        for i in range(len(x)):
            res_x = res_x + x[i]
        res_y = 0
        for i in range(len(y)):
            res_y = res_y + y[i]
        return res_x + res_y


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_lazy_module_kwargs
@program(In([r(5, 5, seed=1)] * 3, [r(5, 5, seed=2)] * 2), In([r(5, 5, seed=3)] * 2, [r(5, 5, seed=4)] * 3))
class LazyModuleKwArgs(LazyModuleMixin, torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def initialize_parameters(self, *args, **kwargs):
        with torch.no_grad():
            self.layer = LazyLayerWithInputs()

    def forward(self, x, y):
        return self.layer(x, y=y)


# pytorch test/dynamo/test_modules.py::OptimizedModuleTest::test_attr_precedence
@program(In(torch.ones(3, 11)), In(r(2, 11, seed=1)), In(r(11, seed=2), c=3), factory=True)
def attr_precedence():
    class Mod(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = 3

        def forward(self, x, c=4):
            return x * c

        def linear(self, x):
            return x

        def b(self, x):
            raise RuntimeError("Should not be called")

    class MyMod(Mod):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(11, 11)
            self.a = 2
            self.b = 2
            self.scale = 1

        def scale(self, x):
            raise RuntimeError("Should not be called")

        def forward(self, x, c=None):
            return self.linear(x) * self.a * self.b * self.scale

    return MyMod()


class _TwoParams(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.param1 = torch.nn.Parameter(torch.ones([1]))
        self.param2 = torch.nn.Parameter(torch.ones([2]))

    def forward(self, x):
        return x


_order_mod = _TwoParams()
_coeffs = [2, 3]


def _reorder_params():
    _order_mod._parameters["param1"] = _order_mod._parameters.pop("param1")


def _restore_param_order():
    _order_mod._parameters.clear()
    _order_mod._parameters.update([("param1", _order_mod.param1), ("param2", _order_mod.param2)])


# pytorch test/dynamo/test_modules.py::OptimizedModuleTest::test_param_order
@program(In(torch.ones(1)), In(t(2.0)), flip=_reorder_params, globals=("_order_mod",))
def param_order(x):
    for idx, p in enumerate(_order_mod.parameters()):
        x += p.sum() * _coeffs[idx]

    for idx, p in enumerate(_order_mod.named_parameters()):
        x += p[1].sum() * _coeffs[idx]

    return x


class _ThreeModules(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = torch.nn.Linear(3, 3)
        self.linear2 = torch.nn.Linear(10, 10)

    def forward(self, x):
        return x


_mo_mod = _ThreeModules()
_mo_coeffs = [2, 3, 4]
_coeffs_for_mod = {_mo_mod: 10, _mo_mod.linear1: 20, _mo_mod.linear2: 30}


def _reorder_modules():
    _mo_mod._modules["linear1"] = _mo_mod._modules.pop("linear1")


# pytorch test/dynamo/test_modules.py::OptimizedModuleTest::test_module_order
@program(In(torch.ones(1)), In(t(2.0, 3.0)), flip=_reorder_modules, globals=("_mo_mod",))
def module_order(x):
    for idx, p in enumerate(_mo_mod.modules()):
        x += _coeffs_for_mod[p] * _mo_coeffs[idx]
    for idx, p in enumerate(_mo_mod.named_modules()):
        x += _coeffs_for_mod[p[1]] * _mo_coeffs[idx]
    for idx, p in enumerate(_mo_mod.children()):
        x += _coeffs_for_mod[p] * _mo_coeffs[idx]
    for idx, p in enumerate(_mo_mod.named_children()):
        x += _coeffs_for_mod[p[1]] * _mo_coeffs[idx]
    return x


class ModulePatch1(torch.nn.Module):
    pass


class ModulePatch2(torch.nn.Module):
    def forward(self, x):
        return x - 1


_patched = ModulePatch1()
_patched.forward = types.MethodType(ModulePatch2.forward, _patched)


# pytorch test/dynamo/test_modules.py::OptimizedModuleTest::test_module_patch
@program(In(torch.ones(10)), In(r(3, seed=1)))
def module_patch(x):
    return _patched(x)


def _forward_hook(module: torch.nn.Module, inputs: Tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
    return 2 * output + 1


def _remove_hooks(m):
    m._forward_hooks.clear()


# pytorch test/dynamo/test_modules.py::OptimizedModuleTest::test_hooks_outer
@program(In(t(1.0, requires_grad=True)), In(t(2.0, 3.0)), flip=_remove_hooks, factory=True)
def hooks_outer():
    class TestModule(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * x + 1

    m = TestModule()
    m.register_forward_hook(_forward_hook)
    return m


class _HookedModule(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x + 1


_hooked = _HookedModule()
_hook_handle = _hooked.register_forward_hook(_forward_hook)


def _remove_global_hook():
    _hooked._forward_hooks.clear()


# pytorch test/dynamo/test_modules.py::OptimizedModuleTest::test_hooks_inner
@program(In(t(1.0, requires_grad=True)), In(t(2.0, 3.0)), flip=_remove_global_hook, globals=("_hooked",))
def hooks_inner(tensor):
    x = tensor * 2 + 1
    y = _hooked(x)
    return y


_activations = []


def _save_activations(mod, inp, out):
    _activations.append(inp)


class _ToyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            *[torch.nn.Linear(10, 16), torch.nn.ReLU()] + [torch.nn.Linear(16, 5), torch.nn.ReLU()]
        )

    def forward(self, x):
        return self.net(x)


# pytorch test/dynamo/test_modules.py::OptimizedModuleTest::test_hooks_allowed_modules_compiles (smaller layers)
@program(In(r(4, 10, seed=1)), In(r(2, 10, seed=2)), globals=("_activations",), factory=True)
def hooks_allowed_modules_compiles():
    model = _ToyModel()
    for name, module in model.named_modules():
        module.register_forward_hook(_save_activations)
    return model


# pytorch test/dynamo/test_modules.py::NNModuleTests::test_nn_moduledict_contains
@program(In(r(1, seed=1)), In(r(3, seed=2)),
         flip=lambda m: setattr(m, "module_dict", torch.nn.ModuleDict({"bar": torch.nn.Conv2d(1, 1, 1)})),
         factory=True)
def nn_moduledict_contains():
    class M(torch.nn.Module):
        def __init__(self, module_dict):
            super().__init__()
            self.module_dict = module_dict

        def forward(self, x):
            if "foo" in self.module_dict:
                x = torch.mul(x, 1.0)
            x = torch.add(x, 1.0)
            return x

    return M(torch.nn.ModuleDict({"foo": torch.nn.Conv2d(1, 1, 1)}))


# pytorch test/dynamo/test_modules.py::OptimizedModuleTest::test_nn_module
@program(*XB, flip=lambda m: m.buf0.mul_(2))
class MockModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.relu = torch.nn.ReLU()
        self.linear = torch.nn.Linear(10, 10)
        self.buf0 = torch.nn.Buffer(torch.randn(10, 10))

    def forward(self, x):
        return self.relu(self.linear(x) + self.buf0)


class _InnerModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.relu = torch.nn.ReLU()

    def forward(self, x):
        return self.relu(torch.sin(x))


# pytorch test/dynamo/test_modules.py::OptimizedModuleTest::test_composition
@program(In(r(4, seed=1)), In(r(2, 3, seed=2)))
class OuterModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mod = _InnerModule()

    def forward(self, x):
        return self.mod(torch.cos(x))
