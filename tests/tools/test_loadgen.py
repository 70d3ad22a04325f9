"""`pdserve bench`: datasets and arrivals reproducible by seed, the report's math on crafted
records, compare; then the command against a local cluster (1 prefill + 1 decode replica, API key
on), whose request and token counts must equal what the server's engines did."""

import json
import math

import numpy as np
import pytest

from cluster.tools.loadgen.arrivals import arrival_offsets, session_offsets
from cluster.tools.loadgen.cli import seeded_generators
from cluster.tools.loadgen.compare import format_comparison
from cluster.tools.loadgen.datasets import MultiTurnDataset, Prompt, RandomDataset, SharedPrefixDataset, check_fits
from cluster.tools.loadgen.files import ShareGPTDataset, TraceDataset
from cluster.tools.loadgen.records import RequestRecord
from cluster.tools.loadgen.report import format_report, parse_goodput, parse_percentiles, summarize
from tests.helpers import http_base, pool_loads, wait_pools_whole, wait_until

PNG = b"\x89PNG\r\n\x1a\n"


def rng(seed):
    return np.random.default_rng(seed)


# ---- datasets ------------------------------------------------------------------------------


def test_random_dataset_is_reproducible_with_pinned_lengths():
    d = RandomDataset(input_len=100, output_len=20, range_ratio=0.5, vocab_size=320)
    a, b = d.sample(5, rng(7)), d.sample(5, rng(7))
    assert a == b and a != d.sample(5, rng(8))
    assert [(s.turns[0].prompt.num_tokens, s.turns[0].max_tokens) for s in a] == [
        (145, 26), (113, 27), (119, 14), (140, 11), (108, 16)]
    assert a[0].turns[0].prompt.token_ids[:8] == (91, 279, 292, 1, 159, 262, 42, 255)
    many = d.sample(2000, rng(1))
    ins = [s.turns[0].prompt.num_tokens for s in many]
    outs = [s.turns[0].max_tokens for s in many]
    assert (min(ins), max(ins), min(outs), max(outs)) == (50, 150, 10, 30)
    assert all(0 <= t < 320 for s in many for t in s.turns[0].prompt.token_ids)
    exact = RandomDataset(100, 20, 0.0, 320).sample(50, rng(2))
    assert {(s.turns[0].prompt.num_tokens, s.turns[0].max_tokens) for s in exact} == {(100, 20)}


def test_shared_prefix_dataset_has_n_prefixes_times_m_suffixes():
    d = SharedPrefixDataset(num_prefixes=3, suffixes_per_prefix=4, prefix_len=32, suffix_len=8, output_len=16,
                            vocab_size=320)
    sessions = d.sample(12, rng(1))
    assert sessions == d.sample(12, rng(1))
    prompts = [s.turns[0].prompt.token_ids for s in sessions]
    assert [len(p) for p in prompts] == [40] * 12 and {s.turns[0].max_tokens for s in sessions} == {16}
    by_prefix = {}
    for p in prompts:
        by_prefix.setdefault(p[:32], []).append(p[32:])
    assert sorted(len(v) for v in by_prefix.values()) == [4, 4, 4]
    assert len({p[32:] for p in prompts}) == 12
    # shuffled: the first four requests do not all share one prefix
    assert [p[:3] for p in prompts[:4]] == [(151, 163, 241), (135, 199, 145), (312, 42, 122), (312, 42, 122)]
    assert len(d.sample(5, rng(1))) == 5
    with pytest.raises(ValueError, match=r"has 3 x 4 = 12 prompts; asked for 13"):
        d.sample(13, rng(1))


def test_multi_turn_dataset_and_context_check():
    d = MultiTurnDataset(turns=3, user_len=10, output_len=6, vocab_size=320)
    sessions = d.sample(10, rng(4))
    assert len(sessions) == 3 and all(s.num_requests == 3 for s in sessions)
    assert {t.prompt.num_tokens for s in sessions for t in s.turns} == {10}
    assert d.max_context() == 48
    check_fits(sessions, 48)
    with pytest.raises(ValueError, match="session 0 needs 48 tokens of context .* context length is 47"):
        check_fits(sessions, 47)
    with pytest.raises(ValueError, match="3 turns; asked for only 2 requests"):
        d.sample(2, rng(4))


def test_prompts_join_only_in_the_same_form():
    assert Prompt((1, 2)) + Prompt((3,)) == Prompt((1, 2, 3))
    assert Prompt(text="a") + Prompt(text="b") == Prompt(text="ab")
    with pytest.raises(ValueError):
        Prompt((1,)) + Prompt(text="b")
    with pytest.raises(ValueError):
        Prompt()


def test_trace_replay_keeps_lengths_timing_and_shared_blocks(tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = [{"timestamp": 2500, "input_length": 10, "output_length": 3, "hash_ids": [7, 9]},
             {"timestamp": 1000, "input_length": 6, "output_length": 5, "hash_ids": [7]},
             {"timestamp": 1500, "input_length": 3, "output_length": 2}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    d = TraceDataset(str(path), vocab_size=320, block_size=4, time_scale=0.5)
    sessions = d.sample(10, rng(0))
    assert sessions == d.sample(10, rng(0))
    assert [s.arrival_s for s in sessions] == [0.0, 0.25, 0.75]  # sorted, ms -> s, scaled by 0.5
    assert [(s.turns[0].prompt.num_tokens, s.turns[0].max_tokens) for s in sessions] == [(6, 5), (3, 2), (10, 3)]
    first, _, third = (s.turns[0].prompt.token_ids for s in sessions)
    assert first[:4] == third[:4]  # hash id 7: the same block in both
    assert third[4:8] != first[4:8]
    assert session_offsets(sessions, 100.0, 1.0, rng(0)) == [0.0, 0.25, 0.75]  # the trace's own times
    assert len(d.sample(2, rng(0))) == 2
    path.write_text('{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="trace.jsonl:1: a trace line needs"):
        d.sample(1, rng(0))


def test_sharegpt_takes_first_exchange_and_filters_by_token_length(tmp_path, tiny_model):
    from cluster.engine.tokenizer import Tokenizer

    path = tmp_path / "sg.json"
    data = [{"conversations": [{"from": "human", "value": f"question number {i}"},
                               {"from": "gpt", "value": "an answer" + "!" * i}]} for i in range(6)]
    data += [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a long answer"}]},
             {"conversations": [{"from": "human", "value": "alone"}]}]
    path.write_text(json.dumps(data))
    tok = Tokenizer(tiny_model)
    d = ShareGPTDataset(str(path), None, tok, max_model_len=512)
    sessions = d.sample(100, rng(3))
    assert sessions == d.sample(100, rng(3))
    prompts = sorted(s.turns[0].prompt.text for s in sessions)
    assert prompts == [f"question number {i}" for i in range(6)]  # "hi" is under 4 tokens; "alone" has no answer
    assert {s.turns[0].prompt.text: s.turns[0].max_tokens for s in sessions}["question number 3"] == 12
    fixed = ShareGPTDataset(str(path), 32, None, 512).sample(3, rng(3))
    assert len(fixed) == 3 and {s.turns[0].max_tokens for s in fixed} == {32}
    with pytest.raises(ValueError, match="needs --tokenizer"):
        ShareGPTDataset(str(path), None, None, 512)


# ---- arrivals ------------------------------------------------------------------------------


def test_arrivals_are_pinned_by_seed():
    assert arrival_offsets(4, 2.0, 1.0, rng(0)) == pytest.approx(
        [0.3399659519844548, 0.8497645027173871, 0.8596678340119148, 0.8608024973525289], abs=1e-12)
    assert arrival_offsets(3, math.inf, 1.0, rng(0)) == [0.0, 0.0, 0.0]
    assert arrival_offsets(3, 4.0, math.inf, rng(0)) == pytest.approx([0.25, 0.5, 0.75])
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, 1.0, rng(0))


@pytest.mark.parametrize("burstiness, cv", [(1.0, 1.0), (0.25, 2.0), (4.0, 0.5)])
def test_long_arrival_sequences_have_the_rate_and_burstiness(burstiness, cv):
    gaps = np.diff([0.0] + arrival_offsets(20000, 10.0, burstiness, rng(3)))
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)  # mean gap 1/rate
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)  # gamma: CV = 1/sqrt(shape)


# ---- records and report math ---------------------------------------------------------------


class Clock:
    def __init__(self, *times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


def test_a_record_times_messages_not_tokens():
    rec = RequestRecord(0, 0, 0, arrival_at=9.5, max_tokens=4)
    rec.clock = Clock(10.0, 10.25, 10.30, 10.50, 10.60)
    rec.sent()
    rec.on_tokens(1)
    rec.on_tokens(2)  # one message, two tokens: one gap
    rec.on_tokens(1)
    rec.finish(prompt_tokens=7, output_tokens=4, cached_tokens=0)
    assert rec.ttft_s == pytest.approx(0.25)
    assert rec.itls_s == pytest.approx([0.05, 0.20])
    assert rec.message_tokens == [1, 2, 1]
    assert rec.latency_s == pytest.approx(0.60)
    assert rec.tpot_s == pytest.approx(0.35 / 3)
    assert rec.queue_s == pytest.approx(0.5)


def crafted_records():
    def ok(i, sent, ttft, itls, counts, latency, prompt, cached):
        return RequestRecord(i, i, 0, arrival_at=sent, max_tokens=8, prompt_len=prompt, sent_at=sent, ttft_s=ttft,
                             itls_s=itls, message_tokens=counts, latency_s=latency, prompt_tokens=prompt,
                             output_tokens=sum(counts), cached_tokens=cached, status="ok")

    return [
        ok(0, 100.0, 0.1, [0.02, 0.04], [1, 1, 2], 0.2, 10, 0),  # tpot 0.1/3
        ok(1, 100.1, 0.3, [0.05], [1, 1], 0.4, 20, 16),  # tpot 0.1
        ok(2, 101.0, 0.2, [], [1], 0.2, 30, 0),  # one token: no tpot (0 for goodput)
        RequestRecord(3, 3, 0, 100.0, 8, 5, sent_at=100.2, latency_s=0.01, status="failed", code="UNAVAILABLE"),
        RequestRecord(4, 4, 0, 100.0, 8, 5, sent_at=100.3, latency_s=0.01, status="failed", code="UNAVAILABLE"),
        RequestRecord(5, 5, 0, 100.0, 8, 5, sent_at=101.5, status="incomplete"),
    ]


def test_report_math_on_crafted_records():
    r = summarize(crafted_records(), started_at=100.0, duration_s=2.0, percentiles=(50, 90, 99),
                  slos=parse_goodput(["ttft:250", "tpot:50"]))
    assert (r["completed"], r["failed"], r["incomplete"]) == (3, 2, 1)
    assert r["errors_by_code"] == {"UNAVAILABLE": 2}
    assert (r["total_input_tokens"], r["total_output_tokens"], r["total_cached_prompt_tokens"]) == (60, 7, 16)
    assert r["request_throughput"] == 1.5 and r["output_throughput"] == 3.5 and r["total_token_throughput"] == 33.5
    # ttft ms [100, 300, 200]: linear interpolation between order statistics
    assert (r["mean_ttft_ms"], r["median_ttft_ms"]) == pytest.approx((200.0, 200.0))
    assert (r["p50_ttft_ms"], r["p90_ttft_ms"], r["p99_ttft_ms"]) == pytest.approx((200.0, 280.0, 298.0))
    # itl ms [20, 40, 50]: per message, not per token
    assert (r["mean_itl_ms"], r["median_itl_ms"], r["p90_itl_ms"]) == pytest.approx((110 / 3, 40.0, 48.0))
    # tpot ms [33.33, 100]: (e2e - ttft) / (tokens - 1), requests with >= 2 tokens
    assert (r["mean_tpot_ms"], r["p50_tpot_ms"]) == pytest.approx((200 / 3, 200 / 3))
    assert (r["mean_e2el_ms"], r["median_e2el_ms"]) == pytest.approx((800 / 3, 200.0))
    # goodput: request 0 meets both SLOs, 1 misses ttft (300 > 250), 2 meets ttft and has tpot 0
    assert (r["good_requests"], r["request_goodput"]) == (2, 1.0)
    # tokens 0.1, 0.12, 0.16 (x2), 0.4, 0.45 fall in second 0; request 2's token in second 1
    assert (r["max_output_tokens_per_s"], r["max_concurrent_requests"]) == (6.0, 2)
    assert r["input_lens"] == [10, 20, 30, 5, 5, 5] and r["output_lens"] == [4, 2, 1, 0, 0, 0]
    assert r["ttfts"] == [0.1, 0.3, 0.2, None, None, None]
    assert r["start_times"] == pytest.approx([0.0, 0.1, 1.0, 0.2, 0.3, 1.5])
    assert r["error_codes"] == ["", "", "", "UNAVAILABLE", "UNAVAILABLE", ""]
    json.dumps(r, allow_nan=False)  # strict JSON: no NaN or Infinity
    assert summarize(crafted_records(), 100.0, 2.0)["request_goodput"] is None  # no SLOs, no goodput
    text = format_report(r, (50, 90, 99))
    assert "Request goodput (req/s) [" in text and "P90 TTFT (ms):" in text and "  errors UNAVAILABLE:" in text


def test_report_with_no_completed_request_has_null_latencies():
    r = summarize(crafted_records()[3:], 100.0, 1.0, percentiles=(99.9,))
    assert r["completed"] == 0 and r["mean_ttft_ms"] is None and r["p99.9_ttft_ms"] is None
    json.dumps(r, allow_nan=False)


@pytest.mark.parametrize("bad", [["ttft"], ["latency:5"], ["ttft:-1"], ["ttft:abc"]])
def test_bad_goodput_slos_are_refused(bad):
    with pytest.raises(ValueError):
        parse_goodput(bad)


def test_percentiles_parse():
    assert parse_percentiles("50,90,99.9") == (50.0, 90.0, 99.9)
    with pytest.raises(ValueError):
        parse_percentiles("0,50")


# ---- compare and plots (from result files) ---------------------------------------------------


def test_compare_prints_both_arms_and_the_ratio(tmp_path, capsys):
    from cluster.app.cli import main

    a = summarize(crafted_records(), 100.0, 2.0)
    b = summarize(crafted_records(), 100.0, 1.0)  # the same requests in half the time
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert main(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                 "--labels", "disagg", "colocated", "--plot-dir", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["metric", "disagg", "colocated", "B/A"]
    rows = {line.split()[0]: line.split()[1:] for line in out[2:] if not line.startswith("wrote")}
    assert rows["request_throughput"] == ["1.50", "3.00", "2.00x"]
    assert rows["duration"] == ["2.00", "1.00", "0.50x"]
    assert rows["completed"] == ["3", "3", "1.00x"]
    assert rows["mean_ttft_ms"] == ["200.00", "200.00", "1.00x"]
    assert rows["request_goodput"] == ["-", "-", "-"]
    assert "p99_e2el_ms" in rows
    for name in ("ttft_cdf", "tpot_cdf", "itl_cdf", "e2el_cdf", "throughput"):
        assert (tmp_path / "plots" / f"{name}.png").read_bytes()[:8] == PNG
    assert format_comparison(a, b, "x", "y").splitlines()[0].split() == ["metric", "x", "y", "B/A"]


def test_bench_without_a_server_says_so(capsys):
    from cluster.app.cli import main
    from cluster.tools.netutil import free_port

    assert main(["bench", "--address", f"localhost:{free_port()}", "--disable-tqdm", "--num-prompts", "1"]) == 1
    assert "cannot reach pdserve at localhost:" in capsys.readouterr().err



# ---- against a local cluster -----------------------------------------------------------------

KEY = "sk-bench"


@pytest.fixture(scope="module")
def cluster(serve_apps, tiny_model):
    """1 prefill + 1 decode replica with an API key. Local prefill is off (threshold 0), so every
    request's first token is sampled on the prefill replica and the rest on the decode replica:
    the engines' token counters then count requests and tokens exactly."""
    import ray

    with serve_apps.run(tiny_model, served_model_name="tiny", engine={"num_blocks": 128},
                        routing={"local_prefill_threshold": 0}, api_keys=[KEY]) as cfg:
        wait_until(lambda: sorted(load.role for load in ray.get(get_router().live_loads.remote()))
                   == ["decode", "prefill"], "both replicas report to the router", timeout=60)
        yield cfg


def get_router():
    from tests.helpers import app_router

    return app_router()


def generated_tokens() -> tuple[int, int]:
    """(prefill, decode) tokens sampled by the engines since they started."""
    loads = pool_loads()
    return loads["prefill"]["generation_tokens"], loads["decode"]["generation_tokens"]


def bench(cluster, tmp_path, *args, backend="grpc", key=KEY):
    """`pdserve bench ...` in-process; returns (exit code, the saved result or None)."""
    from cluster.app.cli import main

    where = (["--address", f"localhost:{cluster.grpc_port}"] if backend == "grpc" else
             ["--backend", "openai", "--base-url", http_base(cluster)])
    out = tmp_path / "result.json"
    code = main(["bench", *where, *(["--api-key", key] if key else []), "--disable-tqdm",
                 "--result-file", str(out), *args])
    return code, (json.loads(out.read_text()) if out.exists() else None)


def planned(dataset, num, seed):
    return dataset.sample(num, seeded_generators(seed)[0])


RESULT_FIELDS = {"date", "backend", "model_id", "completed", "failed", "total_input_tokens", "total_output_tokens",
                 "request_throughput", "output_throughput", "total_token_throughput", "request_goodput",
                 "mean_ttft_ms", "median_ttft_ms", "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                 "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms",
                 "ttfts", "itls", "latencies", "input_lens", "output_lens", "errors", "errors_by_code",
                 "total_cached_prompt_tokens", "max_concurrent_requests", "duration"}


def test_bench_counts_equal_what_the_engines_did(cluster, tmp_path):
    before = generated_tokens()
    code, r = bench(cluster, tmp_path, "--dataset-name", "random", "--num-prompts", "24", "--random-input-len", "40",
                    "--random-range-ratio", "0.5", "--random-output-len", "12", "--ignore-eos", "--request-rate", "40",
                    "--burstiness", "0.5", "--max-concurrency", "8", "--warmup-requests", "2", "--seed", "3",
                    "--goodput", "ttft:600000", "e2el:600000", "--plot-dir", str(tmp_path / "plots"))
    after = generated_tokens()
    assert code == 0
    assert RESULT_FIELDS <= set(r)
    assert (r["completed"], r["failed"], r["incomplete"], r["not_sent"]) == (24, 0, 0, 0)
    d = RandomDataset(40, 12, 0.5, 320)  # lengths in [20, 60] and [6, 18]
    sessions = planned(d, 24, 3)
    warm = d.sample(2, seeded_generators(3)[2])
    want_in = [sessions[s].turns[0].prompt.num_tokens for s in r["sessions"]]
    want_out = [sessions[s].turns[0].max_tokens for s in r["sessions"]]
    assert (r["input_lens"], r["output_lens"]) == (want_in, want_out)  # the server's usage, request by request
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (sum(want_in), sum(want_out))
    # the server: 26 first tokens on prefill (2 of them warm-up), the rest of each on decode
    warm_out = sum(s.turns[0].max_tokens for s in warm)
    assert (after[0] - before[0], after[1] - before[1]) == (26, sum(want_out) + warm_out - 26)
    assert all(sum(c) == n and len(i) == len(c) - 1
               for i, c, n in zip(r["itls"], r["message_tokens"], want_out))
    assert r["request_goodput"] == r["request_throughput"]  # SLOs nothing misses
    assert r["errors"] == [""] * 24 and r["errors_by_code"] == {}
    for name in ("ttft_cdf", "tpot_cdf", "itl_cdf", "e2el_cdf", "throughput"):
        assert (tmp_path / "plots" / f"{name}.png").read_bytes()[:8] == PNG
    wait_pools_whole()


def test_shared_prefix_cached_tokens_are_exact(cluster, tmp_path):
    code, r = bench(cluster, tmp_path, "--dataset-name", "shared-prefix", "--shared-prefix-num-prefixes", "1",
                    "--shared-prefix-suffixes-per-prefix", "5", "--shared-prefix-len", "64",
                    "--shared-prefix-suffix-len", "8", "--shared-prefix-output-len", "4", "--ignore-eos",
                    "--max-concurrency", "1", "--seed", "11")
    assert code == 0 and r["completed"] == 5 and r["input_lens"] == [72] * 5
    assert r["cached_tokens"] == [0, 64, 64, 64, 64]  # the 4 prefix blocks, from the second request on
    assert r["total_cached_prompt_tokens"] == 256
    wait_pools_whole()


def test_multi_turn_sessions_grow_and_run_turn_after_turn(cluster, tmp_path):
    code, r = bench(cluster, tmp_path, "--dataset-name", "multi-turn", "--num-prompts", "6", "--multi-turn-turns", "3",
                    "--multi-turn-user-len", "20", "--multi-turn-output-len", "12", "--ignore-eos",
                    "--max-concurrency", "2", "--seed", "5")
    assert code == 0 and r["completed"] == 6
    by_session = {}
    for i, (s, t) in enumerate(zip(r["sessions"], r["turns"])):
        by_session.setdefault(s, {})[t] = i
    assert sorted(by_session) == [0, 1] and all(sorted(turns) == [0, 1, 2] for turns in by_session.values())
    for turns in by_session.values():
        idx = [turns[t] for t in range(3)]
        # turn k: every earlier prompt and answer, then 20 new tokens
        assert [r["input_lens"][i] for i in idx] == [20, 52, 84]
        # prefill's cache holds the previous turn's prompt blocks (answers were decoded elsewhere)
        assert [r["cached_tokens"][i] for i in idx] == [0, 16, 48]
        for prev, nxt in zip(idx, idx[1:]):
            assert r["start_times"][nxt] >= r["start_times"][prev] + r["latencies"][prev]
    wait_pools_whole()


def test_openai_backend_with_text_prompts(cluster, tmp_path, tiny_model):
    from cluster.tools.loadgen.datasets import to_text
    from cluster.engine.tokenizer import Tokenizer

    before = generated_tokens()
    code, r = bench(cluster, tmp_path, "--dataset-name", "random", "--num-prompts", "6", "--random-input-len", "24",
                    "--random-output-len", "5", "--ignore-eos", "--max-concurrency", "3", "--seed", "8",
                    "--prompt-format", "text", "--tokenizer", tiny_model, backend="openai")
    after = generated_tokens()
    assert code == 0 and r["backend"] == "openai"
    assert (r["completed"], r["total_output_tokens"]) == (6, 30)
    assert (after[0] - before[0], after[1] - before[1]) == (6, 6 * 4)
    tok = Tokenizer(tiny_model)  # HTTP does not report the vocabulary: ids are drawn from the tokenizer's
    texts = [s.turns[0].prompt.text for s in to_text(planned(RandomDataset(24, 5, 0.0, tok.vocab_size), 6, 8), tok)]
    assert r["input_lens"] == [len(tok.encode(texts[s])) for s in r["sessions"]]  # the server re-tokenized
    wait_pools_whole()


@pytest.mark.parametrize("backend, code_name", [("grpc", "INVALID_ARGUMENT"), ("openai", "HTTP 400")])
def test_errors_are_counted_by_code(cluster, tmp_path, backend, code_name):
    code, r = bench(cluster, tmp_path, "--dataset-name", "random", "--num-prompts", "12", "--random-input-len", "4",
                    "--random-output-len", "3", "--ignore-eos", "--vocab-size", "400", "--seed", "2", backend=backend)
    sessions = planned(RandomDataset(4, 3, 0.0, 400), 12, 2)
    bad = sum(max(s.turns[0].prompt.token_ids) >= 320 for s in sessions)  # outside the model's 320
    assert 0 < bad < 12 and code == 0
    assert (r["completed"], r["failed"], r["errors_by_code"]) == (12 - bad, bad, {code_name: bad})
    assert r["total_output_tokens"] == 3 * (12 - bad)
    assert all("prompt_token_ids: token id " in e for e, c in zip(r["errors"], r["error_codes"]) if c)
    wait_pools_whole()


def test_the_time_bound_cancels_streams_and_frees_the_server(cluster, tmp_path):
    code, r = bench(cluster, tmp_path, "--dataset-name", "random", "--num-prompts", "3", "--random-input-len", "20",
                    "--random-output-len", "480", "--ignore-eos", "--duration-s", "0.15")
    # 480 tokens take the tiny model >= 0.48 s (a decode step is ~1 ms on the fastest CI machine seen;
    # a 0.5 s bound let all three finish there): a 0.15 s bound cuts every stream with a 3x margin
    assert code == 1  # nothing completed
    assert (r["completed"], r["incomplete"], r["not_sent"], r["hit_time_bound"]) == (0, 3, 0, True)
    assert abs(r["duration"] - 0.15) < 1e-9
    wait_pools_whole()  # the cancelled streams' blocks are back on both pools


def test_a_missing_api_key_is_reported(cluster, tmp_path, capsys):
    code, r = bench(cluster, tmp_path, "--num-prompts", "1", key=None)
    assert code == 1 and r is None
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_a_run_says_whether_the_load_generator_kept_up():
    from cluster.tools.loadgen.runner import RunOutcome

    def outcome(lags_s, loop_lags_s=(0.002,) * 200):  # 100 requests due 10 ms apart, each sent `lag` after it was due
        recs = [RequestRecord(i, i, 0, arrival_at=i * 0.01, max_tokens=1, sent_at=i * 0.01 + lag)
                for i, lag in enumerate(lags_s)]
        return RunOutcome(recs, started_at=0.0, duration_s=2.0, planned=100, hit_time_bound=False, client_cpu_s=0.5,
                          loop_lags_s=list(loop_lags_s))

    on_time = outcome([0.001] * 100)
    assert on_time.send_lag_s(99) == pytest.approx(0.001, abs=1e-12)
    assert (on_time.kept_up(), on_time.client_cpu_share) == (True, 0.25)
    late = outcome([0.001] * 98 + [0.2, 0.3])  # two of a hundred left 200+ ms late: p99 is one of them
    assert late.send_lag_s(99) == pytest.approx(0.3, abs=1e-12) and late.kept_up() is False
    assert late.kept_up(max_lag_s=0.5)
    # sent on time, but the loop woke 120 ms late twice in 200 ticks: responses waited in the socket
    busy = outcome([0.001] * 100, [0.002] * 197 + [0.12, 0.12, 0.01])
    assert busy.loop_lag_s(99) == pytest.approx(0.12, abs=1e-12) and busy.kept_up() is False
    assert busy.loop_lag_s(50) == pytest.approx(0.002, abs=1e-12)
