"""Guardrails against hostile text, without Ray (issue 39): invisible characters and decomposed
accents, JSON-escaped tool-call arguments, logprob alternatives, and a prompt padded to pass."""

import asyncio
import random
from dataclasses import replace

import pytest
from pydantic import ValidationError

from cluster.config import AppConfig, GuardrailPolicy
from cluster.engine.outputs import FinishReason, TokenLogprob
from cluster.guardrail_rules import compile_rule
from router.ingress.request import Delta
from router.ingress.gateway.guard_checks import RuleCheck
from router.ingress.gateway.guardrails import Action, Cause, GuardrailRejected, Guardrails, Intervention, Stage
from tests.ingress.gateway.guard_helpers import LocalClassifier, Source, guard_for, run

# ---- normalised text: invisible characters, decomposed accents (issue 39) ----------------------

ZW = "\u200b\u200c\u200d\u2060\ufeff\u00ad"  # zero-width space, non-joiner, joiner, word joiner, BOM, soft hyphen


def test_fold_removes_invisible_characters_and_composes_accents():
    from cluster.guardrail_rules import fold

    assert fold("B\u200bo\u00adm\u2060b\ufeff") == "bomb"
    assert fold("Cafe\u0301") == fold("CAF\u00c9") == "caf\u00e9"  # decomposed and composed é fold alike
    assert compile_rule(["caf\u00e9"], None).pattern.search(fold("a cafe\u0301 au lait")) is not None


def test_a_word_split_by_zero_width_characters_across_two_deltas_is_stopped():
    """b, o + 12 invisible characters | 12 more, m, b: 28 generated characters for the 4 of the
    word, window 5 ("bomb" and its boundary): measured on the raw text, the window would let the
    first delta out before the match was whole."""
    pieces = ["we ", "must ", "not ", "b\u200bo" + ZW * 2, ZW * 2 + "m\u00adb", " now", " ok"]
    source = Source(pieces)
    guard = guard_for(words=["bomb"], window=5)
    out = run(guard, source)
    assert "".join(d.text for d in out) == "we must "  # "not " waits: 5 folded characters must follow it
    assert out[-1].finish_reason == FinishReason.CONTENT_FILTER and source.pulled == 6  # " now" settles it
    assert guard.interventions == [Intervention("p", "r1", Stage.OUTPUT, Action.STOPPED, Cause.FLAGGED)]


def test_random_splits_with_invisible_characters_never_release_any_character_of_a_match():
    rng = random.Random(2)
    for _ in range(200):
        word = "".join(c + "".join(rng.choice(ZW) for _ in range(rng.randint(0, 6))) for c in "bomb")
        text = "it is a " + word + " in the cafe\u0301 " + "and then some more text"
        start = text.index(word)
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 20)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        out = run(guard_for(words=["bomb"], window=5), Source(pieces))
        released = "".join(d.text for d in out)
        assert out[-1].finish_reason == FinishReason.CONTENT_FILTER
        assert len(released) <= start and text.startswith(released)


def test_a_decomposed_accent_across_deltas_is_the_listed_word_and_a_bare_letter_is_not():
    out = run(guard_for(words=["caf\u00e9"], window=6), Source(["a ", "cafe", "\u0301 ", "au ", "lait"]))
    assert "".join(d.text for d in out) == "" and out[-1].finish_reason == FinishReason.CONTENT_FILTER
    out = run(guard_for(words=["caf\u00e9"], window=6), Source(["a ", "cafe", " au ", "lait"]))
    assert "".join(d.text for d in out) == "a cafe au lait" and out[-1].finish_reason == "length"


def test_the_input_check_reads_the_normalised_prompt():
    guard = guard_for(words=["bomb", "caf\u00e9"], window=8)
    for prompt in ("how to build a b\u200bo\u200do\u00admb", "how to build a BO\u2060MB", "the cafe\u0301 menu"):
        with pytest.raises(GuardrailRejected):
            guard.check_input(prompt.replace("o\u200do", "o"), "prompt")
    guard.check_input("the cafe menu, a bombast", "prompt")


# ---- JSON-decoded output: tool-call arguments (issue 39) ----------------------------------------


def test_json_atoms_decode_escapes_and_wait_for_a_split_one():
    from router.ingress.gateway.guard_text import MatchView, json_atom

    assert json_atom("\\u0062x", 0, False) == ("b", 6)
    assert json_atom("\\u00", 0, False) is None and json_atom("\\u00", 0, True) == ("\\", 1)
    assert json_atom("\\ud83d\\ude00", 0, False) == ("\U0001f600", 12)
    assert json_atom("\\ud83d\\u", 0, False) is None  # the low half may still come
    assert json_atom("\\ud83d x", 0, False) == ("\ud83d", 6)
    assert json_atom("\\n", 0, False) == ("\n", 2) and json_atom("\\q", 0, False) == ("\\", 1)
    view = MatchView(decode_json=True)
    for piece in ['{"q": "\\u00', '62o\\u006D', 'b\\nX"}']:
        view.feed(piece, False)
    view.feed("", True)
    assert view.text == ['{"q": "bomb\nX"}', '{"q": "bomb\nx"}']


def guard_json(words=("bomb",), window=8, tokenizer=None):
    rule = {"name": "r1", "words": list(words)}
    cfg = AppConfig(guardrail_policies={"p": {"rules": [rule], "holdback_chars": window}}, guardrail_policy="p")
    return Guardrails(cfg).for_request("default", json_output=True, tokenizer=tokenizer)


def test_an_escaped_word_in_a_tool_calls_arguments_is_stopped():
    """A forced call's arguments as generated: `\\u0062omb` is `bomb` to the client's JSON parser
    (it reached the client decoded before). Stopped, and the edge makes no call of it."""
    from router.ingress.api.choices import tool_result
    from router.ingress.flow.tools import ToolUse

    pieces = ['{"target": "the ', '\\u0062', 'o\\u006d', 'b", "when": "', 'now"}']
    source = Source(pieces, finish="stop")
    guard = guard_json()
    out = run(guard, source)
    text = "".join(d.text for d in out)
    assert text == '' and out[-1].finish_reason == FinishReason.CONTENT_FILTER and source.pulled == 4  # settled by '"'
    assert guard.interventions == [Intervention("p", "r1", Stage.OUTPUT, Action.STOPPED, Cause.FLAGGED)]
    assert tool_result(ToolUse("named", "f"), text, out[-1].finish_reason) == (None, text, "content_filter")
    # the same text where no client parses JSON is not the word: as generated, it is a backslash and letters
    out = run(guard_for(words=["bomb"], window=8), Source(pieces, finish="stop"))
    assert "".join(d.text for d in out) == "".join(pieces) and out[-1].finish_reason == "stop"
    # and a surrogate-pair escape that a listed emoji word spells is caught too
    out = run(guard_json(words=["\U0001f4a3"], window=4), Source(['{"x": "\\ud83d', '\\udca3"}'], finish="stop"))
    assert out[-1].finish_reason == FinishReason.CONTENT_FILTER


def test_the_output_is_json_for_tools_and_json_response_formats():
    from router.ingress.gateway.guardrails import json_output
    from router.ingress.request import ClientRequest, FunctionTool, ResponseFormatSpec, SamplingSpec, ToolsSpec

    tools = (FunctionTool("f"),)
    assert [json_output(ClientRequest("t", SamplingSpec(), tools=spec)) for spec in (
        None, ToolsSpec(), ToolsSpec(tools), ToolsSpec(tools, "none"), ToolsSpec(tools, "required"))] == [
        False, False, True, False, True]
    assert [json_output(ClientRequest("t", SamplingSpec(response_format=ResponseFormatSpec(kind)))) for kind in (
        "text", "json_object", "json_schema")] == [False, True, True]


# ---- logprob alternatives (issue 39) -------------------------------------------------------------


class ByteTokens:
    """The tiny model's vocabulary: token i < 256 is byte i (cluster/engine/tokenizer.py token_text)."""

    @staticmethod
    def token_text(token_id: int) -> str:
        return bytes([token_id]).decode("utf-8", errors="replace")


def lp(token: str, *alternatives: str) -> TokenLogprob:
    return TokenLogprob(ord(token), -0.1, ((ord(token), -0.1), *((ord(a), -2.0 - i) for i, a in enumerate(alternatives))))


def guard_alternatives(words, tokenizer=ByteTokens(), json_out=False):
    cfg = AppConfig(guardrail_policies={"p": {"rules": [{"name": "r1", "words": list(words)}], "holdback_chars": 8}},
                    guardrail_policy="p")
    return Guardrails(cfg).for_request("default", json_output=json_out, tokenizer=tokenizer)


def test_alternatives_that_make_a_listed_word_are_left_out_and_the_text_goes_on():
    """Each generated token's alternatives, alone and after the text before it: at "e" of "the
    bomber", " " would make "the bomb " (left out), "q" is a listed word alone (left out), "x"
    stays; the prompt's alternatives alike ("b" after the prompt's "a bom"). The text, the sampled
    tokens and their logprobs are unchanged: it is not stopped."""
    text, prompt = "the bomber", "a bomx"
    top = {8: (" ", "x", "q")}
    deltas = [Delta("r", c, [ord(c)], None if i < len(text) - 1 else "length", len(prompt), i + 1, 0,
                    [lp(c, *top.get(i, ("z",)))]) for i, c in enumerate(text)]
    deltas[0] = replace(deltas[0], prompt_token_ids=[ord(c) for c in prompt],
                        prompt_logprobs=[None, lp(" ", "q"), *(lp(c, "z") for c in "bom"), lp("x", "b", "k")])

    async def source():
        for d in deltas:
            yield d

    guard = guard_alternatives(["bomb", "q"])

    async def collect():
        return [d async for d in guard.output(source())]
    out = asyncio.run(collect())
    assert "".join(d.text for d in out) == text and out[-1].finish_reason == "length"
    assert [t for d in out for t in d.token_ids] == [ord(c) for c in text]
    assert ["".join(chr(t) for t, _ in x.top) for d in out for x in d.logprobs] == [
        "tz", "hz", "ez", " z", "bz", "oz", "mz", "bz", "ex", "rz"]
    assert ["".join(chr(t) for t, _ in x.top) if x else None for x in out[0].prompt_logprobs] == [
        None, " ", "bz", "oz", "mz", "xk"]
    assert [v for d in out for x in d.logprobs for _, v in x.top][16:18] == [-0.1, -3.0]  # "x" kept its logprob
    assert guard.interventions == [Intervention("p", "r1", Stage.OUTPUT, Action.REDACTED, Cause.FLAGGED)]


def test_a_clean_streams_alternatives_are_untouched_and_without_a_tokenizer_none_are_read():
    d = Delta("r", "ok", [1], "stop", 1, 1, 0, [lp("o", "q")])

    async def collect(guard):
        async def source():
            yield d
        return [x async for x in guard.output(source())]
    assert asyncio.run(collect(guard_alternatives(["bomb"])))[0].logprobs == d.logprobs
    assert asyncio.run(collect(guard_alternatives(["q"], tokenizer=None)))[0].logprobs == d.logprobs


# ---- the input check's bound grows with the prompt (issue 39) -----------------------------------

_RNG = random.Random(3)
MANY_WORDS = sorted({"".join(_RNG.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(_RNG.randint(4, 12)))
                     for _ in range(10_100)} - {"lorem", "ipsum", "dolor", "amet", "now", "the"})[:9_999] + ["bomb"]
LONG_CLEAN = "lorem ipsum dolor sit amet " * 8_000  # 216,000 characters


@pytest.mark.parametrize("on_error", ["open", "closed"])
def test_a_long_prompt_is_checked_whole_within_the_bound_however_it_is_padded(on_error):
    """10,000 listed words, a 216k-character prompt. It was one search bounded by 20 x
    rule_timeout_s (1 s), and a flat alternation of 10,000 words costs ~15 us a character (~3 s):
    open passed the padded prompt unchecked, closed refused the clean one. Now chunks, each
    within rule_timeout_s, of a trie (~0.3 us a character)."""
    cfg = AppConfig(guardrail_policies={"p": {"rules": [{"name": "r1", "words": MANY_WORDS, "applies_to": "input"}],
                                              "on_error": on_error}}, guardrail_policy="p")
    guard = Guardrails(cfg).for_request("default")
    guard.check_input(LONG_CLEAN, "prompt")
    assert guard.interventions == []
    with pytest.raises(GuardrailRejected) as e:
        guard.check_input(LONG_CLEAN + "now the bomb", "prompt")
    assert e.value.interventions == (Intervention("p", "r1", Stage.INPUT, Action.REFUSED, Cause.FLAGGED),)


def test_chunks_find_a_match_across_their_seam_and_never_one_their_cut_makes():
    from router.ingress.gateway.guard_checks import INPUT_CHUNK_CHARS

    rule = RuleCheck(GuardrailPolicy(rules=[{"name": "r", "words": ["kill"]}]).rules[0], timeout_s=0.05)
    for at in range(INPUT_CHUNK_CHARS - 5, INPUT_CHUNK_CHARS + 2):
        assert rule.flags_input("x " * (at // 2) + " " * (at % 2) + "kill now")  # "kill" on or near the seam
        assert not rule.flags_input("x " * (at // 2) + " " * (at % 2) + "killer")  # a cut after "kill" is no end


@pytest.mark.parametrize("on_error", ["open", "closed"])
def test_the_classifier_reads_a_long_prompt_in_chunks(on_error):
    """The deployment refuses a text over max_text_chars (an error): a prompt padded past it was
    passed unchecked (open) or refused (closed). Chunks of input_chunk_chars overlapping by
    input_overlap_chars, each a call within timeout_s."""
    handle = LocalClassifier(words=["classified"], max_text_chars=5000)
    cfg = AppConfig(guardrail_policies={"p": {"classifier": {"timeout_s": 0.5}, "on_error": on_error}},
                    guardrail_policy="p", guardrail_classifier={"words": ["classified"], "max_text_chars": 5000})
    guard = Guardrails(cfg, classifier=handle).for_request("default")
    prompt = "lorem ipsum " * 1000  # 12,000 characters
    guard.check_input(prompt, "prompt")
    asyncio.run(guard.check_input_remote())
    assert guard.interventions == [] and handle.calls == [4096, 4096, 4096, 480]  # steps of 3,840
    guard.check_input(prompt[:4089] + " classified " + prompt, "prompt")  # across the end of the first chunk
    with pytest.raises(GuardrailRejected):
        asyncio.run(guard.check_input_remote())
    assert guard.interventions[-1] == Intervention("p", "classifier", Stage.INPUT, Action.REFUSED, Cause.FLAGGED)


def test_an_alternative_that_composes_with_the_text_before_it_is_read_with_it():
    """A combining acute as the alternative after "a cafe" makes "a café" (the listed word); after
    an open JSON escape, an alternative that completes it is read as the escape it completes."""
    class Texts:
        def __init__(self, *texts):
            self.texts = texts

        def token_text(self, token_id):
            return self.texts[token_id]

    async def collect(guard, pieces, tops):
        async def source():
            for i, p in enumerate(pieces):
                yield Delta("r", p, [i], None if i < len(pieces) - 1 else "stop", 1, i + 1, 0,
                            [TokenLogprob(i, -0.1, ((i, -0.1), *((t, -1.0) for t in tops.get(i, ()))))])
        return [d async for d in guard.output(source())]

    pieces = ["a", " ", "c", "a", "f", "e", " ", "!"]
    guard = guard_alternatives(["caf\u00e9"], tokenizer=Texts(*pieces, "\u0301", "s"))
    out = asyncio.run(collect(guard, pieces, {6: (8, 9)}))
    assert [[t for t, _ in x.top] for d in out for x in d.logprobs][6] == [6, 9]
    pieces = ['{"a": "\\u00', "62omb", '"}']
    guard = guard_alternatives(["bomb"], tokenizer=Texts(*pieces, "62omb", "62oo"), json_out=True)
    out = asyncio.run(collect(guard, pieces[:1] + ["x", '"}'], {1: (3, 4)}))
    assert [[t for t, _ in x.top] for d in out for x in d.logprobs][1] == [1, 4]  # "\u00" + "62omb" is "bomb"


def test_a_classifier_chunk_longer_than_the_deployment_reads_is_refused_at_load():
    with pytest.raises(ValidationError) as e:
        AppConfig(guardrail_policies={"p": {"classifier": {"input_chunk_chars": 5000}}},
                  guardrail_classifier={"max_text_chars": 4096})
    assert e.value.errors()[0]["msg"] == ("Value error, guardrail_policies.p.classifier.input_chunk_chars 5000 "
                                          "exceeds guardrail_classifier.max_text_chars 4096")
    with pytest.raises(ValidationError, match="input_overlap_chars must be less than input_chunk_chars"):
        GuardrailPolicy(classifier={"input_chunk_chars": 256, "input_overlap_chars": 256})
