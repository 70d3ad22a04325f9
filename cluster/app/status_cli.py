"""`pdserve status`: the applications, the replicas' loads (the registry) and each app's routers
with how fresh their view of each replica is (router/events.py's feed)."""

from __future__ import annotations

import json


def _routers(apps) -> dict:
    """Each app's routers (one per model version, router/actor.py): their stats and, per replica
    they hear from, how fresh their view is (Router.feed_views)."""
    from dataclasses import asdict  # noqa: PLC0415

    import ray  # noqa: PLC0415

    from router.actor import ROUTER, app_actor_names, lookup  # noqa: PLC0415
    from router.cells import cell_of_name  # noqa: PLC0415

    out = {}
    for app in apps:
        for name in app_actor_names(app, ROUTER):
            handle = lookup(name)
            if handle is None:
                continue
            try:
                stats, views = ray.get([handle.stats.remote(), handle.feed_views.remote()], timeout=10)
            except ray.exceptions.RayError as e:
                out[name] = {"error": str(e).splitlines()[0]}
                continue
            out[name] = {"cell": cell_of_name(name), "replicas": [v.replica_id for v in views],
                         "stats": asdict(stats), "feeds": [asdict(v) for v in views]}
    return out


def status(args) -> int:
    """`pdserve status`: each app's deployments, each replica's load and feed lag, each router's view."""
    import os  # noqa: PLC0415

    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    from cluster.serving.registry import get_registry  # noqa: PLC0415

    ray.init(address=args.address or os.environ.get("RAY_ADDRESS") or "auto", namespace="pdserve",
             log_to_driver=False)
    status = serve.status()
    apps = {name: {"status": app.status.value if hasattr(app.status, "value") else str(app.status),
                   "deployments": {d: {"status": str(ds.status.value if hasattr(ds.status, "value") else ds.status),
                                       "replicas": dict(ds.replica_states)}
                                   for d, ds in app.deployments.items()}}
            for name, app in status.applications.items()}
    replicas = ray.get(get_registry().snapshot.remote())
    routers = _routers(apps)
    if args.json:
        print(json.dumps({"applications": apps, "replicas": replicas, "routers": routers}, default=str))
        return 0
    for name, app in apps.items():
        print(f"application {name}: {app['status']}")
        for d, ds in app["deployments"].items():
            print(f"  {d:<8} {ds['status']:<10} replicas {ds['replicas']}")
    _print_replicas(replicas)
    _print_routers(routers)
    return 0


def _print_replicas(replicas: dict) -> None:
    """Each replica's role (with the deployment it belongs to when a flip made them differ), KV,
    streams, step time and how stale the router's view of it was at its last answered feed call."""
    print(f"{'replica':<18} {'role':<20} {'KV used':>12} {'running':>8} {'waiting':>8} {'step ms':>8} {'age s':>6} "
          f"{'feed lag ms (max)':>18}")
    for rid, s in replicas.items():
        used = s["total_blocks"] - s["free_blocks"]
        feed = s.get("router_feed") or {}
        lag = f"{feed['lag_last_s'] * 1e3:.0f} ({feed['lag_max_s'] * 1e3:.0f})" if feed else "-"
        role = s["role"] if s["role"] == s["deployment"] else f"{s['role']} (of {s['deployment']})"
        print(f"{rid:<18} {role:<20} {used:>5}/{s['total_blocks']:<6} {s['running']:>8} "
              f"{s['waiting'] + s['importing']:>8} {s['last_step_ms']:>8.2f} {s['age_s']:>6.1f} {lag:>18}")


def _print_routers(routers: dict) -> None:
    """Each router (a model version's, or one of its cells': router/cells.py, `.../cell-K`), the
    replicas it hears from and, per replica, its view's staleness at the last feed call (its max)
    and the time since."""
    for name, r in routers.items():
        if "error" in r:
            print(f"router {name}: {r['error']}")
            continue
        st = r["stats"]
        cell = "" if r.get("cell") is None else f" (cell {r['cell']}: {len(r['replicas'])} replicas fed)"
        print(f"router {name}{cell}: {st['replicas']} replicas indexed, {st['tracked_blocks']} blocks, "
              f"{st['decisions']} decisions ({st['spilled']} spilled on), {st['resyncs_requested']} resyncs, "
              f"{st['sessions']} sessions")
        for v in r["feeds"]:
            print(f"  {v['replica_id']:<18} feed calls {v['calls']:>7}  staleness {v['staleness_s'] * 1e3:7.1f} ms "
                  f"(max {v['max_staleness_s'] * 1e3:.1f})  heard {v['heard_s_ago']:.2f} s ago")
