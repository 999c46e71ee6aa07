# Two entry points for a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs what it needs (torch CPU build where there is no CUDA).
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: demo test test-gpu bench clean

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
ifeq ($(HAS_CUDA),1)
	$(VPY) -m pip install -q torch
else
	$(VPY) -m pip install -q torch==2.13.0
endif
	$(VPY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VPY) -m flashtile demo

# CPU: the torch path plus the Triton kernels through the interpreter.
test: $(STAMP)
	TRITON_INTERPRET=1 $(VPY) -m pytest -q -x -p no:cacheprovider tests

# GPU: run on the device machine with its own python (no venv, no network there).
test-gpu:
	mkdir -p docs
	set -o pipefail; $(PY) -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests --gpu 2>&1 | tee docs/gpu-test-log.txt

clean:
	rm -rf $(VENV) build *.egg-info
