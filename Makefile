# Build / test scaffolding for symtrace.
#
#   make venv    create .venv: torch (see TORCH_BUILD below), symtrace (editable) with the
#                dev and triton extras
#   make test    run the test suite
#   make demo    run examples/demo.py
#   make bench   run benchmarks/trace_bench.py
#   make clean   remove .venv and caches

PYTHON     ?= python3
VENV       := .venv
VPY        := $(VENV)/bin/python
PIP        := $(VENV)/bin/pip
STAMP      := $(VENV)/.stamp
# Which torch `make venv` installs (README, "Install"):
#   TORCH_BUILD=auto  (default) cuda where `nvidia-smi -L` lists a GPU, cpu elsewhere
#   TORCH_BUILD=cpu   the CPU-only wheel (Linux x86-64: torch==VERSION+cpu from PyTorch's CPU
#                     index, ~0.75 GB installed; other platforms' default wheels are CPU builds)
#   TORCH_BUILD=cuda  PyPI's default wheel, with its CUDA libraries (several GB)
# TORCH_VERSION picks the release (symtrace supports 2.11 to 2.14); TORCH_SPEC, when set, is
# passed to pip as it is and overrides both.
TORCH_VERSION   ?= 2.13.0
TORCH_BUILD     ?= auto
TORCH_SPEC      ?=
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.DEFAULT_GOAL := test
.PHONY: venv dot test demo bench quant-example qat-example quant-bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	@build='$(TORCH_BUILD)'; \
	case "$$build" in auto|cpu|cuda) ;; *) echo "TORCH_BUILD must be auto, cpu or cuda (got $$build)"; exit 2;; esac; \
	if [ "$$build" = auto ]; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then build=cuda; else build=cpu; fi; \
	fi; \
	if [ -n '$(TORCH_SPEC)' ]; then \
	  echo "installing $(TORCH_SPEC) (TORCH_SPEC)"; $(PIP) install '$(TORCH_SPEC)'; \
	elif [ "$$build" = cpu ] && [ "$$(uname -s)-$$(uname -m)" = Linux-x86_64 ]; then \
	  echo "installing torch $(TORCH_VERSION), CPU build"; \
	  $(PIP) install 'torch==$(TORCH_VERSION)+cpu' 2>/dev/null \
	    || $(PIP) install 'torch==$(TORCH_VERSION)+cpu' --extra-index-url '$(TORCH_CPU_INDEX)'; \
	else \
	  echo "installing torch $(TORCH_VERSION) ($$build build: the platform's default wheel)"; \
	  $(PIP) install 'torch==$(TORCH_VERSION)'; \
	fi
	$(PIP) install -e '.[dev,triton]'
	@touch $@

dot:
	@if command -v dot >/dev/null 2>&1; then \
	  :; \
	elif [ "$$(id -u)" = "0" ]; then \
	  echo "graphviz 'dot' not found; installing Debian package graphviz ..."; \
	  if (apt-get update -qq && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz) >/dev/null \
	     && command -v dot >/dev/null 2>&1; then \
	    echo "graphviz installed: $$(command -v dot)"; \
	  else \
	    echo "WARNING: could not install graphviz with apt-get;" \
	         "graph pictures will fall back to DOT text."; \
	  fi; \
	else \
	  echo "NOTE: graphviz 'dot' not found and not running as root."; \
	  echo "      Install it with: sudo apt-get install graphviz  (or your OS's package manager)."; \
	  echo "      Until then, graph drawings fall back to DOT text."; \
	fi

test: venv dot
	$(VPY) -m pytest tests

demo: venv dot
	$(VPY) examples/demo.py

bench: venv
	$(VPY) benchmarks/trace_bench.py

quant-example: venv dot
	$(VPY) examples/quantization/quantize_digits.py

qat-example: venv
	$(VPY) examples/quantization/qat_mobilenet.py

quant-bench: venv
	OMP_WAIT_POLICY=PASSIVE $(VPY) benchmarks/quant_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build dist *.egg-info .symtrace_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
