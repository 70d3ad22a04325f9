"""A worker of a disaggregated tp=2 decode replica dies mid-stream (issue 41): a prefill pool of tp=1
and a decode pool of two tp=2 replicas on the tiny model (2 KV heads: one a decode rank). Every
stream's prompt KV is pulled over NIXL into a decode replica (each rank reads its head); then rank 1
of the replica serving most streams is killed (ray.kill of its worker actor, not the replica).

The replica's next forward fails in its group's collective, GroupGuard ends the replica, its streams
migrate to the other decode replica (which prefills prompt + tokens sent so far itself) and every
stream finishes with the in-process tp=1 engine's greedy tokens. The prefill replica and the
surviving decode replica are whole afterwards, and Serve replaces the dead one with a whole tp=2
replica (colocated kill: test_tensor_parallel_serving.py).
"""

from __future__ import annotations

import threading

import pytest
import ray

from tests.helpers import grpc_stub, inject_fault, serve_replica_ids, wait_for
from tests.serving.test_tensor_parallel_pd import load, reference
from tests.serving.test_tensor_parallel_serving import NUM_BLOCKS, prompt, request, workers

MAX_TOKENS = 64


@pytest.fixture(scope="module")
def app(serve_apps, tiny_model):
    with serve_apps.run(tiny_model, engine={"num_blocks": NUM_BLOCKS},
                        prefill={"num_replicas": 1, "num_cpus": 0.5},
                        decode={"num_replicas": 2, "num_cpus": 0.5, "engine": {"tensor_parallel_size": 2}},
                        fault_tolerance={"fault_injection": True}) as cfg:
        yield cfg


def whole(pool: str, replica: str, seen: dict) -> bool:
    seen[replica] = s = load(pool, replica)
    return s["free_blocks"] == s["total_blocks"] == NUM_BLOCKS and s["running"] == s["waiting"] == s["held"] == 0


@pytest.mark.timeout(300)
def test_killing_a_decode_worker_migrates_streams_pulled_over_nixl_to_the_reference_tokens(app, tiny_model):
    [p_replica], before = serve_replica_ids()["prefill"], serve_replica_ids()["decode"]
    assert len(before) == 2
    for r in before:  # ~7 s streams: the kill lands while they run
        inject_fault(r, step_delay_s=0.1)
    # 92 .. 150 tokens: past routing.local_prefill_threshold (64), so each is prefilled on the prefill pool
    prompts = [prompt(i) for i in range(3, 6)]
    expected = reference(tiny_model, prompts, MAX_TOKENS)
    got: list[list[int]] = [[] for _ in prompts]
    errors: list[BaseException] = []

    with grpc_stub(app) as stub:
        def consume(i: int) -> None:
            try:
                for r in stub.Generate(request(prompts[i], MAX_TOKENS), timeout=180):
                    got[i].extend(r.token_ids)
            except BaseException as e:  # noqa: BLE001 — reported by the assertion below
                errors.append(e)

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        # The first token comes from prefill; the third from a decode replica that pulled the prompt
        wait_for(lambda: errors or all(len(g) >= 3 for g in got), "every stream's decode leg to run", timeout=120)
        assert not errors, errors
        loads = {r: load("decode", r) for r in before}
        assert sum(s["running"] for s in loads.values()) == len(prompts), loads
        for s in loads.values():  # each stream on its replica was imported over NIXL, none recomputed
            t = s["transfer"]
            assert (t["pulls_ok"], t["pulls_failed"], t["fallbacks_recompute"]) == (s["running"], 0, 0), t
        victim = max(before, key=lambda r: loads[r]["running"])
        [survivor] = [r for r in before if r != victim]
        moved = loads[victim]["running"]
        assert moved >= 2  # three streams over two replicas
        assert max(len(g) for g in got) < MAX_TOKENS
        [worker] = workers(victim)  # rank 1, a Ray actor; rank 0 is the replica itself
        ray.kill(worker, no_restart=True)
        for t in threads:
            t.join(timeout=180)
    assert not errors, errors
    assert got == expected

    wait_for(lambda: victim not in serve_replica_ids().get("decode", []), "the broken replica to be gone", 60)
    seen: dict = {}
    try:
        wait_for(lambda: whole("prefill", p_replica, seen) and whole("decode", survivor, seen),
                 "the prefill and the surviving decode replica whole", timeout=30)
    except AssertionError as e:
        raise AssertionError(f"{e}; last seen {seen}") from None
    t = seen[survivor]["transfer"]  # the migrated streams were prefilled there, not pulled
    assert (t["pulls_ok"], t["pulls_failed"], t["fallbacks_recompute"]) == (len(prompts) - moved, 0, 0), t
    t = seen[p_replica]["transfer"]  # every lease ended by decode's notification, none expired
    assert (t["leases_granted"], t["leases_released"], t["leases_expired"]) == (len(prompts),) * 2 + (0,), t

    wait_for(lambda: len(serve_replica_ids().get("decode", [])) == 2, "Serve to replace the replica", 120)
    [fresh] = [r for r in serve_replica_ids()["decode"] if r != survivor]
    wait_for(lambda: whole("decode", fresh, seen), "the new decode replica whole", timeout=30)
    assert seen[fresh]["rank_nodes"] == [seen[fresh]["node_id"]] * 2
    assert len(workers(fresh)) == 1
