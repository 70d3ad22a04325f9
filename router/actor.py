"""The router as a named Ray actor (a thin shell over router.router.Router).

Ray restarts a dead router (`max_restarts=-1`) by re-running `__init__` with its creation args,
and whoever asks first creates it (a replica usually beats the ingress), so the creation args
cannot carry the policy. `configure()` therefore also writes the policy to the GCS key-value
store, and `__init__` reads it back: a restarted router routes with the configured policy from
its first decision. The GCS outlives every actor; it goes with the Ray cluster."""

from __future__ import annotations

import pickle

import ray
from ray.experimental import internal_kv

from router.policy import PolicyConfig
from router.router import Router

ROUTER_NAME = "pdserve-router"
ROUTER_NAMESPACE = "pdserve"
_POLICY_KEY = b"pdserve-router-policy"  # pickled (PolicyConfig, strategy): the last configure()


@ray.remote(num_cpus=0, max_restarts=-1)
class RouterActor(Router):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        saved = internal_kv._internal_kv_get(_POLICY_KEY, namespace=ROUTER_NAMESPACE)
        if saved is not None:
            super().configure(*pickle.loads(saved))

    def configure(self, config: PolicyConfig, strategy: str = "cost") -> None:
        super().configure(config, strategy)  # validates the strategy before it is kept
        internal_kv._internal_kv_put(_POLICY_KEY, pickle.dumps((config, strategy)), overwrite=True,
                                     namespace=ROUTER_NAMESPACE)


def named_actor(actor_class, name: str, *args, namespace: str = ROUTER_NAMESPACE, options: dict | None = None,
                **kwargs):
    """The cluster's one actor of this name, created (detached, with these arguments and actor
    `options`) by whoever asks first; every later caller gets that one, whatever it passes."""
    return actor_class.options(name=name, namespace=namespace, get_if_exists=True, lifetime="detached",
                               **(options or {})).remote(*args, **kwargs)


def get_router(**kwargs):
    """The cluster's router actor, created by whoever asks first. Restarted by Ray if it dies,
    with the last configured policy; a restarted router refuses the next event batch of every
    replica, which then resyncs."""
    return named_actor(RouterActor, ROUTER_NAME, **kwargs)
