# ec-daemon developer commands. `make run` and `make test` install what they
# need into .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SOCKET ?=
CPU_BYTES ?= 1GiB
PYTEST_ARGS ?=

.PHONY: install proto run test test-unit test-integration lint clean

install: $(STAMP)

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

lint: $(STAMP) proto
	$(BIN)/ruff check ec_daemon ec_client tests proto/generate.py
	$(BIN)/mypy

clean:
	rm -rf $(VENV) ec_client/_proto build *.egg-info .pytest_cache .mypy_cache .ruff_cache
