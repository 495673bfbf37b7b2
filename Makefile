PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

DOCS_STAMP := $(VENV)/.docs-installed
LINT_STAMP := $(VENV)/.lint-installed
LINT_PATHS := timm_layerscale convert tests benchmarks compat

.PHONY: demo test test-full test-all test-compat bench docs lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m timm_layerscale demo --out demo-out --overwrite

test: $(STAMP)
	$(PY) -m pytest -q

# What make test leaves out of the default suite for time (CI runs it after make test).
test-full: $(STAMP)
	$(PY) -m pytest -q -m 'full and not slow'

test-all: $(STAMP)
	$(PY) -m pytest -q -m ''

# The compatibility subset in one environment per timm x torch pair (compat/__main__.py);
# COMPAT passes options, e.g. COMPAT="--only oldest --remove".
test-compat:
	$(PYTHON) -m compat $(COMPAT)

bench: $(STAMP)
	$(PY) -m benchmarks

$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -e '.[test,docs]'
	touch $(DOCS_STAMP)

# The documentation site, warnings as errors, then the doctests of its pages and docstrings.
docs: $(DOCS_STAMP)
	$(PY) -m sphinx -b html -W --keep-going -q docs docs/_build/html
	$(PY) -m sphinx -b doctest -W --keep-going -q docs docs/_build/doctest

$(LINT_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -e '.[test,lint]'
	touch $(LINT_STAMP)

# Lint, formatting and types with the pinned ruff and mypy (the pre-commit hooks run the same).
lint: $(LINT_STAMP)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .compat demo-out build dist *.egg-info docs/_build .mypy_cache .ruff_cache
