"""The output classifier reads a stream once per hold-back window of new text, not once per
delta (issue 52): a 200-character stream in 5-character deltas under a 32-character window made
40 classifier calls and makes 6 now; every released character was still read by it with the
window after it, so a flagged word is never released; the local rules still read every delta."""

import asyncio

from cluster.config import AppConfig
from cluster.engine.outputs import FinishReason
from router.ingress.gateway.guard_checks import Action, Cause, Intervention, Stage
from router.ingress.gateway.guardrails import Guardrails
from tests.ingress.gateway.guard_helpers import LocalClassifier, Source

WINDOW = 32


def guard(handle, rules=()):
    cfg = AppConfig(guardrail_policies={"p": {"classifier": {"timeout_s": 5.0}, "holdback_chars": WINDOW,
                                              "rules": [{"name": "r1", "words": list(rules)}] if rules else []}},
                    guardrail_policy="p", guardrail_classifier={"words": ["classified"]})
    return Guardrails(cfg, classifier=handle).for_request("default")


def run(g, pieces):
    async def collect():
        return [d async for d in g.output(Source(pieces).gen())]
    return asyncio.run(collect())


def test_one_classifier_call_per_window_of_new_text_and_the_stream_is_whole():
    handle = LocalClassifier(words=["classified"])
    pieces = [f"w{i:03d} " for i in range(40)]  # 200 characters, 5 a delta
    out = run(guard(handle), pieces)
    assert "".join(d.text for d in out) == "".join(pieces) and out[-1].finish_reason == "length"
    # read at 35, 70, 105, 140 and 175 characters (32 new since the last read) and at the end: 6, not 40
    assert len(handle.calls) == 6
    # each read covers the window before what was released and everything held (up to 2 windows):
    # from 0 until something is released, then 32 + 70 in the steady state; overlapping, never a gap
    assert handle.calls == [35, 70, 102, 102, 102, 92]


def test_a_word_the_classifier_flags_is_never_released():
    for at in range(0, 40, 3):  # the word in every phase of the reading cycle
        handle = LocalClassifier(words=["classified"])
        pieces = [f"w{i:03d} " for i in range(40)]
        pieces[at:at + 2] = ["class", "ified "]
        out = run(guard(handle), pieces)
        text = "".join(d.text for d in out)
        assert "class" not in text and out[-1].finish_reason == FinishReason.CONTENT_FILTER, at
        assert len(handle.calls) <= at // 6 + 2


def test_the_rules_still_read_every_delta():
    handle = LocalClassifier(words=["classified"])
    g = guard(handle, rules=("kill",))
    out = run(g, ["w000 ", "kill ", "w001 "] + [f"x{i:03d} " for i in range(20)])
    assert out[-1].finish_reason == FinishReason.CONTENT_FILTER and "kill" not in "".join(d.text for d in out)
    assert g.interventions == [Intervention("p", "r1", Stage.OUTPUT, Action.STOPPED, Cause.FLAGGED)]
    assert handle.calls == []  # stopped at the second delta, before 32 characters came: no classifier read
