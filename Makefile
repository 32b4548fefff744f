PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install proto test test-fast lint run bench clean

install: $(BIN)/kvpool-master

$(BIN)/kvpool-master: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# Regenerate the committed protobuf/gRPC modules from proto/ (tests/unit/test_proto_fresh.py
# fails when they are stale).
proto:
	$(BIN)/python -m kvpool_client._pb.generate

test: install
	$(BIN)/python -m pytest -q tests

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" tests

lint: install
	$(BIN)/ruff check kvpool_master kvpool_client tests benchmarks
	$(BIN)/mypy --strict kvpool_master/core kvpool_client/client.py kvpool_client/status.py kvpool_client/types.py

run: install
	$(BIN)/kvpool-master --port 50051 --metrics-port 9003

bench: install
	$(BIN)/python benchmarks/master_core.py
	$(BIN)/python benchmarks/master_rpc.py
	$(BIN)/python benchmarks/client_bench.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
