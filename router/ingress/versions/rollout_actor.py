"""The rollout actor: every model's live traffic split and the canary gate (router/ingress/versions/rollout.py),
shared by every ingress replica of one Serve app (router/actor.py) and reached by `pdserve rollout`. Restarted by Ray if it dies: the
first ingress to sync configures it again from its config (a run-time split is then lost)."""

from __future__ import annotations

import ray

from cluster.config.models import RolloutOptions
from router.actor import ActorRef, named_actor, scoped_name, serve_app
from router.ingress.versions.rollout import Key, Rollouts, VersionStats

ROLLOUT = "rollout"


@ray.remote(num_cpus=0, max_restarts=-1)
class RolloutActor:
    def __init__(self):
        self.state = Rollouts()

    def configure(self, models: dict[str, tuple[dict[str, float], RolloutOptions]]) -> tuple[int, dict]:
        self.state.configure(models)
        return self.state.generation, self.state.splits()

    def sync(self, stats: dict[Key, VersionStats], generation: int) -> tuple[int, dict] | None:
        """An ingress's outcomes since its last sync; the splits when they changed since `generation`."""
        self.state.report(stats)
        if generation == self.state.generation:
            return None
        return self.state.generation, self.state.splits()

    def set_split(self, model: str, weights: dict[str, float], reason: str = "manual") -> dict:
        return self.state.set_split(model, weights, reason)

    def rollback(self, model: str, reason: str = "manual") -> dict:
        return self.state.rollback(model, reason)

    def status(self) -> dict:
        return self.state.status()


def rollout_name(app: str | None = None) -> str:
    return scoped_name(app or serve_app(), ROLLOUT)


def get_rollout(app: str | None = None) -> ActorRef:
    """The app's rollout actor (None: the caller's app); the ingress configures it (catalog.connect)."""
    name = rollout_name(app)
    return ActorRef(name, lambda: named_actor(RolloutActor, name))
