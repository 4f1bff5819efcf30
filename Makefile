# `make run` trains the example PPO on CartPole-v1; `make test` checks the code style (ruff) and runs the test-suite.
# `make test-quick` leaves out the Ray tests (most of the suite's CPU), for a check before each commit.
# Both create .venv and install everything on first use (and again when setup.cfg changes).
# `make test-sims` runs the integration tests against the real simulator frameworks (sims/), each in a venv of its
# own that sims/build.sh builds once, outside the checkout; SIMS='gymnax maniskill' chooses some of them.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Pinned so that pip takes a known release; override e.g. TORCH_SPEC='torch>=2.4'.
TORCH_SPEC ?= torch==2.13.0
# pytest-xdist workers for `make test`, each file in one of them (the Ray tests together, see tests/conftest.py);
# e.g. TEST_WORKERS=auto for one per core, TEST_WORKERS=0 for a single process.
TEST_WORKERS ?= 2

# The frameworks of sims/requirements/*.txt
SIMS ?= $(basename $(notdir $(wildcard sims/requirements/*.txt)))
SIMS_ROOT ?= $(or $(TORCH_ROLLOUT_SIMS),$(HOME)/.cache/torch_rollout/sims)

.PHONY: run test test-quick test-sims lint clean

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

# One pytest run per framework, in its venv, with this checkout on PYTHONPATH (not installed there); every
# framework runs, and the target fails if any did.
test-sims:
	TORCH_ROLLOUT_SIMS='$(SIMS_ROOT)' bash sims/build.sh $(SIMS)
	@failed=; for name in $(SIMS); do \
		echo "== sims/tests/test_$$name.py in $(SIMS_ROOT)/$$name"; \
		PYTHONPATH='$(CURDIR)' '$(SIMS_ROOT)'/$$name/bin/python -m pytest -c sims/pytest.ini --rootdir sims \
			sims/tests/test_$$name.py || failed="$$failed $$name"; \
	done; \
	if [ -n "$$failed" ]; then echo "test-sims: failed:$$failed"; exit 1; fi

# ruff's formatter and linter, configured in pyproject.toml
lint: $(VENV)/.installed
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
