"""Tool calls found in a model's free text (OpenAI's tool_choice "auto"), in the model's own format.

A parser is chosen per model in the config (`tool_call_parser`, named as vLLM names them); "none"
leaves "auto" refused. `hermes`: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Hermes, Qwen; SmolLM2 was taught a JSON list of such objects inside one pair of tags, also read).

The rule, the same for a whole output and a stream: the text before the first opener is content
(trailing whitespace dropped; None when nothing is left); from the opener on the output must be
calls only (whitespace between them), each naming a given function with an object of arguments.
Anything else (malformed JSON, an unknown function, text after a call, two calls when parallel
calls are off) returns the whole output as content: never an exception."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, compact (as a forced call's)


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    calls: tuple[ParsedCall, ...] = ()


def openai_tool_calls(calls: tuple[ParsedCall, ...]) -> list[dict]:
    """OpenAI's message.tool_calls shape (fresh call ids)."""
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


class HermesToolParser:
    opener = "<tool_call>"
    closer = "</tool_call>"

    def parse(self, text: str, names: frozenset[str] | set[str], parallel: bool = True,
              complete: bool = True) -> ParsedOutput:
        """`complete`: the model stopped by itself, so a last call missing its closer counts
        (a model may end at EOS right after the JSON); cut short (length), it does not."""
        start = text.find(self.opener)
        if start < 0:
            return ParsedOutput(text)
        calls = self._calls(text[start:], names, complete)
        if not calls or (len(calls) > 1 and not parallel):
            return ParsedOutput(text)
        return ParsedOutput(text[:start].rstrip() or None, tuple(calls))

    def _calls(self, rest: str, names, complete: bool) -> list[ParsedCall] | None:
        calls: list[ParsedCall] = []
        pos = 0
        while pos < len(rest):
            if not rest.startswith(self.opener, pos):
                return None  # text after a call
            body_at = pos + len(self.opener)
            end = rest.find(self.closer, body_at)
            if end < 0 and not complete:
                return None
            body = rest[body_at:] if end < 0 else rest[body_at:end]
            found = self._read(body, names)
            if found is None:
                return None
            calls += found
            if end < 0:
                break
            pos = end + len(self.closer)
            while pos < len(rest) and rest[pos].isspace():
                pos += 1
        return calls

    @staticmethod
    def _read(body: str, names) -> list[ParsedCall] | None:
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):  # the output is bounded by max_tokens; its nesting is not
            return None
        items = value if isinstance(value, list) else [value]
        out = []
        for item in items:
            if not (isinstance(item, dict) and set(item) == {"name", "arguments"} and item["name"] in names
                    and isinstance(item["arguments"], dict)):
                return None
            out.append(ParsedCall(item["name"], json.dumps(item["arguments"], ensure_ascii=False,
                                                           separators=(",", ":"))))
        return out or None


PARSERS = {"hermes": HermesToolParser}


def parser_for(name: str) -> HermesToolParser | None:
    """The configured parser; None for "none"."""
    return None if name == "none" else PARSERS[name]()


@dataclass
class ToolCallStream:
    """One choice's stream under tool_choice "auto": `feed` returns the text that is content for
    sure (what cannot be the start of a call opener, nor whitespace that may precede one); from
    an opener on, everything is held until `finish`, which parses the whole output and returns
    what is left to send: the calls, or the held rest as content. The content sent in all equals
    the parse of the whole output's content."""

    parser: HermesToolParser
    names: frozenset[str]
    parallel: bool = True
    text: str = ""
    sent: int = 0  # characters of `text` already released as content
    opened: bool = False

    def feed(self, chunk: str) -> str:
        self.text += chunk
        if self.opened:
            return ""
        pending = self.text[self.sent:]
        at = pending.find(self.parser.opener)
        if at >= 0:
            self.opened = True
            safe = len(pending[:at].rstrip())
        else:
            safe = len(pending) - _partial_suffix(pending, self.parser.opener)
            safe = len(pending[:safe].rstrip())
        self.sent += safe
        return pending[:safe]

    def finish(self, stopped: bool) -> tuple[str, tuple[ParsedCall, ...]]:
        """(content left to send, calls). With calls, the content sent before is the whole content.
        `stopped`: the model ended by itself; cut short (length, a guardrail's flag) it is text."""
        out = self.parser.parse(self.text, self.names, self.parallel) if stopped else ParsedOutput(self.text)
        if out.calls:
            return "", out.calls
        rest, self.sent = self.text[self.sent:], len(self.text)
        return rest, ()


def _partial_suffix(text: str, opener: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `opener`."""
    for k in range(min(len(text), len(opener) - 1), 0, -1):
        if text.endswith(opener[:k]):
            return k
    return 0
