"""Decode outputs on a socket of their own, without Ray (router/replies.py): the ingress's inbox and
a replica's links on one loop, over a real Unix socket or TCP. "Serve's call" here is what the
replica's generator yields (ReplyLinks.send), read by the mailbox as Serve's stream would be."""

import asyncio
import pytest

from cluster.engine.outputs import FinishReason, RequestOutput
from cluster.errors import ErrorKind
from router import replies as rp
from router.channel import frame
from router.replies import Mailbox, RepliesLost, ReplyInbox, ReplyLinks

NODE = "node-a"
TOKENS = list(range(100, 112))


def out(ids, produced, finished=False, reason=None, error=None, kind=None) -> RequestOutput:
    return RequestOutput("r", list(ids), "", finished, reason, 5, produced, 2, error, kind)


class Engine:
    """A request's outputs, one per token (the last one final), each released by the test (`step`)."""

    def __init__(self, tokens=TOKENS):
        self.tokens = tokens
        self.released = asyncio.Semaphore(0)
        self.sent = 0

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.released.release()

    async def outputs(self):
        for i, t in enumerate(self.tokens):
            await self.released.acquire()
            last = i == len(self.tokens) - 1
            self.sent += 1
            yield out([t], i + 1, last, FinishReason.LENGTH if last else None)


async def until(predicate, what: str, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


async def started() -> ReplyInbox:
    inbox = ReplyInbox()
    await inbox.start(NODE, "127.0.0.1")
    return inbox


async def never():
    """A Serve call that has not ended."""
    await asyncio.Event().wait()
    yield


async def connected(inbox: ReplyInbox, node: str = NODE) -> ReplyLinks:
    links = ReplyLinks(node)
    links.link(inbox.address)
    await until(lambda: links.link(inbox.address) is not None, "the link to connect")
    return links


async def leg(inbox: ReplyInbox, links: ReplyLinks, engine: Engine, step_all: bool = True) -> list[RequestOutput]:
    box = inbox.open("r")
    if step_all:
        engine.step(len(engine.tokens))
    return [o async for o in box.outputs(links.send(box.reply_to, engine.outputs()))], box


def tokens_of(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


@pytest.mark.parametrize("node", [NODE, "node-b"])  # the same node: the Unix socket; another: TCP
def test_a_legs_outputs_come_as_frames_merged_and_exact(node):
    async def run():
        inbox = await started()
        links = await connected(inbox, node)
        outs, box = await leg(inbox, links, Engine())
        inbox.close()
        return outs, box, links, inbox

    outs, box, links, inbox = asyncio.run(run())
    assert tokens_of(outs) == TOKENS
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].num_output_tokens == 12
    assert (outs[-1].num_prompt_tokens, outs[-1].num_cached_tokens) == (5, 2)
    assert (box.frames, box.served) == (12, 0)  # every output a frame; nothing on Serve's call
    assert links.legs == {"framed": 1, "streamed": 0, "fell_back": 0}
    assert inbox.boxes == {} and inbox.legs == 1


def test_without_a_connection_yet_the_leg_streams_on_serves_call():
    async def run():
        inbox = await started()
        links = ReplyLinks(NODE)  # not connected: the first call starts the connect
        outs, box = await leg(inbox, links, Engine())
        await until(lambda: links.link(inbox.address) is not None, "the link to connect")
        inbox.close()
        return outs, box, links

    outs, box, links = asyncio.run(run())
    assert tokens_of(outs) == TOKENS and outs[-1].finish_reason is FinishReason.LENGTH
    assert (box.frames, box.served) == (0, 12)
    assert links.legs == {"framed": 0, "streamed": 1, "fell_back": 0}


@pytest.mark.parametrize("closed_by", ["replica", "ingress"])
def test_a_connection_closed_mid_leg_sends_the_rest_on_serves_call_each_token_once(closed_by):
    """The replica's first output on Serve's call carries the leg from its first token; the
    mailbox drops the ones it had. Closed at the ingress, a frame written before the replica
    saw the close is lost: the same resend covers it."""
    async def run():
        inbox = await started()
        links = await connected(inbox)
        engine = Engine()
        box = inbox.open("r")
        got = []

        async def consume():
            async for o in box.outputs(links.send(box.reply_to, engine.outputs())):
                got.append(o)

        task = asyncio.create_task(consume())
        engine.step(4)
        await until(lambda: len(tokens_of(got)) == 4, "four tokens")
        if closed_by == "replica":
            links.close()
        else:
            for transport in list(inbox.connections):
                transport.abort()
            engine.step(1)  # written before the replica sees the close: lost
            await until(lambda: engine.sent == 5, "the fifth output")
            await until(lambda: not links._links, "the replica to see the close")
        engine.step(len(TOKENS))
        await task
        inbox.close()
        return got, box, links

    got, box, links = asyncio.run(run())
    assert tokens_of(got) == TOKENS  # in order, none twice, none missing
    assert got[-1].finish_reason is FinishReason.LENGTH
    assert box.frames == 4 and box.served >= 1
    assert links.legs == {"framed": 1, "streamed": 0, "fell_back": 1}


def test_a_failure_that_is_the_first_output_on_serves_call_comes_after_every_token_before_it():
    """The replica resends the leg's tokens as an output of their own, then the failure as it was:
    the failure is never merged into them (legs.py ends the leg at a failure, tokens unsent)."""
    async def run():
        inbox = await started()
        links = await connected(inbox)
        gate = asyncio.Semaphore(0)

        async def engine():
            for i in range(3):
                await gate.acquire()
                yield out([10 + i], i + 1)
            await gate.acquire()
            yield out([], 3, True, FinishReason.DEADLINE, "deadline exceeded after 3 output tokens")

        box = inbox.open("r")
        got = []

        async def consume():
            async for o in box.outputs(links.send(box.reply_to, engine())):
                got.append(o)

        task = asyncio.create_task(consume())
        gate.release()
        await until(lambda: len(got) == 1, "the first token")
        for transport in list(inbox.connections):
            transport.abort()
        gate.release()
        gate.release()  # written before the replica sees the close: lost
        await until(lambda: not links._links, "the replica to see the close")
        gate.release()
        await task
        inbox.close()
        return got, links

    got, links = asyncio.run(run())
    assert [(o.token_ids, o.finish_reason) for o in got] == [([10], None), ([11, 12], None),
                                                             ([], FinishReason.DEADLINE)]
    assert links.legs["fell_back"] == 1


def test_an_ingress_that_stops_reading_past_the_bound_gets_the_rest_on_serves_call(monkeypatch):
    monkeypatch.setattr(rp, "MAX_BUFFERED_BYTES", 4096)

    async def run():
        inbox = await started()
        links = await connected(inbox, "node-b")  # TCP: its buffers are what the bound meets
        await until(lambda: len(inbox.connections) == 1, "the inbox to accept")
        [transport] = inbox.connections
        transport.pause_reading()
        tokens = list(range(20_000))
        engine = Engine(tokens)
        box = inbox.open("r")
        engine.step(len(tokens))
        outs = [o async for o in box.outputs(links.send(box.reply_to, engine.outputs()))]
        inbox.close()
        return outs, tokens, box, links

    outs, tokens, box, links = asyncio.run(run())
    assert tokens_of(outs) == tokens
    assert box.served >= 1 and links.legs["fell_back"] == 1


def test_serves_call_ending_with_no_final_output_is_a_lost_leg(monkeypatch):
    monkeypatch.setattr(rp, "LATE_FRAME_S", 0.05)

    async def ended():  # the replica returned: its final frame was written, and lost
        return
        yield

    async def run():
        inbox = await started()
        box = inbox.open("r")
        box.framed(out([1, 2], 2))
        got = []
        with pytest.raises(RepliesLost) as e:
            async for o in box.outputs(ended()):
                got.append(o)
        inbox.close()
        return got, str(e.value), inbox

    got, message, inbox = asyncio.run(run())
    assert tokens_of(got) == [1, 2]
    assert message == "decode call for r ended without its final output"
    assert inbox.boxes == {}


def test_serves_calls_error_comes_after_the_outputs_before_it():
    async def failing():
        raise RuntimeError("replica died")
        yield

    async def run():
        inbox = await started()
        box = inbox.open("r")
        box.framed(out([1], 1))
        box.framed(out([2], 2))
        got = []
        with pytest.raises(RuntimeError, match="replica died"):
            async for o in box.outputs(failing()):
                got.append(o)
        inbox.close()
        return got

    got = asyncio.run(run())
    assert [o.token_ids for o in got] == [[1, 2]]  # queued while nobody read: merged


def test_a_failure_is_never_merged_into_the_outputs_before_it_and_a_final_ends_the_leg():
    async def run():
        inbox = await started()
        box = inbox.open("r")
        box.framed(out([1], 1))
        box.framed(out([2], 2))
        box.framed(out([], 2, True, FinishReason.ERROR, "bad numbers", ErrorKind.INTERNAL))
        got = [o async for o in box.outputs(never())]
        await asyncio.sleep(0)
        reading = not box.reader.done()  # left to read the call's end (DRAIN_S), not cancelled
        inbox.close()
        return got, reading, box

    got, reading, box = asyncio.run(run())
    assert [(o.token_ids, o.finish_reason) for o in got] == [([1, 2], None), ([], FinishReason.ERROR)]
    assert (got[1].error, got[1].error_kind) == ("bad numbers", ErrorKind.INTERNAL)
    assert box.closed and reading


def test_a_consumer_that_leaves_early_cancels_the_calls_reading_and_later_frames_are_dropped():
    async def run():
        inbox = await started()
        box = inbox.open("r")
        box.framed(out([1], 1))
        outs = box.outputs(never())
        first = await anext(outs)
        await outs.aclose()
        await asyncio.sleep(0)
        inbox.deliver([[box.call, [2], False, None, 5, 2, 2, None, None]])  # its leg ended: dropped
        inbox.close()
        return first, box, inbox

    first, box, inbox = asyncio.run(run())
    assert first.token_ids == [1]
    assert box.reader.cancelled() and inbox.boxes == {} and box.frames == 1


def test_a_connection_without_the_inboxs_token_is_closed_and_its_frames_never_read():
    async def run():
        inbox = await started()
        box = inbox.open("r")
        reader, writer = await asyncio.open_unix_connection(inbox.address[1])
        writer.write(frame(b"x" * 16) + frame([box.call, [7], True, "stop", 5, 1, 0, None, None]))
        eof = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        inbox.close()
        return eof, box, inbox

    eof, box, inbox = asyncio.run(run())
    assert eof == b"" and inbox.refused == 1
    assert (box.frames, list(box.items)) == (0, [])


def test_a_frame_that_does_not_decode_fails_its_leg_alone_and_one_that_is_no_output_closes_the_connection():
    async def run():
        inbox = await started()
        bad, good = inbox.open("bad"), inbox.open("good")
        reader, writer = await asyncio.open_unix_connection(inbox.address[1])
        token = frame(inbox.address[4])
        writer.write(token[:3])  # the token split over two reads
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(token[3:] + frame([bad.call, [7], True, "no-such-reason", 5, 1, 0, None, None])
                     + frame([good.call, [8], False, None, 5, 1, 0, None, None]))
        await until(lambda: good.frames == 1, "the good leg's frame")
        open_after_bad = not reader.at_eof() and inbox.refused == 0
        writer.write(frame({"not": "an output"}))
        eof = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        with pytest.raises(RepliesLost, match="an output frame that does not decode"):
            async for _ in bad.outputs(never()):
                pass
        inbox.close()
        return open_after_bad, eof, bad, good, inbox

    open_after_bad, eof, bad, good, inbox = asyncio.run(run())
    assert open_after_bad and eof == b"" and inbox.refused == 1
    assert (bad.frames, good.frames, [o.token_ids for o in good.items]) == (0, 1, [[8]])


def test_a_leg_on_another_loop_than_the_inboxs_gets_no_mailbox():
    async def ask(inbox):
        return inbox.open("r")

    async def run():
        inbox = ReplyInbox()
        await inbox.start(NODE, "127.0.0.1")  # this loop's (the front door's)
        here = inbox.open("r")
        elsewhere = await asyncio.to_thread(asyncio.run, ask(inbox))
        inbox.close()
        return here, elsewhere, inbox

    here, elsewhere, inbox = asyncio.run(run())
    assert isinstance(here, Mailbox) and elsewhere is None and inbox.legs == 1
