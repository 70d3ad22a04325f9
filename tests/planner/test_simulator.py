"""The simulator on cases worked out by hand (tests/planner/conftest.py: the step times)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.planner.config import SLO, ClusterConfig
from cluster.planner.outcome import Dist, Trend, percentile
from cluster.planner.simulator import Simulator, simulate
from cluster.planner.workload import RequestSpec, SyntheticWorkload
from tests.planner.conftest import decode_s, prefill_s, transfer_s

LOOSE = SLO(ttft_s=100.0, tpot_s=100.0)


def test_one_request_remote_prefill_then_decode(profile):
    """TTFT is the prefill step (the first token is streamed from prefill); the transfer sits in
    the first inter-token gap; then one decode step per token at batch 1."""
    r = simulate(profile, ClusterConfig(1, 1, chunk_tokens=512, skip_prefill_tokens=0),
                 [RequestSpec(0.0, 100, 5)], LOOSE)
    assert (r.remote, r.local, r.completed, r.preemptions) == (1, 0, 1, 0)
    assert r.ttft.p50 == prefill_s(100)
    assert r.itl.n == 4
    assert r.itl.max == pytest.approx(transfer_s(100) + decode_s(1), abs=1e-12)
    assert r.itl.p50 == decode_s(1)  # three of the four gaps
    assert r.tpot.p50 == pytest.approx((transfer_s(100) + 4 * decode_s(1)) / 4, abs=1e-12)
    assert r.duration_s == pytest.approx(prefill_s(100) + transfer_s(100) + 4 * decode_s(1), abs=1e-12)
    assert r.transfer_s == transfer_s(100)


def test_a_long_prompt_is_prefilled_in_chunks(profile):
    r = simulate(profile, ClusterConfig(1, 1, chunk_tokens=256, skip_prefill_tokens=0),
                 [RequestSpec(0.0, 600, 1)], LOOSE)
    assert r.ttft.p50 == 2 * prefill_s(256) + prefill_s(88)
    assert r.itl.n == 0 and r.completed == 1  # one output token: done on prefill, never transferred
    assert r.transfer_s == 0.0


def test_a_short_prompt_is_prefilled_on_decode_below_the_threshold(profile):
    """The router's own policy decides: fewer uncached tokens than skip_prefill_tokens -> local."""
    specs = [RequestSpec(0.0, 32, 2), RequestSpec(10.0, 100, 2)]
    r = simulate(profile, ClusterConfig(1, 1, chunk_tokens=512, skip_prefill_tokens=64), specs, LOOSE)
    assert (r.remote, r.local) == (1, 1)
    assert (2 * r.ttft.mean - r.ttft.max, r.ttft.max) == (prefill_s(32), prefill_s(100))


def test_a_saturated_decode_replica_makes_batch_over_step_time_tokens_a_second(profile):
    """16 requests, max_num_seqs 8: arriving together, all are prefilled in one step and
    transferred together; two waves of 8 decode back to back, every step at batch 8."""
    out = 33
    specs = [RequestSpec(0.0, 16, out)] * 16
    cfg = ClusterConfig(1, 1, chunk_tokens=512, skip_prefill_tokens=0, decode_blocks=1000, max_num_seqs=8)
    r = simulate(profile, cfg, specs, LOOSE)
    decode_time = r.duration_s - prefill_s(16 * 16) - transfer_s(16)
    assert decode_time == pytest.approx(2 * (out - 1) * decode_s(8), abs=1e-9)
    tokens = 16 * (out - 1)  # decode makes every token after the first
    assert tokens / decode_time == pytest.approx(8 / decode_s(8), rel=1e-12)
    assert r.itl.p50 == decode_s(8) and r.itl.p90 == decode_s(8)
    assert r.utilisation["decode"] == pytest.approx(decode_time / r.duration_s, rel=1e-12)


def test_kv_full_preempts_the_newest_request_twice(profile):
    """4 blocks of 16 tokens, two 16-token prompts (2 blocks each once decoding). At 32 tokens the
    older request needs a third block: the newer one is preempted (2 blocks back), readmitted at
    once with a 16-token chunk of its recompute (1 block). At 48 tokens the older one needs a
    fourth block: the newer one is preempted again. After the older one ends, the newer recomputes
    its 16 prompt + 17 output tokens in one chunk and decodes to its end in the 4 blocks."""
    cfg = ClusterConfig(1, 1, chunk_tokens=512, skip_prefill_tokens=0, decode_blocks=4, max_num_seqs=8)
    r = simulate(profile, cfg, [RequestSpec(0.0, 16, 40), RequestSpec(0.0, 16, 40)], LOOSE)
    assert r.preemptions == 2
    assert r.completed == 2
    # the stall: the newer request's gap spans the older one's remaining 23 steps and the recompute
    assert r.itl.n == 2 * 39


def test_a_request_larger_than_the_kv_pool_never_completes(profile):
    cfg = ClusterConfig(0, 1, chunk_tokens=512, decode_blocks=2, max_num_seqs=8)
    r = simulate(profile, cfg, [RequestSpec(0.0, 40, 4)], LOOSE)
    assert (r.requests, r.completed) == (1, 0)


def test_goodput_counts_requests_within_both_slo_targets(profile):
    specs = [RequestSpec(0.0, 100, 5), RequestSpec(0.0, 100, 5)]
    slo = SLO(ttft_s=prefill_s(100) * 1.5, tpot_s=1.0)  # the second request waits a step: late
    r = simulate(profile, ClusterConfig(1, 1, chunk_tokens=100, skip_prefill_tokens=0), specs, slo)
    assert r.slo_met == 1 and r.attainment == 0.5
    assert r.goodput == 1 / r.duration_s


class CheckedSimulator(Simulator):
    """Checks the invariants after every step (from outside: the simulator has no test branch)."""

    def _step_end(self, rep, work, event):
        super()._step_end(rep, work, event)
        self.check_invariants()


def test_blocks_and_queued_tokens_stay_exact_under_preemption(profile):
    specs = SyntheticWorkload.parse("rate=50,n=400,prompt=1:300,output=1:120,seed=7").requests()
    cfg = ClusterConfig(1, 2, chunk_tokens=128, skip_prefill_tokens=64, decode_blocks=40, max_num_seqs=16)
    sim = CheckedSimulator(profile, cfg, LOOSE, seed=2)
    r = sim.run(specs)
    assert r.completed == 400 and r.preemptions > 0 and r.local > 0 and r.remote > 0
    sim.check_invariants()
    assert all(d.free_blocks == d.total_blocks and d.prompt_tokens_left == 0 for d in sim.decodes)
    assert sim.prefills[0].prompt_tokens_left == 0


def test_the_same_seed_gives_the_same_result(profile):
    specs = SyntheticWorkload.parse("rate=40,n=300,prompt=16:600,output=1:64,seed=3").requests()
    cfg = ClusterConfig(2, 3, chunk_tokens=256, skip_prefill_tokens=64, decode_blocks=200)
    assert simulate(profile, cfg, specs, LOOSE, seed=1) == simulate(profile, cfg, specs, LOOSE, seed=1)


def test_percentiles_and_parsers():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert Dist.of([]).n == 0
    assert SLO.parse("ttft=500ms,tpot=0.05") == SLO(0.5, 0.05)
    w = SyntheticWorkload.parse("rate=2,n=3,prompt=10,output=4:8")
    assert (w.prompt, w.output, w.burstiness) == ((10, 10), (4, 8), 1.0)
    with pytest.raises(ValueError, match="unknown keys"):
        SyntheticWorkload.parse("rate=2,n=3,prompt=10,output=4,x=1")


@pytest.mark.parametrize("cores,stretch", [(None, 1.0), (2.0, 1.0), (1.0, 2.0)])
def test_replicas_sharing_cores_stretch_the_steps_that_run_at_once(profile, cores, stretch):
    """Two colocated replicas, a prompt each at once: with one core between them both steps run at
    half pace and end together at twice the profiled time (processor sharing); with two cores or
    a device each, each takes its own."""
    specs = [RequestSpec(0.0, 100, 1), RequestSpec(0.0, 100, 1)]
    sim = Simulator(profile, ClusterConfig(0, 2, chunk_tokens=512, cores=cores), LOOSE)
    r = sim.run(specs)
    assert (r.local, r.completed) == (2, 2)
    assert [d.busy_s for d in sim.decodes] == [stretch * prefill_s(100)] * 2
    assert (r.ttft.mean, r.ttft.max) == (stretch * prefill_s(100),) * 2
    assert sim.busy == 0 and sim._sharing == {}


def test_a_step_s_end_moves_when_another_starts_or_ends_at_the_measured_slowdown(profile):
    """Measured sharing (profile.sharing: 1.5x with two steps at once, 2.25x with three): a
    100-token prompt at 0 (alone: T), a second replica's at T/2. The first runs alone for T/2,
    then both at 1/1.5 pace: the first's other half takes 0.75 T (ends at 1.25 T); the second
    has done 0.5 T of its own work by then and finishes the rest alone (ends at 1.75 T)."""
    from dataclasses import replace

    shared = replace(profile, sharing=(1.0, 1.5, 2.25))
    assert [shared.slowdown(n, 2.0) for n in (0, 1, 2, 3, 6)] == [1.0, 1.0, 1.5, 2.25, 4.5]
    assert [profile.slowdown(n, 2.0) for n in (1, 2, 3)] == [1.0, 1.0, 1.5]  # not measured: n / cores
    t = prefill_s(100)
    specs = [RequestSpec(0.0, 100, 1), RequestSpec(t / 2, 100, 1)]
    sim = Simulator(shared, ClusterConfig(0, 2, chunk_tokens=512, cores=2.0), LOOSE)
    r = sim.run(specs)
    assert sorted(d.busy_s for d in sim.decodes) == pytest.approx([1.25 * t, 1.25 * t])
    assert (r.ttft.mean, r.ttft.max) == pytest.approx((1.25 * t, 1.25 * t))
    sim.check_invariants()
    assert sim._sharing == {}


def test_the_serving_path_s_measured_costs_are_added_where_they_occur(profile):
    """profile.serving (cluster/tools/bench/serving_probe.py): the client's TTFT gains the path's
    share (local or remote), every decode step its fixed and per-stream cost, the remote path's
    first gap the hand-off."""
    from dataclasses import replace

    from cluster.planner.profile import Serving

    served = replace(profile, serving=Serving(ttft_local_s=1 / 64, ttft_remote_s=1 / 32, decode_step_s=1 / 256,
                                              decode_stream_s=1 / 1024, handoff_s=1 / 16))
    local = simulate(served, ClusterConfig(0, 1, chunk_tokens=512), [RequestSpec(0.0, 32, 5)], LOOSE)
    assert local.ttft.p50 == prefill_s(32) + 1 / 64
    assert local.itl.p50 == decode_s(1) + 1 / 256 + 1 / 1024  # the first token came from the prefill step
    remote = simulate(served, ClusterConfig(1, 1, chunk_tokens=512, skip_prefill_tokens=0),
                      [RequestSpec(0.0, 100, 5)], LOOSE)
    assert remote.ttft.p50 == prefill_s(100) + 1 / 32
    assert remote.itl.max == pytest.approx(transfer_s(100) + 1 / 16 + decode_s(1) + 1 / 256 + 1 / 1024, abs=1e-12)
    two = simulate(served, ClusterConfig(0, 1, chunk_tokens=512), [RequestSpec(0.0, 32, 5)] * 2, LOOSE)
    assert two.itl.p50 == decode_s(2) + 1 / 256 + 2 / 1024  # per stream in the step


def test_a_configuration_above_capacity_shows_its_queue_growing_through_the_trace(profile):
    """A 2048-token prompt every 1.5 s, answered in one token, on one colocated replica whose
    prefill step of it takes 1/16 + 2 = 2.0625 s: request i's first token (its end) comes at
    2.0625 (i + 1), so its latency is 2.0625 + 0.5625 i, growing through the trace as a real
    overloaded run's does. Of 30 requests, the first third's median latency is 2.0625 + 0.5625 x 4.5
    and the last third's 0.5625 x 20 = 11.25 s above it: it cannot keep up. Two replicas can."""
    specs = [RequestSpec(1.5 * i, 2048, 1) for i in range(30)]
    cfg = ClusterConfig(0, 1, chunk_tokens=2048, decode_blocks=4096, max_num_seqs=32)
    r = simulate(profile, cfg, specs, SLO(20.0, 0.1))
    assert r.ttft.max == 2.0625 + 0.5625 * 29 and r.ttft.p50 == 2.0625 + 0.5625 * 14.5
    assert r.trend == Trend(2.0625 + 0.5625 * 4.5, 11.25) and not r.keeps_up
    assert r.attainment == 1.0  # every TTFT under 20 s: the trace ends before the queue misses the SLO
    two = simulate(profile, replace(cfg, decode_replicas=2), specs, SLO(20.0, 0.1))
    assert two.ttft.max == two.ttft.p50 == 2.0625 and two.trend == Trend(2.0625, 0.0) and two.keeps_up


def test_the_serving_processes_cpu_per_relayed_token_takes_its_share_of_the_cores(profile):
    """profile.serving.message_cpu_s = 1/64 s of CPU a relayed token, on one core: after the
    prompt's step (its first token sampled), the relay of that token and the next decode step
    (1/64 s alone) share the core, each at half pace: both end 1/32 s later, and so on for each
    token. A token interval is 1/32 s, twice the step's own; without shared cores (a device each,
    the serving processes on other cores) it is the step's own 1/64 s."""
    from cluster.planner.profile import Serving

    served = replace(profile, serving=Serving(0.0, 0.0, 0.0, 0.0, 0.0, message_cpu_s=1 / 64))
    cfg = ClusterConfig(0, 1, chunk_tokens=512, cores=1.0)
    sim = Simulator(served, cfg, LOOSE)
    r = sim.run([RequestSpec(0.0, 16, 4)])
    assert r.ttft.p50 == prefill_s(16) and r.itl.p50 == r.itl.max == 2 * decode_s(1) == 1 / 32
    assert sim._sharing == {} and sim.busy == 0
    alone = simulate(served, replace(cfg, cores=None), [RequestSpec(0.0, 16, 4)], LOOSE)
    assert alone.itl.max == decode_s(1)


def test_a_step_mixing_decodes_and_a_prompt_chunk_is_priced_as_one_forward(profile):
    """Issue 54. One colocated replica, chunk 64: A (16 tokens, 3 out) prefills in step 1; B (100
    tokens) arrives during it. Step 2 is A's decode and 63 of B's tokens, step 3 A's last decode and
    B's other 37 (B's first token), step 4 B's decode. A mixed step is one forward of its rows,
    prefill(chunk + decodes): prefill_s(64) and prefill_s(38), where the sum of a decode and a
    prefill step (the model to session 22) gave decode_s(1) more each, 1/64 s."""
    specs = [RequestSpec(0.0, 16, 3), RequestSpec(0.001, 100, 2)]
    sim = Simulator(profile, ClusterConfig(0, 1, chunk_tokens=64, max_num_seqs=8), LOOSE)
    r = sim.run(specs)
    step1, step2, step3, step4 = prefill_s(16), prefill_s(64), prefill_s(38), decode_s(1)
    assert r.ttft.max == pytest.approx(step1 + step2 + step3 - 0.001, abs=1e-12)  # B's
    assert 2 * r.ttft.mean - r.ttft.max == pytest.approx(step1, abs=1e-12)  # A's
    assert sim.itl == pytest.approx([step2, step3, step4], abs=1e-12)  # A's two gaps, then B's one
    assert r.duration_s == pytest.approx(step1 + step2 + step3 + step4, abs=1e-12)
