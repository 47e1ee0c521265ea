# kvhex developer commands. `make test` works on a fresh machine: it builds .venv from
# nothing (torch==2.13.0 first, so no CUDA build is ever pulled), installs kvhex with its test
# extras, and runs every check CI runs.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvhex-installed

.PHONY: test check lint typecheck layers pytest bench clean

test: $(STAMP) check

check: lint typecheck layers pytest

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,dev,testing]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

layers: $(STAMP)
	$(BIN)/lint-imports

pytest: $(STAMP)
	$(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python bench/primary_tier.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache build dist
