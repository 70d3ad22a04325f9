"""Caps on one request's input, checked before any per-item work; each refusal names the field and
the cap. One past each cap is refused, exactly at it is accepted."""

import pytest

from cluster.config import AppConfig
from cluster.engine.config import EngineConfig, RequestLimits
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from cluster.errors import InvalidRequestError

SP = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def engine(tiny_model):
    # Default limits; a 256-token context, so the text prompt cap is 8 x 256 = 2048 characters.
    return LLMEngine.from_model(tiny_model, num_blocks=40, max_model_len=256)


@pytest.fixture(scope="module")
def small(tiny_model):
    limits = {"max_request_id_len": 8, "max_stop_strings": 2, "max_stop_string_len": 5, "max_stop_token_ids": 3,
              "max_prompt_chars": 100}
    return LLMEngine.from_model(tiny_model, num_blocks=40, max_model_len=256, limits=limits)


def refusal(engine, *args, **kwargs) -> tuple[str, str]:
    with pytest.raises(InvalidRequestError) as e:
        engine.make_request(*args, **kwargs)
    return e.value.field, e.value.message


@pytest.fixture
def tokenizer_calls(engine, monkeypatch):
    """Every text the engine's tokenizer is asked to encode (wrapped from outside)."""
    calls = []
    encode = engine.tokenizer.encode

    def spy(text, *args, **kwargs):
        calls.append(len(text))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", spy)
    return calls


def test_defaults():
    assert RequestLimits().model_dump() == {
        "max_request_id_len": 128, "max_stop_strings": 16, "max_stop_string_len": 256, "max_stop_token_ids": 64,
        "max_logit_bias": 300, "max_logprobs": 20, "max_schema_bytes": 32768, "max_schema_depth": 16,
        "max_prompt_chars": None}
    assert RequestLimits().prompt_chars(256) == 2048
    assert RequestLimits(max_prompt_chars=10).prompt_chars(256) == 10


def test_the_app_config_carries_limits_to_each_engine():
    app = AppConfig.model_validate({"engine": {"limits": {"max_stop_strings": 4}}})
    assert EngineConfig(model="m", **app.engine_for("decode").model_dump()).limits.max_stop_strings == 4
    assert AppConfig().engine.limits == RequestLimits()


# ---- request_id ------------------------------------------------------------------------------

def test_request_id_length(engine, small):
    assert engine.make_request("r" * 128, "hi", sampling=SP).request_id == "r" * 128
    assert refusal(engine, "r" * 129, "hi", sampling=SP) == ("request_id", "has 129 characters; at most 128 are accepted")
    small.make_request("r" * 8, "hi", sampling=SP)
    assert refusal(small, "r" * 9, "hi", sampling=SP) == ("request_id", "has 9 characters; at most 8 are accepted")


@pytest.mark.parametrize("rid", ["a b", "a\tb", "a\nb", "caf\u00e9", "nul\x00", "\x7f", "\u200b", "\ud800"])
def test_request_id_charset_is_printable_ascii_without_whitespace(engine, rid):
    assert refusal(engine, rid, "hi", sampling=SP) == ("request_id", "must be printable ASCII without whitespace")


def test_request_id_every_printable_ascii_character_is_accepted(engine):
    engine.make_request("".join(map(chr, range(0x21, 0x7F))), "hi", sampling=SP)


# ---- stop strings and stop token ids ---------------------------------------------------------

def test_stop_string_count(engine):
    engine.make_request("r", "hi", sampling=SamplingParams(stop=tuple(f"s{i}" for i in range(16))))
    assert refusal(engine, "r", "hi", sampling=SamplingParams(stop=tuple(f"s{i}" for i in range(17)))) == (
        "stop", "has 17 stop strings; at most 16 are accepted")


def test_stop_string_length(engine, small):
    engine.make_request("r", "hi", sampling=SamplingParams(stop=("x", "y" * 256)))
    assert refusal(engine, "r", "hi", sampling=SamplingParams(stop=("x", "y" * 257))) == (
        "stop", "a stop string has 257 characters; at most 256 are accepted")
    small.make_request("r", "hi", sampling=SamplingParams(stop=("abcde", "f")))
    assert refusal(small, "r", "hi", sampling=SamplingParams(stop=("abcde", "f", "g"))) == (
        "stop", "has 3 stop strings; at most 2 are accepted")
    assert refusal(small, "r", "hi", sampling=SamplingParams(stop=("abcdef",))) == (
        "stop", "a stop string has 6 characters; at most 5 are accepted")


def test_stop_token_id_count_is_checked_before_each_id(engine):
    engine.make_request("r", "hi", sampling=SamplingParams(stop_token_ids=tuple(range(64))))
    assert refusal(engine, "r", "hi", sampling=SamplingParams(stop_token_ids=tuple(range(65)))) == (
        "stop_token_ids", "has 65 token ids; at most 64 are accepted")
    # Out of the vocabulary too, but the count is what is refused: it is checked first.
    assert refusal(engine, "r", "hi", sampling=SamplingParams(stop_token_ids=(10**9,) * 10**5)) == (
        "stop_token_ids", "has 100000 token ids; at most 64 are accepted")


def test_stop_string_with_a_lone_surrogate(engine):
    assert refusal(engine, "r", "hi", sampling=SamplingParams(stop=("ok", "x\udfff"))) == (
        "stop", "is not valid Unicode: a lone surrogate '\\udfff' at index 1")


# ---- prompts ---------------------------------------------------------------------------------

def test_prompt_characters(small):
    assert small.make_request("r", "a" * 100, sampling=SP).num_prompt_tokens == 101  # BOS + 100 bytes
    assert refusal(small, "r", "a" * 101, sampling=SP) == ("prompt", "has 101 characters; at most 100 are accepted")


def test_prompt_characters_default_is_8_per_token_of_the_context(engine, tokenizer_calls):
    # At the cap the tokenizer runs (and the tokens are too many); one past it, it never does.
    assert refusal(engine, "r", "a" * 2048, sampling=SP) == (
        "prompt", "has 2049 tokens; the context length is 256, so at most 255 fit")
    assert tokenizer_calls == [2048]
    assert refusal(engine, "r", "a" * 2049, sampling=SP) == ("prompt", "has 2049 characters; at most 2048 are accepted")
    assert tokenizer_calls == [2048]


def test_a_10_mb_prompt_is_refused_without_tokenizing(engine, tokenizer_calls):
    assert refusal(engine, "r", "x" * 10_000_000, sampling=SP) == (
        "prompt", "has 10000000 characters; at most 2048 are accepted")
    assert tokenizer_calls == []


def test_token_id_count_is_checked_before_each_id(engine):
    at_limit = [1] * 255
    assert engine.make_request("r", None, at_limit, SamplingParams(max_tokens=1)).num_prompt_tokens == 255
    # The first id is not even an int, but a million ids are refused on their count alone.
    assert refusal(engine, "r", None, ["x"] + [1] * 10**6, SP) == (
        "prompt", "has 1000001 tokens; the context length is 256, so at most 255 fit")


@pytest.mark.parametrize("ids", ["abc", b"abc", 5, {1: 2}])
def test_token_ids_must_be_a_list(engine, ids):
    assert refusal(engine, "r", None, ids, SP) == ("prompt_token_ids", "must be a list of token ids")


@pytest.mark.parametrize("prompt, index", [("\ud800", 0), ("hi \udfff there", 3), ("\U0001F600\ud83d", 1)])
def test_a_lone_surrogate_is_invalid_input_not_a_server_error(engine, tokenizer_calls, prompt, index):
    field, message = refusal(engine, "r", prompt, sampling=SP)
    assert (field, message) == ("prompt", f"is not valid Unicode: a lone surrogate {prompt[index]!r} at index {index}")
    assert tokenizer_calls == []


def test_non_ascii_text_is_fine(engine):
    assert engine.make_request("r", "caf\u00e9 \U0001F600", sampling=SP).num_prompt_tokens == 1 + 6 + 4


# ---- bools are not numbers -------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, field, message",
    [
        ({"max_tokens": True}, "max_tokens", "must be an integer, got True"),
        ({"top_k": True}, "top_k", "must be an integer, got True"),
        ({"min_tokens": False}, "min_tokens", "must be an integer, got False"),
        ({"seed": True}, "seed", "must be an integer, got True"),
        ({"temperature": True}, "temperature", "must be a number, got True"),
        ({"top_p": True}, "top_p", "must be a number, got True"),
        ({"stop_token_ids": (1, True)}, "stop_token_ids", "must be an integer, got True"),
        ({"ignore_eos": 1}, "ignore_eos", "must be a boolean, got 1"),
        ({"stop": 5}, "stop", "must be a list, got int"),
        ({"stop_token_ids": 5}, "stop_token_ids", "must be a list, got int"),
    ],
)
def test_bools_and_other_types_where_they_do_not_belong(kwargs, field, message):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert (e.value.field, e.value.message) == (field, message)


def test_a_bool_token_id_is_refused(engine):
    assert refusal(engine, "r", None, [1, True], SP) == (
        "prompt_token_ids", "token id True at index 1 is outside the vocabulary [0, 320)")


def test_a_single_stop_string_is_one_stop_string():
    assert SamplingParams(stop="abc").stop == ("abc",)
