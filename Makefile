# `make run` trains the example PPO on CartPole-v1; `make test` checks the code style (ruff) and runs the test-suite.
# `make test-quick` leaves out the Ray tests (most of the suite's CPU), for a check before each commit.
# `make coverage` runs the whole suite under coverage.py and prints its branch coverage of torch_rollout/.
# All create .venv and install everything on first use (and again when setup.cfg changes).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Pinned so that pip takes a known release; override e.g. TORCH_SPEC='torch>=2.4'.
TORCH_SPEC ?= torch==2.13.0
# pytest-xdist workers for `make test`, each file in one of them (the Ray tests together, see tests/conftest.py);
# e.g. TEST_WORKERS=auto for one per core, TEST_WORKERS=0 for a single process.
TEST_WORKERS ?= 2

.PHONY: run test test-quick coverage lint clean

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

# `make test`'s pytest command under coverage.py (pyproject.toml's [tool.coverage.*]): the worker processes, their
# fork server and the tests' Ray actors measure themselves and write .coverage.* here (an absolute COVERAGE_FILE,
# whatever their working directory), and import torch_rollout from here (a PYTHONPATH that wins over an install
# of another copy, which coverage would not count). The report fails below [tool.coverage.report] fail_under.
coverage: $(VENV)/.installed
	$(PY) -m coverage erase
	COVERAGE_FILE=$(CURDIR)/.coverage PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} \
		$(PY) -m coverage run -m pytest -n $(TEST_WORKERS) --dist loadfile
	$(PY) -m coverage combine --quiet
	$(PY) -m coverage report

# ruff's formatter and linter, configured in pyproject.toml
lint: $(VENV)/.installed
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache .coverage .coverage.* htmlcov
