#!/usr/bin/env bash
# What to run when a session is lent a GPU (the device tool runs it in the repository root):
#     bash benchmarks/gpu_run.sh
# 1. the Triton test matrix with the kernels compiled for the GPU (TRITON_INTERPRET=0), and every
#    other `cuda`-marked test (QAT on a GPU...); 2. benchmarks/kernel_bench.py --device cuda (eager, Inductor and
#    symtrace's Triton kernels in one run, plain and autotuned). The GPU machine has its own torch
#    (2.11) and triton (3.6) and no network: nothing is installed here. FULL=1 also runs the whole
#    test suite there (pytest-xdist, 8 workers): a check on torch 2.11 (the graphviz Python
#    package is not on that machine: bring its wheel, see the device tool's notes, or the drawing
#    tests fail). 3. MODELS=1 (the default): benchmarks/model_bench.py --device cuda on whole models (eager,
#    Inductor with freezing, symtrace's Triton lowering; needs torchvision and transformers there); MODELS=0 skips
#    it; KERNELS=0 skips kernel_bench. Each step has a time limit (STEP_S seconds), so one slow step cannot use up a short lease; the test steps
#    use pytest-xdist's 8 workers where it is installed.
set -u
STEP_S=${STEP_S:-180}
XDIST=""
python -c "import xdist" 2>/dev/null && XDIST="-n 8"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name())"
if python -c "import pytest" 2>/dev/null; then
    TRITON_INTERPRET=0 timeout "$STEP_S" python -m pytest tests/test_lower_triton.py -q -p no:cacheprovider --maxfail=25 -o addopts="" $XDIST || echo "(Triton tests on the GPU failed)"
    TRITON_INTERPRET=0 timeout "$STEP_S" python -m pytest tests/test_woq.py -k triton -q -p no:cacheprovider -o addopts="" || echo "(weight-only Triton kernels on the GPU failed)"
    timeout "$STEP_S" python -m pytest tests -m cuda -q -p no:cacheprovider -o addopts="" --ignore=tests/test_lower_triton.py || echo "(cuda-marked tests failed)"
    if [ "${FULL:-0}" = 1 ]; then   # the whole suite on this machine's torch (a version check), 8 workers
        timeout 300 python -m pytest tests -q -p no:cacheprovider -o addopts="" -n 8 --maxfail=40 || echo "(full suite: failures above)"
    fi
else
    echo "(pytest is not installed on this machine: Triton tests skipped)"
fi
[ "${KERNELS:-1}" = 1 ] && timeout "$STEP_S" python benchmarks/kernel_bench.py --device cuda --rounds 15
if [ "${MODELS:-1}" = 1 ]; then
    timeout "$((STEP_S * 2))" python benchmarks/model_bench.py --device cuda --rounds 20 --no-inductor-default \
        --models "${MODEL_LIST:-resnet50_b1,bert,llama,gpt2,resnet50_b8}"
fi
if [ "${KERNELS:-1}" = 1 ]; then
    timeout "$STEP_S" python benchmarks/kernel_bench.py --device cuda --rounds 15 --no-inductor --autotune
fi
