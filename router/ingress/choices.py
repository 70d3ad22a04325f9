"""A request's choices (OpenAI's `n`, GenerateRequest.n), for both edges: starting them so they
share the prompt's blocks, collecting one, closing them, and a forced tool call's result.

As vLLM does for n > 1, each choice is a request of its own through the flow (choice i samples
with seed + i); the edges shape what they return (openai_responses.py, grpc_api.py)."""

from __future__ import annotations

import asyncio
import json
import uuid
from contextlib import aclosing
from dataclasses import replace
from typing import AsyncIterator

from router.ingress.flow import Delta
from router.ingress.openai_schema import ToolUse
from router.ingress.tool_parser import openai_tool_calls

Choice = tuple[AsyncIterator[Delta], Delta]  # a running request's stream and its first delta


async def start_choices(flow, n: int, prompt, ids, sp, tenant: str, deadline, messages,
                         tools: list[dict] | None = None, session: str | None = None) -> list[Choice]:
    """Start the request's n choices (`flow`: what has `generate`, a RequestFlow or the catalog's
    Routed); return once each has its first delta. Bad input, refusals
    and early failures raise here (and stop every choice started), so they become HTTP errors.

    As vLLM does for n > 1, each choice is a request of its own (choice i samples with seed + i
    when a seed is given). Choice 0 runs first, and the others start once it has its second
    token: by then its prompt's full blocks are cached where it was prefilled and, after its KV
    pull, on its decode replica, so the others compute only the prompt's last partial block and
    pull only that (the full blocks are shared, not copied). Without a session key of their own,
    the choices share one (`choices:<id>`) so the router keeps them on choice 0's replicas while
    their load allows."""
    session = session if session is not None or n == 1 else f"choices:{uuid.uuid4().hex}"

    def start(i: int) -> AsyncIterator[Delta]:
        child = sp if i == 0 or sp.seed is None else replace(sp, seed=sp.seed + i)
        return flow.generate(prompt, ids, child, tenant=tenant, deadline=deadline, messages=messages, tools=tools,
                             session=session)

    streams = [start(0)]
    try:
        firsts = [await anext(streams[0])]
        if n > 1:
            if firsts[0].finish_reason is None:  # its second delta: its decode leg holds the prompt
                second = await anext(streams[0], None)
                if second is not None:
                    streams[0] = prepend(second, streams[0])
            streams += [start(i) for i in range(1, n)]
            rest = await asyncio.gather(*(anext(s) for s in streams[1:]), return_exceptions=True)
            if failed := next((r for r in rest if isinstance(r, BaseException)), None):
                raise failed
            firsts += rest
    except BaseException:
        await close_streams(streams)
        raise
    return list(zip(streams, firsts))


async def prepend(item: Delta, stream: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """`item`, then the rest of `stream` (closing this closes `stream`)."""
    async with aclosing(stream):
        yield item
        async for d in stream:
            yield d


async def close_streams(streams) -> None:
    for s in streams:
        try:
            await s.aclose()  # the flow's cleanup: cancels the request on both legs
        except Exception:  # noqa: BLE001 — a stream that already failed has nothing to close
            pass


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
    source when this ends, the client's going away included."""
    for i, (_, first) in enumerate(choices):
        yield i, first
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream):
        try:
            async for d in stream:
                await queue.put((i, d))
            await queue.put((i, None))
        except Exception as e:  # noqa: BLE001 — handed to the consumer, which raises it
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, (s, _) in enumerate(choices)]
    try:
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
        await close_streams([s for s, _ in choices])
