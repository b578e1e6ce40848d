# The two commands of the README: `make test` and `make demo` (`make bench`: the full benchmark;
# `make train-demo`: a few minutes of training on CPU; `make experiment`: the kanji batch-size
# experiment, about an hour; `make gpu-check DIR=...`: the GPU check, bench/gpu_check.sh, on a GPU;
# `make compile-check`: the Triton compile check with every sm_80 launch, after a kernel or tile change).
# Both create (or reuse) .venv, install the pinned dependencies and build the extension in place.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0

.PHONY: test demo bench build venv clean gpu-check train-demo experiment compile-check

# A torch that $(PYTHON) already has (a GPU user's own build) is reused through the system
# site-packages; otherwise the venv gets the pinned torch (the CPU build where pip's index serves it).
$(VENV)/.deps: requirements-dev.txt
	test -x $(PY) || { if $(PYTHON) -c "import torch" 2>/dev/null; \
	  then $(PYTHON) -m venv --system-site-packages $(VENV); else $(PYTHON) -m venv $(VENV); fi; }
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

venv: $(VENV)/.deps

# --no-build-isolation: build against the torch of the venv, never a freshly downloaded one.
# Editable install: ms_loss_cuda/_C*.so is built in place; rebuilt when a source changes.
$(VENV)/.built: $(VENV)/.deps setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

build: $(VENV)/.built

# One pytest-xdist worker a core, each with one intra-op thread (two threads each on two cores spend a
# sixth of the suite's CPU time spinning); each compile check's module
# stays on one worker (loadgroup).
test: build
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --dist loadgroup tests

# The suite compiles sm_80's float16 and float32 launches with mining on alone (tests/triton_aot.py).
compile-check: build
	MS_LOSS_COMPILE_ALL=1 $(PY) -m pytest -q tests/test_triton_compile.py

demo: build
	$(PY) bench/benchmark.py --sizes 1024 2048 4096 --out bench/results/demo

# The CPU benchmark at every hardness level (docs/benchmarks.md), then the large sizes.
bench: build
	for level in easy typical hard; do \
	  $(PY) bench/benchmark.py --sizes 1024 4096 --hardness $$level --out bench/results/cpu/$$level || exit 1; done
	$(PY) bench/benchmark.py --sizes 1024 4096 --no-mining --out bench/results/cpu/mining-off
	$(PY) bench/benchmark.py --sizes 16384 65536 --providers floor cpu compiled --repeats 1 --out bench/results/cpu/large

# Trains the small convnet on rendered kanji (SOP's protocol: unseen classes at test) and prints
# Recall@K before and after: batch 512 for 300 steps, the best setting of `make experiment` that
# trains in a few minutes on 2 cores (docs/experiments.md).
train-demo: build
	$(PY) -m ms_loss_cuda.train --steps 300 --batch-size 512 --eval-every 100 --out runs/train-demo

# The kanji experiment with the MS paper's protocol (every setting the same steps; about an hour on
# 2 cores); bench/kanji_experiment.py --protocol equal-images runs the equal-images comparison.
experiment: build
	$(PY) bench/kanji_experiment.py --out bench/results/experiment/fixed-steps

# Builds into the python3 on PATH (a CUDA build of torch, triton and nvcc), not into .venv.
gpu-check:
	PYTHON=$(PYTHON) bench/gpu_check.sh $(or $(DIR),bench/results/gpu/latest)

clean:
	rm -rf build *.egg-info ms_loss_cuda/*.so $(VENV) runs
