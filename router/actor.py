"""The router as a named Ray actor (a thin shell over router.router.Router)."""

from __future__ import annotations

import ray

from router.router import Router

ROUTER_NAME = "pdserve-router"
ROUTER_NAMESPACE = "pdserve"


@ray.remote(num_cpus=0, max_restarts=-1)
class RouterActor(Router):
    pass


def get_router(**kwargs):
    """The cluster's router actor, created by whoever asks first. Restarted by Ray if it dies;
    a restarted router refuses the next event batch of every replica, which then resyncs."""
    return RouterActor.options(
        name=ROUTER_NAME, namespace=ROUTER_NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote(**kwargs)
