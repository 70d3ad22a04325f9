"""The rollout actor: every model's live traffic split and the canary gate (router/ingress/versions/rollout.py),
shared by every ingress replica and reached by `pdserve rollout`. Restarted by Ray if it dies: the
first ingress to sync configures it again from its config (a run-time split is then lost)."""

from __future__ import annotations

import ray

from cluster.config.models import RolloutOptions
from router.actor import named_actor
from router.ingress.versions.rollout import Key, Rollouts, VersionStats

ROLLOUT_NAME = "pdserve-rollout"


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


def get_rollout():
    return named_actor(RolloutActor, ROLLOUT_NAME)
