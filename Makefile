# The two commands of README.md: `make run` (the main job on the embedded target) and `make test`.
PYTHON ?= python3
export PYTHON
# CUDA or CPU builds of torch and vLLM: auto asks nvidia-smi; `make setup DEVICE=cuda` on a login node without GPUs.
DEVICE ?= auto
export DEVICE

RESULTS ?= results

.PHONY: setup run test test-fast smoke paper lint
setup:
	@bash scripts/setup.sh

run: setup
	$(PYTHON) src/run.py $(ARGS)

smoke: setup
	$(PYTHON) src/run.py experiment=smoke $(ARGS)

# Lint and format check first (ruff, configured in pyproject.toml), then the tests. The paper test builds a PDF:
# LaTeX comes with the test set-up. Two pytest-xdist workers, each taking whole test files, longest first (module
# fixtures are built once; each worker has its own session cache; --no-loadscope-reorder keeps that order, which
# xdist otherwise replaces by the number of tests per file) and each bound to its own core with everything
# it starts (tests/conftest.py). On the 2-core box, unbound workers were only 1.25x faster than one process: both
# workers' torch and vLLM OpenMP pools spanned both cores.
TEST_WORKERS ?= 2
# The guard on its time: set-up's seconds here, pytest's wall time and its ten slowest tests at the end (--durations,
# pyproject.toml); the developers' notes quote them.
test:
	@t0=$$(date +%s); EAGLELAB_TEST=1 bash scripts/setup.sh; echo "make test: set-up took $$(( $$(date +%s) - t0 )) s"
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The edit loop: lint, then the tests that start no real run, engine, cluster or CLI process (`-m "not slow"`,
# 56 s on the 2-core box once set up). CI and `make test` run everything.
test-fast:
	@EAGLELAB_TEST=1 bash scripts/setup.sh
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q -m "not slow" tests

# Every figure, table and number of paper/ regenerated from the results store, and paper/paper.pdf.
paper:
	@EAGLELAB_LATEX=1 bash scripts/setup.sh
	$(PYTHON) paper/build.py $(RESULTS)

# Fix what ruff can fix and format the code (what `make test` checks).
lint:
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .
