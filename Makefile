# Build / test scaffolding for symtrace.
#
#   make venv    create .venv and install symtrace (editable) with dev extras
#   make test    run the test suite
#   make demo    run examples/demo.py
#   make bench   run benchmarks/trace_bench.py
#   make clean   remove .venv and caches

PYTHON     ?= python3
VENV       := .venv
VPY        := $(VENV)/bin/python
PIP        := $(VENV)/bin/pip
STAMP      := $(VENV)/.stamp
# Pinned on purpose: an unpinned torch pulls a multi-GB CUDA build.
# The 2.13.0 CPU wheel is available locally.
TORCH_SPEC ?= torch==2.13.0

.DEFAULT_GOAL := test
.PHONY: venv dot test demo bench quant-example qat-example quant-bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install '$(TORCH_SPEC)'
	$(PIP) install -e '.[dev]'
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
