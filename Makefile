PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all test-compat bench clean

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

test-all: $(STAMP)
	$(PY) -m pytest -q -m ''

# The compatibility subset in one environment per timm x torch pair (compat/__main__.py);
# COMPAT passes options, e.g. COMPAT="--only oldest --remove".
test-compat:
	$(PYTHON) -m compat $(COMPAT)

bench: $(STAMP)
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) .compat demo-out build dist *.egg-info
