# voxring — every routine action is a target here. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON_BASE ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.voxring-installed
# torch goes in first: on CPU machines this exact pin resolves to the CPU build on local disk.
TORCH_SPEC ?= torch==2.13.0
PROTOS := $(wildcard protos/voxring/v1/*.proto)
GENERATED := $(foreach p,$(PROTOS),$(patsubst protos/%.proto,%_pb2.py,$(p)) \
	$(patsubst protos/%.proto,%_pb2.pyi,$(p)) $(patsubst protos/%.proto,%_pb2_grpc.py,$(p)))
PYTEST_ARGS ?=

.PHONY: help setup proto tools test lint demo up down bench soak clean

help:  ## list the targets
	@grep -E '^[a-z]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-6s %s\n", $$1, $$2}'

setup: $(STAMP) proto  ## create .venv, install torch + voxring[server,gateway,test], generate protobuf code

$(STAMP): pyproject.toml
	@echo "==> creating $(VENV) with $(PYTHON_BASE)"
	@test -x $(PY) || $(PYTHON_BASE) -m venv $(VENV)
	@echo "==> installing $(TORCH_SPEC)"
	@$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH_SPEC)
	@echo "==> installing voxring with server, gateway and test extras"
	@$(PY) -m pip install --quiet --disable-pip-version-check -e '.[server,gateway,test]'
	@touch $@
	@echo "==> environment ready"

proto: $(GENERATED)  ## generate voxring/v1 from protos/ (committed; a test fails when stale)

$(GENERATED) &: $(PROTOS) | $(STAMP)
	@echo "==> generating protobuf code into voxring/v1"
	@$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

# Tools the tests drive as users would: Debian's Chromium for the playground test (never
# playwright's own downloads) and curl for the HTTP API's SSE test. Only on CI (CI=true, as
# root) is a missing one installed; elsewhere the test that needs it skips and says why.
# The paths are the ones tests/integration/test_playground.py and test_http_api.py run.
TOOLS := /usr/bin/chromium:chromium /usr/bin/curl:curl

tools:  ## CI: install the tests' tools (chromium, curl) from Debian when they are missing
	@missing=""; for t in $(TOOLS); do [ -x "$${t%%:*}" ] || missing="$$missing $${t##*:}"; done; \
	if [ -z "$$missing" ]; then \
	  echo "==> tools: chromium and curl are there, nothing to install"; \
	elif [ "$$CI" = "true" ]; then \
	  echo "==> tools: missing$$missing and CI=true: apt-get install$$missing"; \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing; \
	else \
	  echo "==> tools: missing$$missing, not installing (not CI); the tests that need them skip"; \
	fi

test: setup tools  ## run the whole suite (CPU; GPU tests skip with a reason)
	@echo "==> running tests"
	@$(PY) -m pytest $(PYTEST_ARGS)

lint: setup  ## ruff
	@$(VENV)/bin/ruff check .

demo: setup  ## stack up on the tiny model, synthesize demo.wav, stack down
	@$(VENV)/bin/voxring demo

up: setup  ## start gateway, talker and Code2Wav in the background
	@$(VENV)/bin/voxring up

down:  ## stop the local stack gracefully
	@if [ -x $(VENV)/bin/voxring ]; then $(VENV)/bin/voxring down; else echo "no stack (no $(VENV))"; fi

# make bench runs where torch sees a GPU: with .venv's python when there is one, else the
# image's python3 (the GPU machine has no internet, so no `setup` there; carry .whl, see
# bench/README.md). Each part has its own wall-clock cap; a tiers part cut by its cap
# (exit 3) is run once more and measures only the tiers it is missing.
BENCH_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
BENCH_OUT ?= bench/results/server
BENCH_PART_S ?= 600
BENCH_WALL_S ?= 540
BENCH_ARGS ?=
BENCH_RUN = timeout -s TERM -k 30 $(BENCH_PART_S) $(BENCH_PY) -m bench.server --out $(BENCH_OUT) \
	--max-wall $(BENCH_WALL_S) $(BENCH_ARGS)

# BENCH_LAYOUTS="one two-pairs split" adds the two-GPU layouts (bench/notes/README.md, scale-out).
BENCH_LAYOUTS ?= one

bench:  ## GPU only: the whole server under load (without, with MPS) and the transformers baseline
	@$(BENCH_PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: make bench \
	runs on the GPU machine only (bench/README.md); on a CPU: python -m bench.server --smoke')"
	@fail=0; \
	for layout in $(BENCH_LAYOUTS); do \
	for mps in off on; do \
	  for attempt in 1 2; do \
	    echo "==> bench: tiers, layout $$layout, MPS $$mps (attempt $$attempt)"; \
	    $(BENCH_RUN) --part tiers --layout $$layout --mps $$mps; rc=$$?; \
	    [ $$rc -eq 3 ] || break; \
	  done; \
	  [ $$rc -eq 0 ] || { echo "==> bench: tiers, layout $$layout, MPS $$mps ended with exit $$rc"; fail=1; }; \
	done; \
	done; \
	echo "==> bench: baseline (transformers generate, talker frame vs its floor)"; \
	$(BENCH_RUN) --part baseline || { echo "==> bench: baseline ended with exit $$?"; fail=1; }; \
	$(BENCH_PY) -m bench.server --part report --out $(BENCH_OUT) > /dev/null; \
	echo "==> bench: results, table (server_gpu.md) and plots in $(BENCH_OUT)"; \
	exit $$fail

soak: setup  ## longer fault and load runs (bounded); not part of make test
	@$(PY) -m pytest -n 0 -m soak --run-soak tests $(PYTEST_ARGS)

clean:  ## remove the venv and caches (not the committed generated code)
	rm -rf $(VENV) .pytest_cache .ruff_cache .voxring
