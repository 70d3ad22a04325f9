"""Request identity: the ingress gives every request its own id; the client's request_id is a
label echoed back. A lease is released on the prefill replica that holds it, also when the
client leaves right after the first token."""

import asyncio

from cluster.config import AppConfig
from cluster.engine.sampling_params import SamplingParams
from kv_transfer.handle import KVHandle, KVLayout
from prefill.engine import PrefillResult
from router.ingress.flow import RequestFlow

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

    async def _prefill(self, rid, ids, sampling, ctx, target_replica=None):
        self.prefills.append(rid)
        handle = KVHandle(rid, self.holder, "inc", "agent", (0, 1), (), len(ids), 7, LAYOUT, 0.0)
        return PrefillResult(rid, handle, None, None, 7, 0)

    async def _release(self, rid, target_replica=None):
        self.releases.append((rid, target_replica))


def test_client_ids_are_labels_and_a_disconnect_after_the_first_token_releases_on_the_holder(tiny_model):
    prefill = FakePrefill(holder="prefill-replica-B")
    flow = RequestFlow(AppConfig(model=tiny_model), prefill, decode_handle=None)

    async def first_delta_then_leave(label):
        stream = flow.generate(None, [256] + list(range(1, 20)), SP, request_id=label)
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
