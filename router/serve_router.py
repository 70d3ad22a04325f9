"""Serve's side of routing: a request router (runs in the caller, e.g. the ingress) that sends a
request to the replica the policy chose, passed as the `target_replica` keyword argument; without
one, or when that replica is gone, it falls back to power of two choices among the live replicas.
It tells its app's routers at once when a replica dies, so decisions stop naming it (it looks them
up: a router that does not exist is not created for that).

Which pending request gets a chosen replica: the one it was chosen for. Serve's FIFOMixin alone
hands it to the oldest pending request, so in a burst requests ran on replicas chosen for others,
away from their cached prefixes (3 and 4 of 8 concurrent streams in two loaded runs of
tests/serving/test_colocated.py); Serve's base router without the mixin matches by request id but
assigns nothing when the id does not match, and its routing task then loops without a pause (an
ingress at 100% CPU, requests hung: seen in the suite). So: the request's own id first, FIFO when
it matches nothing (Serve's private matching helpers, Ray 2.60)."""

from __future__ import annotations

import logging
import random
from typing import List, Optional

import ray
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from router.actor import tell_routers_forget

log = logging.getLogger(__name__)

TARGET_KWARG = "target_replica"


class PrefixAwareRequestRouter(FIFOMixin, RequestRouter):
    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None):
        if self._get_pending_request_matching_internal_request_id(request_metadata) is None:
            return super()._fulfill_next_pending_request(replica, request_metadata)  # FIFO: never wasted
        return RequestRouter._fulfill_next_pending_request(self, replica, request_metadata)  # its own request

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        target = pending_request.kwargs.get(TARGET_KWARG) if pending_request is not None else None
        if target is not None:
            for r in candidate_replicas:
                if r.replica_id.unique_id == target:
                    return [[r]]
        if len(candidate_replicas) <= 2:
            return [list(candidate_replicas)]
        return [random.sample(candidate_replicas, 2)]

    def update_replicas(self, replicas: List[RunningReplica]):
        """Serve pushes the live replica set here; replicas that left it (died, scaled down) are
        dropped from the index at once."""
        live = {r.replica_id.unique_id for r in replicas}
        gone = getattr(self, "_pdserve_live", set()) - live
        self._pdserve_live = live
        super().update_replicas(replicas)
        for replica_id in gone:
            _forget(self._deployment_id.app_name, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        _forget(replica_id.deployment_id.app_name, replica_id.unique_id)


def _forget(app: str, replica_id: str) -> None:
    try:
        tell_routers_forget(app, replica_id)
    except ray.exceptions.RayError as e:  # the routers also drop replicas that stop reporting
        log.debug("could not tell the routers that %s is gone: %s", replica_id, e)
