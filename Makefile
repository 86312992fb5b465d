# The two commands a new user needs: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck bench docs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/ruff format --check src tests examples benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy --strict src

# The suite runs in one process per core (pytest-xdist), each test file in one of them, so
# that its module fixtures start once; `make test PYTEST_WORKERS=0` runs it in one process.
# One process more than cores finished sooner on a 2-core machine, but in one of its runs a
# Redis Cluster test's first calls failed (cause not found): one per core is the default.
PYTEST_WORKERS ?= $(shell nproc)

test: lint typecheck
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/python -m examples.demo $(if $(PORT),--port $(PORT)) $(if $(HOST),--host $(HOST))

DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(BIN)/python benchmarks/bench.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis site benchmarks/.venv benchmarks/results
