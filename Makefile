# The two commands a newcomer runs: `make demo` and `make test`.
# Both create .venv on first use and reuse it afterwards (re-installing only when
# pyproject.toml or constraints.txt changed).

PYTHON ?= python3
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
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) runs .pytest_cache
