"""A reply's choices (OpenAI's `n`, GenerateRequest.n) as both edges read them: interleaved as
they come, one collected whole, all closed, and a tool-using choice's result. The front door
starts them (gateway/front_door.py); the edges shape what they return (openai_responses.py,
grpc_api.py)."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import AsyncIterator

from router.ingress.flow.tool_parser import openai_tool_calls
from router.ingress.flow.tools import ToolUse
from router.ingress.gateway.front_door import close_streams
from router.ingress.request import Delta


async def collect(stream: AsyncIterator[Delta], first: Delta) -> tuple[str, Delta, list]:
    text, last, logprobs = first.text, first, list(first.logprobs or ())
    async for d in stream:
        text += d.text
        last = d
        logprobs += d.logprobs or ()
    return text, last, logprobs


def tool_result(use: ToolUse, text: str, finish_reason: str | None) -> tuple[list[dict] | None, str | None, str | None]:
    """A tool-using output -> (tool_calls, content, finish_reason). Forced: the grammar makes the
    text valid JSON of the call's schema once it stopped; cut short (length), the text is
    returned as content, with its finish reason, and no call. "auto": the model's parser; its
    calls end with finish "tool_calls", else the text is content."""
    if use.parser is not None:  # calls only when the model stopped by itself (not length, not a guardrail's flag)
        out = use.parser.parse(text, use.names, use.parallel) if finish_reason == "stop" else None
        return (openai_tool_calls(out.calls), out.content, "tool_calls") if out and out.calls else (
            None, text, finish_reason)
    if finish_reason != "stop":
        return None, text, finish_reason
    try:
        parsed = json.loads(text)
    except ValueError:
        return None, text, finish_reason
    if use.forced == "named":
        calls = [(use.name, text)]
    else:
        calls = [(c["name"], json.dumps(c["parameters"], separators=(",", ":"))) for c in parsed]
    tool_calls = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                   "function": {"name": name, "arguments": arguments}} for name, arguments in calls]
    # OpenAI: "tool_calls" when the model chose to call ("required"); "stop" for a named function
    return tool_calls, None, "tool_calls" if use.forced == "required" else "stop"


async def interleave(choices) -> AsyncIterator[tuple[int, Delta]]:
    """The n choices' deltas as they come, each with its choice's index (every first delta
    first, in order). A failure of one choice raises here; every choice is stopped at its
    source when this ends, the client's going away included (at a first delta too). One choice
    (n = 1: nearly every request) is read in the caller's task: no pump task and no queue
    between its stream and the edge, one task switch less a message (docs/benchmarks.md, "One
    choice, read in place")."""
    if len(choices) == 1:
        try:
            yield 0, choices[0].first
            async for d in choices[0].stream:
                yield 0, d
        finally:
            await close_streams([choices[0].stream])
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream):
        try:
            async for d in stream:
                await queue.put((i, d))
            await queue.put((i, None))
        except Exception as e:  # noqa: BLE001 — handed to the consumer, which raises it
            await queue.put((i, e))

    tasks: list[asyncio.Future] = []
    try:
        for i, c in enumerate(choices):
            yield i, c.first
        tasks = [asyncio.ensure_future(pump(i, c.stream)) for i, c in enumerate(choices)]
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_streams([c.stream for c in choices])
