"""Trace small Hugging Face transformers models with symtrace and check the graphs against eager.

Models are built from tiny configs in code (random init, no hub downloads). For each model:

* ``symtrace.symbolic_trace(model, example_inputs=kwargs)``: trace on keyword inputs;
* replay the graph on the same inputs, on new inputs of the same shape (different ids /
  pixels) and on a different sequence length (a GuardError is allowed there, a wrong answer
  never);
* ``symtrace.capture(model)`` on all three inputs (must equal eager every time), and again with
  the plain call (tensors only, config defaults: decoders then return cache objects, whose
  tensors are compared too);
* ``torch.fx.symbolic_trace(model)`` for comparison.

When the direct trace fails, the model is also run through ``KwargsWrapper`` (``forward(**kw)``
-> ``model(**kw)``) to show how far the rest of the pipeline gets. Each model runs in its own
process, so a crash (segfault) in one is reported instead of ending the run.

Inputs are keyword arguments: ``input_ids`` + ``attention_mask`` (text), ``pixel_values`` (ViT),
``decoder_input_ids`` + ``decoder_attention_mask`` (T5), with ``use_cache=False`` and
``return_dict=True`` (so outputs are ModelOutput dataclasses; every tensor leaf is compared).

Usage (transformers lives in ~/zooenv, not the project venv):
    ~/zooenv/bin/python benchmarks/hf_models.py [--only bert,gpt2] [--verbose]
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Tuple

import torch
from tabulate import tabulate

import symtrace

RTOL, ATOL = 1e-4, 1e-5
BATCH, SEQ, SEQ2 = 2, 8, 11
VOCAB = 1000


# --- models --------------------------------------------------------------------------------
def _text_inputs(seed: int, seq: int, vocab: int = VOCAB, pad_last: bool = True) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (BATCH, seq), generator=g)
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    if pad_last:
        mask[1, seq - 2:] = 0  # one padded row, so the mask matters
    return {"input_ids": ids, "attention_mask": mask}


def _common(kw: Dict[str, Any]) -> Dict[str, Any]:
    kw.update(use_cache=False, return_dict=True)
    return kw


def bert():
    from transformers import BertConfig, BertModel
    cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                     vocab_size=VOCAB, max_position_embeddings=64)
    m = BertModel(cfg)
    return m, lambda seed, seq: _common(_text_inputs(seed, seq))


def distilbert():
    from transformers import DistilBertConfig, DistilBertModel
    cfg = DistilBertConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=VOCAB,
                           max_position_embeddings=64)
    m = DistilBertModel(cfg)
    return m, lambda seed, seq: {**_text_inputs(seed, seq), "return_dict": True}


def roberta():
    from transformers import RobertaConfig, RobertaModel
    cfg = RobertaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                        vocab_size=VOCAB, max_position_embeddings=66)
    m = RobertaModel(cfg)
    return m, lambda seed, seq: _common(_text_inputs(seed, seq))


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=1, eos_token_id=2)
    m = GPT2LMHeadModel(cfg)
    return m, lambda seed, seq: _common(_text_inputs(seed, seq))


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64)
    m = LlamaForCausalLM(cfg)
    return m, lambda seed, seq: _common(_text_inputs(seed, seq))


def mistral():
    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64, sliding_window=None)
    m = MistralForCausalLM(cfg)
    return m, lambda seed, seq: _common(_text_inputs(seed, seq))


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64)
    m = Qwen2ForCausalLM(cfg)
    return m, lambda seed, seq: _common(_text_inputs(seed, seq))


def t5():
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                   vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0)
    m = T5ForConditionalGeneration(cfg)

    def inputs(seed: int, seq: int) -> Dict[str, Any]:
        kw = _text_inputs(seed, seq)
        dec = _text_inputs(seed + 100, max(seq - 3, 2), pad_last=False)
        kw["decoder_input_ids"] = dec["input_ids"]
        kw["decoder_attention_mask"] = dec["attention_mask"]
        return _common(kw)

    return m, inputs


def vit():
    from transformers import ViTConfig, ViTModel
    cfg = ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                    image_size=32, patch_size=8, num_channels=3)
    m = ViTModel(cfg)

    # ViT has no sequence length to vary (the patch count is fixed by image_size), so the
    # "other length" input is a different batch size (see _OTHER_NOTE).
    def inputs(seed: int, seq: int) -> Dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        batch = BATCH if seq == SEQ else BATCH + 1
        return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=g), "return_dict": True}

    return m, inputs


def bloom():
    from transformers import BloomConfig, BloomForCausalLM
    cfg = BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB)
    m = BloomForCausalLM(cfg)
    return m, lambda seed, seq: _common(_text_inputs(seed, seq))


MODELS: Dict[str, Callable[[], Tuple[torch.nn.Module, Callable[[int, int], Dict[str, Any]]]]] = {
    "bert": bert, "distilbert": distilbert, "roberta": roberta, "gpt2": gpt2, "llama": llama,
    "mistral": mistral, "qwen2": qwen2, "t5": t5, "vit": vit, "bloom": bloom,
}
_OTHER_NOTE = {"vit": "other 'length' = batch 3 (ViT has fixed patch count at 32x32)"}


# --- comparison ------------------------------------------------------------------------------
def _is_proxy(x: Any) -> bool:
    # type(), not isinstance(): a symtrace Proxy claims to be a Tensor through __class__
    return type(x).__name__ in ("Proxy", "Attribute") and type(x).__module__.startswith("symtrace")


def _leaves(out: Any, prefix: str = "out", depth: int = 0) -> List[Tuple[str, Any]]:
    """(path, leaf) pairs of a (nested) output: ModelOutput/dict, tuple/list, tensors, cache
    objects (DynamicCache & co: their attributes, recursively), others."""
    if _is_proxy(out) or isinstance(out, torch.Tensor):
        return [(prefix, out)]
    if isinstance(out, dict):  # ModelOutput is an OrderedDict
        res = []
        for k in out.keys():
            res += _leaves(out[k], f"{prefix}.{k}", depth + 1)
        return res
    if isinstance(out, (tuple, list)):
        res = []
        for i, x in enumerate(out):
            res += _leaves(x, f"{prefix}[{i}]", depth + 1)
        return res
    if depth < 6 and type(out).__module__.startswith("transformers.") and hasattr(out, "__dict__"):
        res = []  # e.g. DynamicCache.layers[i].keys / .values
        for k, v in sorted(vars(out).items()):
            if isinstance(v, (torch.Tensor, list, tuple, dict)) or type(v).__module__.startswith("transformers.") \
                    or _is_proxy(v):
                res += _leaves(v, f"{prefix}.{k}", depth + 1)
        return res
    return [(prefix, out)]


def compare(got: Any, want: Any) -> None:
    """Raise AssertionError unless every leaf of ``got`` equals the one of ``want``."""
    g, w = _leaves(got), _leaves(want)
    gp, wp = [p for p, _ in g], [p for p, _ in w]
    if type(got) is not type(want):
        raise AssertionError(f"output type {type(got).__name__} != eager {type(want).__name__}")
    if gp != wp:
        raise AssertionError(f"output structure differs: {gp} vs eager {wp}")
    for (p, a), (_, b) in zip(g, w):
        if _is_proxy(a):
            raise AssertionError(f"{p}: a leaked symtrace Proxy ({a!r}) instead of a value")
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                raise AssertionError(f"{p}: got {type(a).__name__}, eager gives a tensor")
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, p=p: f"{p}: {m}")
        elif a != b:
            raise AssertionError(f"{p}: {a!r} != eager {b!r}")


def _short(e: BaseException, n: int = 160) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) <= n else text[: n - 3] + "..."


def _guard_text(e: symtrace.GuardError) -> str:
    g = getattr(e, "guard", None)
    if g is None:
        return _short(e)
    return f"GuardError: {g.describe()} [{g.kind}] at {g.where()}"


# --- one model -------------------------------------------------------------------------------
class KwargsWrapper(torch.nn.Module):
    """``forward(**kw)`` -> ``model(**kw)``: the keyword inputs reach the model as keywords (works
    around symtrace passing keyword example inputs positionally, see the report)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **kw):
        return self.model(**kw)


def _natural(kw: Dict[str, Any]) -> Dict[str, Any]:
    """The plain call: tensors only, config defaults for use_cache / return_dict."""
    return {k: v for k, v in kw.items() if isinstance(v, torch.Tensor)}


def _eager_time(model, inp, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model(**inp)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def check(model: torch.nn.Module, target: torch.nn.Module, inputs, wants, errors: Dict[str, str],
          with_fx: bool) -> Dict[str, Any]:
    """Trace ``target`` (the model or a wrapper of it) on inputs[0] and check it against eager."""
    row: Dict[str, Any] = {}
    inp_a, inp_b, inp_c = inputs
    want_a, want_b, want_c = wants
    gm = None
    t0 = time.perf_counter()
    try:
        gm = symtrace.symbolic_trace(target, example_inputs=inp_a)
        row["trace s"] = time.perf_counter() - t0
        row["trace"] = "ok"
        row["nodes"] = len(gm.graph.nodes)
        row["guards"] = len(gm.graph.guards)
        row["data guards"] = sum(1 for n in gm.graph.nodes if n.name.startswith("guard_"))
    except Exception as e:
        row["trace s"] = time.perf_counter() - t0
        row["trace"] = "FAIL " + _short(e, 110)
        errors["trace"] = traceback.format_exc()

    def replay(inp, want, key, guard_ok):
        if gm is None:
            return "-"
        try:
            got = gm(**inp)
        except symtrace.GuardError as e:
            errors[key] = traceback.format_exc()
            return _guard_text(e) if guard_ok else "UNEXPECTED " + _guard_text(e)
        except Exception as e:
            errors[key] = traceback.format_exc()
            return "ERROR " + _short(e)
        try:
            compare(got, want)
            return "ok"
        except AssertionError as e:
            errors[key] = traceback.format_exc()
            return "MISMATCH " + _short(e)

    row["same inputs"] = replay(inp_a, want_a, "same", False)
    row["same shape"] = replay(inp_b, want_b, "new", False)
    row["other length"] = replay(inp_c, want_c, "other", True)

    def run_capture(ins, ws, tag):
        cap = symtrace.capture(target)
        res = []
        for t, inp, want in zip("abc", ins, ws):
            try:
                compare(cap(**inp), want)
                res.append((t, "ok"))
            except Exception as e:
                errors[f"{tag} {t}"] = traceback.format_exc()
                res.append((t, _short(e, 100)))
        if all(r == "ok" for _, r in res):
            return "ok", cap.captures
        by_msg: Dict[str, str] = {}
        for t, r in res:
            if r != "ok":
                by_msg[r] = by_msg.get(r, "") + t
        return "; ".join(f"{ts}: {m}" for m, ts in by_msg.items()), cap.captures

    row["capture"], row["captures"] = run_capture(inputs, wants, "capture")
    nat = [_natural(i) for i in inputs]
    row["capture (plain call)"], _ = run_capture(nat, [model(**i) for i in nat], "capture-plain")

    if with_fx:
        try:
            torch.fx.symbolic_trace(model)
            row["torch.fx"] = "ok"
        except Exception as e:
            row["torch.fx"] = _short(e, 90)
    return row


def run_model(name: str, verbose: bool = False) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(row for the model itself, row for KwargsWrapper(model) if tracing the model failed)."""
    torch.manual_seed(0)
    model, make = MODELS[name]()
    model.eval()
    inputs = (make(1, SEQ), make(2, SEQ), make(3, SEQ2))
    errors: Dict[str, str] = {}
    with torch.no_grad():
        model(**inputs[0])  # warm-up
        wants = tuple(model(**i) for i in inputs)
        row = {"model": name, **check(model, model, inputs, wants, errors, with_fx=True)}
        row["eager s"] = _eager_time(model, inputs[0])
        wrapped = None
        if row["trace"] != "ok":
            werr: Dict[str, str] = {}
            wrapped = {"model": name + " (**kw wrapper)", **check(model, KwargsWrapper(model).eval(), inputs, wants,
                                                                  werr, with_fx=False)}
            errors.update({"wrapper " + k: v for k, v in werr.items()})
    if verbose:
        for k, tb in errors.items():
            print(f"===== {name} / {k} =====\n{tb}")
    return row, wrapped


COLS = ["model", "trace", "same inputs", "same shape", "other length", "capture", "capture (plain call)", "nodes",
        "guards", "data guards", "trace s", "eager s", "torch.fx"]


def _child(name: str, verbose: bool) -> None:
    """Run one model and print its rows as JSON on the last line (the parent survives a crash)."""
    import json
    try:
        row, wrapped = run_model(name, verbose)
    except Exception as e:  # building the model or eager failed
        row, wrapped = {"model": name, "trace": "SETUP " + _short(e)}, None
        if verbose:
            traceback.print_exc()
    sys.stdout.flush()
    print("\n" + json.dumps([row, wrapped], default=str))


def _run_isolated(name: str, verbose: bool) -> Tuple[Dict[str, Any], Any]:
    import json
    import subprocess
    cmd = [sys.executable, __file__, "--child", name] + (["--verbose"] if verbose else [])
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if verbose:
        sys.stdout.write(proc.stdout.rsplit("\n", 2)[0] + "\n")
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [""]
        sig = f"signal {-proc.returncode}" if proc.returncode < 0 else f"rc {proc.returncode}"
        return {"model": name, "trace": f"CRASH ({sig}) {tail[0][:80]}"}, None
    row, wrapped = json.loads(proc.stdout.strip().splitlines()[-1])
    return row, wrapped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated model names")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    ap.add_argument("--width", type=int, default=40, help="max column width in the table")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (timings)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers
    transformers.logging.set_verbosity_error()
    if args.child:
        _child(args.child, args.verbose)
        return
    names = [n for n in args.only.split(",") if n] or list(MODELS)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, symtrace {symtrace.__version__}, "
          f"{args.threads} torch thread(s); each model runs in its own process")
    print(f"inputs: keyword args input_ids + attention_mask (batch {BATCH}, row 1 right-padded), "
          "use_cache=False, return_dict=True; T5 adds decoder_input_ids/decoder_attention_mask, ViT takes "
          f"pixel_values. same shape: new ids, seq {SEQ}; other length: seq {SEQ2}. 'capture (plain call)': "
          "tensors only, config defaults (use_cache=True for decoders -> cache objects are compared too).")
    rows, wrapped_rows = [], []
    for n in names:
        row, wrapped = _run_isolated(n, args.verbose)
        rows.append(row)
        if wrapped is not None:
            wrapped_rows.append(wrapped)

    def fmt(r):
        return [f"{r[c]:.3f}" if isinstance(r.get(c), float) else r.get(c, "") for c in COLS]

    w = args.width
    print(tabulate([fmt(r) for r in rows], headers=COLS, tablefmt="github",
                   maxcolwidths=[w] * len(COLS)))
    if wrapped_rows:
        print("\nModels whose direct trace failed, traced through KwargsWrapper (forward(**kw) -> model(**kw)):")
        print(tabulate([fmt(r)[:-1] for r in wrapped_rows], headers=COLS[:-1], tablefmt="github",
                       maxcolwidths=[w] * (len(COLS) - 1)))
    for n, note in _OTHER_NOTE.items():
        if n in names:
            print(f"note: {n}: {note}")


if __name__ == "__main__":
    main()
