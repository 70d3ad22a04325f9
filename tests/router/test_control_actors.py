"""The control actors are scoped per Serve app and run with the app's current options
(router/actor.py), driven directly on the session's Ray: the routers of two apps serving one model
share nothing; a router killed for good is resolved again, with its app's policy; a finalizer's
lookup creates nothing; the audit writer, ledger and admission actors apply a changed option (the
app redeployed), come back from a kill with it, and a second app's writer or ledger on the same file
is refused, naming the option."""

import os

import pytest
import ray

from cluster.config import AdmissionOptions, AuditOptions, BudgetOptions
from router.actor import app_actor_names, get_router, kill_app_actors, lookup, router_name, tell_routers_forget
from router.ingress.gateway.admission_actor import ADMISSION, AdmissionSettings, get_admission
from router.ingress.gateway.audit_actor import WriterSettings, get_audit_writer
from router.ingress.gateway.audit_log import read_records, verify
from router.ingress.gateway.budget import Ledger
from router.ingress.gateway.budget_actor import LedgerSettings, get_ledger
from router.policy import PolicyConfig, ReplicaLoad
from tests.helpers import wait_for

APP, OTHER = "test-scoped", "test-scoped-other"
READY_S = 60.0


@pytest.fixture()
def apps(ray_session, serve_apps):
    """Through serve_apps: these tests start no Serve app, so Serve stays up as it is (a Ray test
    without the fixture stops it, and the next module would pay its restart)."""
    yield
    for app in (APP, OTHER):
        kill_app_actors(app)


def pid(ref) -> int:
    return ray.get(ref.handle().__ray_call__.remote(lambda self: os.getpid()))


def settings(ref):
    return ray.get(ref.handle().__ray_call__.remote(lambda self: self.settings))


def restart(ref) -> None:
    """Kill the actor; Ray restarts it (its __init__ again, with its creation arguments)."""
    before = pid(ref)
    ray.kill(ref.handle(), no_restart=False)
    wait_for(lambda: pid(ref) != before, "the actor restarted in a new process", 30,
             retry_on=(ray.exceptions.RayActorError,))


def kill_for_good(ref, method: str) -> None:
    """Kill the actor without restart; the ref's next call (`method`, no arguments) meets ActorDiedError."""
    ray.kill(ref.handle(), no_restart=True)
    wait_for(lambda: lookup(ref.name) is None, f"{ref.name} is gone", 30)
    with pytest.raises(ray.exceptions.ActorDiedError):
        ray.get(getattr(ref, method).remote())


def test_two_apps_serving_one_model_keep_separate_routing_state(apps):
    a, b = get_router("tiny", APP), get_router("tiny", OTHER)
    policy = PolicyConfig(local_prefill_threshold=7)
    ray.get(a.configure.remote(policy, "round_robin"))
    ray.get(a.report_load.remote(ReplicaLoad("a-decode", "decode", 10, 10, group="tiny")))
    ray.get(a.resync.remote("a-decode", "incarnation", 0, [b"h1"]))
    ray.get(b.report_load.remote(ReplicaLoad("b-decode", "decode", 10, 10, group="tiny")))
    assert [x.replica_id for x in ray.get(a.live_loads.remote())] == ["a-decode"]
    assert [x.replica_id for x in ray.get(b.live_loads.remote())] == ["b-decode"]
    assert (ray.get(a.hashes.remote("a-decode")), ray.get(b.hashes.remote("a-decode"))) == ({b"h1"}, set())
    assert ray.get(b.policy_settings.remote()) == (PolicyConfig(), "cost")  # a's configure is not b's
    assert ray.get(b.route.remote([b"h1"], 32, None, "tiny")).decode == "b-decode"
    assert app_actor_names(APP) == ["test-scoped/router/tiny"]

    # a finalizer's (and a replica death's) lookup creates nothing: an app without routers stays without
    tell_routers_forget("test-scoped-none", "a-decode")
    assert get_router("tiny", "test-scoped-none").existing() is None
    assert app_actor_names("test-scoped-none") == []
    tell_routers_forget(APP, "a-decode")  # the app's live routers drop the replica
    wait_for(lambda: ray.get(a.live_loads.remote()) == [], "a's router forgot a-decode")

    # killed for good: the ref's next call resolves it again, a fresh router with the app's policy
    kill_for_good(a, "stats")
    wait_for(lambda: ray.get(a.policy_settings.remote()) == (policy, "round_robin"), "a's router again", 30,
             retry_on=(ray.exceptions.RayActorError,))
    assert a.resolutions == 2 and lookup(router_name(APP, "tiny")) is not None


def test_a_changed_audit_dir_is_applied_kept_through_restarts_and_refused_to_another_app(apps, tmp_path):
    first = AuditOptions(enabled=True, dir=str(tmp_path / "a"))
    second = AuditOptions(enabled=True, dir=str(tmp_path / "b"), dedup_window=100)
    writer = get_audit_writer(first, APP)
    writer.ready(READY_S)
    assert ray.get(writer.append.remote([{"request_id": "r1"}])) == (1, 0)
    redeployed = get_audit_writer(second, APP)  # the app redeployed with another audit.dir: applied
    assert redeployed.ready(READY_S) == WriterSettings.of(second)
    assert ray.get(redeployed.append.remote([{"request_id": "r2"}])) == (1, 0)

    restart(writer)  # Ray re-runs __init__ with the first options; it runs with the second
    assert settings(writer) == WriterSettings.of(second)
    assert ray.get(writer.append.remote([{"request_id": "r3"}, {"request_id": "r2"}])) == (1, 1)
    assert [r["request_id"] for r in read_records(tmp_path / "a")] == ["r1"]
    assert [r["request_id"] for r in read_records(tmp_path / "b")] == ["r2", "r3"]
    v = verify(tmp_path / "b")
    assert (v.ok, v.records) == (True, 2)

    # another app's writer on the same directory: refused, naming the option (two writers break a chain)
    with pytest.raises(ValueError, match=r"audit\.dir: .*\.writer\.lock is held by another pdserve process"):
        get_audit_writer(second, OTHER).ready(READY_S)

    kill_for_good(redeployed, "head")  # gone for good: created again, with the ref's options
    wait_for(lambda: ray.get(redeployed.head.remote()) == (2, list(read_records(tmp_path / "b"))[-1]["hash"]),
             "the writer again, on b's chain", 30, retry_on=(ray.exceptions.RayActorError,))
    assert redeployed.resolutions == 2


def test_a_killed_ledger_comes_back_with_the_apps_current_path_and_another_app_is_refused(apps, tmp_path):
    first = BudgetOptions(ledger_path=str(tmp_path / "a.json"))
    second = BudgetOptions(ledger_path=str(tmp_path / "b.json"), reservation_ttl_s=60.0)
    ledger = get_ledger(first, APP)
    ledger.ready(READY_S)
    assert ray.get(ledger.reserve.remote("t", "r1", 100, 1000))[0] is True
    assert ray.get(ledger.settle.remote("t", "r1", 40)) is True
    assert get_ledger(second, APP).ready(READY_S) == LedgerSettings.of(second)  # the redeploy's: applied
    assert ray.get(ledger.snapshot.remote())["tenants"] == {}  # b's (empty), not a's spend
    assert Ledger(tmp_path / "a.json").snapshot()["tenants"]["t"]["spent_usd"] > 0  # a's spend stays in a

    # 20 calls at once: each answered once its journal line is fsynced (shared writes), all read back
    assert all(g for g, _, _ in ray.get([ledger.reserve.remote("u", f"q{i}", 1, 100) for i in range(20)]))
    restart(ledger)
    assert settings(ledger) == LedgerSettings.of(second)
    assert ray.get(ledger.snapshot.remote())["tenants"]["u"]["open_reservations"] == 20
    assert (tmp_path / "b.json.journal").read_text().count("\n") == 20
    with pytest.raises(ray.exceptions.ActorDiedError,  # its creation refused
                       match=r"budgets\.ledger_path: .*\.b\.json\.lock is held by another pdserve"):
        get_ledger(second, OTHER).ready(READY_S)


def test_a_killed_admission_actor_comes_back_with_the_apps_current_bounds(apps):
    store = get_admission(AdmissionOptions(), APP)
    store.ready(READY_S)
    changed = AdmissionOptions(idempotency_max_keys=2, idempotency_ttl_s=30.0)
    assert get_admission(changed, APP).ready(READY_S) == AdmissionSettings.of(changed)
    restart(store)
    assert settings(store) == AdmissionSettings.of(changed)
    assert [ray.get(store.begin.remote("t", f"k{i}", "f"))[0] for i in range(3)] == ["run", "run", "full"]
    assert app_actor_names(APP, ADMISSION) == [f"{APP}/{ADMISSION}"]  # a kind's one actor, not only nested names


@ray.remote(num_cpus=0)
class _InAPlacementGroup:
    """Stands for a tensor-parallel Serve replica: Serve places it in its placement group with
    placement_group_capture_child_tasks (ray/serve/_private/deployment_scheduler.py)."""

    def create(self, name: str) -> int:
        from cluster.serving.registry import RegistryActor
        from router.actor import named_actor

        return ray.get(named_actor(RegistryActor, name).__ray_call__.remote(lambda self: os.getpid()))


def test_a_control_actor_created_in_a_replicas_placement_group_outlives_it(apps):
    """A named actor created from inside a placement group that captures child tasks is scheduled
    outside it: removing the group (Serve stopping a tp replica) neither kills it nor leaves it
    RESTARTING for good. (It was placed in the group: the registry, first asked for by a tp=2
    replica, died with that replica's app and every later pull failed on ActorUnavailableError.)"""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    name = "test-control-actor-outside-pg"
    pg = placement_group([{"CPU": 0.5}])
    ray.get(pg.ready(), timeout=READY_S)
    creator = _InAPlacementGroup.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_capture_child_tasks=True)).remote()
    try:
        created_pid = ray.get(creator.create.remote(name), timeout=READY_S)
        ray.kill(creator)
        remove_placement_group(pg)
        wait_for(lambda: ray.util.placement_group_table(pg)["state"] == "REMOVED", "the group removed", 30)
        actor = ray.get_actor(name, namespace="pdserve")
        assert ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=10) == created_pid
    finally:
        if lookup(name, "pdserve") is not None:
            ray.kill(ray.get_actor(name, namespace="pdserve"), no_restart=True)
