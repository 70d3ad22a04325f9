"""Penalties, logit_bias and logprobs through the real app in disaggregated mode, with the official
`openai` client: every request is prefilled remotely (local_prefill_threshold 0), so the first
token is sampled on the prefill replica and the rest on decode. Tokens equal the engine-level
reference over transformers' logits (tests/engine/test_logits_processing.py); logprobs equal
transformers' log_softmax within 1e-4, the first token's included."""

import grpc
import openai
import pytest
import torch

from cluster.config import AppConfig
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.tokenizer import Tokenizer
from protos.pdserve.v1 import generation_pb2 as pb
from router.ingress.flow.request_flow import RequestFlow
from tests.engine.test_logits_processing import PROMPT, reference_greedy
from tests.helpers import grpc_stub, http_base, pool_loads, wait_pools_whole
from tests.reference import hf_last_logits, hf_prompt_logprobs

N = 12
PENALISED = dict(presence_penalty=0.3, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={65: -100.0, 223: 1.5})
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server(serve_apps, tiny_model):
    with serve_apps.run(tiny_model, served_model_name="tiny", routing={"local_prefill_threshold": 0}) as cfg:
        yield cfg


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{http_base(server)}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(tiny_model):
    return Tokenizer(tiny_model)


def reference_logprobs(model: str, prompt: list[int], tokens: list[int], k: int):
    """Per token: (its logprob, the top k (id, logprob)) under transformers' raw distribution."""
    out = []
    for i, t in enumerate(tokens):
        lp = torch.log_softmax(hf_last_logits(model, prompt + tokens[:i]), dim=-1)
        top = lp.topk(k)
        out.append((float(lp[t]), list(zip(top.indices.tolist(), top.values.tolist()))))
    return out


def test_penalties_and_logit_bias_change_the_output_as_the_reference_does(server, client, tiny_model, tok):
    pulls = pool_loads()["decode"]["transfer"]["pulls_ok"]
    sp = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, **PENALISED)
    expected = reference_greedy(tiny_model, PROMPT, sp, N)
    plain = reference_greedy(tiny_model, PROMPT, SamplingParams(max_tokens=N, temperature=0), N)
    assert expected[0] != plain[0]  # the bias changes the first token: the one prefill samples

    got = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=N, temperature=0, presence_penalty=0.3, frequency_penalty=0.4,
        logit_bias={"65": -100, "223": 1.5}, extra_body={"repetition_penalty": 1.3, "ignore_eos": True})
    assert got.choices[0].text == tok.decode(expected) != tok.decode(plain)
    assert (got.usage.completion_tokens, got.choices[0].finish_reason) == (N, "length")

    with grpc_stub(server) as stub:
        responses = list(stub.Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(
                max_tokens=N, temperature=0, ignore_eos=True, presence_penalty=0.3, frequency_penalty=0.4,
                repetition_penalty=1.3, logit_bias={65: -100.0, 223: 1.5})), timeout=60))
    assert [t for r in responses for t in r.token_ids] == expected  # float32 on the wire: same tokens
    assert pool_loads()["decode"]["transfer"]["pulls_ok"] >= pulls + 2  # both prefilled remotely
    wait_pools_whole()


@pytest.mark.parametrize("stream", [False, True])
def test_completions_logprobs_equal_transformers(client, tiny_model, tok, stream):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=N, temperature=0, logprobs=5, extra_body={"ignore_eos": True})
    if stream:
        lps = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for chunk in client.completions.create(stream=True, **kw):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                for key in lps:
                    lps[key] += getattr(chunk.choices[0].logprobs, key)
    else:
        lp = client.completions.create(**kw).choices[0].logprobs
        lps = {key: getattr(lp, key) for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    tokens = reference_greedy(tiny_model, PROMPT, SamplingParams(max_tokens=N, temperature=0), N)
    ref = reference_logprobs(tiny_model, PROMPT, tokens, 5)
    assert lps["tokens"] == [tok.token_text(t) for t in tokens]
    texts = [tok.token_text(t) for t in tokens]
    assert lps["text_offset"] == [sum(len(x) for x in texts[:i]) for i in range(N)]
    for i, ((lp, top), got_lp, got_top) in enumerate(zip(ref, lps["token_logprobs"], lps["top_logprobs"])):
        assert abs(got_lp - lp) < 1e-4, i
        want = {tok.token_text(t): v for t, v in top}  # the top 5 and the sampled token, keyed by text
        want.setdefault(tok.token_text(tokens[i]), lp)
        assert set(got_top) == set(want), i
        assert max(abs(got_top[key] - want[key]) for key in want) < 1e-4, i
    wait_pools_whole()


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_and_its_logprobs_before_the_completion(client, tiny_model, tok, stream):
    """echo with logprobs: the prompt's text, then the completion's; the prompt's logprobs (computed
    by prefill: the first is null) equal transformers' within 1e-4, then the completion's."""
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=N, temperature=0, logprobs=2, echo=True,
              extra_body={"ignore_eos": True})
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    if stream:
        text, lps = "", {key: [] for key in keys}
        for chunk in client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                text += c.text
                for key in keys:
                    lps[key] += getattr(c.logprobs, key) if c.logprobs is not None else []
    else:
        choice = client.completions.create(**kw).choices[0]
        text, lps = choice.text, {key: getattr(choice.logprobs, key) for key in keys}
    tokens = reference_greedy(tiny_model, PROMPT, SamplingParams(max_tokens=N, temperature=0), N)
    assert text == tok.decode(PROMPT) + tok.decode(tokens)
    every = PROMPT + tokens
    texts = [tok.token_text(t) for t in every]
    assert lps["tokens"] == texts
    assert lps["text_offset"] == [sum(len(x) for x in texts[:i]) for i in range(len(every))]
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    ref = hf_prompt_logprobs(tiny_model, PROMPT, 2)[1:] + reference_logprobs(tiny_model, PROMPT, tokens, 2)
    for i, ((lp, top), got_lp, got_top) in enumerate(zip(ref, lps["token_logprobs"][1:], lps["top_logprobs"][1:])):
        assert abs(got_lp - lp) < 1e-4, i
        want = {tok.token_text(t): v for t, v in top}
        want.setdefault(texts[i + 1], lp)
        assert set(got_top) == set(want), i
        assert max(abs(got_top[key] - want[key]) for key in want) < 1e-4, i
    wait_pools_whole()


def test_echo_without_logprobs_returns_the_prompt_string_as_given(client, tiny_model, tok):
    tokens = reference_greedy(tiny_model, tok.encode("Hello there"), SamplingParams(max_tokens=N, temperature=0), N)
    got = client.completions.create(model="tiny", prompt="Hello there", max_tokens=N, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == "Hello there" + tok.decode(tokens) and got.choices[0].logprobs is None
    assert got.usage.completion_tokens == N


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_equal_transformers(client, server, tiny_model, tok, stream):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=N, temperature=0, logprobs=True, top_logprobs=3,
              extra_body={"ignore_eos": True})
    if stream:
        content = []
        for chunk in client.chat.completions.create(stream=True, **kw):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                content += chunk.choices[0].logprobs.content
    else:
        content = client.chat.completions.create(**kw).choices[0].logprobs.content
    prompt = RequestFlow(AppConfig(model=tiny_model), None, None).chat_ids(MESSAGES)
    tokens = reference_greedy(tiny_model, prompt, SamplingParams(max_tokens=N, temperature=0), N)
    ref = reference_logprobs(tiny_model, prompt, tokens, 3)
    assert [(c.token, c.bytes) for c in content] == [(tok.token_text(t), list(tok.token_bytes(t))) for t in tokens]
    for i, (c, (lp, top)) in enumerate(zip(content, ref)):
        assert abs(c.logprob - lp) < 1e-4, i
        assert [(e.token, e.bytes) for e in c.top_logprobs] == [(tok.token_text(t), list(tok.token_bytes(t)))
                                                              for t, _ in top], i
        assert max(abs(e.logprob - v) for e, (_, v) in zip(c.top_logprobs, top)) < 1e-4, i
    wait_pools_whole()


@pytest.mark.parametrize("path_kw, param", [
    (dict(prompt=PROMPT, logit_bias={str(i): 1 for i in range(10_000)}), "logit_bias"),
    (dict(prompt=PROMPT, logit_bias={"5": 1000}), "logit_bias"),
    (dict(prompt=PROMPT, logit_bias={"five": 1}), "logit_bias"),
    (dict(prompt=PROMPT, presence_penalty=3), "presence_penalty"),
    (dict(messages=MESSAGES, logprobs=True, top_logprobs=21), "top_logprobs"),
])
def test_bad_values_are_400_naming_the_field(client, path_kw, param):
    create = client.chat.completions.create if "messages" in path_kw else client.completions.create
    with pytest.raises(openai.BadRequestError) as e:
        create(model="tiny", max_tokens=2, **path_kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param


def test_a_bad_value_over_grpc_is_invalid_argument(server):
    with grpc_stub(server) as stub:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(logprobs=21)), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "logprobs: asks for 21 top logprobs; at most 20 are accepted"


def test_grpc_prompt_logprobs_equal_transformers_and_come_once(server, tiny_model):
    with grpc_stub(server) as stub:
        replies = list(stub.Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(
                max_tokens=N, temperature=0, ignore_eos=True, prompt_logprobs=3)), timeout=60))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(prompt_logprobs=21)), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "prompt_logprobs: asks for 21 top logprobs; at most 20 are accepted"
    assert [len(r.prompt_logprobs) for r in replies] == [len(PROMPT) - 1] + [0] * (len(replies) - 1)
    ref = hf_prompt_logprobs(tiny_model, PROMPT, 3)[1:]
    for i, (got, (lp, top)) in enumerate(zip(replies[0].prompt_logprobs, ref)):
        assert got.token_id == PROMPT[i + 1] and abs(got.logprob - lp) < 1e-4, i
        assert [t.token_id for t in got.top] == [t for t, _ in top], i
        assert max(abs(t.logprob - v) for t, (_, v) in zip(got.top, top)) < 1e-4, i
    wait_pools_whole()


def test_n_choices_greedy_equal_the_reference_and_usage_bills_the_prompt_once(client, tiny_model, tok):
    expected = tok.decode(reference_greedy(tiny_model, PROMPT, SamplingParams(max_tokens=N, temperature=0), N))
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, temperature=0, n=3,
                                    extra_body={"ignore_eos": True})
    assert [(c.index, c.text, c.finish_reason) for c in got.choices] == [(i, expected, "length") for i in range(3)]
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (
        len(PROMPT), 3 * N, len(PROMPT) + 3 * N)
    wait_pools_whole()


def test_n_4_computes_and_pulls_the_prompt_once_and_shares_its_full_blocks(client, tiny_model, tok):
    """Choices 1-3 start once choice 0 has its second token: prefill finds the prompt's 2 full
    blocks cached and computes only its last 8 tokens for each; decode finds them cached (choice
    0's pull) and pulls only the partial third block for each."""
    prompt = [256] + [(5 * k + 11) % 256 for k in range(39)]  # 40 tokens: 2 full blocks of 16 and 8
    expected = tok.decode(reference_greedy(tiny_model, prompt, SamplingParams(max_tokens=N, temperature=0), N))
    before = wait_pools_whole()
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=N, temperature=0, n=4,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in got.choices] == [expected] * 4
    after = wait_pools_whole()

    def delta(pool: str, *keys: str) -> int:
        a, b = after[pool], before[pool]
        for k in keys:
            a, b = a[k], b[k]
        return a - b
    assert delta("prefill", "cached_prompt_tokens") == 3 * 32
    assert delta("prefill", "tokens_computed") == 40 + 3 * 8
    assert delta("decode", "transfer", "pulls_ok") == 4
    assert delta("decode", "transfer", "blocks_pulled") == 3 + 3 * 1
    assert delta("decode", "transfer", "blocks_reused") == 3 * 2


@pytest.mark.parametrize("stream", [False, True])
def test_n_sampled_choices_are_requests_with_seed_plus_index(client, stream):
    """Choice i of a seeded request is the request with seed + i: reproducible, and not n copies."""
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=N, temperature=1.0, extra_body={"ignore_eos": True})
    singles = [client.chat.completions.create(seed=40 + i, **kw).choices[0].message.content for i in range(3)]
    assert len(set(singles)) > 1
    if not stream:
        got = client.chat.completions.create(seed=40, n=3, **kw)
        assert [c.message.content for c in got.choices] == singles
        assert got.usage.completion_tokens == 3 * N
    else:
        texts, roles, finishes, usage = ["", "", ""], [0, 0, 0], [None] * 3, None
        for chunk in client.chat.completions.create(seed=40, n=3, stream=True, stream_options={"include_usage": True},
                                                    **kw):
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                roles[c.index] += c.delta.role == "assistant"
                finishes[c.index] = c.finish_reason or finishes[c.index]
        assert texts == singles
        assert roles == [1, 1, 1] and finishes == ["length"] * 3
        assert usage.completion_tokens == 3 * N
    wait_pools_whole()


@pytest.mark.parametrize("n", [0, 9])
def test_n_outside_its_limit_is_400_naming_it(client, n):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=n)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"
    assert e.value.body["message"] == f"n: must be in [1, 8] (max_choices), got {n}"


def grpc_choices(server, n: int, **sampling) -> tuple[set[str], list[list[int]], list[str], list[tuple]]:
    """Over real gRPC: the replies' request ids, each choice's tokens and text, and each choice's
    last response (index, finish reason, completion tokens)."""
    with grpc_stub(server) as stub:
        responses = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), n=n, sampling=pb.SamplingParams(
            max_tokens=N, ignore_eos=True, **sampling)), timeout=60))
    tokens, texts, ends = [[] for _ in range(n)], [""] * n, []
    for r in responses:
        tokens[r.index] += r.token_ids
        texts[r.index] += r.text
        if r.finish_reason:
            ends.append((r.index, r.finish_reason, r.usage.completion_tokens))
    return {r.request_id for r in responses}, tokens, texts, sorted(ends)


def test_n_over_grpc_greedy_equals_the_reference_and_seeded_equals_http(server, client, tiny_model):
    """GenerateRequest.n: greedy, every choice is the reference; sampled with a seed, choice i is
    the HTTP request with seed + i."""
    expected = reference_greedy(tiny_model, PROMPT, SamplingParams(max_tokens=N, temperature=0), N)
    ids, tokens, _, ends = grpc_choices(server, 3, temperature=0)
    assert tokens == [expected] * 3 and len(ids) == 1
    assert ends == [(i, pb.FINISH_REASON_LENGTH, N) for i in range(3)]

    singles = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, temperature=1.0, seed=40 + i,
                                         extra_body={"ignore_eos": True}).choices[0].text for i in range(3)]
    assert len(set(singles)) > 1
    _, _, texts, _ = grpc_choices(server, 3, temperature=1.0, seed=40)
    assert texts == singles
    wait_pools_whole()


@pytest.mark.parametrize("n", [0, 9])
def test_n_outside_its_limit_over_grpc_is_invalid_argument_naming_it(server, n):
    with grpc_stub(server) as stub:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), n=n), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == f"n: must be in [1, 8] (max_choices), got {n}"
