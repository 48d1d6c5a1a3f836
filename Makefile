# ds4serve: `make serve` and `make test` work on a fresh machine (they create .venv first).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export PYTHONPATH := $(CURDIR)

.PHONY: serve plan test test-gpu install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: pip takes this CPU build from local disk instead of downloading a CUDA one
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

# the embedded default, default_model/ (the trained tiny V4.1, tracked in git), unless ARGS names a model
serve: $(VENV)/.installed
	$(PY) -m server $(ARGS)

# the memory plan of a rig, without serving: make plan CONFIG=configs/rtxpro6000x4.yaml [ARGS="--set k=v"]
CONFIG ?= configs/cpu-tiny.yaml
plan: $(VENV)/.installed
	$(PY) -m server plan --config $(CONFIG) $(ARGS)

# one pytest worker per core (pytest-xdist), each test file on one worker (its module-scoped servers start once)
test: $(VENV)/.installed
	$(PY) -m pytest -q -n auto --dist loadfile $(PYTEST_ARGS)

test-gpu: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
