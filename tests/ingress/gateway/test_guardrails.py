"""Guardrails without Ray: rule compilation and its bounds, the hold-back window, the output
stream's release and stop, the input check, and the response cache's keys and bounds."""

import asyncio
import random
import time

import pytest
from pydantic import ValidationError

from cluster.config import AppConfig, GuardrailPolicy, ResponseCacheOptions
from cluster.engine.outputs import FinishReason, TokenLogprob
from cluster.engine.sampling_params import SamplingParams
from cluster.guardrail_rules import RuleError, compile_rule
from router.ingress.request import Delta
from router.ingress.gateway.guard_checks import RuleCheck
from router.ingress.gateway.guardrails import Action, Cause, GuardrailRejected, HoldBack, Intervention, Stage
from router.ingress.gateway.response_cache import ResponseCache, delta_bytes
from tests.ingress.gateway.guard_helpers import D, Source, guard_for, run

# ---- rules and their bounds ------------------------------------------------------------------


@pytest.mark.parametrize("words, pattern, span, lookahead", [
    (["kill"], None, 4 + 1, 1),  # the word, plus the character (?!\w) reads
    (["bad word", "kill"], None, 8 + 1, 1),
    ([], r"\d{3}-\d{4}", 8 + 1, 1),  # \d may be followed by more: a settled match waits for one character
    ([], r"ab(?=cd)e{2,3}", 5 + 2, 2),
    ([], r"(?<=x)abc", 3 + 1, 1),  # lookbehind reads released text: no extra span
])
def test_a_rule_knows_its_span(words, pattern, span, lookahead):
    rule = compile_rule(words, pattern)
    assert (rule.span, rule.lookahead) == (span, lookahead)


@pytest.mark.parametrize("pattern, why", [
    ("a+b", "a repetition without an upper bound"),
    ("x(?=a*)", "a repetition without an upper bound"),
    (r"\p{L}{3}", "not in Python re syntax (bad escape \\p at position 0)"),
])
def test_an_unbounded_rule_has_no_span(pattern, why):
    rule = compile_rule([], pattern)
    assert (rule.span, rule.why_unbounded) == (None, why)


@pytest.mark.parametrize("pattern, message", [
    ("a?", "matches the empty string"),
    (r"\b", "matches the empty string"),
    ("(", "does not compile: missing ) at position 1"),
])
def test_a_bad_rule_is_refused(pattern, message):
    with pytest.raises(RuleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        compile_rule([], pattern)


@pytest.mark.parametrize("rule, window, error", [
    ({"name": "r", "pattern": "a+"}, 64,
     "rule 'r': an output rule needs a bounded match length (no *, + or {n,}): a repetition without an upper bound"),
    ({"name": "r", "pattern": "a{70}"}, 64,
     "rule 'r': a match and its lookahead span up to 71 characters, more than holdback_chars 64"),
    ({"name": "w", "words": ["kill"]}, 4, "rule 'w': a match and its lookahead span up to 5 characters, more than "
                                          "holdback_chars 4"),
    ({"name": "w", "words": ["kill"], "pattern": "x"}, 64, "rule 'w': give words or pattern (exactly one)"),
])
def test_the_config_refuses_an_output_rule_that_does_not_fit_the_window(rule, window, error):
    with pytest.raises(ValidationError) as e:
        GuardrailPolicy(rules=[rule], holdback_chars=window)
    assert e.value.errors()[0]["msg"] == f"Value error, {error}"


def test_an_input_only_rule_may_be_unbounded_and_a_tenant_must_name_a_known_policy():
    GuardrailPolicy(rules=[{"name": "r", "pattern": "a+b", "applies_to": "input"}])
    with pytest.raises(ValidationError, match="tenant 'x': guardrail_policy 'nope' is not in guardrail_policies"):
        AppConfig(tenants={"x": {"api_keys": ["k"], "guardrail_policy": "nope"}})


def test_catastrophic_backtracking_is_bounded_by_the_rule_timeout():
    rule = RuleCheck(GuardrailPolicy(rules=[{"name": "evil", "pattern": "(a|aa){1,30}b"}]).rules[0],
                     timeout_s=0.005)
    text = "a" * 60  # without the bound this search takes far longer than a second
    started = time.monotonic()
    with pytest.raises(Exception) as e:
        rule.flags_input(text)
    assert type(e.value).__name__ == "CheckFailed" and e.value.cause is Cause.TIMEOUT
    with pytest.raises(Exception):
        rule.scan(text, 0, final=True)
    assert time.monotonic() - started < 0.5


# ---- the hold-back window --------------------------------------------------------------------


def test_holdback_releases_a_delta_once_window_characters_follow_it():
    """Counted in committed characters: the last one may still take a combining mark (the next
    delta's), so it follows a delta only once another character came after it."""
    hold = HoldBack(5)
    hold.add(D("abc"))
    assert hold.release(False) == [] and hold.held == 3
    hold.add(D("de"))
    assert hold.release(False) == []  # "abcd" committed, "e" open
    hold.add(D("fgh"))
    assert [d.text for d in hold.release(False)] == []  # "abc" ends at 3; 7 committed: 4 follow it
    hold.add(D("i"))
    assert [d.text for d in hold.release(False)] == ["abc"]  # 8 committed: 5 follow it
    assert (hold.released, hold.scan_from(0, 0), hold.held) == (3, 0, 6)
    hold.add(D("jklmn"))
    assert [d.text for d in hold.release(False)] == ["de", "fgh"]  # 13 committed; "i" ends at 9
    assert (hold.released, hold.scan_from(0, 0)) == (8, 3)
    hold.add(D("", finish="length"), final=True)
    assert [d.text for d in hold.release(True)] == ["i", "jklmn", ""]


def test_a_clean_stream_is_released_whole_and_in_order():
    pieces = ["The ", "skill", "ed ", "killer", "s ", "sang"]  # "kill" only inside other words
    source = Source(pieces)
    guard = guard_for()
    out = run(guard, source)
    assert "".join(d.text for d in out) == "".join(pieces) and out[-1].finish_reason == "length"
    assert [t for d in out for t in d.token_ids] == [1, 2, 3, 4, 5, 6]  # deltas released together are merged
    assert [d.text for d in out] == ["The skill", "ed killers sang"]  # the window's text, at the end
    assert guard.interventions == [] and not source.closed_early


def test_a_flagged_word_is_never_released_and_the_source_is_closed():
    pieces = ["I ", "said ", "that ", "I ", "will ", "ki", "ll ", "them ", "all ", "now"]
    source = Source(pieces)
    guard = guard_for(window=8)
    out = run(guard, source)
    released = "".join(d.text for d in out)
    assert released == "I said that "  # each piece once 8 characters followed it; "I will kill " held
    assert out[-1].finish_reason == FinishReason.CONTENT_FILTER and out[-1].text == "" and out[-1].token_ids == []
    assert out[-1].completion_tokens == 7  # "ll " settled "kill": its tokens were generated, never delivered
    assert source.closed_early and source.pulled == 7
    assert guard.interventions == [Intervention("p", "r1", Stage.OUTPUT, Action.STOPPED, Cause.FLAGGED)]


def test_a_match_at_the_end_of_the_stream_is_caught_by_the_final_check():
    source = Source(["you ", "really ", "should ", "kill"], finish="stop")
    out = run(guard_for(window=8), source)
    assert "".join(d.text for d in out) == "you "
    assert out[-1].finish_reason == FinishReason.CONTENT_FILTER


def test_random_splits_never_release_any_character_of_a_match():
    rng = random.Random(0)
    text = "the quick brown fox said 555-1234 loudly and then went home to sleep"
    start = text.index("555-1234")
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 20)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        out = run(guard_for(pattern=r"\d{3}-\d{4}", window=9), Source(pieces))
        released = "".join(d.text for d in out)
        assert out[-1].finish_reason == FinishReason.CONTENT_FILTER
        assert len(released) <= start and text.startswith(released)


def test_fold_is_nfkc_and_casefold_per_character():
    from cluster.guardrail_rules import fold

    assert fold("KiLL") == "kill"
    assert fold("\uff2b\uff49\uff4c\uff4c") == "kill"  # full-width ＫｉＬＬ
    assert fold("\ufb01re") == "fire"  # the ligature ﬁ: one character, two folded
    assert fold("Stra\u00dfe") == "strasse"
    assert fold("\ufdfa") == "\u0635\u0644\u0649 \u0627\u0644\u0644\u0647 \u0639\u0644\u064a\u0647 \u0648\u0633\u0644\u0645"  # 1 -> 18


def test_a_full_width_or_mixed_case_word_is_caught_and_delivered_text_is_never_changed():
    # a clean stream with full-width and mixed-case text goes out exactly as generated
    pieces = ["\uff34\uff48\uff45 ", "SKILL", "ed ", "\uff2b\uff29\uff2c\uff2c\uff25\uff32", "s ", "sang"]
    guard = guard_for()
    out = run(guard, Source(pieces))
    assert [d.text for d in out] == ["\uff34\uff48\uff45 SKILL", "ed \uff2b\uff29\uff2c\uff2c\uff25\uff32s sang"]
    assert out[-1].finish_reason == "length" and guard.interventions == []
    # full-width "ｋｉＬＬ" (split across deltas) is the listed "Kill": stopped, none of it released
    pieces = ["I ", "said ", "that ", "I ", "will ", "\uff4b\uff49", "\uff2c\uff2c ", "them ", "all ", "now"]
    source = Source(pieces)
    out = run(guard_for(words=["Kill"], window=8), source)
    assert "".join(d.text for d in out) == "I said that "
    assert out[-1].finish_reason == FinishReason.CONTENT_FILTER and source.pulled == 7
    # a listed word with a character that folds to two: "Straße" catches "STRASSE"
    out = run(guard_for(words=["Stra\u00dfe"], window=8), Source(["the ", "STRASSE ", "is long"]))
    assert "".join(d.text for d in out) == "" and out[-1].finish_reason == FinishReason.CONTENT_FILTER  # flagged first


def test_a_pattern_sees_the_text_as_generated():
    out = run(guard_for(pattern=r"kill", window=8), Source(["I ", "KILL ", "\uff4b\uff49\uff4c\uff4c ", "done"]))
    assert "".join(d.text for d in out) == "I KILL \uff4b\uff49\uff4c\uff4c done" and out[-1].finish_reason == "length"


def test_characters_that_fold_to_many_never_let_a_match_out_of_the_window():
    # "ﬁre" folds to "fire" (5 folded characters to 4 generated): the window (5 = "fire" + lookahead),
    # counted in generated characters, still holds all of it; "ﷺ" (18 folded) before it changes nothing
    rng = random.Random(1)
    text = "a \ufdfa b \ufb01re now and then"
    start = text.index("\ufb01re")
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        out = run(guard_for(words=["fire"], window=5), Source(pieces))
        released = "".join(d.text for d in out)
        assert out[-1].finish_reason == FinishReason.CONTENT_FILTER
        assert len(released) <= start and text.startswith(released)


def test_the_input_check_folds_the_prompt():
    guard = guard_for(words=["forbidden topic"], window=32)
    guard.check_input("a harmless \uff26\uff4f\uff52\uff42\uff49\uff44\uff44\uff45\uff4e", "prompt")
    with pytest.raises(GuardrailRejected):
        guard.check_input("tell me about the \uff26\uff2f\uff32\uff22\uff29\uff24\uff24\uff25\uff2e topic", "prompt")
    guard_for(pattern=r"forbidden", window=32).check_input("\uff46\uff4f\uff52\uff42\uff49\uff44\uff44\uff45\uff4e", "prompt")


def test_a_failing_check_follows_the_policy():
    evil = r"(a|aa){1,30}b"
    guard = guard_for(pattern=evil, window=64)
    out = run(guard, Source(["a" * 40, "a" * 20, "c"]))
    assert out[-1].finish_reason == FinishReason.CONTENT_FILTER
    assert guard.interventions[0].cause is Cause.TIMEOUT
    guard = guard_for(pattern=evil, window=64, on_error="open")
    out = run(guard, Source(["a" * 40, "a" * 20, "c"]))
    assert "".join(d.text for d in out) == "a" * 60 + "c" and out[-1].finish_reason == "length"
    assert {iv.action for iv in guard.interventions} == {Action.PASSED_ON_ERROR}


def test_the_input_check_refuses_naming_the_policy_and_check():
    guard = guard_for(words=["forbidden topic"], window=32)
    guard.check_input("a harmless prompt", "prompt")
    with pytest.raises(GuardrailRejected) as e:
        guard.check_input("tell me about the Forbidden  topic and the FORBIDDEN TOPIC", "messages")
    assert e.value.message == "messages: refused by guardrail policy 'p', check 'r1'"
    assert (e.value.code.http_status, e.value.param, e.value.openai_code) == (400, "messages", "content_filter")
    assert e.value.interventions == (Intervention("p", "r1", Stage.INPUT, Action.REFUSED, Cause.FLAGGED),)


def test_an_output_only_rule_does_not_check_the_prompt():
    guard_for(words=["kill"], applies_to="output").check_input("kill", "prompt")


# ---- the response cache ----------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def cache(clock, **options):
    return ResponseCache(ResponseCacheOptions(**options), {"t"}, "v1", clock=clock)


GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def test_only_opted_in_tenants_and_temperature_zero_are_cached():
    c = ResponseCache(ResponseCacheOptions(), {"t", "u"}, "v1")
    assert c.key("other", [1], GREEDY) is None
    assert c.key("t", [1], SamplingParams(temperature=0.5)) is None
    assert c.key("t", [1], GREEDY) != c.key("u", [1], GREEDY)  # tenants never share entries


def test_entries_expire_and_the_cache_is_bounded_by_entries_and_bytes():
    clock = Clock()
    c = cache(clock, ttl_s=10, max_entries=2, max_bytes=1024, max_entry_bytes=300)
    one = [D("x" * 100, "length", 1)]  # 64 + 100 + 4 bytes
    c.put(b"a", one), c.put(b"b", one)
    assert c.get(b"a") is not None  # a is now the most recently used
    c.put(b"c", one)
    assert (c.get(b"b"), len(c), c.nbytes) == (None, 2, 2 * 168)
    assert c.put(b"big", [D("x" * 300, "length")]) is False  # over max_entry_bytes
    clock.t = 10.0
    assert c.get(b"a") is None and c.get(b"c") is None and c.nbytes == 0
    small = ResponseCache(ResponseCacheOptions(max_bytes=1024, max_entry_bytes=300), {"t"}, "v1", clock=clock)
    for k in range(8):
        small.put(bytes([k]), [D("y" * 200, "stop")])
    assert small.nbytes <= 1024 and len(small) == 1024 // 268


def test_a_hit_replays_the_stored_deltas_without_starting_the_source():
    c = cache(Clock())
    lp = [TokenLogprob(5, -0.5, ((5, -0.5),))]

    async def flow(pieces, started):
        started.append(True)
        for i, t in enumerate(pieces):
            yield Delta("r1", t, [i], "stop" if i == len(pieces) - 1 else None, 2, i + 1, 0, lp)

    async def go(label, started, hits):
        return [d async for d in c.through("t", [1, 2], GREEDY, label, flow(["a", "b"], started),
                                           lambda: hits.append(label))]

    first_started, second_started, hits = [], [], []
    first = asyncio.run(go("r1", first_started, hits))
    second = asyncio.run(go("r2", second_started, hits))
    assert first_started == [True] and second_started == [] and hits == ["r2"]
    assert [(d.text, d.token_ids, d.finish_reason, d.logprobs) for d in second] == \
        [(d.text, d.token_ids, d.finish_reason, d.logprobs) for d in first]
    assert [(d.request_id, d.cached_prompt_tokens) for d in second] == [("r2", 2)] * 2


def test_an_entry_counts_its_prompt_logprobs_and_prompt_ids():
    """An 8k-token prompt's echo (prompt_logprobs, prompt_token_ids) is most of its entry: counted,
    max_bytes bounds the memory it holds (it counted 70 bytes before)."""
    prompt = list(range(8192))
    lps = [None] + [TokenLogprob(t, -1.0, ((t, -1.0),)) for t in prompt[1:]]
    first = Delta("r", "a", [5], None, 8192, 1, 0, None, lps, prompt)
    assert delta_bytes(first) == 64 + 1 + 4 * (1 + 8192) + 8 + 8191 * 32
    c = ResponseCache(ResponseCacheOptions(max_bytes=100_000, max_entry_bytes=1 << 20), {"t"}, "v1")
    assert c.put(b"k", [first, D("b", "stop", 2)]) is False and c.nbytes == 0  # over max_bytes: not stored


def test_a_completion_a_guardrail_passed_because_a_check_failed_open_is_not_stored():
    from types import SimpleNamespace

    from router.ingress.gateway.response_cache import ResponseCacheStage
    from router.ingress.gateway.stages import Outcome
    from router.ingress.request import ClientRequest, SamplingSpec

    c = cache(Clock())
    stage = ResponseCacheStage(c)

    async def source():
        yield D("a", None, 1)
        yield D("b", "stop", 2)

    def run(interventions) -> int:
        o = Outcome("rid", ClientRequest("t", SamplingSpec()), GREEDY, None,
                    prepared=SimpleNamespace(prompt_token_ids=[1, 2]), interventions=interventions)

        async def go():
            return [d async for d in stage.wrap(o, source())]
        asyncio.run(go())
        return len(c)

    failed_open = Intervention("p", "classifier", Stage.OUTPUT, Action.PASSED_ON_ERROR, Cause.TIMEOUT)
    assert run([failed_open]) == 0  # unchecked output is never replayed
    assert run([]) == 1


def test_a_guarded_streams_prompt_logprobs_survive_the_merge():
    """The hold-back window merges the deltas it releases together: the first delta's prompt
    logprobs and prompt ids (echo, prompt_logprobs) went with it (the merge kept the last's)."""
    plp = [None, TokenLogprob(7, -0.5, ((7, -0.5),))]

    async def source():
        yield Delta("r", "ab", [1], None, 2, 1, 0, None, plp, [3, 7])
        yield Delta("r", "cd", [2], None, 2, 2)
        yield Delta("r", "ef", [3], "length", 2, 3)

    async def collect():
        return [d async for d in guard_for(window=8).output(source())]
    out = asyncio.run(collect())
    assert [d.text for d in out] == ["abcdef"]
    assert (out[0].prompt_logprobs, out[0].prompt_token_ids) == (plp, [3, 7])
