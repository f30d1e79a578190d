# hierps — everything a fresh machine needs runs from here.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.hierps-installed
export DS_ACCELERATOR ?= cpu

.PHONY: setup demo test test-all lint bench clean

setup: $(STAMP)

# torch is installed first and pinned: this machine carries its CPU wheel, while a bare
# `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip setuptools wheel
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/hierps demo

test: $(STAMP)
	$(BIN)/ruff check plugin integrations tests examples
	$(BIN)/python -m pytest -q

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m ''

lint: $(STAMP)
	$(BIN)/ruff check plugin integrations tests examples
	$(BIN)/ruff format --check plugin integrations tests examples

bench: $(STAMP)
	$(BIN)/hierps bench

clean:
	rm -rf $(VENV) build *.egg-info
