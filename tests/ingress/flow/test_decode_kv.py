"""What the auto in-flight cap reads of the decode pool (RequestFlow.decode_kv_tokens): the KV of
the replicas that decode now for this serving group, from the router's live loads, which hold
every group's replicas, prefill and draining ones too."""

import asyncio

from cluster.config import AppConfig
from router.ingress.flow.request_flow import RequestFlow
from router.policy import ReplicaLoad


class Router:
    """The router actor's live_loads: what it was given."""

    def __init__(self, loads: list[ReplicaLoad]):
        self.loads = loads
        self.live_loads = self

    async def _loads(self):
        return self.loads

    def remote(self):
        return self._loads()


def test_only_this_groups_decode_replicas_that_take_requests_count(tiny_model):
    cfg = AppConfig(model=tiny_model, served_model_name="tiny", version="v1")
    assert cfg.serving_group == "tiny@v1" and cfg.engine.block_size == 16
    loads = [
        ReplicaLoad("d-1", "decode", free_blocks=10, total_blocks=100, group="tiny@v1"),
        ReplicaLoad("d-2", "decode", free_blocks=0, total_blocks=60, group="tiny@v1"),
        ReplicaLoad("p-flipped", "decode", free_blocks=5, total_blocks=40, group="tiny@v1", deployment="prefill"),
        ReplicaLoad("d-draining", "decode", free_blocks=90, total_blocks=1000, group="tiny@v1", draining=True),
        ReplicaLoad("d-other", "decode", free_blocks=0, total_blocks=5000, group="tiny@v2"),
        ReplicaLoad("p-1", "prefill", free_blocks=0, total_blocks=700, group="tiny@v1"),
    ]
    flow = RequestFlow(cfg, None, None, router=Router(loads))
    # d-1, d-2 and the prefill replica that decodes now: (100 + 60 + 40) blocks x 16 tokens
    assert asyncio.run(flow.decode_kv_tokens(1.0)) == 200 * 16
