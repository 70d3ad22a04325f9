"""response_format in the engine: JSON outputs of a real model (SmolLM2-135M-Instruct) validated
with jsonschema, the grammar state rebuilt from the tokens already generated, one request's broken
grammar state failing it alone, and the caps on schemas naming response_format."""

import json

import jsonschema
import pytest

from cluster.engine.chat_template import render_chat
from cluster.engine.config import EngineOptions
from cluster.engine.grammar import ResponseFormat
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.validation import RequestValidator
from cluster.errors import InvalidRequestError

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
TAGS = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                  "maxItems": 3}},
        "required": ["ok", "tags"], "additionalProperties": False}
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["color", "n"], "additionalProperties": False}
SCHEMAS = {"person": PERSON, "tags": TAGS, "color": COLOR}
ASK = {"person": "Describe a famous scientist as JSON with name and age.",
       "tags": "Answer as JSON: is the sky blue? Add a few tags.",
       "color": "Pick a color and a digit, as JSON."}


def fmt(v: RequestValidator, schema: dict, strict: bool = True) -> ResponseFormat:
    return v.response_format("json_schema", schema, strict)


def chat_ids(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(render_chat(engine.tokenizer, [{"role": "user", "content": text}]),
                                   add_special_tokens=False)


@pytest.fixture(scope="module")
def engine(smollm2):
    return LLMEngine.from_model(smollm2, num_blocks=64, max_model_len=1024)


def test_json_schema_outputs_validate_for_several_schemas(engine):
    names = list(SCHEMAS)
    sps = [SamplingParams(max_tokens=48, temperature=0, response_format=fmt(engine.validator, SCHEMAS[n]))
           for n in names]
    # One batch: grammar rows of three schemas, plus a plain greedy row that must be untouched.
    plain = SamplingParams(max_tokens=8, temperature=0)
    outs = engine.generate([chat_ids(engine, ASK[n]) for n in names] + [chat_ids(engine, ASK["person"])],
                           sps + [plain])
    for n, out in zip(names, outs):
        assert out.finish_reason == "stop", (n, engine.tokenizer.decode(out.token_ids))
        assert out.token_ids[-1] in engine.eos_token_ids  # EOS only once the JSON is complete
        jsonschema.validate(json.loads(engine.tokenizer.decode(out.token_ids)), SCHEMAS[n])
    alone = engine.generate([chat_ids(engine, ASK["person"])], plain)[0]
    assert outs[-1].token_ids == alone.token_ids
    assert len(engine.runner.sampler.grammars) == 0  # matchers released with their requests


def test_json_object_and_seeded_sampling(engine):
    obj = ResponseFormat("json_object")
    outs = engine.generate([chat_ids(engine, "Give me a JSON object describing a cat.")] * 2,
                           [SamplingParams(max_tokens=64, temperature=0, response_format=obj),
                            SamplingParams(max_tokens=64, temperature=0.8, seed=7,
                                           response_format=fmt(engine.validator, COLOR))])
    text = engine.tokenizer.decode(outs[0].token_ids)
    if outs[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # a free-form object may outgrow max_tokens: then it is a prefix of one, compact
        assert outs[0].finish_reason == "length" and text.startswith("{")
    assert outs[1].finish_reason == "stop"
    jsonschema.validate(json.loads(engine.tokenizer.decode(outs[1].token_ids)), COLOR)


def test_a_resumed_request_replays_its_tokens_into_the_grammar(engine):
    """What decode does after prefill's first token and a migrated leg after the tokens already
    sent: the matcher is rebuilt from the request's output, and the rest equals the whole run."""
    sp = SamplingParams(max_tokens=48, temperature=0, response_format=fmt(engine.validator, PERSON))
    prompt = chat_ids(engine, ASK["person"])
    whole = engine.generate([prompt], sp)[0].token_ids
    for k in (1, 5):
        req = engine.make_request(f"resume-{k}", prompt_token_ids=prompt, sampling=sp)
        engine.add_after_tokens(req, whole[:k])
        rest = []
        while engine.has_unfinished():
            rest += [t for o in engine.step() for t in o.token_ids]
        assert whole[:k] + rest == whole, k


def test_tokens_the_grammar_refuses_fail_that_request_alone(engine):
    sp = SamplingParams(max_tokens=16, temperature=0, response_format=fmt(engine.validator, COLOR))
    prompt = chat_ids(engine, ASK["color"])
    bad = engine.make_request("bad", prompt_token_ids=prompt, sampling=sp)
    engine.add_after_tokens(bad, engine.tokenizer.encode("hello", add_special_tokens=False))  # not JSON
    good = engine.make_request("good", prompt_token_ids=prompt, sampling=sp)
    engine.add(good)
    finals, good_tokens = {}, []
    while engine.has_unfinished():
        for o in engine.step():
            good_tokens += o.token_ids if o.request_id == "good" else []
            finals |= {o.request_id: o} if o.finished else {}
    assert finals["bad"].finish_reason == "error"
    assert "do not follow response_format" in finals["bad"].error
    assert finals["good"].finish_reason == "stop"
    assert good_tokens == engine.generate([prompt], sp)[0].token_ids  # as if "bad" were not there
    jsonschema.validate(json.loads(engine.tokenizer.decode(good_tokens)), COLOR)
    engine.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def nested(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth - 1):
        s = {"type": "array", "items": s}
    return s


def test_without_strict_unimplemented_keywords_are_ignored(tiny_model):
    v = RequestValidator.for_model(tiny_model, [EngineOptions()])
    v.check_sampling(SamplingParams(response_format=v.response_format(
        "json_schema", {"type": "array", "uniqueItems": True}, False)))


@pytest.mark.parametrize("kind,schema,strict,says", [
    ("json_schema", {"type": "strin"}, False, "the JSON schema does not compile: Invalid type: strin"),
    ("json_schema", {"type": "strin"}, True, "the JSON schema does not compile: Invalid type: strin"),
    ("json_schema", {"type": "array", "uniqueItems": True}, True,
     'strict: the JSON schema cannot be enforced: Unimplemented keys: ["uniqueItems"]'),
    ("json_schema", {"type": "string", "pattern": "("}, False, "does not compile"),
    ("json_schema", {"properties": {"a": {"$ref": "#/nope"}}}, False, "does not compile"),
    ("json_schema", [1], False, "must be a JSON object"),
    ("json_schema", {"enum": ["x" * 100] * 400}, False, "at most 32768 are accepted"),
    ("json_schema", nested(40), False, "nests 40 deep; at most 16"),
    ("xml", None, False, "must be text, json_object or json_schema"),
])
def test_bad_schemas_are_refused_naming_response_format(tiny_model, kind, schema, strict, says):
    v = RequestValidator.for_model(tiny_model, [EngineOptions()])
    with pytest.raises(InvalidRequestError) as e:
        f = v.response_format(kind, schema, strict)
        v.check_sampling(SamplingParams(response_format=f))
    assert e.value.field == "response_format"
    assert says in str(e.value)
