"""The legs around a replica whose role flipped after a decision named it (no Ray: handles are
fakes). It refuses before starting anything (WrongRoleError): a prefill leg leaves the prompt to
decode; a decode leg goes to the replica a fresh decision names, through that replica's home
deployment, with the same KV handle and request id (not a migration, no lease released). A
replica is always called through its home deployment's handle."""

import asyncio

import pytest

from cluster.engine.outputs import FinishReason, RequestOutput
from cluster.engine.request import RequestContext
from cluster.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from cluster.errors import WrongRoleError
from router.ingress.flow.legs import MAX_REROUTES, DecodeLegs, PrefillLeg
from router.ingress.flow.stream import ClientStream
from router.ingress.status import Code, ServingError


class Deployment:
    """A deployment handle whose replicas each play one role: `roles[replica id]`. Records every call."""

    def __init__(self, roles: dict[str, str], tokens=(7, 8, 9)):
        self.roles = roles
        self.tokens = list(tokens)
        self.calls: list[tuple] = []
        self.prefill, self.release, self.generate = self._Method(self, "prefill"), self._Method(self, "release"), \
            self._Method(self, "generate")

    def options(self, **_):
        return self

    class _Method:
        def __init__(self, deployment, name):
            self.deployment, self.name = deployment, name

        def remote(self, *args, target_replica=None, **kwargs):
            d = self.deployment
            d.calls.append((self.name, args[0], target_replica, args[3] if self.name == "generate" else None))
            replica = target_replica or next(iter(d.roles))
            if self.name == "generate":
                return d._stream(replica, args[0])
            return d._call(self.name, replica)

    async def _call(self, name, replica):
        if name == "prefill" and self.roles[replica] != "prefill":
            raise WrongRoleError(f"replica {replica} plays {self.roles[replica]} now, not prefill")

    def _stream(self, replica, rid):
        deployment = self

        class Stream:
            def __init__(self):
                self.sent = 0

            def __aiter__(self):
                return self

            async def __anext__(self):
                if deployment.roles[replica] != "decode":
                    raise WrongRoleError(f"replica {replica} plays {deployment.roles[replica]} now, not decode")
                if self.sent == len(deployment.tokens):
                    raise StopAsyncIteration
                self.sent += 1
                last = self.sent == len(deployment.tokens)
                return RequestOutput(rid, [deployment.tokens[self.sent - 1]], "", last,
                                     FinishReason.LENGTH if last else None, 2, self.sent + 1, 0)

            def cancel(self):
                pass
        return Stream()


class Lease:
    engine_id = "p-a"


class Releases:
    def __init__(self):
        self.released = []

    async def release(self, rid, holder):
        self.released.append((rid, holder))


def client(tiny_model):
    return ClientStream("r", IncrementalDetokenizer(Tokenizer(tiny_model), [1, 2], ()), [1, 2])


def run_decode(legs, tiny_model, target, home, reroute):
    async def run():
        return [t for d in [d async for d in legs.stream("rid", [1, 2], None, RequestContext(), Lease(), target,
                                                          client(tiny_model), home, reroute)] for t in d.token_ids]
    return asyncio.run(run())


def test_a_decode_leg_refused_by_a_flipped_replica_goes_where_a_new_decision_says(tiny_model):
    # d-0 (decode deployment) prefills now; p-b (prefill deployment) decodes now
    prefill_dep, decode_dep = Deployment({"p-a": "prefill", "p-b": "decode"}), Deployment({"d-0": "prefill"})
    releases = Releases()
    legs = DecodeLegs(decode_dep, max_migrations=1, prefill=releases, homes={"prefill": prefill_dep})
    rerouted = []

    async def reroute():
        rerouted.append(1)
        return "p-b", "prefill"

    assert run_decode(legs, tiny_model, "d-0", "decode", reroute) == [7, 8, 9]
    assert [c[:3] for c in decode_dep.calls] == [("generate", "rid", "d-0")]
    [(name, rid, target, kv)] = prefill_dep.calls
    assert (name, rid, target, kv.engine_id) == ("generate", "rid", "p-b", "p-a")  # same id, same lease: no migration
    assert (rerouted, releases.released) == ([1], [])


def test_a_decode_leg_every_replica_refuses_ends_unavailable_and_releases_the_lease(tiny_model):
    decode_dep = Deployment({"d-0": "prefill"})
    releases = Releases()
    legs = DecodeLegs(decode_dep, max_migrations=1, prefill=releases)

    async def reroute():
        return "d-0", "decode"  # a router that has not seen the flip yet

    with pytest.raises(ServingError) as e:
        run_decode(legs, tiny_model, "d-0", "decode", reroute)
    assert e.value.code == Code.UNAVAILABLE
    assert len(decode_dep.calls) == MAX_REROUTES + 1
    assert all(c[1] == "rid" for c in decode_dep.calls)  # never a migrated leg's id
    assert releases.released == [("rid", "p-a")]


def test_without_a_decision_the_decode_leg_calls_its_pool_and_serves_choice_reroutes(tiny_model):
    decode_dep = Deployment({"d-0": "decode"})
    legs = DecodeLegs(decode_dep, max_migrations=0, prefill=None, homes={"prefill": Deployment({"p-a": "prefill"})})
    assert run_decode(legs, tiny_model, None, None, None) == [7, 8, 9]
    assert [c[:3] for c in decode_dep.calls] == [("generate", "rid", None)]


def test_a_prefill_refused_by_a_flipped_replica_leaves_the_prompt_to_decode():
    # p-a (prefill deployment) decodes now; d-0 (decode deployment) was named as a prefill replica, then flipped back
    prefill_dep, decode_dep = Deployment({"p-a": "decode"}), Deployment({"d-0": "decode"})
    leg = PrefillLeg(prefill_dep, homes={"decode": decode_dep})

    async def first(target, home):
        return await leg.first_token("rid", [1, 2], None, RequestContext(), target, None, home)

    assert asyncio.run(first("p-a", "prefill")) is None  # prefilled on decode instead
    assert asyncio.run(first("d-0", "decode")) is None
    assert (prefill_dep.calls, decode_dep.calls) == ([("prefill", "rid", "p-a", None)],
                                                     [("prefill", "rid", "d-0", None)])


def test_a_release_goes_to_the_lease_holders_home(tiny_model):
    from types import SimpleNamespace

    prefill_dep, decode_dep = Deployment({"p-a": "prefill"}), Deployment({"d-0": "prefill"})
    leased = SimpleNamespace(finish_reason=None, num_cached_tokens=0, first_logprob=None, prompt_logprobs=None,
                             handle=SimpleNamespace(engine_id="d-0", first_token=5))

    async def granted(*_):
        return leased
    decode_dep._call = granted  # d-0, in the decode deployment, prefills now and grants a lease
    leg = PrefillLeg(prefill_dep, homes={"decode": decode_dep})

    async def run():
        _, handle = await leg.first_token("rid", [1, 2], None, RequestContext(), "d-0", client(tiny_model), "decode")
        await leg.release("rid", handle.engine_id)
        await leg.release("rid2", "p-a")
    asyncio.run(run())
    assert (prefill_dep.calls, decode_dep.calls) == ([("release", "rid2", "p-a", None)],
                                                     [("prefill", "rid", "d-0", None), ("release", "rid", "d-0", None)])
