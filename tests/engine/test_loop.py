"""Async streaming: tokens arrive as produced; leaving the stream early frees the blocks."""

import asyncio
import threading

import pytest

from cluster.engine.loop import EngineLoop, chunk_tokens
from cluster.engine.llm_engine import LLMEngine
from cluster.errors import InvalidRequestError
from cluster.engine.sampling_params import SamplingParams
from tests.reference import hf_greedy


@pytest.fixture(scope="module")
def aengine(tiny_model):
    ae = EngineLoop(LLMEngine.from_model(tiny_model, num_blocks=64))
    yield ae
    ae.shutdown()


async def engine_state(ae: EngineLoop) -> tuple[int, bool, int]:
    """(free blocks, unfinished work, cancelled so far), read on the loop thread. Its command
    queue is FIFO, so this runs after the aborts queued before it: no polling, no wait."""
    eng = ae.engine
    return await ae.call(lambda: (eng.kv.num_free_blocks, eng.has_unfinished(),
                                  eng.stats.finished_by_reason.get("cancelled", 0)))


def test_stream_is_incremental_and_equals_the_reference(aengine, tiny_model):
    prompt = [256] + list(range(1, 30))

    async def run():
        chunks = []
        async for out in aengine.generate("s1", prompt_token_ids=prompt,
                                          sampling=SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)):
            chunks.append(out)
        return chunks

    chunks = asyncio.run(run())
    assert len(chunks) == 10  # one delta per token: the first arrives before the last is made
    assert [c.finished for c in chunks] == [False] * 9 + [True]
    assert sum((c.token_ids for c in chunks), []) == hf_greedy(tiny_model, prompt, 10)


def test_concurrent_streams(aengine, tiny_model):
    prompts = [[256] + list(range(i, i + 5 + 3 * i)) for i in range(8)]

    async def one(i):
        toks = []
        async for out in aengine.generate(f"c{i}", prompt_token_ids=prompts[i],
                                          sampling=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)):
            toks += out.token_ids
        return toks

    async def run():
        return await asyncio.gather(*(one(i) for i in range(8)))

    results = asyncio.run(run())
    assert results == [hf_greedy(tiny_model, p, 6) for p in prompts]


def test_leaving_the_stream_early_aborts_and_frees_blocks(aengine):
    async def run():
        n = 0
        cancelled = (await engine_state(aengine))[2]
        agen = aengine.generate("cancel-me", prompt_token_ids=[256] + [3] * 40,
                                sampling=SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        async for _ in agen:
            n += 1
            if n == 3:
                break
        await agen.aclose()
        return n, cancelled, await engine_state(aengine)

    n, cancelled, state = asyncio.run(run())
    assert n == 3
    assert state == (aengine.engine.kv.num_blocks, False, cancelled + 1)  # aborted at once, not run out
    aengine.engine.check_invariants()


def test_cancelled_task_frees_blocks(aengine):
    streaming = asyncio.Event()
    received = []

    async def consume():
        async for out in aengine.generate("task", prompt_token_ids=[256] + [4] * 40,
                                          sampling=SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)):
            received.append(out)
            streaming.set()

    async def run():
        cancelled = (await engine_state(aengine))[2]
        task = asyncio.create_task(consume())
        await asyncio.wait_for(streaming.wait(), 30)  # cancelled mid-stream, its blocks held
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return cancelled, await engine_state(aengine)

    cancelled, state = asyncio.run(run())
    # the abort, not the request running out its 400 tokens, freed the blocks
    assert state == (aengine.engine.kv.num_blocks, False, cancelled + 1)
    assert 1 <= len(received) < 400 and not received[-1].finished
    aengine.engine.check_invariants()


def test_bad_input_raises_before_streaming_and_the_loop_survives(aengine):
    async def run():
        with pytest.raises(InvalidRequestError):
            async for _ in aengine.generate("bad", prompt_token_ids=[1000]):
                pass
        out = [o async for o in aengine.generate("ok", prompt="hi",
                                                 sampling=SamplingParams(max_tokens=2, ignore_eos=True))]
        return out[-1]

    last = asyncio.run(run())
    assert last.finished and last.num_output_tokens == 2


def test_chunk_tokens_auto_grows_with_the_streams_and_is_capped():
    assert [chunk_tokens("auto", n) for n in (0, 1, 8, 9, 16, 17, 32, 56, 57, 64, 65, 5000)] == \
        [1, 1, 1, 2, 2, 3, 4, 7, 8, 8, 8, 8]
    assert [chunk_tokens(k, 500) for k in (1, 3, 64)] == [1, 3, 64]


def test_a_stream_interval_sends_the_first_token_alone_then_chunks(tiny_model):
    from cluster.engine.outputs import merge_outputs

    class HoldSecondStep:
        """Keeps the second step's token from being delivered until the consumer took the first:
        otherwise a slow consumer finds both queued and merges them (as it should), and the first
        message holds 2 tokens (1 fresh-clone run in ~20 on a busy machine)."""

        def __init__(self):
            self.steps, self.first_taken = 0, threading.Event()

        def after_step(self, now):  # runs before the step's outputs are delivered
            self.steps += 1
            if self.steps == 2:
                self.first_taken.wait(10)

        def service(self, now, busy):
            pass

    hold = HoldSecondStep()
    ae = EngineLoop(LLMEngine.from_model(tiny_model, num_blocks=64), stream_interval=4, hooks=[hold])
    prompt = [256] + list(range(1, 30))

    async def run():
        req = ae.engine.make_request("si", None, prompt, SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))
        chunks = []
        async for out in ae.stream("si", lambda: ae.engine.add(req), merge=merge_outputs):
            chunks.append(out)
            hold.first_taken.set()
        return chunks

    try:
        chunks = asyncio.run(run())
    finally:
        ae.shutdown()
    sizes = [len(c.token_ids) for c in chunks]
    # the first token alone and at once; then no message with fewer than 4 but the last (the end goes at once)
    assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and 1 <= sizes[-1] and sum(sizes) == 14
    assert len(chunks) <= 1 + 13 // 4 + 1 and [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert sum((c.token_ids for c in chunks), []) == hf_greedy(tiny_model, prompt, 14)
    assert ae.engine.kv.num_free_blocks == ae.engine.kv.num_blocks
