"""A response-cache hit takes no place in the ingress's first-token queue and no stream in its
pace: its flow never starts (CapacityStage joins at the flow's `started`), and its replay releases
the place it reserved at admission. It used to join at `wrap`, before the cache decided, and count
its whole prompt ahead of every other request for its whole replay."""

import asyncio

from cluster.config import AppConfig
from router.ingress.gateway.response_cache import ResponseCacheStage
from router.ingress.request import ClientRequest, Delta, SamplingSpec
from tests.helpers import front_door

IDS = tuple(range(5, 45))  # 40 prompt tokens


def test_a_cache_hit_never_joins_the_first_token_queue(tiny_model):
    door = front_door(AppConfig(model=tiny_model, response_cache={"default_tenant": True}))
    flow = door.catalog.flows[0]
    spec = SamplingSpec(max_tokens=2, temperature=0.0)
    cache = next(s for s in door.gateways[flow.group].stages if isinstance(s, ResponseCacheStage)).cache
    stored = [Delta("x", "a", [7], None, len(IDS), 1), Delta("x", "b", [8], "length", len(IDS), 2)]
    assert cache.put(cache.key("default", IDS, flow.sampling(spec).params), stored)
    queue, pace = door.capacity.first_tokens, door.capacity.pace

    async def main():
        reply = await door.serve(ClientRequest("default", spec, prompt_token_ids=IDS))
        choice = reply.choices[0]
        during = (queue.pending_requests, queue.pending_tokens, queue.reserved, pace.streams)
        rest = [d async for d in choice.stream]
        return choice.first, rest, choice.outcome.cache_hit, during

    first, rest, hit, during = asyncio.run(main())
    assert hit and [first.token_ids, *[d.token_ids for d in rest]] == [[7], [8]]
    assert during == (0, 0, 0, 0)  # mid-replay: nothing ahead of the next request, no stream paced
    assert (queue.pending_requests, queue.pending_tokens, queue.reserved, pace.streams) == (0, 0, 0, 0)
