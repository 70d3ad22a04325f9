"""A flip starts the replica's estimators again (issue 52, item 5): the rate its old role
measured says nothing of the new one's, so its next load reports no rate of its own (the router
then prices it at its new pool's median, router/load_model.py) until it measures one."""

from __future__ import annotations

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from cluster.serving.reporting import LoadReporter
from kv_transfer.stats import TransferStats


class Registry:
    def report(self, replica_id: str, report: dict) -> None:
        self.last = report


def test_a_flip_resets_the_reporters_rate_and_the_next_work_measures_the_new_one(tiny_model):
    engine = LLMEngine.from_model(tiny_model, num_blocks=64)
    reporter = LoadReporter(engine, TransferStats(), "d-1", "decode", registry=Registry())
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    while engine.stats.busy_s <= 0.05:  # enough busy time for an estimate (LoadReporter._throughput)
        engine.generate([list(range(1, 40))], sp)
    decoding = reporter.replica_load(engine.load(), 1.0)
    assert (decoding.role, decoding.deployment, decoding.rate_samples) == ("decode", "decode", 1)
    assert decoding.tokens_per_s > 0
    reporter.draining = True
    reporter.flipped("prefill")
    flipped = reporter.replica_load(engine.load(), 2.0)
    assert (flipped.role, flipped.deployment, flipped.draining) == ("prefill", "decode", False)
    assert (flipped.tokens_per_s, flipped.rate_samples) == (0.0, 0)  # before: the decode rate, kept
    start = engine.stats.busy_s
    while engine.stats.busy_s - start <= 0.05:
        engine.generate([list(range(50, 300))], SamplingParams(max_tokens=1, temperature=0))
    measured = reporter.replica_load(engine.load(), 3.0)
    assert measured.rate_samples == 1 and measured.tokens_per_s > 0
