"""The hermes tool-call parser (tool_choice "auto"): exact content and calls for whole outputs, and
a stream fed in chunks sends exactly the whole output's content, holding a split opener."""

import pytest

from router.ingress.flow.tool_parser import HermesToolParser, ParsedCall, ParsedOutput, ToolCallStream

P = HermesToolParser()
NAMES = frozenset({"get_weather", "add"})
W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
A = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}</tool_call>'
W_CALL = ParsedCall("get_weather", '{"city":"Paris","unit":"°C"}')
A_CALL = ParsedCall("add", '{"a":1,"b":[2,3]}')


@pytest.mark.parametrize("text, expected", [
    ("The weather is fine.", ParsedOutput("The weather is fine.")),
    (W, ParsedOutput(None, (W_CALL,))),
    (W + "\n" + A + "\n", ParsedOutput(None, (W_CALL, A_CALL))),
    ("Let me check.\n\n" + W, ParsedOutput("Let me check.", (W_CALL,))),
    # SmolLM2's taught form: a list of calls in one pair of tags
    ('<tool_call>[{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}, '
     '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}]</tool_call>',
     ParsedOutput(None, (A_CALL, W_CALL))),
    # stopped at EOS right after the JSON: the last call needs no closer
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}', ParsedOutput(None, (A_CALL,))),
])
def test_whole_outputs(text, expected):
    assert P.parse(text, NAMES) == expected


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',  # malformed JSON
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # an unknown function
    '<tool_call>{"name": "add", "arguments": "{}"}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "add", "arguments": {}, "id": 1}</tool_call>',  # an extra key
    A + " and then some text",  # text after a call
    "<tool_call></tool_call>",
    "<tool_call>[]</tool_call>",
    "<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>",  # nesting past the recursion limit
])
def test_a_malformed_call_is_the_whole_output_as_content(text):
    assert P.parse(text, NAMES) == ParsedOutput(text)


def test_two_calls_without_parallel_calls_and_a_cut_call_are_content():
    assert P.parse(W + A, NAMES, parallel=False) == ParsedOutput(W + A)
    assert P.parse(W + A[:-len("</tool_call>")], NAMES, complete=False) == ParsedOutput(W + A[:-len("</tool_call>")])
    assert P.parse(W + A[:-len("</tool_call>")], NAMES) == ParsedOutput(None, (W_CALL, A_CALL))


def feed_all(chunks: list[str], stopped: bool = True) -> tuple[list[str], str, tuple]:
    s = ToolCallStream(P, NAMES)
    sent = [s.feed(c) for c in chunks]
    rest, calls = s.finish(stopped)
    return sent, rest, calls


def test_a_stream_holds_an_opener_split_across_chunks():
    sent, rest, calls = feed_all(["Let me check", ".\n<tool", "_ca", "ll>\n{\"name\": \"get_weather\", ",
                                  '"arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'])
    assert (sent, rest, calls) == (["Let me check", ".", "", "", ""], "", (W_CALL,))


def test_a_stream_cut_short_is_text_even_with_a_whole_call():
    sent, rest, calls = feed_all(["Hm ", W], stopped=False)
    assert (sent, rest, calls) == (["Hm", ""], " " + W, ())


def test_a_stream_releases_a_false_opener_and_held_whitespace():
    sent, rest, calls = feed_all(["a <tool", "box> b \n", "c"])
    assert (sent, rest, calls) == (["a", " <toolbox> b", " \nc"], "", ())


def test_a_stream_whose_call_is_malformed_ends_with_the_held_text_as_content():
    text = 'Sure.\n<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'
    sent, rest, calls = feed_all([text[:9], text[9:30], text[30:]])
    assert (sent, rest, calls) == (["Sure.", "", ""], text[len("Sure."):], ())
    assert "".join(sent) + rest == text


@pytest.mark.parametrize("text", ["The weather is fine.", W, W + "\n" + A, "Let me check.\n\n" + W, A + " trailing",
                                  "tabs\t\t<tool_cal", "x <tool_call> y"])
def test_a_stream_sends_what_the_whole_output_parses_to(text):
    """Fed one character at a time, the content sent (plus the rest at the end) and the calls equal
    the whole output's parse."""
    sent, rest, calls = feed_all(list(text))
    whole = P.parse(text, NAMES)
    assert ("".join(sent) + rest or None, calls) == (whole.content, whole.calls)
