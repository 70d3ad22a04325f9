"""Guardrails and the response cache through the real cluster (1 prefill + 1 decode replica):
an output that trips a rule mid-generation over gRPC, HTTP streaming and non-streaming (no flagged
text delivered, content_filter, both pools back to their totals), a refused prompt, the classifier
deployment (the rule-based stand-in) flagging, stalled and killed under fail-closed and fail-open
policies, and a repeated temperature-0 request served from the cache without reaching an engine."""

import concurrent.futures
import json
import re
import time
import urllib.error
import urllib.request

import grpc
import pytest

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from protos.pdserve.v1 import generation_pb2 as pb
from tests.helpers import grpc_stub, http_base, pool_loads, serve_replica_ids, wait_for, wait_pools_whole

KEYS = {"guarded": "k-guarded", "plain": "k-plain", "early": "k-early", "cls-closed": "k-cls-closed",
        "cls-open": "k-cls-open", "cls-out": "k-cls-out", "cls-kill": "k-cls-kill", "cls-kill-open": "k-cls-kill-open",
        "alts": "k-alts"}
KILL_TIMEOUT_S = 30.0  # the killed-classifier tenants' bound: their calls end by the replica's death, not by this
TOP = 5
CLASSIFIER_TIMEOUT_S = 0.5
PROMPT = [256] + list(range(1, 40))  # 40 tokens: prefilled remotely (threshold 16), so both legs hold blocks
MAX_TOKENS = 120
WINDOW = 16


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = LLMEngine.from_model(tiny_model, num_blocks=64)
    return engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                                    logprobs=TOP))[0]


@pytest.fixture(scope="module")
def flagged(reference):
    """A 3-character piece of the reference output first seen past its 24th character (of 85, about a
    third into the output: the random model repeats itself later): the rule."""
    text = reference.text
    for p in range(24, len(text) - 20):
        piece = text[p:p + 3]
        if piece not in text[:p + 2] and piece.isprintable() and "\ufffd" not in piece:
            return p, piece
    pytest.fail("no piece of the reference output fits")


@pytest.fixture(scope="module")
def classified(reference):
    """A word of the reference output first seen (whole, as the classifier stand-in reads words)
    past its 24th character: the classifier flags it, so an output check of the classifier stops there."""
    text = reference.text
    for m in re.finditer(r"\w{2,}", text):
        first = re.search(r"(?i)(?<!\w)" + re.escape(m.group()) + r"(?!\w)", text)
        if first.start() >= 24 and m.group().isascii() and first.start() == m.start():
            return m.start(), m.group()
    pytest.fail("no word of the reference output fits")


@pytest.fixture(scope="module")
def tok(tiny_model):
    from cluster.engine.tokenizer import Tokenizer

    return Tokenizer(tiny_model)


def contexts(tok, token_ids) -> list[str]:
    """The text before each token, as the guard reads it when tokens come one a delta: the tokens' texts."""
    out, text = [], ""
    for t in token_ids:
        out.append(text)
        text += tok.token_text(t)
    return out


@pytest.fixture(scope="module")
def alternative(reference, tok):
    """A 3-character pattern that two generated ASCII characters and an alternative of the token
    after them make, and that the output itself never holds: the rule of tenant "alts". (Its two
    characters are never followed by a byte the detokenizer may hold back, so the text before a
    token reads the same however deltas split.)"""
    ids = reference.token_ids
    for j in range(2, len(ids)):
        pair = ids[j - 2:j]
        if not all(32 <= t < 127 for t in pair) or any(
                ids[k:k + 2] == pair and k + 2 < len(ids) and 128 <= ids[k + 2] < 256 for k in range(len(ids))):
            continue
        for t, _ in reference.logprobs[j].top:
            piece = tok.token_text(pair[0]) + tok.token_text(pair[1]) + tok.token_text(t)
            if t != ids[j] and len(piece) == 3 and piece.isascii() and piece.isprintable() and piece not in reference.text:
                return piece
    pytest.fail("no alternative fits")


@pytest.fixture(scope="module")
def server(serve_apps, tiny_model, flagged, reference, classified, alternative):
    policy = {"rules": [{"name": "secret", "pattern": re.escape(flagged[1]), "applies_to": "output"},
                        {"name": "banned-prompt", "words": ["forbidden topic"], "applies_to": "input"}],
              "holdback_chars": WINDOW}
    with serve_apps.run(  # its own app: the module kills the classifier replica
        tiny_model, served_model_name="tiny", routing={"local_prefill_threshold": 16},
        guardrail_policies={"strict": policy, "early": {"rules": [  # the output's first two characters
            {"name": "first", "pattern": re.escape(reference.text[:2]), "applies_to": "output"}]},
            "cls-closed": {"classifier": {"timeout_s": CLASSIFIER_TIMEOUT_S}, "on_error": "closed"},
            "cls-open": {"classifier": {"timeout_s": CLASSIFIER_TIMEOUT_S, "applies_to": "input"}, "on_error": "open"},
            "cls-out": {"classifier": {"timeout_s": 5.0, "applies_to": "output"}, "on_error": "closed"},
            "cls-kill": {"classifier": {"timeout_s": KILL_TIMEOUT_S, "applies_to": "input"}, "on_error": "closed"},
            "cls-kill-open": {"classifier": {"timeout_s": KILL_TIMEOUT_S, "applies_to": "input"}, "on_error": "open"},
            "alts": {"rules": [{"name": "alt", "pattern": re.escape(alternative), "applies_to": "output"}],
                     "holdback_chars": WINDOW}},
        guardrail_classifier={"words": ["classified", classified[1]]}, fault_tolerance={"fault_injection": True},
        tenants={"guarded": {"api_keys": [KEYS["guarded"]], "guardrail_policy": "strict"},
                 "early": {"api_keys": [KEYS["early"]], "guardrail_policy": "early"},
                 "cls-closed": {"api_keys": [KEYS["cls-closed"]], "guardrail_policy": "cls-closed"},
                 "cls-open": {"api_keys": [KEYS["cls-open"]], "guardrail_policy": "cls-open"},
                 **{t: {"api_keys": [KEYS[t]], "guardrail_policy": t} for t in ("cls-out", "cls-kill", "cls-kill-open",
                                                                               "alts")},
                 "plain": {"api_keys": [KEYS["plain"]], "response_cache": True}},
    ) as cfg:
        yield cfg


@pytest.fixture(scope="module")
def stub(server):
    with grpc_stub(server) as stub:
        yield stub


def request(ids=PROMPT, max_tokens=MAX_TOKENS):
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def meta(tenant):
    return [("authorization", f"Bearer {KEYS[tenant]}")]


def check_released(text, tokens, reference, flagged):
    """What the client got is the reference's beginning, ending before the flagged piece."""
    start, piece = flagged
    assert piece not in text and len(text) <= start
    assert tokens == reference.token_ids[:len(tokens)] and text == reference.text[:len(text)]
    assert len(tokens) >= 1  # text before the flag, at least the window back from it, was delivered


def generated_tokens() -> int:
    return sum(load["generation_tokens"] for load in pool_loads().values())


def test_grpc_output_flag_delivers_no_flagged_text_and_frees_both_pools(stub, reference, flagged):
    responses = list(stub.Generate(request(), metadata=meta("guarded"), timeout=120))
    text = "".join(r.text for r in responses)
    tokens = [t for r in responses for t in r.token_ids]
    check_released(text, tokens, reference, flagged)
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_CONTENT_FILTER and not last.text and not last.token_ids
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    assert len(tokens) < last.usage.completion_tokens < MAX_TOKENS  # stopped at the source, held tokens unsent
    loads = wait_pools_whole()
    assert loads["decode"]["free_blocks"] == loads["prefill"]["free_blocks"] == 64


def test_a_flag_before_any_release_ends_the_stream_with_no_text(stub):
    responses = list(stub.Generate(request(), metadata=meta("early"), timeout=120))
    assert [(r.text, list(r.token_ids), r.finish_reason) for r in responses] == [
        ("", [], pb.FINISH_REASON_CONTENT_FILTER)]
    assert 1 <= responses[0].usage.completion_tokens < MAX_TOKENS
    wait_pools_whole()


def test_the_unguarded_tenant_gets_the_whole_output(stub, reference, flagged):
    responses = list(stub.Generate(request(), metadata=meta("plain"), timeout=120))
    assert "".join(r.text for r in responses) == reference.text and flagged[1] in reference.text
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    wait_pools_whole()


def openai_client(server, tenant):
    import openai

    return openai.OpenAI(base_url=f"{http_base(server)}/v1", api_key=KEYS[tenant], max_retries=0)


def test_http_streaming_ends_with_a_content_filter_chunk(server, reference, flagged):
    chunks = list(openai_client(server, "guarded").completions.create(
        model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks)
    assert flagged[1] not in text and text == reference.text[:len(text)] and len(text) <= flagged[0]
    assert chunks[-1].choices[0].finish_reason == "content_filter" and chunks[-1].choices[0].text == ""
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    wait_pools_whole()


def test_http_non_streaming_finishes_with_content_filter(server, reference, flagged):
    c = openai_client(server, "guarded").completions.create(
        model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    text = c.choices[0].text
    assert c.choices[0].finish_reason == "content_filter"
    assert flagged[1] not in text and text == reference.text[:len(text)] and len(text) <= flagged[0]
    assert c.usage.completion_tokens < MAX_TOKENS
    wait_pools_whole()


def test_a_flagged_prompt_is_refused_before_any_engine_work(stub, server):
    before = generated_tokens()
    prompt = pb.GenerateRequest(text="tell me about the Forbidden Topic", sampling=pb.SamplingParams(max_tokens=4))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(prompt, metadata=meta("guarded"), timeout=30))
    assert (e.value.code(), e.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "prompt: refused by guardrail policy 'strict', check 'banned-prompt'")
    req = urllib.request.Request(
        f"{http_base(server)}/v1/chat/completions", headers={
            "content-type": "application/json", "authorization": f"Bearer {KEYS['guarded']}"},
        data=json.dumps({"messages": [{"role": "user", "content": "the forbidden topic"}], "max_tokens": 4}).encode())
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(req, timeout=30)
    assert http.value.code == 400
    assert json.loads(http.value.read())["error"] == {
        "message": "messages: refused by guardrail policy 'strict', check 'banned-prompt'",
        "type": "invalid_request_error", "param": "messages", "code": "content_filter"}
    assert generated_tokens() == before
    wait_pools_whole()


def outcome(stub, tenant, req):
    """("OK", tokens) or (code, details) of one stream, and how long it took."""
    started = time.monotonic()
    try:
        tokens = [t for r in stub.Generate(req, metadata=meta(tenant), timeout=60) for t in r.token_ids]
        result = ("OK", tokens)
    except grpc.RpcError as e:
        result = (e.code().name, e.details())
    return result, time.monotonic() - started


def short(text=None):
    if text is not None:
        return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    return request(PROMPT, 6)


def test_the_classifier_deployment_flags_a_prompt_and_checks_the_output(stub, reference, classified):
    assert outcome(stub, "cls-closed", short("this is Classified material"))[0] == (
        "INVALID_ARGUMENT", "prompt: refused by guardrail policy 'cls-closed', check 'classifier'")
    assert outcome(stub, "cls-closed", short())[0] == ("OK", reference.token_ids[:6])  # noise passes
    # the output is classified on every release: the stream stops before the classified word goes out
    responses = list(stub.Generate(request(), metadata=meta("cls-out"), timeout=120))
    text = "".join(r.text for r in responses)
    tokens = [t for r in responses for t in r.token_ids]
    start, word = classified
    assert responses[-1].finish_reason == pb.FINISH_REASON_CONTENT_FILTER and not responses[-1].text
    assert len(text) <= start and text == reference.text[:len(text)] and tokens == reference.token_ids[:len(tokens)]
    assert len(tokens) < responses[-1].usage.completion_tokens < MAX_TOKENS  # stopped at the source
    wait_pools_whole()


def classifier():
    from ray import serve

    return serve.get_deployment_handle("guardrail-classifier", "pdserve")


FAILED_CLOSED = "prompt: refused by guardrail policy 'cls-closed', check 'classifier' (the check {}; policy fails closed)"


def test_a_stalled_classifier_fails_closed_or_open_within_its_timeout(stub, reference):
    """...and a check given up on is cancelled on the classifier: its calls do not sit out the
    stall holding the replica's slots."""
    classifier().stall.remote(10.0).result(timeout_s=30)
    (closed, took_closed), (opened, took_open) = (outcome(stub, "cls-closed", short()),
                                                  outcome(stub, "cls-open", short()))
    assert closed == ("INVALID_ARGUMENT", FAILED_CLOSED.format("timeout"))
    assert opened == ("OK", reference.token_ids[:6])  # passed, and the pass recorded as an intervention
    assert took_closed < CLASSIFIER_TIMEOUT_S + 2.0 and took_open < CLASSIFIER_TIMEOUT_S + 2.0
    wait_for(lambda: classifier().stalled.remote().result(timeout_s=10) == 0, "the given-up calls cancelled", 3.0)
    wait_pools_whole()


def test_a_classifier_killed_under_its_calls_fails_them_closed_or_open(stub):
    """Both tenants' prompt checks are in flight on the classifier's one replica (stalled there)
    when it is killed: each call fails at once with the replica's death (an error, long before
    their 30 s bound), closed refuses and open passes. It accepted OK for closed before (a call
    could reach a replacement). Open's prompt is one the classifier flags, so its pass is the
    failed check's: classified on a replacement it would be refused.

    "In flight" is the replica's own count of stalled calls, so it must start at 0: the stalled
    test's two timed-out calls are not cancelled on the replica (the ingress stops waiting, the
    call sleeps out its 4 s stall), and counted as these two they let the kill come before this
    test's calls were accepted; a call the dead replica never accepted is routed by Serve to the
    replacement, which is not stalled, and passes (OK for closed: the flake this precondition ends)."""
    import ray

    flaggable = short("this is Classified material")
    (unguarded, _), (replica,) = outcome(stub, "plain", flaggable), serve_replica_ids()["guardrail-classifier"]
    assert unguarded[0] == "OK" and len(unguarded[1]) == 4
    wait_for(lambda: classifier().stalled.remote().result(timeout_s=10) == 0, "no earlier call stalled", 30)
    classifier().stall.remote(120.0).result(timeout_s=30)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        closed = pool.submit(outcome, stub, "cls-kill", short())
        opened = pool.submit(outcome, stub, "cls-kill-open", flaggable)
        wait_for(lambda: classifier().stalled.remote().result(timeout_s=10) == 2, "both checks in flight", 30)
        ray.kill(ray.get_actor(f"SERVE_REPLICA::pdserve#guardrail-classifier#{replica}", namespace="serve"),
                 no_restart=True)
        (closed, took_closed), (opened, took_open) = closed.result(), opened.result()
    assert closed == ("INVALID_ARGUMENT", "prompt: refused by guardrail policy 'cls-kill', check 'classifier' "
                                          "(the check error; policy fails closed)")
    assert opened == unguarded  # passed unclassified, and the pass recorded as an intervention
    assert took_closed < KILL_TIMEOUT_S and took_open < KILL_TIMEOUT_S
    wait_for(lambda: len(serve_replica_ids().get("guardrail-classifier", [])) == 1, "a new classifier replica", 60)
    wait_pools_whole()


def test_logprob_alternatives_that_make_a_rule_match_are_left_out_on_both_edges(stub, server, alternative, tok):
    """Tenant "alts" lists a 3-character pattern the output never holds, made by two generated
    characters and an alternative of the next token: that alternative is left out of the next
    token's top, over gRPC (token ids) and OpenAI (token text); everything else is as the
    unguarded tenant gets it, the text whole."""
    def grpc_run(tenant):
        responses = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)), metadata=meta(tenant), timeout=120))
        return "".join(r.text for r in responses), [lp for r in responses for lp in r.logprobs], responses[-1]

    text, plain, _ = grpc_run("plain")
    guarded_text, guarded, last = grpc_run("alts")
    assert guarded_text == text and last.finish_reason == pb.FINISH_REASON_LENGTH
    before = contexts(tok, [lp.token_id for lp in plain])
    expected = [{t.token_id for t in lp.top if t.token_id == lp.token_id
                 or alternative not in before[i][-2:] + tok.token_text(t.token_id)} for i, lp in enumerate(plain)]
    left_out = sum(len(lp.top) for lp in plain) - sum(map(len, expected))
    assert left_out >= 1 and [{t.token_id for t in lp.top} for lp in guarded] == expected
    assert [lp.token_id for lp in guarded] == [lp.token_id for lp in plain]

    def openai_run(tenant):
        c = openai_client(server, tenant).completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                             temperature=0, logprobs=TOP, extra_body={"ignore_eos": True})
        return c.choices[0].text, c.choices[0].logprobs.top_logprobs

    http_text, http_plain = openai_run("plain")
    http_guarded_text, http_guarded = openai_run("alts")
    assert http_text == http_guarded_text == text
    # the sampled token's text is a key too (OpenAI's completions shape); only alternatives are left out
    sampled = [tok.token_text(lp.token_id) for lp in plain]
    assert [set(top) for top in http_guarded] == [
        {k for k in top if k == sampled[i] or alternative not in before[i][-2:] + k} for i, top in enumerate(http_plain)]
    assert sum(map(len, http_plain)) - sum(map(len, http_guarded)) == left_out
    wait_pools_whole()


def test_a_repeated_greedy_request_is_served_from_the_cache(stub, reference):
    ids = [256] + list(range(50, 80))
    first_before = generated_tokens()
    first = list(stub.Generate(request(ids, 12), metadata=meta("plain"), timeout=60))
    after_first = generated_tokens()
    second = list(stub.Generate(request(ids, 12), metadata=meta("plain"), timeout=60))
    assert generated_tokens() == after_first == first_before + 12  # the engines saw the first request only
    assert [t for r in second for t in r.token_ids] == [t for r in first for t in r.token_ids]
    assert "".join(r.text for r in second) == "".join(r.text for r in first)
    assert [len(r.token_ids) for r in second] == [len(r.token_ids) for r in first]  # the same stream shape
    assert (first[-1].usage.response_cache_hit, second[-1].usage.response_cache_hit) == (False, True)
    assert (second[-1].usage.prompt_tokens, second[-1].usage.cached_prompt_tokens,
            second[-1].usage.completion_tokens, second[-1].finish_reason) == (31, 31, 12, pb.FINISH_REASON_LENGTH)
    hot = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=12, temperature=0.7, seed=1, ignore_eos=True)), metadata=meta("plain"), timeout=60))
    assert not hot[-1].usage.response_cache_hit and generated_tokens() == after_first + 12  # not temperature 0
    wait_pools_whole()


def test_an_http_request_equal_to_a_cached_one_is_a_marked_hit(stub, server):
    """Cached by a gRPC request of its own (a prompt no other test sends), then asked over HTTP:
    the cache is the ingress's, shared by both edges. Runs alone or in any order."""
    ids = [256] + list(range(90, 120))
    before = generated_tokens()
    cached = list(stub.Generate(request(ids, 12), metadata=meta("plain"), timeout=60))
    assert cached[-1].usage.response_cache_hit is False and generated_tokens() == before + 12
    c = openai_client(server, "plain").completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0,
                                                          extra_body={"ignore_eos": True})
    assert c.usage.model_extra["pdserve_response_cache_hit"] is True
    assert (c.usage.prompt_tokens, c.usage.prompt_tokens_details.cached_tokens, c.usage.completion_tokens) == (31, 31, 12)
    assert c.choices[0].finish_reason == "length" and generated_tokens() == before + 12
    assert c.choices[0].text == "".join(r.text for r in cached)
