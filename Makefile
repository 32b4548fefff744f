PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install proto test test-fast lint run bench clean lmcache-env

install: $(BIN)/kvpool-master

$(BIN)/kvpool-master: pyproject.toml setup.py kvpool_client/transfer/_ntcopy.c
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# Regenerate the committed protobuf/gRPC modules from proto/ (tests/unit/test_proto_fresh.py
# fails when they are stale).
proto:
	$(BIN)/python -m kvpool_wire._pb.generate

# A second environment with LMCache 0.5.6 and its pins (numpy<=2.2.6, grpcio 1.78, protobuf 6):
# the LMCache engine test runs its scenario there, in a subprocess, when it exists.
LMCACHE_VENV ?= .venv-lmcache
lmcache-env: $(LMCACHE_VENV)/bin/lmcache-ready

$(LMCACHE_VENV)/bin/lmcache-ready: pyproject.toml tests/engines/lmcache-requirements.txt
	$(PY) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/pip install -q --upgrade pip
	$(LMCACHE_VENV)/bin/pip install -q -r tests/engines/lmcache-requirements.txt \
		-c tests/engines/lmcache-requirements.txt -e .
	$(LMCACHE_VENV)/bin/pip install -q --no-deps lmcache==0.5.6
	touch $@

test: install lmcache-env
	$(BIN)/python -m pytest -q tests

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" tests

lint: install
	$(BIN)/ruff check kvpool_master kvpool_client tests benchmarks
	$(BIN)/mypy --strict kvpool_master/core kvpool_client/client.py kvpool_wire

run: install
	$(BIN)/kvpool-master --port 50051 --metrics-port 9003

bench: install
	$(BIN)/python benchmarks/master_core.py
	$(BIN)/python benchmarks/master_rpc.py
	$(BIN)/python benchmarks/rpc_floor.py
	$(BIN)/python benchmarks/copy_policy.py
	$(BIN)/python benchmarks/client_bench.py

clean:
	rm -rf $(VENV) $(LMCACHE_VENV) build *.egg-info .pytest_cache
	find kvpool_client -name '*.so' -delete
