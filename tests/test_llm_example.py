"""examples/llm/llama_decode.py on its tiny configuration: it runs, captured fp32 generates eager's
tokens (lowered too), and the table has a row per variant (timings are not checked)."""
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_llama_decode_example_runs_on_a_tiny_config(tmp_path):
    script = os.path.join(ROOT, "examples", "llm", "llama_decode.py")
    p = subprocess.run([sys.executable, script, "--config", "tiny", "--prompt", "8", "--new", "4",
                        "--positions", "32"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, SYMTRACE_SPEED_CHECK="0"))
    assert p.returncode == 0, p.stderr
    rows = {cells[0]: cells for cells in (re.split(r"\s{2,}", line.strip()) for line in p.stdout.splitlines()
                                          if line.startswith(("eager fp32", "symtrace fp32", "int8", "int4")))}
    assert set(rows) >= {"eager fp32", "symtrace fp32", "int8", "int4", "int4 a8", "symtrace fp32 lowered",
                         "int8 lowered", "int4 lowered", "int4 a8 lowered"}
    sym = rows["symtrace fp32"]
    assert sym[-3:-1] == ["yes", "100.0%"] and float(sym[-1]) == 0.0   # same tokens and logits as eager
    low = rows["symtrace fp32 lowered"]   # oneDNN's linears round differently: tokens the same
    assert low[-3:-1] == ["yes", "100.0%"] and float(low[-1]) < 1e-6
    # the limit uses the best copy bandwidth seen (before the timing and after each round)
    bw = re.search(r"the highest of (\d+) copy-bandwidth measurements, ([\d.]+) GB/s; all: ([\d., ]+)\)", p.stdout)
    assert bw, p.stdout
    seen = [float(v) for v in bw.group(3).split(", ")]
    assert int(bw.group(1)) == len(seen) >= 2 and float(bw.group(2)) == max(seen)
    for q in ("int8", "int4", "int4 a8"):   # lowering a quantized graph changes its numbers by rounding only
        kl, kl_lowered = float(rows[q][-1]), float(rows[q + " lowered"][-1])
        assert abs(kl_lowered - kl) <= 0.05 * kl


def _tiny_llama():
    sys.path.insert(0, os.path.join(ROOT, "examples", "llm"))
    from llama_decode import build
    return build("tiny")


def test_pretrain_splits_the_standard_library_into_disjoint_files():
    sys.path.insert(0, os.path.join(ROOT, "examples", "llm"))
    import pretrain
    train, held = pretrain._files("train"), pretrain._files("held-out")
    assert train and held and not set(train) & set(held)
    assert 0.05 < len(held) / (len(train) + len(held)) < 0.2
    text = pretrain.corpus("held-out", limit_bytes=4096)
    assert text.dtype == torch.int64 and text.numel() == 4096 and int(text.max()) < 256
    with pytest.raises(ValueError, match="split must be"):
        pretrain.corpus("test")


def test_pretrain_learns_the_text_and_caches_its_weights(tmp_path, monkeypatch):
    # the agreement measure needs weights that predict something: a few steps of byte-level
    # training already beat random weights on held-out files; a second run loads the same weights
    sys.path.insert(0, os.path.join(ROOT, "examples", "llm"))
    import pretrain
    monkeypatch.setenv("SYMTRACE_CACHE_DIR", str(tmp_path))
    model = _tiny_llama()
    ids = pretrain.held_out_text(256, seed=7)
    with torch.no_grad():
        before = model(input_ids=ids, labels=ids, use_cache=False).loss.item()
    lines = []
    after = pretrain.pretrain(model, steps=20, seq=48, batch=4, log=lines.append)
    assert after < before - 1.0, (before, after)
    assert any("step 20/20" in s for s in lines)
    again = _tiny_llama()
    lines.clear()
    assert pretrain.pretrain(again, steps=20, seq=48, batch=4, log=lines.append) == after
    assert any("loaded" in s for s in lines)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
