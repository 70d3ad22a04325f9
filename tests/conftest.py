"""Shared fixtures: small random HF checkpoints written by `init-model` (the real loading code)."""

from __future__ import annotations

import pytest

from cluster.model.init_model import init_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """2 layers, hidden 64, GQA 4/2, 320-token vocab: fast enough for every engine test."""
    return str(init_model(tmp_path_factory.mktemp("tiny"), layers=2, hidden=64, heads=4, kv_heads=2,
                          vocab=320, max_positions=512, seed=0))


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    def make(name: str, **kwargs) -> str:
        return str(init_model(tmp_path_factory.mktemp(name), **kwargs))

    return make


@pytest.fixture(scope="session")
def ray_session():
    """The one Ray instance of the test session (started on first use)."""
    import ray

    ray.init(num_cpus=8, include_dashboard=False, namespace="pdserve", log_to_driver=False)
    yield ray
    ray.shutdown()
