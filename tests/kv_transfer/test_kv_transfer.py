"""Disaggregated prefill -> decode over real NIXL between two OS processes.

Process A (spawned) runs the prefill engine; this process runs the decode engine. Every test ends
with both pools' free blocks back at their totals.
"""

import time

import pytest

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from decode.engine import DecodeEngine
from kv_transfer.errors import IncompatiblePeerError
from kv_transfer.layout import engine_layout
from kv_transfer.metadata_store import FileMetadataStore
from kv_transfer.runs import block_runs
from kv_transfer.measured import MeasuredTransport
from kv_transfer.transport import NixlTransport
from cluster.tools.local_peer import PrefillProcess
from tests.helpers import wait_for

SP = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [[256] + [(7 * i + 3 * n) % 250 for i in range(n - 1)] for n in (1, 9, 16, 17, 40, 70)]




@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("peers")


@pytest.fixture(scope="module")
def reference(tiny_model):
    eng = LLMEngine.from_model(tiny_model, num_blocks=64)
    return {tuple(p): o.token_ids for p, o in zip(PROMPTS, eng.generate(PROMPTS, SP))}


@pytest.fixture(scope="module")
def prefill(tiny_model, store):
    proc = PrefillProcess(tiny_model, store, num_blocks=48)
    yield proc
    proc.close()


def make_decode(model, store, name, policy="recompute", timeout=5.0, **kw):
    engine = LLMEngine.from_model(model, **({"num_blocks": 48} | kw))
    transport = NixlTransport(name, engine.kv_cache, engine_layout(engine), FileMetadataStore(store))
    return DecodeEngine(engine, transport, policy=policy, transfer_timeout_s=timeout)


@pytest.fixture(scope="module")
def decode(tiny_model, store):
    d = make_decode(tiny_model, store, "decode-0")
    yield d
    d.transport.close()


def run_disaggregated(prefill, decode, prompts, sp=SP, tag="r"):
    """Prefill each prompt in A, import and decode in B. Returns full token lists and outputs."""
    tokens, finals = {}, {}
    for i, p in enumerate(prompts):
        rid = f"{tag}{i}"
        res = prefill.prefill(rid, p, sp)
        assert res.handle is not None, res
        tokens[rid] = [res.handle.first_token]
        decode.submit(rid, p, sp, res.handle)
    deadline = time.monotonic() + 60
    while decode.has_unfinished():
        assert time.monotonic() < deadline, "decode did not finish"
        for out in decode.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                finals[out.request_id] = out
    return [tokens[f"{tag}{i}"] for i in range(len(prompts))], [finals[f"{tag}{i}"] for i in range(len(prompts))]


def assert_pools_whole(prefill, decode):
    decode.engine.check_invariants()
    assert decode.engine.kv.num_free_blocks == decode.engine.kv.num_blocks

    seen = {}

    def prefill_whole() -> bool:
        # decode's loop turns at least once a second when idle (idle_poll_s), and each turn's
        # service() progresses UCX: a release or done notice sent by the last step may still sit
        # in decode's worker (under load the eager send does not always complete at once)
        decode.service()
        seen.update(prefill.stats())
        return seen["free"] == seen["total"] and seen["leases"] == 0

    # Blocks come back by a done/release notice (or a grace period after an abort), never by
    # waiting out a lease: a test that leaves a lease standing must end it itself (see
    # test_mismatched_block_size_or_model_is_refused), or the next test waits for its expiry.
    try:
        wait_for(prefill_whole, what="prefill blocks back", timeout=15)
    except AssertionError as e:
        raise AssertionError(f"{e}; prefill: {seen}; decode: {decode.transport.stats}") from None


def test_disaggregated_output_equals_in_process(prefill, decode, reference):
    got, finals = run_disaggregated(prefill, decode, PROMPTS)
    assert got == [reference[tuple(p)] for p in PROMPTS]
    assert [f.finish_reason for f in finals] == ["length"] * len(PROMPTS)
    assert decode.transport.stats.pulls_ok == len(PROMPTS)
    assert decode.transport.stats.fallbacks_recompute == 0
    # serving's transport keeps no benchmark measures on its poll (MeasuredTransport does: below)
    assert (decode.transport.stats.last_pull_phases, decode.transport.stats.descriptors_used) == ((0.0, 0.0, 0), 0)
    assert_pools_whole(prefill, decode)
    s = prefill.stats()
    assert s["leases_released"] >= len(PROMPTS) and s["leases_expired"] == 0  # notifications, not expiry


def test_only_missing_blocks_are_pulled(prefill, decode, tiny_model, reference):
    decode.engine.kv.pool.reset_cache()
    prompt = PROMPTS[-1]  # 70 tokens: 4 full blocks + 1 partial
    # Decode already holds the first 48 tokens (3 blocks) from a local request.
    decode.engine.generate([prompt[:48]], SamplingParams(max_tokens=1, temperature=0))
    before = decode.transport.stats
    pulled0, bytes0, reused0 = before.blocks_pulled, before.bytes_pulled, before.blocks_reused
    got, finals = run_disaggregated(prefill, decode, [prompt], tag="delta")
    st = decode.transport.stats
    assert st.blocks_reused - reused0 == 3
    assert st.blocks_pulled - pulled0 == 2  # block 4 (full) and block 5 (partial)
    assert st.bytes_pulled - bytes0 == 2 * decode.transport.block_bytes
    assert finals[0].num_cached_tokens == 48
    assert got[0] == reference[tuple(prompt)]
    assert_pools_whole(prefill, decode)


def test_a_pull_posts_one_descriptor_per_run_of_blocks_contiguous_on_both_sides(prefill, tiny_model, store,
                                                                                reference):
    engine = LLMEngine.from_model(tiny_model, num_blocks=48)
    transport = MeasuredTransport("decode-runs", engine.kv_cache, engine_layout(engine), FileMetadataStore(store),
                                  telemetry=True)  # NIXL counts the descriptors it used
    decode = DecodeEngine(engine, transport, transfer_timeout_s=5.0)
    try:
        prompt = PROMPTS[-1]  # 70 tokens: 5 blocks
        res = prefill.prefill("runs-0", prompt, SP)
        decode.submit("runs-0", prompt, SP, res.handle)
        runs = block_runs(engine.block_ids("runs-0")[:5], res.handle.block_ids, (48,), (48,))
        tokens = [res.handle.first_token]
        while decode.has_unfinished():
            tokens += [t for out in decode.step() for t in out.token_ids]
        assert tokens == reference[tuple(prompt)]
        assert (transport.stats.blocks_pulled, transport.stats.descriptors_used) == (5, len(runs))
        posting, to_first_poll, polls = transport.stats.last_pull_phases  # measured from outside the poll
        assert posting > 0 and to_first_poll >= 0 and polls >= 1
        assert_pools_whole(prefill, decode)
    finally:
        transport.close()


def test_blocks_in_the_decode_replicas_own_host_tier_are_loaded_not_pulled(prefill, tiny_model, store, reference):
    """Delta transfer counts the decode's lower tiers too: a prefix its device pool evicted to
    its host tier is copied back locally (on the loader thread, while the READ runs)."""
    decode = make_decode(tiny_model, store, "decode-tiered", num_blocks=8, kv_tiers={"host_blocks": 16})
    try:
        prompt = PROMPTS[-1]  # 70 tokens: 4 full blocks + 1 partial
        decode.engine.generate([prompt[:48]], SamplingParams(max_tokens=1, temperature=0))  # 3 blocks cached
        decode.engine.generate([[256] + list(range(100, 212))], SamplingParams(max_tokens=1, temperature=0))
        host = decode.engine.kv.host
        assert decode.engine.kv.pool.match_prefix(decode.engine.full_block_hashes(
            decode.engine.make_request("probe", prompt_token_ids=prompt))) == []  # evicted from the pool
        got, finals = run_disaggregated(prefill, decode, [prompt], tag="tiered")
        st = decode.transport.stats
        assert (st.blocks_reused, st.blocks_pulled, host.stats.loaded) == (3, 2, 3)
        assert finals[0].num_cached_tokens == 48
        assert got[0] == reference[tuple(prompt)]
        assert decode.engine.kv.num_loading == 0
        assert_pools_whole(prefill, decode)
    finally:
        decode.transport.close()


def test_a_lease_served_from_the_prefill_host_tier_frees_its_device_blocks_at_once(tiny_model, store, decode,
                                                                                  reference):
    """kv_tiers.lease_from_host: the full prompt blocks go to the prefill's host tier and decode's
    READ reads them there (NIXL, the host arena registered beside the pool); only the partial
    last block stays leased on prefill's device. Host pins end with the lease, or its grace."""
    proc = PrefillProcess(tiny_model, store, engine_id="prefill-host", num_blocks=48, release_grace_s=0.3,
                          kv_tiers={"host_blocks": 32, "lease_from_host": True})
    try:
        decode.engine.kv.pool.reset_cache()
        prompt = PROMPTS[-1]  # 70 tokens: 4 full blocks (host) + 1 partial (device)
        res = proc.prefill("host-0", prompt, SP)
        s = proc.stats()
        assert (s["free"], s["leases"], s["host_pinned"], s["leases_from_host"]) == (47, 1, 4, 1)
        assert [b >= 48 for b in res.handle.block_ids] == [True] * 4 + [False]
        pulled0 = decode.transport.stats.blocks_pulled
        tokens = [res.handle.first_token]
        decode.submit("host-0", prompt, SP, res.handle)
        deadline = time.monotonic() + 60
        while decode.has_unfinished():
            assert time.monotonic() < deadline, "decode did not finish"
            tokens += [t for out in decode.step() for t in out.token_ids]
        assert tokens == reference[tuple(prompt)]
        assert decode.transport.stats.blocks_pulled - pulled0 == 5
        assert_pools_whole(proc, decode)
        assert proc.stats()["host_pinned"] == 0
        # an aborted lease keeps its host slots pinned for the grace period, then lets go
        res = proc.prefill("host-1", PROMPTS[-2], SP)  # 40 tokens: 2 full blocks + 1 partial
        assert proc.stats()["host_pinned"] == 2
        proc.abort("host-1")
        s = proc.stats()
        assert (s["leases"], s["in_grace"], s["host_pinned"], s["quarantined"]) == (0, 1, 2, 1)
        wait_for(lambda: proc.stats()["in_grace"] == 0, what="grace over", timeout=10)
        s = proc.stats()
        assert (s["free"], s["host_pinned"], s["quarantined"]) == (48, 0, 0)
    finally:
        proc.close()


def test_lease_expiry_frees_prefill_blocks(tiny_model, store):
    proc = PrefillProcess(tiny_model, store, engine_id="prefill-lease", lease_s=0.3, num_blocks=16,
                          release_grace_s=0.3)
    try:
        res = proc.prefill("orphan", PROMPTS[4], SP)  # nobody pulls it
        assert len(res.handle.block_ids) == 3
        s = proc.stats()
        assert s["free"] == 13 and s["leases"] == 1
        wait_for(lambda: proc.stats()["leases"] == 0, what="lease expiry")
        # expired, but a decode may still be reading: the blocks wait out the grace period
        wait_for(lambda: proc.stats()["in_grace"] == 0, what="grace period")
        s = proc.stats()
        assert (s["free"], s["quarantined"], s["leases_expired"], s["leases_released"]) == (16, 0, 1, 0)
        assert s["grace_blocks_released"] == 3
    finally:
        proc.close()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_killed_before_the_pull(tiny_model, store, reference, policy):
    proc = PrefillProcess(tiny_model, store, engine_id=f"prefill-doomed-{policy}", num_blocks=16)
    dec = make_decode(tiny_model, store, f"decode-{policy}", policy=policy)
    try:
        prompt = PROMPTS[4]
        res = proc.prefill("k", prompt, SP)
        proc.kill()
        dec.submit("k", prompt, SP, res.handle)
        tokens, final = [res.handle.first_token], None
        deadline = time.monotonic() + 30
        while dec.has_unfinished():
            assert time.monotonic() < deadline
            for out in dec.step():
                tokens += out.token_ids
                final = out if out.finished else final
        if policy == "recompute":
            assert tokens == reference[tuple(prompt)]
            assert final.finish_reason == "length"
            assert dec.transport.stats.fallbacks_recompute == 1
        else:
            assert final.finish_reason == "error"
            assert final.error.startswith("KV transfer failed: ")
        assert dec.transport.stats.pulls_failed + dec.transport.stats.pulls_timed_out == 1
        dec.engine.check_invariants()
        assert dec.engine.kv.num_free_blocks == dec.engine.kv.num_blocks
    finally:
        dec.transport.close()


def test_mismatched_block_size_or_model_is_refused(prefill, tiny_model, model_factory, store):
    res = prefill.prefill("mm", PROMPTS[2], SP)
    other_bs = make_decode(tiny_model, store, "decode-bs8", block_size=8)
    with pytest.raises(IncompatiblePeerError, match="refusing KV from engine prefill-0: block_size 16 != ours 8"):
        other_bs.submit("mm", PROMPTS[2], SP, res.handle)
    other = model_factory("other", layers=3, hidden=64, vocab=320, max_positions=512)
    other_model = make_decode(other, store, "decode-other")
    with pytest.raises(IncompatiblePeerError, match="model_fingerprint"):
        other_model.submit("mm", PROMPTS[2], SP, res.handle)
    for d in (other_bs, other_model):
        assert d.engine.kv.num_free_blocks == d.engine.kv.num_blocks and not d.has_unfinished()
        d.transport.close()
    assert prefill.stats()["leases"] == 1  # nobody pulled: the lease stands until expiry...
    prefill.abort("mm")  # ...or until the ingress, told decode refused, ends it (as flow._decode does)
    assert prefill.stats()["leases"] == 0


def test_restarted_prefill_is_a_new_incarnation(tiny_model, store, reference):
    dec = make_decode(tiny_model, store, "decode-restart")
    first = PrefillProcess(tiny_model, store, engine_id="prefill-restart", num_blocks=16)
    try:
        got, _ = run_disaggregated(first, dec, [PROMPTS[3]], tag="before")
        assert got[0] == reference[tuple(PROMPTS[3])]
        first.kill()
        second = PrefillProcess(tiny_model, store, engine_id="prefill-restart", num_blocks=16)
        assert second.incarnation != first.incarnation
        try:
            got, _ = run_disaggregated(second, dec, [PROMPTS[4]], tag="after")
            assert got[0] == reference[tuple(PROMPTS[4])]
            assert dec.transport.stats.peer_refreshes == 1
            assert dec.transport.stats.fallbacks_recompute == 0
            assert_pools_whole(second, dec)
        finally:
            second.close()
    finally:
        dec.transport.close()


def test_a_required_transport_that_is_missing_refuses_to_start(tiny_model, store, monkeypatch):
    from kv_transfer.errors import TransportUnavailableError
    from kv_transfer.transports import available_transports

    monkeypatch.delenv("UCX_TLS", raising=False)
    assert "tcp" in available_transports()
    engine = LLMEngine.from_model(tiny_model, num_blocks=8)
    # One this host lacks (InfiniBand hosts have rc, GPU hosts cuda_ipc): checked by device.
    absent = [tl for tl in ("rc", "dc", "cuda_ipc", "gdr_copy") if tl not in available_transports()]
    if absent:
        with pytest.raises(TransportUnavailableError, match=rf"required UCX transports \['{absent[0]}'\] are not"):
            NixlTransport("needs-rdma", engine.kv_cache, engine_layout(engine), FileMetadataStore(store),
                          required_transports=["tcp", absent[0]])
    # UCX_TLS narrows what any host offers, InfiniBand or not.
    monkeypatch.setenv("UCX_TLS", "tcp")
    for required, missing in ((["tcp", "rc"], "rc"), (["cma"], "cma"), (["ib"], "ib")):
        with pytest.raises(TransportUnavailableError, match=rf"\['{missing}'\]"):
            NixlTransport("needs-" + missing, engine.kv_cache, engine_layout(engine), FileMetadataStore(store),
                          required_transports=required)


def test_cuda_ipc_reads_are_turned_on_for_vram_pools_only_and_never_over_the_operator(tiny_model, store,
                                                                                     monkeypatch):
    """Without NVLink UCX turns cuda_ipc's GET off and a pull of VRAM falls to TCP emulation (0.5 GB/s
    on an H200, docs/benchmarks.md): a VRAM pool's transport turns it on, a DRAM pool's leaves UCX be."""
    import os

    from kv_transfer.transports import enable_cuda_ipc_reads

    var = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
    monkeypatch.delenv(var, raising=False)
    engine = LLMEngine.from_model(tiny_model, num_blocks=8)
    NixlTransport("dram-pool", engine.kv_cache, engine_layout(engine), FileMetadataStore(store)).close()
    assert var not in os.environ
    enable_cuda_ipc_reads()  # what NixlTransport calls for a CUDA pool (tests/gpu runs that path)
    assert os.environ[var] == "y"
    monkeypatch.setenv(var, "n")
    enable_cuda_ipc_reads()
    assert os.environ[var] == "n"


class UnansweredLookups(FileMetadataStore):
    """The real store, with its lookups failing as RayMetadataStore's do when the registry actor
    is dead, restarting or too slow (an injected fault, not a fake: publishing still works)."""

    def lookup(self, engine_id):
        from kv_transfer.errors import KVTransferError

        raise KVTransferError(f"registry did not answer a lookup of {engine_id} within 2 s (GetTimeoutError)")


def test_a_registry_that_does_not_answer_is_a_failed_pull(tiny_model, store, reference):
    # Without the peer's info decode cannot tell prefill it is done: the lease frees those blocks.
    proc = PrefillProcess(tiny_model, store, engine_id="prefill-noreg", lease_s=0.5, num_blocks=16)
    engine = LLMEngine.from_model(tiny_model, num_blocks=48)
    transport = NixlTransport("decode-no-registry", engine.kv_cache, engine_layout(engine), UnansweredLookups(store))
    # the short lease frees prefill's blocks quickly; decode must still try the pull (not refuse the lease)
    dec = DecodeEngine(engine, transport, policy="recompute", transfer_timeout_s=5.0, min_lease_left_s=0.1)
    try:
        got, finals = run_disaggregated(proc, dec, PROMPTS[3:5], tag="noreg")
        assert got == [reference[tuple(p)] for p in PROMPTS[3:5]]  # recomputed here, same tokens
        assert [f.finish_reason for f in finals] == ["length", "length"]
        assert (transport.stats.pulls_failed, transport.stats.fallbacks_recompute, transport.stats.pulls_ok) == (2, 2, 0)
        assert_pools_whole(proc, dec)
        assert proc.stats()["leases_expired"] == 2
    finally:
        transport.close()
        proc.close()


def test_penalties_bias_and_logprobs_span_prefill_and_decode(prefill, decode, tiny_model):
    """The first token is sampled in the prefill process (bias and repetition penalty apply to it;
    its logprobs come back in the result), the rest on decode, whose penalty counts start from
    that first token; a migrated leg (the tokens already sent, no handle) goes on identically."""
    import torch

    from tests.engine.test_logits_processing import PROMPT, reference_greedy
    from tests.reference import hf_last_logits

    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3, presence_penalty=0.3,
                        frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={65: -100.0, 223: 1.5})
    expected = reference_greedy(tiny_model, PROMPT, sp, 12)
    expired = prefill.stats()["leases_expired"]
    res = prefill.prefill("pen", PROMPT, sp)
    tokens, logprobs = [res.handle.first_token], [res.first_logprob]
    decode.submit("pen", PROMPT, sp, res.handle)
    while decode.has_unfinished():
        for out in decode.step():
            tokens += out.token_ids
            logprobs += out.logprobs or []
    assert tokens == expected
    assert [lp.token_id for lp in logprobs] == tokens
    for i, lp in enumerate(logprobs):
        ref = torch.log_softmax(hf_last_logits(tiny_model, PROMPT + tokens[:i]), dim=-1)
        assert abs(lp.logprob - float(ref[tokens[i]])) < 1e-4, i
        assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist(), i

    decode.submit("pen.m1", PROMPT, sp, None, generated=tokens[:5])
    rest = []
    while decode.has_unfinished():
        rest += [t for out in decode.step() for t in out.token_ids]
    assert rest == expected[5:]
    assert_pools_whole(prefill, decode)
    assert prefill.stats()["leases_expired"] == expired  # the READ's done notice ended the lease


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decode_after_an_imported_first_token_equals_in_process(prefill, tiny_model, store, method):
    """The decode engine speculates (n-gram, or the model itself as its draft model, whose KV is
    rebuilt on decode: nothing of it moves) from the token prefill sampled: greedy output equals
    the engine without speculation, drafts were accepted, both pools (and the draft's) end whole."""
    spec = {"method": "ngram", "k": 4, "ngram_min": 1, "ngram_max": 3, "cost_model": "off"}  # acceptance alone decides: deterministic
    if method == "draft":
        spec = {"method": "draft", "draft_model": tiny_model, "k": 4, "cost_model": "off"}
    dec = make_decode(tiny_model, store, f"decode-spec-{method}", speculative=spec)
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [[256] + [(i * i + 3 * n) % 11 for i in range(n - 1)] for n in (9, 17, 40)]
    want = [o.token_ids for o in LLMEngine.from_model(tiny_model, num_blocks=64).generate(prompts, sp)]
    try:
        got, finals = run_disaggregated(prefill, dec, prompts, sp, tag="spec")
        assert got == want
        assert [f.num_output_tokens for f in finals] == [40] * len(prompts)
        assert dec.transport.stats.pulls_ok == len(prompts)
        assert dec.engine.stats.spec_accepted_tokens >= 20
        assert_pools_whole(prefill, dec)
        if method == "draft":
            draft_kv = dec.engine.speculator.proposer.kv
            assert draft_kv.num_free_blocks == draft_kv.num_blocks and draft_kv.num_requests() == 0
    finally:
        dec.transport.close()
