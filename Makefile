# `make run` trains the example PPO on CartPole-v1; `make test` checks the code style (ruff) and the annotations
# (mypy), then runs the test-suite.
# `make test-quick` leaves out the Ray tests (most of the suite's CPU), for a check before each commit.
# Both create .venv and install everything on first use (and again when setup.cfg changes).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Pinned so that pip takes a known release; override e.g. TORCH_SPEC='torch>=2.4'.
TORCH_SPEC ?= torch==2.13.0
# pytest-xdist workers for `make test`, each file in one of them (the Ray tests together, see tests/conftest.py);
# e.g. TEST_WORKERS=auto for one per core, TEST_WORKERS=0 for a single process.
TEST_WORKERS ?= 2

.PHONY: run test test-quick lint clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet '$(TORCH_SPEC)'
	$(PY) -m pip install --quiet -e '.[examples,test]'
	touch $@

run: $(VENV)/.installed
	$(PY) examples/ppo.py --config configs/ppo_cartpole.yaml

test: lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

test-quick: lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --without-ray

# ruff's formatter and linter, then mypy on the package and tests/typecheck, all configured in pyproject.toml
lint: $(VENV)/.installed
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache
