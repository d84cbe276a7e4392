"""The inference pipeline's expansion of torch's transformer modules (``nn.Transformer``, its
encoder and decoder and their layers) into calls of their parts
(:mod:`symtrace.lower.transformer_modules`): same results as the modules, every form; calls
with masks, in training mode or with unknown activations keep the module."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symtrace
from symtrace.lower import compile as lower
from symtrace.lower.pipeline import private_copy
from symtrace.lower.transformer_modules import expand_transformer_modules
from kernel_tests import needs_c_compiler

pytestmark = [needs_c_compiler, pytest.mark.usefixtures("session_kernel_cache")]

_TRANSFORMER_CLASSES = (nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder, nn.TransformerEncoderLayer,
                        nn.TransformerDecoderLayer, nn.MultiheadAttention)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():   # (torch's note that norm_first turns its nested-tensor path off)
        warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
        yield


class Seq2Seq(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.t = nn.Transformer(32, 4, 2, 2, 64, **kw)
        self.head = nn.Linear(32, 10)

    def forward(self, src, tgt):
        return self.head(self.t(src, tgt))


class Encoder(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, **kw)
        self.enc = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(32), enable_nested_tensor=False)

    def forward(self, x, mask=None):
        return self.enc(x, mask=mask)


def _modules_called(gm):
    return [type(gm.get_submodule(n.target)).__name__ for n in gm.graph.find_nodes(op="call_module")
            if isinstance(gm.get_submodule(n.target), _TRANSFORMER_CLASSES)]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu", "module"])
def test_transformer_matches_the_module(batch_first, norm_first, activation):
    torch.manual_seed(0)
    act = nn.SiLU() if activation == "module" else activation
    model = Seq2Seq(batch_first=batch_first, norm_first=norm_first, activation=act).eval()
    src, tgt = torch.randn(2, 9, 32), torch.randn(2, 6, 32)
    if not batch_first:
        src, tgt = src.transpose(0, 1), tgt.transpose(0, 1)
    with torch.no_grad():
        want = model(src, tgt)
        lm = lower(model, (src, tgt), speed_check=False)
        torch.testing.assert_close(lm(src, tgt), want, rtol=1e-5, atol=1e-5)
    report = lm.report()
    assert "7 transformer module call(s) as calls of their parts: t, t.encoder, t.decoder ..." in report
    assert "6 nn.MultiheadAttention call(s) as linear layers and SDPA" in report
    assert _modules_called(lm.gm) == []
    assert "torch.nn.functional.linear " not in report   # every linear packed (cross-attention's too)


def test_encoder_with_a_final_norm_and_its_layers_alone():
    torch.manual_seed(0)
    model = Encoder(batch_first=True).eval()
    x = torch.randn(3, 7, 32)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    copy = private_copy(gm)
    assert expand_transformer_modules(copy) == ["enc", "enc.layers.0", "enc.layers.1"]
    assert _modules_called(copy) == ["MultiheadAttention"] * 2   # (the next step's)
    assert [n.target for n in copy.graph.find_nodes(op="call_module")][-1] == "enc.norm"
    with torch.no_grad():
        torch.testing.assert_close(copy(x), model(x), rtol=1e-5, atol=1e-5)
    assert _modules_called(gm) == ["TransformerEncoder"]   # (the caller's graph is unchanged)


class Custom(nn.Module):
    def __init__(self, case):
        super().__init__()
        self.case = case
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True,
                                                activation=(lambda t: t * 2) if case == "lambda activation" else
                                                nn.GELU(approximate="tanh") if case == "tanh gelu module" else "relu")

    def forward(self, x, mask):
        if self.case == "mask":
            return self.layer(x, src_mask=mask)
        if self.case == "padding mask":
            return self.layer(x, src_key_padding_mask=mask)
        if self.case == "causal":
            return self.layer(x, src_mask=mask, is_causal=True)
        return self.layer(x)


@pytest.mark.parametrize("case", ["mask", "padding mask", "causal", "training", "hook", "patched block",
                                  "lambda activation", "tanh gelu module"])
def test_calls_it_cannot_expand_keep_the_module(case):
    torch.manual_seed(0)
    model = Custom(case).eval()
    x = torch.randn(2, 5, 16)
    mask = torch.zeros(2, 5, dtype=torch.bool) if case == "padding mask" else \
        nn.Transformer.generate_square_subsequent_mask(5)
    if case == "training":
        model.layer.train()
        model.layer.dropout.p = model.layer.dropout1.p = model.layer.dropout2.p = model.layer.self_attn.dropout = 0.0
    elif case == "hook":
        model.layer.register_forward_pre_hook(lambda m, args: None)
    elif case == "patched block":
        model.layer._ff_block = lambda t: t
    gm = symtrace.symbolic_trace(model, example_inputs=(x, mask))
    copy = private_copy(gm)
    # ("tanh gelu module": eager's fast path for an encoder layer, taken without grad, runs
    # any nn.GELU as the erf form; its forward written out would not match it)
    assert expand_transformer_modules(copy) == []
    with torch.no_grad():
        torch.testing.assert_close(copy(x, mask), model(x, mask))


class _CausalByDefault(nn.TransformerDecoder):
    """A custom decoder whose own default differs from the None nn.Transformer passes."""

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=True, memory_is_causal=False):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1]) if tgt_is_causal else tgt_mask
        return super().forward(tgt, memory, tgt_mask=mask)


def test_parts_that_are_not_torchs_own_keep_their_container_a_module_call():
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(16, 2, 32, batch_first=True)
    model = nn.Transformer(16, 2, 1, 1, 32, batch_first=True,
                           custom_decoder=_CausalByDefault(layer, 1)).eval()
    src, tgt = torch.randn(2, 5, 16), torch.randn(2, 4, 16)
    gm = symtrace.symbolic_trace(model, example_inputs=(src, tgt))
    copy = private_copy(gm)
    expanded = expand_transformer_modules(copy)
    assert "decoder" not in expanded and "encoder" in expanded   # (the encoder is torch's own)
    with torch.no_grad():
        torch.testing.assert_close(copy(src, tgt), model(src, tgt), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change", ["activation assigned later", "layer norm subclass", "global hook"])
def test_encoder_layers_eagers_fast_path_would_not_compute_as_written_stay_module_calls(change):
    torch.manual_seed(0)
    model = Encoder(batch_first=True).eval()
    layer = model.enc.layers[0]
    if change == "activation assigned later":
        layer.activation = F.gelu   # (built with relu: eager's fast path still runs relu)
    elif change == "layer norm subclass":
        layer.norm1 = type("MyNorm", (nn.LayerNorm,), {})(32)
    x = torch.randn(2, 5, 32)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    copy = private_copy(gm)
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: None) \
        if change == "global hook" else None
    try:
        expanded = expand_transformer_modules(copy)
    finally:
        if handle is not None:
            handle.remove()
    assert "enc.layers.0" not in expanded   # (the container and the other layer may expand)
    with torch.no_grad():
        torch.testing.assert_close(copy(x), model(x), rtol=1e-5, atol=1e-5)
