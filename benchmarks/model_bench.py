"""Whole models: eager vs Inductor (default, freezing) vs ``symtrace.lower`` (issue 19's table).

    ~/zooenv/bin/python benchmarks/model_bench.py [--quick] [--models resnet50_b1,bert]
        [--rounds 15] [--threads 2] [--clock wall|thread] [--no-inductor] [--no-inductor-default] [--warm-cache]
        [--lower-options KEY=VALUE,...] [--plain] [--json out.jsonl] [--report] [--device cpu|cuda]

Models outside the table: ``tv:NAME[@batch]`` (a torchvision classification model),
``timm:NAME[@batch]`` (a timm model at its default input size), and ``nn_encoder`` /
``nn_transformer``: torch's own ``nn.TransformerEncoder`` (6 layers, 512 wide, 8 heads, GELU,
batch-first, sequence 128) and ``nn.Transformer`` (3 + 3 layers, source 128, target 32).

Models (random weights, eval mode, ``torch.no_grad``): torchvision resnet50 at batch 1 and 8
(224x224), mobilenet_v3_large (batch 1), vit_b_16 (batch 1); transformers BERT-base, GPT-2 small
and a Llama-architecture decoder (hidden 1024, 8 layers, 16 heads / 4 KV heads, MLP 2816), all at
batch 1, sequence 128, returning the last hidden state. It needs torchvision and transformers, so
it runs in the zoo environment (``~/zooenv``), not in ``make test``.

Each model runs in a child process of its own (a crash is reported, not fatal; Inductor's
caches start cold for every model, like a user's first compile). In the child the variants are
timed interleaved, round by round, one call per sample, ``--threads`` intra-op threads; the
table quotes medians. "err" is ``max|y - eager| / max|eager|`` on the benchmark input. Compile
times are the first call (plus tracing, for symtrace) with empty on-disk caches (fresh
``TORCHINDUCTOR_CACHE_DIR`` and ``SYMTRACE_CACHE_DIR`` per model unless ``--warm-cache``):
Inductor with freezing compiles first, so it pays Inductor's one-time process setup (the column
"Inductor cold"); Inductor default compiles second, in the warmed process.

The machine's load average is printed beside each model: on a shared machine, rerun a model
whose numbers look off (``--models``), or time with ``--threads 1 --clock thread`` (CPU time of
the one thread doing the work). ``--quick``: 5 rounds, no Inductor default. ``--plain`` adds
"symtrace plain": ``lower.compile(..., inference=False)`` (no inference pipeline).

``--device cuda``: the models and inputs on the GPU, symtrace lowered with ``target="cuda"``
(Triton kernels; convolutions and matmuls stay cuDNN / cuBLAS calls), every sample timed between
two ``torch.cuda.synchronize()`` calls. Inductor there is ``torch.compile``'s default mode (no
CUDA graphs), the same launch model as symtrace's.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

# the symtrace of this checkout, not an installed one
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MODELS = ("resnet50_b1", "resnet50_b8", "mobilenet_v3_large", "vit_b_16", "bert", "gpt2", "llama")
SEQ = 128


# --------------------------------------------------------------------------- models

def _vision(name: str, batch: int):
    import torch
    import torchvision
    torch.manual_seed(0)
    kwargs = {"aux_logits": False, "init_weights": True} if name in ("inception_v3", "googlenet") else {}
    model = getattr(torchvision.models, name)(weights=None, **kwargs).eval()
    if name == "vit_b_16":   # its head starts at zero: every output would be 0 and errors meaningless
        torch.nn.init.normal_(model.heads.head.weight, std=0.02)
    size = 299 if name == "inception_v3" else 224
    return model, (torch.randn(batch, 3, size, size),)


def _hf(make):
    import torch
    from torch import nn

    class LastHidden(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state

    torch.manual_seed(0)
    model, vocab = make()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, SEQ), generator=g)
    mask = torch.ones(1, SEQ, dtype=torch.long)
    return LastHidden(model.eval()).eval(), (ids, mask)


def _bert():
    from transformers import BertConfig, BertModel
    cfg = BertConfig()  # bert-base: 12 layers, 768, 12 heads
    return BertModel(cfg, add_pooling_layer=False), cfg.vocab_size


def _gpt2():
    from transformers import GPT2Config, GPT2Model
    cfg = GPT2Config()  # gpt2 small: 12 layers, 768, 12 heads
    return GPT2Model(cfg), cfg.vocab_size


def _llama():
    from transformers import LlamaConfig, LlamaModel
    cfg = LlamaConfig(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                      intermediate_size=2816, vocab_size=32000, max_position_embeddings=512)
    return LlamaModel(cfg), cfg.vocab_size


def build(name: str):
    """``(model, example inputs)`` for a model name of :data:`MODELS`."""
    if name == "resnet50_b1":
        return _vision("resnet50", 1)
    if name == "resnet50_b8":
        return _vision("resnet50", 8)
    if name in ("mobilenet_v3_large", "vit_b_16"):
        return _vision(name, 1)
    makers = {"bert": _bert, "gpt2": _gpt2, "llama": _llama}
    if name in makers:
        return _hf(makers[name])
    if name in ("nn_encoder", "nn_transformer"):
        return _torch_transformer(name)
    if name.startswith(("tv:", "timm:")):   # models outside the table: tv:densenet121, timm:convnext_tiny@4
        kind, _, rest = name.partition(":")
        model_name, _, batch = rest.partition("@")
        return _vision(model_name, int(batch or 1)) if kind == "tv" else _timm(model_name, int(batch or 1))
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}, nn_encoder, nn_transformer, "
                     "tv:NAME[@batch] or timm:NAME[@batch]")


def _torch_transformer(name: str):
    import torch
    from torch import nn
    torch.manual_seed(0)
    if name == "nn_encoder":
        layer = nn.TransformerEncoderLayer(512, 8, 2048, activation="gelu", batch_first=True)
        return nn.TransformerEncoder(layer, 6, enable_nested_tensor=False).eval(), (torch.randn(1, SEQ, 512),)
    model = nn.Transformer(512, 8, 3, 3, 2048, batch_first=True).eval()
    return model, (torch.randn(1, SEQ, 512), torch.randn(1, 32, 512))


def _timm(name: str, batch: int):
    import timm
    import torch
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False).eval()
    size = model.default_cfg.get("input_size", (3, 224, 224))
    return model, (torch.randn(batch, *size),)


# --------------------------------------------------------------------------- child: one model

def _rel_err(got, ref) -> float:
    import torch
    if not isinstance(got, torch.Tensor) or got.shape != ref.shape:
        return float("inf")
    d = (got.double() - ref.double()).abs().max().item()
    return d / max(ref.double().abs().max().item(), 1e-30)


def _lower_options(text: str) -> dict:
    """``k=v,...`` as keyword arguments of ``lower.compile``; fields of ``InferenceOptions``
    (``nan_exact=false``) go into ``inference=InferenceOptions(...)``."""
    import dataclasses
    from symtrace.lower import InferenceOptions
    fields = {f.name for f in dataclasses.fields(InferenceOptions)}
    out, inference = {}, {}
    for item in filter(None, (text or "").split(",")):
        k, _, v = item.partition("=")
        value = {"true": True, "false": False}.get(v.strip().lower(), v.strip())
        (inference if k.strip() in fields else out)[k.strip()] = value
    if inference:
        out["inference"] = InferenceOptions(**inference)
    return out


def run_child(name: str, args) -> dict:
    import torch
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    row = {"model": name, "load_start": os.getloadavg()[0]}
    model, inputs = build(name)
    device = torch.device(args.device)
    if device.type != "cpu":
        model = model.to(device)
        inputs = tuple(x.to(device) for x in inputs)
        sync = getattr(torch, device.type).synchronize
        plain_clock = clock

        def clock():
            sync()
            return plain_clock()
    variants = {}
    with torch.no_grad():
        ref = model(*inputs)
        variants["eager"] = model
        if not args.no_inductor:
            import torch._inductor.config as icfg
            for label, freezing in (("inductor_freezing", True), ("inductor", False)):
                if label == "inductor" and args.no_inductor_default:
                    continue
                torch._dynamo.reset()
                t = time.perf_counter()
                try:
                    with icfg.patch(freezing=freezing):
                        fn = torch.compile(model, dynamic=False)
                        fn(*inputs)
                except Exception as e:  # pragma: no cover - depends on the toolchain
                    row[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    continue
                row[f"{label}_compile_s"] = time.perf_counter() - t
                variants[label] = fn
        import symtrace
        from symtrace.lower import compile as lower
        t = time.perf_counter()
        try:
            gm = symtrace.symbolic_trace(model, example_inputs=inputs)
            row["trace_s"] = time.perf_counter() - t
            options = _lower_options(args.lower_options)
            if device.type == "cuda":
                options.setdefault("target", "cuda")
            lm = lower(gm, inputs, **options)
            lm(*inputs)
            row["symtrace_compile_s"] = time.perf_counter() - t
            variants["symtrace"] = lm
            row["kernels"] = len(lm.kernels)
            row["through_torch"] = lm.torch_reason is not None   # (the speed check found the kernels slower)
            if args.report:
                print(lm.report(), file=sys.stderr)
            if args.plain:   # the same lowering without the inference pipeline, for comparison
                variants["symtrace_plain"] = lower(gm, inputs, **{**options, "inference": False})
                variants["symtrace_plain"](*inputs)
        except Exception as e:
            import traceback
            traceback.print_exc()
            row["symtrace_error"] = f"{type(e).__name__}: {str(e)[:300]}"

        for k, fn in variants.items():
            row[f"{k}_err"] = _rel_err(fn(*inputs), ref)
        for fn in variants.values():   # warm up
            for _ in range(2):
                fn(*inputs)
        times = {k: [] for k in variants}
        keys = list(variants)
        for r in range(args.rounds):
            order = keys[r % len(keys):] + keys[:r % len(keys)]
            for k in order:
                t = clock()
                variants[k](*inputs)
                times[k].append(clock() - t)
    for k, v in times.items():
        row[f"{k}_ms"] = statistics.median(v) * 1e3
        row[f"{k}_min_ms"] = min(v) * 1e3
    row["load_end"] = os.getloadavg()[0]
    return row


# --------------------------------------------------------------------------- parent: the table

def _fmt(v, spec=".1f"):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def table(rows) -> str:
    head = ["model", "eager", "Inductor", "Inductor (freezing)", "symtrace", "symtrace plain", "vs eager",
            "vs Ind. freezing",
            "err", "Inductor cold s", "symtrace cold s", "load"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | failed: {r['error'][:120]} |")
            continue
        e, s, f = r.get("eager_ms"), r.get("symtrace_ms"), r.get("inductor_freezing_ms")
        lines.append("| " + " | ".join([
            r["model"], _fmt(e), _fmt(r.get("inductor_ms")), _fmt(f),
            _fmt(s) + (" (torch)" if r.get("through_torch") else ""), _fmt(r.get("symtrace_plain_ms")),
            _fmt(e / s, ".2f") + "x" if e and s else "-",
            _fmt(f / s, ".2f") + "x" if f and s else "-",
            _fmt(r.get("symtrace_err"), ".1e") if "symtrace_err" in r else r.get("symtrace_error", "-")[:60],
            _fmt(r.get("inductor_freezing_compile_s")), _fmt(r.get("symtrace_compile_s"), ".2f"),
            f"{r['load_start']:.1f}-{r['load_end']:.1f}"]) + " |")
    ok = [r for r in rows if r.get("eager_ms") and r.get("symtrace_ms")]
    if ok:
        geo = math.exp(sum(math.log(r["eager_ms"] / r["symtrace_ms"]) for r in ok) / len(ok))
        lines.append(f"\ngeomean symtrace vs eager: {geo:.2f}x over {len(ok)} models")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="5 rounds, no Inductor default")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: CPU time of the calling thread (with --threads 1 all work runs on it, so time "
                         "the OS gives other processes is not counted)")
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--plain", action="store_true", help="also time symtrace.lower(..., inference=False)")
    ap.add_argument("--no-inductor-default", action="store_true")
    ap.add_argument("--warm-cache", action="store_true", help="keep the user's Inductor and symtrace caches")
    ap.add_argument("--lower-options", default="", help="keyword arguments for symtrace.lower.compile, k=v,...")
    ap.add_argument("--json", default="", help="append one JSON line per model to this file")
    ap.add_argument("--report", action="store_true", help="print each lowered module's report (stderr)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: symtrace lowers with target='cuda' (Triton)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds = min(args.rounds, 5)
        args.no_inductor_default = True
    if args.child:
        print("ROW " + json.dumps(run_child(args.child, args)), flush=True)
        return
    rows = []
    passthrough = [f"--rounds={args.rounds}", f"--threads={args.threads}", f"--lower-options={args.lower_options}",
                   f"--clock={args.clock}", f"--device={args.device}"]
    passthrough += [f for f, on in (("--no-inductor", args.no_inductor), ("--report", args.report), ("--plain", args.plain),
                                    ("--no-inductor-default", args.no_inductor_default)) if on]
    for name in args.models.split(","):
        env = dict(os.environ)
        tmp = None
        if not args.warm_cache:
            tmp = tempfile.TemporaryDirectory(prefix="model_bench_")
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp.name, "inductor")
            env["SYMTRACE_CACHE_DIR"] = os.path.join(tmp.name, "symtrace")
        p = subprocess.run([sys.executable, __file__, "--child", name, *passthrough], env=env,
                           stdout=subprocess.PIPE, text=True)
        row = next((json.loads(ln[4:]) for ln in p.stdout.splitlines() if ln.startswith("ROW ")), None)
        if row is None:
            row = {"model": name, "error": f"child exited {p.returncode}"}
        rows.append(row)
        if tmp is not None:
            tmp.cleanup()
        print(table([row]).splitlines()[2], flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    print()
    print(f"device {args.device}, {args.threads} threads, {args.clock} clock, medians of {args.rounds} interleaved rounds (ms); "
          "err = max|y-eager|/max|eager|; "
          "(torch): the speed check found the kernels slower, the module runs its graph through torch")
    print(table(rows))


if __name__ == "__main__":
    main()
