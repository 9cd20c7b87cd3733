# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch must be pinned first: 2.13.0 is a local CPU build here, any other spec
# downloads gigabytes of CUDA packages.
TORCH_PIN := torch==2.13.0

.PHONY: demo demo-replay demo-lm test test-avx2 test-gpu test-slow test-matrix test-bench lint bench bench-setup clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e '.[dev,hf]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/gradsketch demo --out demo_out

# The digits demo with its replay (MAGIC; make demo includes it too) -> demo_replay_out/
demo-replay: $(VENV)/.installed
	$(VENV)/bin/gradsketch demo --replay --out demo_replay_out

# The language-model main job: GPT-2 on the standard library's sources -> demo_lm_out/
demo-lm: $(VENV)/.installed
	$(VENV)/bin/gradsketch demo --lm --out demo_lm_out

test: $(VENV)/.installed
	$(PY) -m pytest -q

# The suite again on the AVX2 code paths of torch, MKL and the native kernels,
# whatever this CPU has: an AVX-512 machine then sums floats the way an
# AVX2-only one (AMD Zen 2/3, older Intel) does, so an exact-equality
# assertion that only holds on one instruction set fails here too.
AVX2_ENV := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 GRADSKETCH_NATIVE_MARCH=x86-64-v3
test-avx2: $(VENV)/.installed
	$(AVX2_ENV) $(PY) -m pytest -q

# The suites that build Hugging Face models again on the oldest transformers the
# `hf` extra allows, in a venv of its own (`make test` has the newest).
OLDEST_VENV := .venv-oldest
OLDEST_PIN := transformers==5.0.0
$(OLDEST_VENV)/.installed: pyproject.toml
	test -x $(OLDEST_VENV)/bin/python || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(OLDEST_VENV)/bin/python -m pip install -q $(TORCH_PIN)
	$(OLDEST_VENV)/bin/python -m pip install -q -e '.[dev,hf]' '$(OLDEST_PIN)'
	touch $@

test-oldest: $(OLDEST_VENV)/.installed
	$(OLDEST_VENV)/bin/python -m pytest -q tests/slt tests/attribution

# The GPU cases (`gpu`-marked: each capability on CUDA against the CPU, the Triton
# kernels) in the current environment, whose torch must be a CUDA build: there,
# `pip install -e '.[dev,hf,gpu]'` after your torch. Without CUDA they skip.
test-gpu:
	$(PYTHON) -m pytest -q -m gpu

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow

# Attribution on every Hugging Face family (tests/attribution/test_families.py);
# the default run keeps a representative few.
test-matrix: $(VENV)/.installed
	$(PY) -m pytest -q -m matrix

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

# Reference packages, installed without letting them replace the pinned torch
# (traker wants torchvision, which has no CPU build here).
$(VENV)/.bench: $(VENV)/.installed
	$(PIP) install -q $(TORCH_PIN) scikit-learn
	$(PIP) install -q --no-deps traker devinterp==2.0.1 mosaicml kronfluence==1.0.1 dattri==0.3.0 bergson==2.5.1
	$(PIP) install -q -r benchmarks/requirements-refs.txt
	touch $@

bench-setup: $(VENV)/.bench

test-bench: $(VENV)/.bench
	$(PY) -m pytest -q -m bench

bench: $(VENV)/.bench
	for f in benchmarks/bench_*.py; do $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) $(OLDEST_VENV) demo_out demo_replay_out demo_lm_out build dist src/*.egg-info
