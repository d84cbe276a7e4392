"""A Llama-architecture decoder through symtrace: fp32 capture, int8 and int4 weight-only.

    python examples/llm/llama_decode.py [--config small|1b] [--prompt 64] [--new 32]
        [--threads 2] [--positions 256] [--anchors] [--variants fp32,int8,int4]

The model is built from a ``transformers`` config with random weights (no downloads): ``small``
is hidden 1024, 8 layers, 16 query / 4 key-value heads, vocab 32000; ``1b`` is hidden 2048,
16 layers, 32 / 8 heads (~1.1B parameters, ~4.5 GB in fp32). Each variant is the same model
with ``model.forward = symtrace.capture(model.forward, passes=[...])``:

- ``symtrace fp32``: the captured graph as it is;
- ``int8``: ``Q.weight_only(bits=8)`` (per output channel);
- ``int4``: ``Q.weight_only(bits=4, group_size=128, lm_head=8)`` (the LM head int8 per channel,
  as llama.cpp keeps its output layer: an int4 head cost 6-10 points of top-1 agreement);
- ``int4a8``: the same int4 weights with ``activations="int8"`` (each Linear's input rounded to
  int8 per block of 32; on AVX2 and AVX512-VNNI CPUs the GEMVs sum in integers);
  (int8: the LM head too, ``lm_head=True``: at vocab 32000 it is a large share of the bytes);
- ``... lowered`` (``fp32+lower`` ...): the same passes, then ``symtrace.lower.lowering_pass()``,
  which lowers the tensor region between the KV cache's reads and writes (RMSNorm, RoPE, the
  SiLU gate fused into C kernels; fp32 linears through oneDNN with packed weights).

Printed per variant: prefill time, decode tokens/s (greedy, batch 1, a KV cache), the weight
bytes read per decoded token, the memory-bandwidth limit that implies (copy bandwidth / bytes
per token) and the share of it reached, and agreement with eager fp32: the tokens of a
greedy generation, and teacher-forced over ``--positions`` positions of random text, top-1
agreement and mean KL(fp32 || variant). ``--anchors`` adds torch.compile (Inductor) fp32 and
torch's dynamic int8 quantization (``torch.ao.quantization.quantize_dynamic``) as anchors.
Decode is timed step by step in ``--rounds`` interleaved rounds (median of all steps; prefill:
median of the rounds, after a warm-up that captures and compiles); the load average is printed.
The copy bandwidth is measured before the timing and after each round, and the limit uses the
highest: on a shared machine other processes only ever lower what a measurement sees (one
measurement here read 14.6 GB/s, minutes after others read 29-32), and a limit is what the
memory can do.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import symtrace  # noqa: E402
from symtrace.lower import lowering_pass  # noqa: E402
from symtrace.passes import quant as Q  # noqa: E402

CONFIGS = {
    "tiny": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=4096),
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=32000),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000),
}


def build(config: str):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=False, **CONFIGS[config])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():   # random weights of a plausible scale (the default init is tiny)
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0, 0.02 if "embed" in name else 1.0 / p.shape[1] ** 0.5)
    return model


def copy_bandwidth(mb: int = 512) -> float:
    """Bytes per second of a large tensor copy (read + write counted), median of 5."""
    src = torch.empty(mb * 2 ** 20 // 4)
    src.fill_(1.0)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 2 * src.numel() * 4 / statistics.median(times[1:])


def read_bandwidth(mb: int = 512) -> float:
    """Bytes per second of a large tensor's sum (reads only, as a decode step's weights are),
    median of 5: printed beside the copy bandwidth, which the limit column uses."""
    src = torch.ones(mb * 2 ** 20 // 4)
    times = []
    for _ in range(6):
        t = time.perf_counter()
        src.sum()
        times.append(time.perf_counter() - t)
    return src.numel() * 4 / statistics.median(times[1:])


def bytes_per_token(module) -> int:
    """Bytes of weights one decode step reads: the tensors the graph uses (``get_attr`` and the
    parameters and buffers of the modules it calls), an embedding table counting one row, the
    rotary tables not at all. For eager, every parameter and buffer of the model."""
    graph = getattr(module, "graph", None)
    if graph is None or not hasattr(graph, "nodes"):
        used = list(module.named_parameters()) + list(module.named_buffers())
        for name, sub in module.named_modules():   # torch's quantized Linear keeps its int8 weight packed
            if isinstance(sub, torch.ao.nn.quantized.dynamic.Linear):
                w = sub.weight()
                used.append((f"{name}.weight", w.int_repr()))
                if w.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
                    used.append((f"{name}.scales", w.q_per_channel_scales()))
    else:
        used = []
        for n in graph.nodes:
            if n.op == "get_attr":
                used.append((n.target, _attr(module, n.target)))
            elif n.op == "call_module":
                sub = module.get_submodule(n.target)
                used += [(f"{n.target}.{k}", t) for k, t in list(sub.named_parameters()) + list(sub.named_buffers())]
    total, seen = 0, set()
    for name, t in used:
        if not isinstance(t, torch.Tensor) or id(t) in seen:
            continue
        seen.add(id(t))
        if "embed_tokens" in name or "embedding" in name:
            total += t.shape[-1] * t.element_size()
        elif "rotary" not in name and "inv_freq" not in name:
            total += t.numel() * t.element_size()
    return total


def _attr(module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def variants(model, names, anchors):
    out = {"eager fp32": model}
    passes = {"symtrace fp32": [], "int8": [Q.weight_only(bits=8, lm_head=True)],
              "int4": [Q.weight_only(bits=4, group_size=128, lm_head=8)],
              "int4 a8": [Q.weight_only(bits=4, group_size=128, lm_head=8, activations="int8")]}
    wanted = {"fp32": "symtrace fp32", "int8": "int8", "int4": "int4", "int4a8": "int4 a8"}
    for short in names:
        base, _, lowered = short.partition("+")
        if base not in wanted or lowered not in ("", "lower"):
            raise SystemExit(f"unknown variant {short!r}: expected fp32, int8, int4 or int4a8, optionally +lower")
        name = wanted[base] + (" lowered" if lowered else "")
        m = copy.copy(model)   # shares the weights; only forward differs
        m.forward = symtrace.capture(model.forward, passes=passes[wanted[base]] + ([lowering_pass()] if lowered else []))
        out[name] = m
    if anchors:
        m = copy.copy(model)
        m.forward = torch.compile(model.forward)
        out["inductor fp32"] = m
        out["torch dynamic int8"] = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear},
                                                                            dtype=torch.qint8)
    return out


def generate_timed(m, ids, new: int):
    """Greedy decoding with a DynamicCache: (tokens, prefill seconds, per-step seconds)."""
    from transformers import DynamicCache
    cache = DynamicCache(config=m.config)
    with torch.no_grad():
        t = time.perf_counter()
        out = m(input_ids=ids, past_key_values=cache, use_cache=True)
        prefill = time.perf_counter() - t
        tok = out.logits[:, -1:].argmax(-1)
        tokens, steps = [tok], []
        for _ in range(new - 1):
            t = time.perf_counter()
            out = m(input_ids=tok, past_key_values=cache, use_cache=True)
            steps.append(time.perf_counter() - t)
            tok = out.logits[:, -1:].argmax(-1)
            tokens.append(tok)
    return torch.cat(tokens, 1), prefill, steps


def teacher_forced(m, text):
    with torch.no_grad():
        return m(input_ids=text, use_cache=False).logits[0].float()


ALL_VARIANTS = "fp32,int8,int4,int4a8,fp32+lower,int8+lower,int4+lower,int4a8+lower"
#: the 1b config's default: every variant holds its own weights, and all eight (with the fp32
#: lowered variant's packed copy) were killed for memory on a 24 GiB machine
LARGE_VARIANTS = "fp32,int8+lower,int4a8+lower"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=tuple(CONFIGS), default="small")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (medians over all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default=None,
                    help="comma-separated: fp32, int8, int4, int4a8, each optionally +lower (lowering_pass last); "
                         f"default: {ALL_VARIANTS} ({LARGE_VARIANTS} for --config 1b, whose every variant at once "
                         "needs more than 24 GiB)")
    ap.add_argument("--anchors", action="store_true", help="add torch.compile fp32 and torch dynamic int8")
    ap.add_argument("--trained", type=int, default=0, metavar="STEPS",
                    help="train the model first for STEPS steps on byte-level text (pretrain.py; cached), then "
                         "prompt and measure agreement on held-out text; 0: random weights and random tokens")
    args = ap.parse_args(argv)
    if args.variants is None:
        args.variants = LARGE_VARIANTS if args.config == "1b" else ALL_VARIANTS
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    model = build(args.config)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    if args.trained:
        from pretrain import held_out_text, pretrain
        loss = pretrain(model, steps=args.trained, log=lambda s: print(s, file=sys.stderr))
        print(f"trained {args.trained} steps on byte-level text: held-out loss {loss:.3f} nats/byte")
        text = held_out_text(args.positions + args.prompt, seed=1)
        ids, text = text[:, :args.prompt], text[:, args.prompt:]
    else:
        ids = torch.randint(0, vocab, (1, args.prompt), generator=g)
        text = torch.randint(0, vocab, (1, args.positions), generator=g)
    bws = [copy_bandwidth()]
    rbw = read_bandwidth()
    print(f"config {args.config}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters; "
          f"{args.threads} threads; copy bandwidth {bws[0] / 1e9:.1f} GB/s (read + write; a read-only sum: "
          f"{rbw / 1e9:.1f} GB/s); load average {os.getloadavg()[0]:.1f}")
    runs = variants(model, args.variants.split(","), args.anchors)
    ref_logits = teacher_forced(model, text)
    confidence = F.softmax(ref_logits, -1).max(-1).values.mean().item()
    for name, m in runs.items():
        generate_timed(m, ids, 3)          # warm-up: captures, compiles, caches (same prompt length)
        print(f"  {name}: warmed up", file=sys.stderr)
    # timed in interleaved rounds (each variant once per round), so that a slow stretch of the
    # machine hits every variant alike; the medians are over all rounds' steps
    timing = {name: ([], [], None) for name in runs}
    for _ in range(args.rounds):
        for name, m in runs.items():
            tokens, prefill, steps = generate_timed(m, ids, args.new)
            prefills, all_steps, _ = timing[name]
            prefills.append(prefill)
            all_steps.extend(steps)
            timing[name] = (prefills, all_steps, tokens)
        bws.append(copy_bandwidth())
    bw = max(bws)
    ref_tokens = timing["eager fp32"][2]
    rows = []
    for name, m in runs.items():
        prefills, steps, tokens = timing[name]
        prefill, step = statistics.median(prefills), statistics.median(steps)
        graph = m.forward.graphs[0] if hasattr(m.forward, "graphs") and m.forward.graphs else m
        graph = getattr(graph, "meta", {}).get("lowered_from", graph)   # the graph before lowering
        nbytes = bytes_per_token(graph)
        logits = teacher_forced(m, text)
        top1 = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
        kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(ref_logits, -1), log_target=True,
                      reduction="batchmean").item()
        known = nbytes > 0   # (torch's quantized Linear keeps its packed weights out of sight)
        rows.append([name, f"{prefill * 1e3:.0f}", f"{1 / step:.2f}", f"{nbytes / 1e6:.0f}" if known else "n/a",
                     f"{bw / nbytes:.1f}" if known else "n/a", f"{100 * nbytes / step / bw:.0f}%" if known else "n/a",
                     "yes" if torch.equal(tokens, ref_tokens) else f"{(tokens == ref_tokens).float().mean():.0%}",
                     f"{100 * top1:.1f}%", f"{kl:.2e}"])
    base = float(rows[0][2])
    from tabulate import tabulate
    print(tabulate([r[:3] + [f"{float(r[2]) / base:.2f}x"] + r[3:] for r in rows],
                   headers=["variant", "prefill ms", "decode tok/s", "vs eager", "weight MB/token",
                            "BW limit tok/s", "% of BW limit", "greedy tokens = eager",
                            "top-1 agree (teacher-forced)", "KL vs fp32"], disable_numparse=True))
    print(f"(BW limit: the highest of {len(bws)} copy-bandwidth measurements, {bw / 1e9:.1f} GB/s; all: "
          f"{', '.join(f'{b / 1e9:.1f}' for b in bws)})")
    print(f"(prompt {args.prompt}, {args.new} new tokens, {args.rounds} interleaved rounds, decode = median step, "
          f"prefill = median; teacher-forced over "
          f"{args.positions} positions; load average now {os.getloadavg()[0]:.1f})")
    if args.trained:
        print(f"(fp32's mean top-1 probability on the held-out text is {confidence:.3f})")
    else:
        print(f"(fp32's mean top-1 probability is {confidence:.4f}: random weights give nearly flat "
              f"next-token distributions, so small numeric changes flip the top-1 token far more often "
              f"than in a trained model; KL measures the change itself; --trained STEPS measures a trained one)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
