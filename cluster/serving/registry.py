"""The cluster registry: a named Ray actor where engines publish their NIXL identity (the KV
handshake's MetadataStore) and report their load (for `pdserve status` and, later, the router)."""

from __future__ import annotations

import time

import ray

from kv_transfer.handle import PeerInfo

REGISTRY_NAME = "pdserve-registry"
REGISTRY_NAMESPACE = "pdserve"


class Registry:
    """Plain class: peers by engine id, latest stats by replica id (with the time they arrived)."""

    def __init__(self, clock=time.time):
        self.clock = clock
        self.peers: dict[str, PeerInfo] = {}
        self.stats: dict[str, tuple[float, dict]] = {}

    def publish(self, info: PeerInfo) -> None:
        self.peers[info.engine_id] = info

    def lookup(self, engine_id: str) -> PeerInfo | None:
        return self.peers.get(engine_id)

    def report(self, replica_id: str, stats: dict) -> None:
        self.stats[replica_id] = (self.clock(), stats)

    def snapshot(self) -> dict[str, dict]:
        now = self.clock()
        return {rid: {**s, "age_s": round(now - t, 3)} for rid, (t, s) in sorted(self.stats.items())}


@ray.remote(num_cpus=0)
class RegistryActor(Registry):
    pass


def get_registry():
    """The cluster's registry actor, created by whoever asks first."""
    return RegistryActor.options(
        name=REGISTRY_NAME, namespace=REGISTRY_NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()


class RayMetadataStore:
    """MetadataStore over the registry actor. Called from engine loop threads, never event loops."""

    def __init__(self, actor=None):
        self.actor = actor or get_registry()

    def publish(self, info: PeerInfo) -> None:
        ray.get(self.actor.publish.remote(info))

    def lookup(self, engine_id: str) -> PeerInfo | None:
        return ray.get(self.actor.lookup.remote(engine_id))
