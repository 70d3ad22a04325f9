"""Load reports to the router: the router counts work it sent to a replica as pending until that
replica's next report, so a replica must report after every request it received, even one that
came and went within router_min_interval_s and left its queues as they were. Otherwise the idle
replica (whose loop may not turn again) keeps a phantom request and its prompt tokens at the
router, and the router sends that prompt's next request elsewhere, missing its cache (the colocated
prefix test's intermittent miss: `waiting=1, queued_prefill_tokens=70` on an idle replica)."""

import pytest

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from cluster.serving.reporting import LoadReporter
from kv_transfer.stats import TransferStats
from router.policy import PolicyConfig, RoutingPolicy
from router.router import Router

SP = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


class InProcessRouter:
    """The router actor as a replica's feed calls it: each call delivered to a real Router at
    once and answered with an object ref (the feed checks its call's answer, router/events.py)."""

    def __init__(self, router: Router):
        import ray

        self.feed = type("Method", (), {"remote": staticmethod(lambda *a: ray.put(router.feed(*a)))})()


class Registry:
    """The replica registry's report() (fire-and-forget there): the last report kept."""

    def report(self, replica_id: str, report: dict) -> None:
        self.last = report


@pytest.mark.ray
def test_a_request_within_the_min_interval_is_still_reported_so_no_phantom_stays(ray_session, tiny_model):
    engine = LLMEngine.from_model(tiny_model, num_blocks=32)
    router = Router(RoutingPolicy(PolicyConfig()))
    reporter = LoadReporter(engine, TransferStats(), "decode-a", "decode", registry=Registry(),
                            router=InProcessRouter(router), router_min_interval_s=10.0,
                            router_interval_s=100.0)
    reporter.service(0.0, busy=False)  # the first report: idle
    decision = router.route([], 70)  # the router sends a request here: pending until the next report
    assert (decision.decode, router.pending_requests()) == ("decode-a", 1)

    engine.add_request("r", prompt_token_ids=[256] + list(range(1, 70)), sampling=SP)
    reporter.service(0.001, busy=True)  # within the min interval: no report
    assert router.pending_requests() == 1
    while engine.has_unfinished():
        engine.step()
    reporter.service(0.002, busy=False)  # idle again, queues as at the last report: it must report
    assert router.pending_requests() == 0
    load = router.live_loads()[0]
    assert (load.waiting, load.running, load.queued_prefill_tokens) == (0, 0, 0)


def test_the_report_shows_each_kv_tier_with_exact_counts(tiny_model):
    engine = LLMEngine.from_model(tiny_model, num_blocks=8, max_num_batched_tokens=64,
                                  kv_tiers={"host_blocks": 16})
    registry = Registry()
    reporter = LoadReporter(engine, TransferStats(), "decode-a", "decode", registry=registry,
                            router=InProcessRouter(Router(RoutingPolicy(PolicyConfig()))))
    base = [256] + list(range(1, 70))  # 4 full blocks
    engine.generate([base], SP)
    engine.generate([[256] + list(range(100, 212))], SP)  # 8 blocks: base's 4 go to the host tier
    engine.generate([base], SP)  # and come back
    report = reporter.report()
    assert report["kv_tiers"] == [{"name": "host", "used": 8, "total": 16, "stats": {
        "stored": 8, "refreshed": 0, "dropped": 0, "evicted": 0, "loaded": 4, "load_failed": 0,
        "written_through": 0, "save_failed": 0, "load_s": report["kv_tiers"][0]["stats"]["load_s"], "save_s": report["kv_tiers"][0]["stats"]["save_s"]}}]
    # the router's load carries the measured cost of a block loaded back (its tier weight's input)
    load = reporter.replica_load(engine.load(), 0.0)
    assert load.tier_load_s_per_block == (report["kv_tiers"][0]["stats"]["load_s"] / 4,)
    assert load.tier_load_s_per_block[0] > 0
    plain = LLMEngine.from_model(tiny_model, num_blocks=8)
    assert LoadReporter(plain, TransferStats(), "d", "decode", registry=registry,
                        router=InProcessRouter(Router(RoutingPolicy(PolicyConfig())))).report()["kv_tiers"] == []
