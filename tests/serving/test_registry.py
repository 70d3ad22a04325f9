"""The registry actor as a replica's loop meets it: every call bounded, a restart survived.
A private RegistryActor per test (not the cluster's named one), driven through RayMetadataStore."""

import os
import time

import pytest
import ray

from cluster.serving.registry import RayMetadataStore, RegistryActor
from kv_transfer.errors import KVTransferError
from kv_transfer.handle import KVLayout, PeerInfo
from tests.helpers import wait_until


@pytest.fixture()
def registry(ray_session):
    actor = RegistryActor.remote()
    ray.get(actor.snapshot.remote(), timeout=60)  # started: the timeouts below are the calls' own
    yield actor
    ray.kill(actor, no_restart=True)


def peer(engine_id: str) -> PeerInfo:
    return PeerInfo(engine_id, "inc-1", f"agent-{engine_id}", b"md", 4096, 8, "DRAM", 0,
                    KVLayout("fp", 16, "float32", 2, 2, 16))


def test_a_busy_registry_is_a_bounded_failed_lookup(registry):
    store = RayMetadataStore(registry, timeout_s=0.3)
    store.publish(peer("p0"))
    assert store.lookup("p0").engine_id == "p0"
    registry.__ray_call__.remote(lambda self: time.sleep(5))  # the actor answers nothing for 5 s
    t0 = time.monotonic()
    with pytest.raises(KVTransferError, match="did not answer a lookup of p0 within 0.3 s"):
        store.lookup("p0")
    assert time.monotonic() - t0 < 2.0  # bounded by the timeout, not by the busy actor


def test_a_restarted_registry_learns_the_peers_again_from_reports(registry):
    store = RayMetadataStore(registry, timeout_s=5.0)
    store.publish(peer("p1"))
    before = ray.get(registry.__ray_call__.remote(lambda self: os.getpid()))
    ray.kill(registry, no_restart=False)
    wait_until(lambda: ray.get(registry.__ray_call__.remote(lambda self: os.getpid())) != before,
               "the registry restarts", timeout=30)
    assert store.lookup("p1") is None  # restarted empty
    store.report("replica-1", {"role": "prefill"})  # the next load report republishes
    wait_until(lambda: store.lookup("p1") is not None, "p1 republished", timeout=10)
    assert "replica-1" in ray.get(registry.snapshot.remote())
