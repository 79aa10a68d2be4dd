# Two commands do all set-up on a fresh machine:
#   make demo   - embedded reference server, one publisher, two readers
#   make test   - every test suite, each in the environment it needs
# Each target creates or refreshes its own virtual environment.

PYTHON ?= python3
# The CPU build of torch; an unpinned torch pulls a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q

.PHONY: demo test test-core test-verl bench bench-pull proto lint clean

$(VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install "$(TORCH)"
	$(PIP) install -e '.[test]'
	touch $@

demo: $(VENV)/.stamp
	$(VENV)/bin/tensorhub demo

test: test-core

test-core: $(VENV)/.stamp
	$(VENV)/bin/pytest -q tests/core

# verl 0.9.1 and what it needs on CPU, in its own environment (verl's pins
# would otherwise move the core environment's packages).
VERL_VENV := .venv-verl
VERL_PIP  := $(VERL_VENV)/bin/python -m pip --disable-pip-version-check -q

$(VERL_VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_PIP) install --upgrade pip
	$(VERL_PIP) install "$(TORCH)"
	$(VERL_PIP) install -e '.[verl,test]'
	touch $@

test-verl: $(VERL_VENV)/.stamp
	$(VERL_VENV)/bin/pytest -q tests/verl

bench-pull: $(VENV)/.stamp
	mkdir -p bench-results
	$(VENV)/bin/tensorhub bench pull --size 1GiB --readers 1 --json bench-results/pull-r1.json

bench: bench-pull

proto: $(VENV)/.stamp
	$(PY) tensorhub/proto/regenerate.py

lint: $(VENV)/.stamp
	$(PIP) install ruff
	$(VENV)/bin/ruff check tensorhub tests

clean:
	rm -rf $(VENV) .venv-* build *.egg-info
