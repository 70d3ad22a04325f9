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


def pool_loads() -> dict[str, dict]:
    """The load of the `pdserve` app's prefill and decode replica (one each in the tests that ask)."""
    from ray import serve

    return {pool: serve.get_deployment_handle(pool, "pdserve").load.remote().result(timeout_s=30)
            for pool in ("prefill", "decode")}


def wait_pools_whole(timeout: float = 30.0) -> dict[str, dict]:
    """Until both pools have every block free and nothing running, waiting, importing or held;
    returns those loads (a leak shows as a timeout naming the last loads seen)."""
    seen: dict[str, dict] = {}

    def whole() -> bool:
        seen.update(pool_loads())
        return all(s["free_blocks"] == s["total_blocks"] and s["running"] == s["waiting"] == s["importing"]
                   == s["held"] == 0 for s in seen.values())

    wait_for(whole, f"both pools back at their totals (last seen: {seen})", timeout)
    return seen


APP_ACTORS = ("pdserve-admission", "pdserve-audit-writer", "pdserve-ledger")


def kill_app_actors() -> None:
    """The detached actors an app creates (admission buckets, audit writer, ledger): a test module's
    own state, so the next module's app starts them with its own config."""
    import ray

    for name in APP_ACTORS:
        try:
            ray.kill(ray.get_actor(name, namespace="pdserve"))
        except ValueError:  # never created by this module
            pass
