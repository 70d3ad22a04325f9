"""The cluster registry: a named Ray actor where engines publish their NIXL identity (the KV
handshake's MetadataStore) and report their load (for `pdserve status` and, later, the router).

Ray restarts the actor empty; each replica republishes its PeerInfo with its load report (every
second), so a restarted registry knows every live peer again within a second. The decode loop
asks it only on a handshake cache miss, with a timeout: a registry that does not answer is a
failed pull (the decode policy recomputes), never a blocked loop."""

from __future__ import annotations

import logging
import time

import ray

from kv_transfer.errors import KVTransferError
from router.actor import named_actor
from kv_transfer.handle import PeerInfo

log = logging.getLogger(__name__)

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


@ray.remote(num_cpus=0, max_restarts=-1)
class RegistryActor(Registry):
    pass


def get_registry():
    """The cluster's registry actor, created by whoever asks first."""
    return named_actor(RegistryActor, REGISTRY_NAME, namespace=REGISTRY_NAMESPACE)


# A registry that is dead, restarting or too slow to answer.
_UNANSWERED = (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError)


class RayMetadataStore:
    """MetadataStore over the registry actor. Called from engine loop threads, never event loops;
    every wait is bounded by `timeout_s`."""

    def __init__(self, actor=None, timeout_s: float = 2.0):
        self.actor = actor or get_registry()
        self.timeout_s = timeout_s
        self._published: dict[str, PeerInfo] = {}

    def publish(self, info: PeerInfo) -> None:
        """Publish now (bounded); on no answer the next `report()` publishes it again."""
        self._published[info.engine_id] = info
        try:
            ray.get(self.actor.publish.remote(info), timeout=self.timeout_s)
        except _UNANSWERED as e:
            log.warning("registry did not take %s's peer info (%s); republished with the next report",
                        info.engine_id, type(e).__name__)

    def lookup(self, engine_id: str) -> PeerInfo | None:
        """The peer's info, or None if unpublished. KVTransferError when the registry does not
        answer within timeout_s: the caller treats it as a failed pull."""
        try:
            return ray.get(self.actor.lookup.remote(engine_id), timeout=self.timeout_s)
        except _UNANSWERED as e:
            raise KVTransferError(f"registry did not answer a lookup of {engine_id} within "
                                  f"{self.timeout_s:g} s ({type(e).__name__})") from e

    def report(self, replica_id: str, stats: dict) -> None:
        """Fire-and-forget: the replica's load, and what it published (a restarted registry is empty)."""
        for info in self._published.values():
            self.actor.publish.remote(info)
        self.actor.report.remote(replica_id, stats)
