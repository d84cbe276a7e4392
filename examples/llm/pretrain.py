"""Weights that predict something, without downloads: a short byte-level training run.

Random weights give nearly flat next-token distributions, where any numeric change flips the
top-1 token and "top-1 agreement with fp32" says little about a quantization scheme. This module
trains the example's model for a few hundred steps on text every Python installation carries,
the standard library's own ``.py`` files, one token per byte (ids 0-255 of the vocabulary). The
model then predicts real text with confident, uneven distributions, and agreement measured on
held-out files (a fixed tenth of the files, never trained on) means what it means for a trained
model. It is still a small model trained briefly: its agreement is a measurement on this model,
not a claim about a given pretrained LLM.

The trained weights are cached (``torch.save`` of the state dict, read back with
``weights_only=True``) under ``$SYMTRACE_CACHE_DIR/llm`` (default ``~/.cache/symtrace/llm``),
keyed by the configuration and the training settings.
"""
from __future__ import annotations

import hashlib
import math
import os
import sys
import sysconfig
import time
import zlib
from typing import Callable, Optional

import torch

__all__ = ["corpus", "held_out_text", "pretrain"]


def _files(split: str):
    root = sysconfig.get_paths()["stdlib"]
    names = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "test", "tests",
                                                        "idlelib", "__pycache__"))
        names += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".py")]
    held = [n for n in names if zlib.crc32(os.path.relpath(n, root).encode()) % 10 == 0]
    return held if split == "held-out" else [n for n in names if n not in set(held)]


def corpus(split: str = "train", limit_bytes: int = 8 << 20) -> torch.Tensor:
    """Bytes of the standard library's ``.py`` files as a 1-d int64 tensor of token ids 0-255.
    ``split``: ``"train"`` (nine tenths of the files) or ``"held-out"`` (the rest)."""
    if split not in ("train", "held-out"):
        raise ValueError(f"split must be 'train' or 'held-out', got {split!r}")
    chunks, total = [], 0
    for path in _files(split):
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= limit_bytes:
            break
    data = b"".join(chunks)[:limit_bytes]
    if not data:
        raise RuntimeError("found no Python standard library sources to train on")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def held_out_text(positions: int, seed: int = 1) -> torch.Tensor:
    """``(1, positions)`` token ids from a random place in the held-out files."""
    text = corpus("held-out", limit_bytes=1 << 20)
    g = torch.Generator().manual_seed(seed)
    start = int(torch.randint(0, max(1, text.numel() - positions), (1,), generator=g))
    return text[start:start + positions].unsqueeze(0)


def _cache_path(model, steps: int, seq: int, batch: int, lr: float) -> str:
    cfg = model.config.to_json_string(use_diff=False)
    key = hashlib.sha256(f"{cfg}|{steps}|{seq}|{batch}|{lr}|{sys.version_info[:2]}|v1".encode()).hexdigest()[:16]
    root = os.environ.get("SYMTRACE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "symtrace")
    return os.path.join(root, "llm", f"bytes-{key}.pt")


def pretrain(model, steps: int = 200, seq: int = 128, batch: int = 4, lr: float = 2e-3,
             log: Optional[Callable[[str], None]] = print) -> float:
    """Train ``model`` (a ``transformers`` causal LM with a vocabulary of at least 256) in place on
    the training files for ``steps`` AdamW steps of ``batch`` x ``seq`` bytes, or load the weights
    of an earlier identical run. Returns the mean held-out loss (nats per byte)."""
    if model.config.vocab_size < 256:
        raise ValueError("byte-level training needs a vocabulary of at least 256 tokens")
    path = _cache_path(model, steps, seq, batch, lr)
    if os.path.exists(path):
        model.load_state_dict(torch.load(path, weights_only=True))
        if log:
            log(f"pretrain: loaded {path}")
    else:
        text = corpus("train")
        g = torch.Generator().manual_seed(0)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
        warmup = max(1, steps // 10)
        model.train()
        start = time.perf_counter()
        for step in range(steps):
            for group in opt.param_groups:   # linear warm-up, then cosine decay to a tenth
                frac = step / warmup if step < warmup else (step - warmup) / max(1, steps - warmup)
                group["lr"] = lr * (frac if step < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
            at = torch.randint(0, text.numel() - seq - 1, (batch,), generator=g)
            ids = torch.stack([text[i:i + seq] for i in at.tolist()])
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if log and (step % 25 == 0 or step == steps - 1):
                log(f"pretrain: step {step + 1}/{steps}, loss {loss.item():.3f}, "
                    f"{time.perf_counter() - start:.0f} s")
        model.eval()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + f".{os.getpid()}.tmp"
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, path)
    model.eval()
    with torch.no_grad():
        ids = held_out_text(4 * seq, seed=7)
        return model(input_ids=ids, labels=ids, use_cache=False).loss.item()
