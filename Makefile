# `make run` trains the example PPO on CartPole-v1; `make test` checks the code style (ruff) and the annotations
# (mypy), then runs the test-suite but for the Ray tests, and the float-sensitive test files a second time on
# other CPU kernels (`make test-kernels`).
# `make test-ray` runs the Ray tests, whose actors each start a fresh interpreter (most of the suite's CPU).
# `make coverage` runs the whole suite under coverage.py and prints its branch coverage of torch_rollout/: `make test
# COVERAGE=1` (what CI runs, so that the suite runs once) runs make test with the whole suite, the Ray tests
# included, under coverage.py, and `make coverage-report` combines and reports what it measured.
# All create .venv and install everything on first use (and again when setup.cfg changes).
# `make test-sims` runs the integration tests against the real simulator frameworks (sims/), each in a venv of its
# own that sims/build.sh builds once, outside the checkout; SIMS='gymnax maniskill' chooses some of them.
# `make test-pythons` runs the suite but for Ray on the lowest and the highest Python that setup.cfg accepts (3.10,
# with the lowest torch and gymnasium it accepts, and 3.13), each in a venv of its own that tests/pythons.sh builds
# once, outside the checkout; PYTHONS='3.13' chooses.
# `make venvs` builds the venvs of test-pythons and test-sims, once, and runs nothing.
# `make bench-sims` times each of them (sims/bench_throughput.py: the env alone, a hand-written loop and the
# collector's placements), in the same venvs, and writes benchmarks/results/sims_NAME.json; SIMS chooses too.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Pinned so that pip takes a known release; override e.g. TORCH_SPEC='torch>=2.13'.
TORCH_SPEC ?= torch==2.13.0
# pytest-xdist workers for `make test`, each file in one of them (the Ray tests together, see tests/conftest.py);
# e.g. TEST_WORKERS=auto for one per core, TEST_WORKERS=0 for a single process.
TEST_WORKERS ?= 2
# torch's intra-op threads in each test process and the processes it starts (OMP_NUM_THREADS): one, so that the
# test processes do not each spin a team of threads on the same cores (on 2 cores `make test` took 5 min 6 s with
# torch's default of 2, 4 min 30 s to 5 min 1 s with 1); e.g. TEST_THREADS= for torch's default.
TEST_THREADS ?= 1
TEST_ENV := $(if $(TEST_THREADS),OMP_NUM_THREADS=$(TEST_THREADS))

# The test files whose assertions compare floats from different calls (placements, bootstrap calls, batch
# shapes, GAE against a float64 loop): `make test` runs them again on other CPU kernels, MKL's reproducible code
# path and torch's non-vectorised one, with linear layers whose last bits depend on the call's row count
# (tests/shaped_floats), so that a comparison that holds only on this CPU's kernels fails here too.
FLOAT_TESTS ?= tests/test_shaped_floats.py tests/test_gae.py tests/test_torch_loop.py tests/test_collector.py tests/test_next_obs.py \
	tests/test_recurrent.py tests/test_async_loop.py tests/test_seed.py tests/test_cleanrl_parity.py
OTHER_KERNELS := MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default SHAPED_FLOATS=1 PYTHONPATH=$(CURDIR)/tests/shaped_floats$${PYTHONPATH:+:$$PYTHONPATH}

# The Pythons of `make test-pythons`, each VERSION or VERSION:PIN,PIN (pins installed beside the extras): the lowest
# Python with the lowest torch and gymnasium that setup.cfg accepts, and the highest with TORCH_SPEC.
PYTHONS ?= 3.10:torch==2.11.0,gymnasium==1.4.0 3.13
# The versions among them whose suite runs in one test process: on torch 2.11.0 a second test process beside it
# crashed inside torch (docs/development.md, "The versions the suite runs").
PYTHONS_SERIAL ?= 3.10
PYTHONS_ROOT ?= $(HOME)/.cache/torch_rollout/pythons

# The frameworks of sims/requirements/*.txt
SIMS ?= $(basename $(notdir $(wildcard sims/requirements/*.txt)))
SIMS_ROOT ?= $(or $(TORCH_ROLLOUT_SIMS),$(HOME)/.cache/torch_rollout/sims)

.PHONY: run test test-ray test-kernels test-pythons coverage coverage-report test-sims bench-sims venvs lint clean

# The suite's pytest command; with COVERAGE=1 under coverage.py (pyproject.toml's [tool.coverage.*]): the worker
# processes, their fork server and the tests' Ray actors measure themselves and write .coverage.* here (an absolute
# COVERAGE_FILE, whatever their working directory), and import torch_rollout from here (a PYTHONPATH that wins over
# an install of another copy, which coverage would not count).
# With COVERAGE=1 `make test` runs the whole suite, the Ray tests among the rest (in one of the two processes, while
# the other runs the other files), so that coverage counts them.
ifeq ($(COVERAGE),1)
PYTEST := $(TEST_ENV) COVERAGE_FILE=$(CURDIR)/.coverage PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m coverage run -m pytest
SUITE :=
else
PYTEST := $(TEST_ENV) $(PY) -m pytest
SUITE := --without-ray
endif

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet '$(TORCH_SPEC)'
	$(PY) -m pip install --quiet -e '.[examples,test]'
	touch $@

run: $(VENV)/.installed
	$(PY) examples/ppo.py --config configs/ppo_cartpole.yaml

test: lint
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile $(SUITE)
	$(MAKE) --no-print-directory test-kernels COVERAGE=

test-ray: $(VENV)/.installed
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile --only-ray

# The float-sensitive files on the other kernels (without Ray: its actors run the same code as the workers)
test-kernels: $(VENV)/.installed
	$(TEST_ENV) $(OTHER_KERNELS) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --without-ray $(FLOAT_TESTS)

# Builds (once) the venvs of test-pythons and test-sims without running anything in them: .ci/run builds them while
# the suite runs (downloads and unpacking, mostly waiting on the network and the disk).
venvs:
	@for entry in $(PYTHONS); do \
		version=$${entry%%:*}; pins=; case "$$entry" in *:*) pins=$$(echo "$${entry#*:}" | tr , ' ');; esac; \
		bash tests/pythons.sh "$$version" '$(PYTHONS_ROOT)' '$(TORCH_SPEC)' $$pins || exit 1; \
	done
	TORCH_ROLLOUT_SIMS='$(SIMS_ROOT)' bash sims/build.sh $(SIMS)

# Every Python of PYTHONS runs, and the target fails if any did.
test-pythons:
	@failed=; for entry in $(PYTHONS); do \
		version=$${entry%%:*}; pins=; case "$$entry" in *:*) pins=$$(echo "$${entry#*:}" | tr , ' ');; esac; \
		bash tests/pythons.sh "$$version" '$(PYTHONS_ROOT)' '$(TORCH_SPEC)' $$pins || { failed="$$failed $$version"; continue; }; \
		workers=$(TEST_WORKERS); case " $(PYTHONS_SERIAL) " in *" $$version "*) workers=0;; esac; \
		echo "== the suite on Python $$version ($(PYTHONS_ROOT)/$$version) $$pins, $$workers test workers"; \
		$(TEST_ENV) PYTHONPATH='$(CURDIR)' '$(PYTHONS_ROOT)'/$$version/bin/python -m pytest -n $$workers --dist loadfile \
			--without-ray -p no:cacheprovider || failed="$$failed $$version"; \
	done; \
	if [ -n "$$failed" ]; then echo "test-pythons: failed on Python$$failed"; exit 1; fi

# The whole suite under coverage.py, then its report, which fails below [tool.coverage.report] fail_under
coverage: $(VENV)/.installed
	$(PY) -m coverage erase
	$(MAKE) --no-print-directory test COVERAGE=1
	$(MAKE) --no-print-directory coverage-report

coverage-report: $(VENV)/.installed
	$(PY) -m coverage combine --quiet
	$(PY) -m coverage report

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

# sims/bench_throughput.py per framework, in its venv, each at most a few minutes on 2 cores; every framework
# runs, and the target fails if any did.
bench-sims:
	TORCH_ROLLOUT_SIMS='$(SIMS_ROOT)' bash sims/build.sh $(SIMS)
	@failed=; for name in $(SIMS); do \
		echo "== sims/bench_throughput.py --framework $$name in $(SIMS_ROOT)/$$name"; \
		PYTHONPATH='$(CURDIR)' '$(SIMS_ROOT)'/$$name/bin/python sims/bench_throughput.py --framework $$name \
			|| failed="$$failed $$name"; \
	done; \
	if [ -n "$$failed" ]; then echo "bench-sims: failed:$$failed"; exit 1; fi

# ruff's formatter and linter, then mypy on the package and tests/typecheck, all configured in pyproject.toml
lint: $(VENV)/.installed
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .coverage .coverage.* htmlcov
