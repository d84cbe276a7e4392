"""Feature extraction over the model zoo: symtrace's node names against torchvision's, and the
values the extractor returns against forward hooks on the same modules.

Runs in the zoo environment (torchvision, timm; see /work/shared/zoo/README.md), one model per
subprocess:

    PYTHONPATH=. ~/zooenv/bin/python benchmarks/feature_extraction_zoo.py [--only REGEX] [--timeout S]
        [--out results.jsonl]

Per model:
* names: ``symtrace.get_graph_node_names`` (traced with the zoo's example inputs, batch 2)
  against torchvision's ``get_graph_node_names`` where torch.fx can trace the model: equal
  lists, and otherwise how many names each side has that the other lacks;
* module values: an extractor for up to 40 leaf modules called once plus every top-level child
  (a module path selects its last node), in eval and in training mode (same seed), against
  forward hooks on those modules in an eager run (outputs cloned when made);
* op values: up to 6 function/method nodes both sides name, each extracted alone with
  torchvision's extractor (on a copy whose modules run out of place: see ``tv_overwritten``),
  against ours (checks that one name means one value).
Values are compared with ``torch.allclose(rtol=1e-4, atol=1e-5)``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import time
import warnings

ZOO = "/work/shared/zoo"
DEFAULT = [
    "torchvision/resnet18", "torchvision/resnet50", "torchvision/mobilenet_v2", "torchvision/mobilenet_v3_small",
    "torchvision/efficientnet_b0", "torchvision/vit_b_16", "torchvision/convnext_tiny",
    "torchvision/regnet_y_400mf", "torchvision/densenet121", "torchvision/squeezenet1_0",
    "torchvision/shufflenet_v2_x0_5", "torchvision/mnasnet0_5", "torchvision/googlenet",
    "torchvision/inception_v3", "torchvision/swin_t", "torchvision/alexnet", "torchvision/vgg11",
    "torchvision/resnext50_32x4d", "torchvision/maxvit_t",
    "timm/resnet", "timm/efficientnet", "timm/vision_transformer", "timm/convnext", "timm/regnet",
    "timm/mobilenetv3", "timm/densenet", "timm/deit", "timm/levit", "timm/swin_transformer", "timm/cspnet",
    "timm/ghostnet", "timm/mlp_mixer", "timm/rexnet", "timm/dla", "timm/vgg",
]


def _case(key: str):
    sys.path.insert(0, ZOO)
    import zoo

    family, name = key.split("/", 1)
    if family == "torchvision":
        return next(c for c in zoo.torchvision_cases() if c.name == key)
    pick = zoo.timm_picks()[name]
    return zoo._timm_case(name, pick)


#: models whose training-mode forward needs a larger input than the zoo's (inception's aux head)
SIZES = {"torchvision/inception_v3": 299}


def _batch2(key: str, inputs: dict) -> dict:
    """The zoo's inputs with a batch of 2 (training-mode batch norm needs more than one value)."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            shape = (2,) + tuple(v.shape[1:-2]) + (SIZES[key],) * 2 if key in SIZES else (2,) + tuple(v.shape[1:])
            v = torch.randn(shape, generator=g)
        out[k] = v
    return out


def _close(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-4, atol=1e-5,
                                                                            equal_nan=True)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _clone(v):
    import torch

    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, (tuple, list)):
        return type(v)(_clone(x) for x in v) if not hasattr(v, "_fields") else type(v)(*(_clone(x) for x in v))
    return v


def _hook_values(model, paths, inputs, seed):
    import torch

    seen, calls, handles = {}, {}, []
    for p in paths:
        def hook(mod, args, out, p=p):
            calls[p] = calls.get(p, 0) + 1
            seen[p] = _clone(out)
        handles.append(model.get_submodule(p).register_forward_hook(hook))
    try:
        torch.manual_seed(seed)
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return seen, calls


def run_one(key: str) -> dict:
    import torch

    import symtrace

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    rec: dict = {"case": key}
    t0 = time.perf_counter()
    model, inputs = _case(key).make()
    inputs = _batch2(key, inputs)
    try:
        ours = symtrace.get_graph_node_names(model, example_inputs=inputs, suppress_diff_warning=True)
    except Exception as e:
        rec["status"] = "trace-error"
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return rec
    rec["n_names"] = len(ours[1])
    rec["train_eval_differ"] = ours[0] != ours[1]
    try:
        from torchvision.models.feature_extraction import create_feature_extractor as tv_create
        from torchvision.models.feature_extraction import get_graph_node_names as tv_names

        tv = tv_names(model, suppress_diff_warning=True)
    except Exception as e:
        tv = None
        rec["tv"] = f"fx cannot trace: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    if tv is not None:
        rec["names_equal"] = list(tv) == list(ours)
        rec["eval_only_ours"] = [n for n in ours[1] if n not in set(tv[1])]
        rec["eval_only_tv"] = [n for n in tv[1] if n not in set(ours[1])]
        shared = set(tv[1]) & set(ours[1])
        rec["shared_same_order"] = [n for n in tv[1] if n in shared] == [n for n in ours[1] if n in shared]
        # what the names only torchvision gives are (an `assert x.ndim == 4` is a guard here, not nodes)
        kinds = {}
        for n in rec["eval_only_tv"] + rec["eval_only_ours"]:
            k = re.sub(r"_[0-9]+$", "", n.rsplit(".", 1)[-1])
            kinds[k] = kinds.get(k, 0) + 1
        rec["diff_kinds"] = kinds

    # module values: leaf modules called once, and the top-level children (prefixes)
    modules = dict(model.named_modules())
    leaves = [n for n in ours[1] if n in modules and not n.endswith(tuple(f"_{i}" for i in range(10)))]
    step = max(1, len(leaves) // 40)
    chosen = leaves[::step][:40]
    tops = [n for n, _ in model.named_children() if any(x == n or x.startswith(n + ".") for x in ours[1])]
    paths = list(dict.fromkeys(chosen + tops))
    rec["n_modules_checked"] = len(paths)
    try:
        ext = symtrace.create_feature_extractor(model, paths, example_inputs=inputs, suppress_diff_warning=True)
    except Exception as e:
        rec["status"] = "extract-error"
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return rec
    bad, element = {}, set()
    for mode in ("eval", "train"):
        model.train(mode == "train")
        want, calls = _hook_values(model, paths, inputs, seed=1)
        ext.train(mode == "train")
        torch.manual_seed(1)
        with torch.no_grad():
            got = ext(**inputs)
        for p in paths:
            if calls.get(p) != 1:
                continue  # a module run twice: its hook keeps the last call's output
            if _close(got[p], want[p]):
                continue
            if isinstance(want[p], (tuple, list)) and any(_close(got[p], w) for w in want[p]):
                # a module returning several values: its path selects its last node, one of them
                # (torchvision's rule), which the hook sees inside the container
                element.add(p)
                continue
            bad.setdefault(mode, []).append(p)
    model.eval()
    rec["module_values_bad"] = bad
    rec["module_values_element"] = sorted(element)
    rec["module_values_checked"] = sum(1 for p in paths if calls.get(p) == 1)

    # op values: names both sides give to function/method nodes, each extracted alone by torchvision
    if tv is not None:
        tv_eval = set(tv[1])
        common = [n for n in ours[1] if n in tv_eval and n not in modules and n not in inputs]
        ops = common[:: max(1, len(common) // 6)][:6]
        # torchvision's extractor keeps fx's side-effectful nodes (torch._assert) to the end, so an
        # nn.ReLU(inplace=True) after a requested node can overwrite what it returns: the reference
        # is its extractor on a copy whose modules run out of place; `tv_overwritten` counts the
        # names where the extractor on the model itself returns something else
        ref_model = copy.deepcopy(model)
        for m in ref_model.modules():
            if getattr(m, "inplace", None) is True:
                m.inplace = False
        mismatched, errors, overwritten = [], [], []
        if ops:
            try:
                ours_ext = symtrace.create_feature_extractor(model, ops, example_inputs=inputs,
                                                             suppress_diff_warning=True).eval()
                with torch.no_grad():
                    got = ours_ext(**inputs)
                for n in ops:
                    try:
                        with torch.no_grad():
                            ref = tv_create(ref_model, [n], suppress_diff_warning=True).eval()(**inputs)[n]
                            raw = tv_create(model, [n], suppress_diff_warning=True).eval()(**inputs)[n]
                    except Exception as e:
                        errors.append(f"{n}: {type(e).__name__}")
                        continue
                    if not _close(got[n], ref):
                        mismatched.append(n)
                    if not _close(raw, ref):
                        overwritten.append(n)
            except Exception as e:
                errors.append(f"ours: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        rec["tv_overwritten"] = overwritten
        rec["op_values_checked"] = len(ops)
        rec["op_values_bad"] = mismatched
        rec["op_values_errors"] = errors
    rec["status"] = "ok" if not bad and not rec.get("op_values_bad") else "mismatch"
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", help="run one case in this process and print its JSON record")
    ap.add_argument("--only", help="regex over the default case list")
    ap.add_argument("--cases", nargs="*", help="zoo case names to run instead of the default list")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--out", default="feature_extraction_zoo.jsonl")
    a = ap.parse_args()
    if a.case:
        print("RESULT " + json.dumps(run_one(a.case)))
        return
    keys = [k for k in (a.cases or DEFAULT) if not a.only or re.search(a.only, k)]
    with open(a.out, "a") as out:
        for key in keys:
            t0 = time.perf_counter()
            try:
                p = subprocess.run([sys.executable, __file__, "--case", key], capture_output=True, text=True,
                                   timeout=a.timeout, env=dict(os.environ))
                line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
                rec = json.loads(line[7:]) if line else {"case": key, "status": "crash",
                                                         "error": p.stderr.strip().splitlines()[-1:]}
            except subprocess.TimeoutExpired:
                rec = {"case": key, "status": "timeout"}
            rec.setdefault("seconds", round(time.perf_counter() - t0, 1))
            out.write(json.dumps(rec) + "\n")
            out.flush()
            print(_line(rec), flush=True)


def _line(r: dict) -> str:
    names = {True: "names=", False: "names!=", None: "names(no fx)"}[r.get("names_equal")]
    extra = ""
    if r.get("names_equal") is False:
        extra = f" (+{len(r['eval_only_ours'])} ours-only, -{len(r['eval_only_tv'])} tv-only: {r['diff_kinds']})"
    return (f"{r['case']:<40} {r['status']:<13} {names}{extra} modules {r.get('module_values_checked', '-')} "
            f"bad {sum(len(v) for v in r.get('module_values_bad', {}).values())} ops "
            f"{r.get('op_values_checked', '-')} bad {len(r.get('op_values_bad', []))} "
            f"tv-overwritten {len(r.get('tv_overwritten', []))} {r.get('seconds')}s "
            f"{r.get('error', '')}")


if __name__ == "__main__":
    main()
