"""Bounded waits for tests: poll a condition until it holds or the time runs out (never a bare sleep)."""

import time


def wait_for(predicate, what: str = "condition", timeout: float = 15.0, retry_on: tuple = ()) -> None:
    """Poll `predicate` until true; exceptions of the types in `retry_on` count as "not yet"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except retry_on:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def wait_until(predicate, what: str = "condition", timeout: float = 20.0) -> None:
    """wait_for, through restarts of the actor the predicate asks (Ray answers "unavailable")."""
    import ray

    wait_for(predicate, what, timeout, retry_on=(ray.exceptions.ActorUnavailableError,))


def serve_replica_ids(app: str = "pdserve") -> dict[str, list[str]]:
    """The live replicas of a Serve app, per deployment. Serve names each replica's actor
    SERVE_REPLICA::app#deployment#id (the id a replica reports under), and only live actors are listed."""
    import ray

    ids: dict[str, list[str]] = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(f"SERVE_REPLICA::{app}#"):
            _, deployment, replica = actor["name"].removeprefix("SERVE_REPLICA::").split("#")
            ids.setdefault(deployment, []).append(replica)
    return {d: sorted(r) for d, r in ids.items()}
