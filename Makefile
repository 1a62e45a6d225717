# The two commands a newcomer runs: `make demo` and `make test`.
# Both create .venv on first use and reuse it afterwards (re-installing only when
# pyproject.toml or constraints.txt changed).

PYTHON ?= python3
# Test files run in this many processes at once (pytest-xdist, one file per process at a
# time so module-scoped fixtures are built once): most of a test's wall time is a
# single-threaded process start or a rank waiting on another, so two workers keep both
# cores of a small machine busy. Files run heaviest first (tests/conftest.py orders them;
# --no-loadscope-reorder keeps that order). TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/moebit demo

test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) --durations=15

lint: $(STAMP)
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) runs .pytest_cache
