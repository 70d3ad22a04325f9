"""response_format across prefill and decode over real NIXL (two OS processes, SmolLM2-135M):
the first token, sampled by prefill, obeys the grammar; decode rebuilds the grammar state by
replaying it, and a migrated leg (the tokens already sent, no handle) by replaying those; every
output equals the colocated engine's and validates against its schema (jsonschema)."""

import json

import jsonschema
import pytest

from cluster.engine.grammar import ResponseFormat
from cluster.engine.sampling_params import SamplingParams
from cluster.tools.local_peer import PrefillProcess
from tests.engine.test_structured_output import ASK, COLOR, PERSON, TAGS, chat_ids
from tests.kv_transfer.test_kv_transfer import assert_pools_whole, make_decode

KW = {"num_blocks": 64, "max_model_len": 1024}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("peers-grammar")


@pytest.fixture(scope="module")
def prefill(smollm2, store):
    proc = PrefillProcess(smollm2, store, "prefill-grammar", **KW)
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def decode(smollm2, store):
    d = make_decode(smollm2, store, "decode-grammar", timeout=20.0, **KW)  # two shared cores, a 135M model (lease 30 s)
    yield d
    d.transport.close()


def drain(decode) -> tuple[dict[str, list[int]], dict]:
    tokens, finals = {}, {}
    while decode.has_unfinished():
        for out in decode.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                finals[out.request_id] = out
    return tokens, finals


def test_prefill_first_token_and_decode_follow_the_grammar(prefill, decode):
    eng = decode.engine
    v = eng.validator
    cases = {"person": (PERSON, v.response_format("json_schema", PERSON, True)),
             "tags": (TAGS, v.response_format("json_schema", TAGS, True)),
             "object": (None, ResponseFormat("json_object"))}
    sps, prompts, firsts, tokens, finals = {}, {}, {}, {}, {}
    for name, (_, fmt) in cases.items():
        sps[name] = SamplingParams(max_tokens=48, temperature=0, response_format=fmt)
        prompts[name] = chat_ids(eng, ASK.get(name, "Give me a JSON object describing a cat."))
        res = prefill.prefill(name, prompts[name], sps[name])
        firsts[name] = res.handle.first_token
        decode.submit(name, prompts[name], sps[name], res.handle)
        got, fin = drain(decode)
        tokens |= got
        finals |= fin
    colocated = eng.generate([prompts[n] for n in cases], [sps[n] for n in cases])
    for (name, (schema, _)), ref in zip(cases.items(), colocated):
        got = [firsts[name]] + tokens[name]
        assert got == ref.token_ids, name
        text = eng.tokenizer.decode(got)
        assert eng.tokenizer.decode([firsts[name]]).startswith("{")  # prefill's token obeys the grammar
        if schema is not None:
            assert finals[name].finish_reason == "stop"
            jsonschema.validate(json.loads(text), schema)
    assert decode.transport.stats.pulls_ok == len(cases)
    assert_pools_whole(prefill, decode)


def test_a_migrated_leg_continues_the_grammar(prefill, decode):
    eng = decode.engine
    sp = SamplingParams(max_tokens=48, temperature=0, response_format=eng.validator.response_format(
        "json_schema", COLOR, True))
    prompt = chat_ids(eng, ASK["color"])
    res = prefill.prefill("mig", prompt, sp)
    decode.submit("mig", prompt, sp, res.handle)
    tokens, _ = drain(decode)
    whole = [res.handle.first_token] + tokens["mig"]
    jsonschema.validate(json.loads(eng.tokenizer.decode(whole)), COLOR)
    for k in (1, 4):  # the decode replica died after k tokens: another gets them as `generated`
        decode.submit(f"mig.{k}", prompt, sp, None, generated=whole[:k])
        rest, finals = drain(decode)
        assert whole[:k] + rest[f"mig.{k}"] == whole
        assert finals[f"mig.{k}"].finish_reason == "stop"
    assert_pools_whole(prefill, decode)
