"""Hugging Face decoders with a KV cache under ``symtrace.capture`` (issue: LLM decoders end to
end): ``model.forward = capture(model.forward)``, then ``generate`` gives eager's tokens with at
most 3 captures, and the caller's cache object holds the same tensors as eager's. Tiny configs
with random weights; no downloads."""
import warnings

import pytest
import torch

import symtrace

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

pytestmark = pytest.mark.filterwarnings("ignore")


def layers_define_call() -> bool:
    """transformers up to about 5.17 gives decoder layers their own ``__call__``
    (GradientCheckpointingLayer); capture traces through it when it is given a KV cache."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return False
    return "__call__" in vars(GradientCheckpointingLayer)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                     bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).eval()


def _greedy(cache: str, new_tokens: int) -> dict:
    """``generate``'s keyword arguments: greedy, ``new_tokens`` tokens, with the cache kind."""
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    return kwargs


@pytest.mark.parametrize("make, cache", [(_llama, "dynamic"), (_llama, "static"), (_gpt2, "dynamic")],
                         ids=["llama-dynamic", "llama-static", "gpt2-dynamic"])
def test_generate_gives_eager_tokens_with_at_most_three_captures(make, cache):
    model = make()
    ids = torch.randint(2, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    kwargs = _greedy(cache, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model.generate(ids, **kwargs)
        model.forward = captured = symtrace.capture(model.forward)
        got = model.generate(ids, **kwargs)
    assert torch.equal(got, want)
    assert 1 <= captured.captures <= 3


def test_decode_steps_update_the_callers_dynamic_cache_as_eager_does():
    from transformers import DynamicCache
    model = _llama()
    captured = symtrace.capture(model.forward)
    eager_cache, cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
    tokens = torch.randint(2, 96, (1, 5), generator=torch.Generator().manual_seed(2))

    def steps(tokens):
        with torch.no_grad():
            for _ in range(4):
                want = model(tokens, past_key_values=eager_cache, use_cache=True)
                got = captured(tokens, past_key_values=cache, use_cache=True)
                torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)
                assert got.past_key_values is cache        # the caller's object, not a stand-in
                for a, b in zip(eager_cache.layers, cache.layers):
                    assert type(b.keys) is torch.Tensor and torch.equal(a.keys, b.keys) and \
                        torch.equal(a.values, b.values)
                tokens = want.logits[:, -1:].argmax(-1)

    steps(tokens)
    assert captured.captures == 2   # prefill on an empty cache, then decode


@pytest.mark.parametrize("make, cache, bits", [(_llama, "dynamic", None), (_llama, "static", None),
                                               (_gpt2, "dynamic", None), (_llama, "dynamic", 8)],
                         ids=["llama-dynamic", "llama-static", "gpt2-dynamic", "llama-int8"])
def test_a_lowering_pass_lowers_the_tensor_regions_of_a_decoder(make, cache, bits):
    # the captured graph takes the cache object: lowering_pass lowers the tensor region(s)
    # between its reads and writes; generate gives eager's tokens (int8: the unlowered int8
    # graph's), and the decode region serves every cache length from at most 2 compiles
    from symtrace.lower import lowering_pass
    from symtrace.lower.capture_pass import LazyRegion
    from symtrace.passes import quant as Q
    model = make()
    ids = torch.randint(2, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    kwargs = _greedy(cache, 10)
    quant = [Q.weight_only(bits=bits)] if bits else []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if bits:
            model.forward = symtrace.capture(model.forward, passes=quant)
        want = model.generate(ids, **kwargs)
        if bits:
            del model.forward
        model.forward = captured = symtrace.capture(model.forward, passes=quant + [lowering_pass()])
        got = model.generate(ids, **kwargs)
    assert torch.equal(got, want)
    assert 1 <= captured.captures <= 3
    regions = [m for gm in captured.graphs for m in gm.modules() if isinstance(m, LazyRegion)]
    assert regions and all(r.failure is None and r.lowered is not None for r in regions)
    from symtrace.graph.node import TensorMeta   # only tensors cross, between regions too (a
    for r in regions:                            # StaticCache's write splits every layer)
        assert all(isinstance(p.meta.get("tensor_meta"), TensorMeta)
                   for p in r.region.graph.nodes if p.op == "placeholder")
    per_size = [r for r in regions if r.lowered.compiles > 2 or r.lowered.torch_calls]
    # (transformers <= 5.17: prepare_padding_mask's guard ties the mask's length to the cache's,
    # which the size-generic probes vary independently: that one region compiles per size)
    assert len(per_size) <= (1 if layers_define_call() else 0)
    assert sum(len(r.lowered.kernels) for r in regions) > 0
    from symtrace.rollback import plan_rollback   # a failing guard is undone from a log of the
    assert all(plan_rollback(gm) in ("none", "log") for gm in captured.graphs)   # writes, no cache copies


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_decode_steps_run_symtrace_attention(cache):
    # head size 64: a decode step's attention (one query row per head; StaticCache: the group's
    # heads folded into rows, and a mask) runs symtrace's kernel; generate gives eager's tokens
    from transformers import LlamaConfig, LlamaForCausalLM
    from symtrace.lower import lowering_pass
    from symtrace.lower.attention_cpu import KERNEL
    from symtrace.lower.capture_pass import LazyRegion
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(2, 96, (1, 5), generator=torch.Generator().manual_seed(3))
    kwargs = _greedy(cache, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model.generate(ids, **kwargs)
        model.forward = captured = symtrace.capture(model.forward, passes=[lowering_pass()])
        got = model.generate(ids, **kwargs)
    assert torch.equal(got, want)
    regions = [m for gm in captured.graphs for m in gm.modules() if isinstance(m, LazyRegion)]
    notes = [n for r in regions if r.lowered is not None for n in r.lowered.pipeline_notes]
    assert any("decode-step attention" in n for n in notes) == KERNEL.available(), notes


@pytest.mark.parametrize("window, new_tokens, most", [(64, 10, 3), (10, 12, 5)], ids=["inside", "crossing"])
def test_sliding_window_caches_count_with_a_traced_int(window, new_tokens, most):
    # a sliding-window layer counts what it has seen in a Python int (cumulative_length): once it
    # changes it is traced, not specialised, so decoding does not capture at every step; crossing
    # the window flips the program's own decisions (two of them), a capture each
    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        sliding_window=window)
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).eval()
    ids = torch.randint(2, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    kwargs = _greedy("dynamic", new_tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model.generate(ids, **kwargs)
        model.forward = captured = symtrace.capture(model.forward)
        got = model.generate(ids, **kwargs)
    assert torch.equal(got, want)
    assert captured.captures <= most and captured.eager_calls == 0, captured.captures


def test_captured_forward_shows_the_models_signature_to_generate():
    # generate passes position_ids (and logits_to_keep) only to a forward whose signature takes
    # them: behind (*args, **kwargs) OPT with a static cache got no position_ids, computed them
    # from the 4-D mask generate builds for static caches, and failed
    import inspect
    from transformers import OPTConfig, OPTForCausalLM
    cfg = OPTConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                    word_embed_proj_dim=32, max_position_embeddings=128)
    torch.manual_seed(0)
    model = OPTForCausalLM(cfg).eval()
    want_sig = inspect.signature(model.forward)
    ids = torch.randint(2, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    kwargs = _greedy("static", 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model.generate(ids, **kwargs)
        model.forward = captured = symtrace.capture(model.forward)
        assert inspect.signature(captured) == want_sig
        got = model.generate(ids, **kwargs)
    assert torch.equal(got, want) and captured.captures <= 3


def test_library_state_that_a_forward_never_reads_is_not_guarded():
    # the global-guard walk followed names from transformers' code into huggingface_hub's
    # download code (HfApi, the HTTP client): ~100 guards on a tiny Llama, and creating the
    # download client after a capture (any download does) re-captured every graph
    model = _llama()
    ids = torch.randint(2, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.forward = captured = symtrace.capture(model.forward)
        model.generate(ids, **_greedy("dynamic", 4))
    guards = [str(g.expr) for gm in captured.graphs for g in gm.graph.guards]
    assert guards and not [g for g in guards if "huggingface_hub" in g]
    assert any("transformers" in g for g in guards)   # (transformers' own globals still are)


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return T5ForConditionalGeneration(cfg).eval()


def test_an_encoder_decoder_that_copies_its_config_in_forward_traces_and_generates():
    # T5's decoder makes its cache from config.get_text_config(), which deep-copies the config
    # inside forward; the copy of the config (read through a view) used to copy the tracer too
    model = _t5()
    ids, dec = torch.randint(2, 96, (2, 7)), torch.randint(2, 96, (2, 5))
    with torch.no_grad():
        gm = symtrace.symbolic_trace(model, example_inputs={"input_ids": ids, "decoder_input_ids": dec})
        torch.testing.assert_close(gm(input_ids=ids, decoder_input_ids=dec).logits,
                                   model(input_ids=ids, decoder_input_ids=dec).logits)
        expected = model.generate(ids[:1], max_new_tokens=6, do_sample=False)
        model.forward = symtrace.capture(model.forward)
        assert torch.equal(model.generate(ids[:1], max_new_tokens=6, do_sample=False), expected)
    assert model.forward.captures <= 3
