"""Request identity: the ingress gives every request its own id; the client's request_id is a
label echoed back. A lease is released on the prefill replica that holds it, also when the
client leaves right after the first token."""

import asyncio
import concurrent.futures

from ray import serve

from cluster.config import AppConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from kv_transfer.handle import KVHandle, KVLayout
from prefill.result import PrefillResult
from protos.pdserve.v1 import generation_pb2 as pb
from tests.helpers import front_door, generate, grpc_stub, serve_replica_ids, wait_for

SP = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LAYOUT = KVLayout("fp", 16, "float32", 2, 2, 8)


class _Method:
    def __init__(self, fn):
        self.remote = fn


class FakePrefill:
    """A prefill deployment handle: each call is recorded with the replica it targets; prefill
    answers from replica `holder` with a lease on the request's blocks."""

    def __init__(self, holder: str):
        self.holder = holder
        self.prefills: list[str] = []
        self.releases: list[tuple[str, str | None]] = []
        self.prefill = _Method(self._prefill)
        self.release = _Method(self._release)

    def options(self, **_):  # how a call travels (flow/legs.py `via`): one way here
        return self

    async def _prefill(self, rid, ids, sampling, ctx, target_replica=None):
        self.prefills.append(rid)
        handle = KVHandle(rid, self.holder, "inc", "agent", (0, 1), (), len(ids), 7, LAYOUT, 0.0)
        return PrefillResult(rid, handle, None, None, 7, 0)

    async def _release(self, rid, target_replica=None):
        self.releases.append((rid, target_replica))


def test_client_ids_are_labels_and_a_disconnect_after_the_first_token_releases_on_the_holder(tiny_model):
    prefill = FakePrefill(holder="prefill-replica-B")
    door = front_door(AppConfig(model=tiny_model), prefill=prefill, decode=None)

    async def first_delta_then_leave(label):
        stream = generate(door, ids=[256] + list(range(1, 20)), label=label, max_tokens=8, temperature=0,
                          ignore_eos=True)
        d = await stream.__anext__()
        await stream.aclose()  # the client is gone before any decode leg started
        return d

    async def main():
        return await asyncio.gather(first_delta_then_leave("1"), first_delta_then_leave("1"))

    a, b = asyncio.run(main())
    assert (a.request_id, b.request_id) == ("1", "1")  # the label is echoed
    assert a.token_ids == b.token_ids == [7]
    internal = prefill.prefills
    assert len(set(internal)) == 2 and "1" not in internal  # the engines saw two distinct ids of ours
    assert sorted(prefill.releases) == sorted((rid, "prefill-replica-B") for rid in internal)


# ---- on a real app: two tenants, the same request_id, two prefill replicas ---------------------

def test_two_tenants_with_the_same_request_ids_both_finish_and_the_pools_come_back(serve_apps, tiny_model):
    prompts = {(t, label): [256] + [(k * i + len(label) + ord(t)) % 250 for i in range(30)]
               for k, t in ((3, "a"), (7, "b")) for label in ("1", "2", "3")}
    engine = LLMEngine.from_model(tiny_model, num_blocks=64)
    keys = list(prompts)
    reference = dict(zip(keys, (o.token_ids for o in engine.generate([prompts[k] for k in keys], SP))))

    with serve_apps.run(
        tiny_model, served_model_name="tiny", engine={"num_blocks": 32}, prefill={"num_replicas": 2},
        routing={"local_prefill_threshold": 0}, tenants={"a": {"api_keys": ["key-a"]}, "b": {"api_keys": ["key-b"]}},
        kv_transfer={"release_grace_s": 0.5},
    ) as cfg:
        with grpc_stub(cfg) as stub:

            def run(key):
                tenant, label = key
                req = pb.GenerateRequest(request_id=label, token_ids=pb.TokenIds(ids=prompts[key]),
                                         sampling=pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
                replies = list(stub.Generate(req, metadata=[("authorization", f"Bearer key-{tenant}")], timeout=40))
                return [r.request_id for r in replies], [t for r in replies for t in r.token_ids]

            with concurrent.futures.ThreadPoolExecutor(len(keys)) as pool:
                results = dict(zip(keys, pool.map(run, keys)))
        for key, (labels, tokens) in results.items():
            assert set(labels) == {key[1]}, key  # every reply echoes the client's id
            assert tokens == reference[key], key

        prefills = serve_replica_ids()["prefill"]
        assert len(prefills) == 2
        handles = {pool: serve.get_deployment_handle(pool, "pdserve") for pool in ("prefill", "decode")}
        seen = {}

        def whole():
            for rid in prefills:
                seen[rid] = handles["prefill"].load.remote(target_replica=rid).result(timeout_s=10)
            seen["decode"] = handles["decode"].load.remote().result(timeout_s=10)
            return all(s["free_blocks"] == s["total_blocks"] and s["held"] == s["running"] == s["waiting"]
                       == s["importing"] == 0 for s in seen.values())

        wait_for(whole, f"both prefill replicas and decode back at their totals (last: {seen})", timeout=20)
        assert sum(seen[rid]["transfer"]["leases_granted"] for rid in prefills) == len(keys)
