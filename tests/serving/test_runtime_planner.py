"""The run-time planner on a real cluster (planner.enabled): 2 prefill + 1 decode replica whose
decode KV fills under long streams while the prefill pool idles. The planner moves a prefill
replica to decode by itself (drain, flip, re-register: cluster/planner/runtime_actor.py), says why,
and every stream ends with the reference tokens; new streams then decode on the moved replica, and
every replica's blocks are back at the end."""

import concurrent.futures
import re

import pytest
import ray

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from tests.helpers import app_router, grpc_stub, wait_until
from tests.serving.test_fault_tolerance import prompts, request

pytestmark = pytest.mark.ray

DECODE_BLOCKS = 48  # 6 streams of 100 + 300 tokens need 150: the decode pool's KV is the bound
STEP_DELAY_S = 0.01  # each decode step (fault injection): the streams run for seconds, not one


def roles() -> dict[str, str]:
    return {load.replica_id: load.role for load in ray.get(app_router().live_loads.remote())}


def replica_load(home: str, replica_id: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(home, "pdserve").load.remote(target_replica=replica_id).result(timeout_s=30)


def history() -> list[dict]:
    from ray import serve

    return serve.get_deployment_handle("planner", "pdserve").history.remote().result(timeout_s=30)


def test_the_planner_moves_an_idle_prefill_replica_to_a_full_decode_pool(serve_apps, tiny_model):
    ps = prompts(6, 100, base=300)
    expected = [o.token_ids for o in LLMEngine.from_model(tiny_model, num_blocks=512).generate(
        ps, SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))]
    with serve_apps.run(tiny_model, prefill={"num_replicas": 2, "num_cpus": 0.25},
                        decode={"num_replicas": 1, "num_cpus": 0.25, "engine": {"num_blocks": DECODE_BLOCKS}},
                        fault_tolerance={"fault_injection": True},
                        # KV bound at 70% of the blocks: preemptions free blocks now and then, and a
                        # pressure that dips under 1.0 between two decisions restarts the streak
                        planner={"enabled": True, "interval_s": 0.5, "patience": 2, "cooldown_s": 600.0,
                                 "kv_high": 0.7, "drain_timeout_s": 30.0}) as cfg, grpc_stub(cfg) as stub:
        wait_until(lambda: sorted(roles().values()) == ["decode", "prefill", "prefill"], "three replicas report")
        before = roles()
        [home_decode] = [rid for rid, role in before.items() if role == "decode"]
        from ray import serve

        serve.get_deployment_handle("decode", "pdserve").inject_fault.remote(
            step_delay_s=STEP_DELAY_S, target_replica=home_decode).result(timeout_s=30)
        with concurrent.futures.ThreadPoolExecutor(len(ps)) as pool:
            got = list(pool.map(lambda p: [t for r in stub.Generate(request(p, 300), timeout=120)
                                           for t in r.token_ids], ps))
        assert got == expected  # preempted on a full decode pool, moved around it: never failed
        wait_until(lambda: any(h["action"] == "flip" for h in history()), "the planner moved a replica")
        [move] = [h for h in history() if h["action"] == "flip"]
        assert (move["to"], move["binding"]) == ("decode", "decode KV")
        assert move["outcome"].startswith("moved in ")
        # the prefill pool one smaller: its queue or its busy fraction (router/load_model.py), both low
        assert re.fullmatch(r"decode KV at \d+\.\d\dx; the prefill pool one smaller would be at 0\.[0-5]\dx",
                            move["reason"]), move["reason"]
        moved = move["replica_id"]
        assert before[moved] == "prefill"
        wait_until(lambda: roles() == {**before, moved: "decode"}, "the router sees 1 prefill + 2 decode")
        # the moved replica now decodes: a second wave lands on both decode replicas
        made = replica_load("prefill", moved)["generation_tokens"]
        with concurrent.futures.ThreadPoolExecutor(len(ps)) as pool:
            again = list(pool.map(lambda p: [t for r in stub.Generate(request(p, 300), timeout=120)
                                             for t in r.token_ids], ps))
        assert again == expected
        # a prefill replica samples one token a request; at least one 300-token stream decoded there
        assert replica_load("prefill", moved)["generation_tokens"] - made >= 299
        homes = {rid: "decode" if before[rid] == "decode" else "prefill" for rid in before}

        def whole():
            loads = {rid: replica_load(home, rid) for rid, home in homes.items()}
            return all(s["free_blocks"] == s["total_blocks"] and s["running"] == s["waiting"] == s["importing"]
                       == s["held"] == 0 for s in loads.values())

        wait_until(whole, "every replica's blocks back, nothing held")
