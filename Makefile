# The two commands of README.md: `make run` (the main job on the embedded target) and `make test`.
PYTHON ?= python3
export PYTHON

.PHONY: setup run test smoke
setup:
	@bash scripts/setup.sh

run: setup
	$(PYTHON) src/run.py $(ARGS)

smoke: setup
	$(PYTHON) src/run.py experiment=smoke $(ARGS)

test: setup
	$(PYTHON) -m pytest -q tests
