"""A prefill that finishes just as the ingress gives up on it (issue 52): its answer, and the lease
in it, arrive after the leg timed out. The lease used to stay held on the replica until lease_s
(the call was cancelled and its answer dropped); now it is released as the answer lands, and a
replica the decision named is told at once. No Ray: the handle's calls run a real PrefillEngine
(its blocks, its lease) in this process; only the answer's arrival is delayed."""

import asyncio
import time

import pytest

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.request import RequestContext
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from kv_transfer.layout import engine_layout
from kv_transfer.metadata_store import FileMetadataStore
from kv_transfer.transport import NixlTransport
from prefill.engine import PrefillEngine
from router.ingress.flow.legs import PrefillLeg
from router.ingress.flow.stream import ClientStream
from router.ingress.status import Code, ServingError

NUM_BLOCKS = 16
PROMPT = list(range(3, 43))  # 40 tokens: 3 blocks of 16
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture()
def prefill(tiny_model, tmp_path):
    engine = LLMEngine.from_model(tiny_model, num_blocks=NUM_BLOCKS)
    p = PrefillEngine(engine, NixlTransport("prefill-late", engine.kv_cache, engine_layout(engine),
                                            FileMetadataStore(tmp_path)), release_grace_s=0.0)
    yield p
    p.transport.close()


class LateReplica:
    """A prefill deployment handle with one replica: its prefill runs at once (the blocks leased),
    its answer arrives `late_s` after; `release` ends a lease as the replica's does. Records both, in order."""

    def __init__(self, engine: PrefillEngine, late_s: float):
        self.engine, self.late_s, self.events = engine, late_s, []
        self.prefill, self.release = self._Method(self._prefill), self._Method(self._release)

    def options(self, **_):
        return self

    class _Method:
        def __init__(self, fn):
            self.fn = fn

        def remote(self, *args, **kwargs):
            return self.fn(*args, **kwargs)

    async def _prefill(self, rid, ids, sampling, ctx, target_replica=None):
        result = self.engine.prefill(rid, ids, sampling)
        await asyncio.sleep(self.late_s)
        self.events.append(("answered", rid, result.handle.engine_id))
        return result

    async def _release(self, rid, target_replica=None):
        self.events.append(("release", rid, target_replica))
        self.engine.abort(rid)


def blocks_held(p: PrefillEngine) -> int:
    p.service()
    return p.engine.kv.num_blocks - p.engine.kv.num_free_blocks


@pytest.mark.parametrize("target, wait_s, deadline, code", [
    (None, 0.05, None, Code.UNAVAILABLE),  # Serve's choice, no deadline: replica_wait_s passed
    ("prefill-late", 30.0, 0.0, Code.DEADLINE_EXCEEDED),  # a named replica, the deadline (+ 1 s grace) passed
], ids=["replica-wait", "deadline"])
def test_a_late_prefill_answer_has_its_lease_released_not_held_to_lease_s(tiny_model, prefill, target, wait_s,
                                                                        deadline, code):
    replica = LateReplica(prefill, late_s=0.3 if deadline is None else 1.3)
    leg = PrefillLeg(replica, replica_wait_s=wait_s)
    ctx = RequestContext(deadline=None if deadline is None else time.time() + deadline)
    client = ClientStream("rid", IncrementalDetokenizer(Tokenizer(tiny_model), PROMPT, ()), PROMPT)

    async def run():
        with pytest.raises(ServingError) as e:
            await leg.first_token("rid", PROMPT, GREEDY, ctx, target, client)
        assert e.value.code == code
        held_at_give_up = blocks_held(prefill), prefill.num_leases
        await asyncio.wait_for(asyncio.gather(*leg.late_calls), 10)
        return held_at_give_up

    assert asyncio.run(run()) == (3, 1)  # the prefill finished as the ingress gave up: 3 blocks leased
    answered, release = ("answered", "rid", "prefill-late"), ("release", "rid", "prefill-late")
    if target is None:  # nobody to tell at once: released as the answer landed
        assert replica.events == [answered, release]
    else:  # the named replica is told at once; the late answer's release is a no-op
        assert replica.events == [release, answered, release]
    assert (blocks_held(prefill), prefill.num_leases, leg.late_calls) == (0, 0, set())
    assert prefill.transport.stats.leases_granted == 1
