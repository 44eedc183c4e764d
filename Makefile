# refengine: two commands do everything on a fresh machine (see README.md).
#   make run    set up, fetch + convert the default model, generate text
#   make test   set up with the test extras, fetch the model, run every test (two pytest-xdist workers)

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PROMPT ?= What is the capital of France? Answer in one sentence.
# pytest-xdist workers: each loads models of its own (a few GB), so more than the cores helps nothing
TEST_WORKERS ?= 2

.PHONY: run install test test-deps weights kernels bench gpu-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# --no-compile: pip would byte-compile every file of every package (torch's thousands: half of
# its time); Python compiles a module when it is first imported, and keeps the result
PIP_INSTALL := $(BIN)/python -m pip install -q --no-compile

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(PIP_INSTALL) -e '.[plot,serve]'
	touch $@

# one pip run for everything (each run resolves the whole environment again); it also
# stands for `install`'s, so `weights` does not install a second time
$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(PIP_INSTALL) -e '.[test,plot,serve]'
	touch $(VENV)/.installed $@

install: $(VENV)/.installed

weights: $(VENV)/.installed
	$(BIN)/python weights/fetch_smollm2.py
	$(BIN)/python weights/fetch_gemma3.py

run: weights
	$(BIN)/refengine generate --chat "$(PROMPT)" --max-tokens 64

test-deps: $(VENV)/.installed-test

# Compile every CUDA kernel for sm_90 with nvcc, file by file, and fail on an error or a register
# spill. `make test` does the same through NVRTC, the compiler the GPU backend uses
# (tests/kernels/test_nvrtc.py), so this one is for reading ptxas's per-kernel report.
kernels:
	@if command -v nvcc >/dev/null 2>&1; then bash cuda/check_nvcc.sh; \
	else echo "nvcc not found: skipping the sm_90 compile check"; fi

# --dist loadscope: a test module is a unit of work, its fixtures built by one worker (tests/conftest.py
# refines it: modules sharing big session fixtures go together, the NVRTC shares split);
# --durations: the slowest 30, so every CI log says where the suite's time went
test: test-deps weights
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --durations=30

# Batch 1 and offline throughput against transformers; each writes its section of docs/PERFORMANCE.md.
bench: weights
	$(BIN)/python benchmarks/bench_single.py --performance-md docs/PERFORMANCE.md
	$(BIN)/refengine bench throughput --compare-transformers --performance-md docs/PERFORMANCE.md

# On a machine with an NVIDIA GPU and CuPy already installed; installs nothing.
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf cuda/build .pytest_cache
