"""RequestFlow.prepare: a short token-id prompt with nothing to inspect is checked on the event loop
(two thread hops a request were most of what preparing cost the front door); a longer one, text,
or one a stage inspects goes to the tokenizing threads. The checks and errors are the same."""

import asyncio
import threading

import pytest

from cluster.config import AppConfig
from cluster.engine.sampling_params import SamplingParams
from cluster.errors import InvalidRequestError
from router.ingress.flow.request_flow import INLINE_TOKEN_IDS, TOKENIZE_THREADS, RequestFlow
from router.ingress.request import ClientRequest, SamplingSpec


@pytest.fixture(scope="module")
def flow(tiny_model):
    return RequestFlow(AppConfig(model=str(tiny_model), default_max_tokens=16), None, None)


def _request(ids=None, prompt=None) -> ClientRequest:
    return ClientRequest("t", SamplingSpec(), None, prompt, None if ids is None else tuple(ids))


async def _with_threads_busy(flow, request: ClientRequest, inspect=None):
    """`request` prepared while every tokenizing thread is held: (prepared within 0.25 s?, the
    request, or the error), the threads then let go."""
    release = threading.Event()
    held = [flow._tokenize_pool.submit(release.wait, 30) for _ in range(TOKENIZE_THREADS)]
    task = asyncio.ensure_future(flow.prepare("rid-1", request, SamplingParams(max_tokens=4), inspect))
    try:
        done, _ = await asyncio.wait([task], timeout=0.25)
    finally:
        release.set()
    result = await asyncio.gather(task, return_exceptions=True)
    for h in held:
        h.result(timeout=5)
    return bool(done), result[0]


def test_a_short_token_id_prompt_is_prepared_while_the_tokenizing_threads_are_busy(flow):
    at_once, made = asyncio.run(_with_threads_busy(flow, _request(ids=[1, 2, 3])))
    assert at_once and made.prompt_token_ids == [1, 2, 3]


@pytest.mark.parametrize("kind", ["long ids", "text", "inspected"])
def test_a_long_prompt_text_or_an_inspected_one_waits_for_a_tokenizing_thread(flow, kind):
    texts = []
    request = {"long ids": _request(ids=[1] * (INLINE_TOKEN_IDS + 1)), "text": _request(prompt="hello there"),
               "inspected": _request(ids=[1, 2, 3])}[kind]
    inspect = (lambda text: texts.append(text())) if kind == "inspected" else None
    at_once, made = asyncio.run(_with_threads_busy(flow, request, inspect))
    assert not at_once
    if kind == "long ids":  # past the tiny model's 512 positions: refused there, as on the loop
        assert isinstance(made, InvalidRequestError) and str(made) == (
            f"prompt: has {INLINE_TOKEN_IDS + 1} tokens; the context length is 512, so at most 511 fit")
    else:
        assert made.prompt_token_ids == (flow.tokenizer.encode("hello there") if kind == "text" else [1, 2, 3])
    assert texts == ([flow.tokenizer.decode([1, 2, 3])] if kind == "inspected" else [])


def test_the_inline_check_refuses_as_the_threads_do(flow):
    vocab = flow.validator.vocab_size
    _, error = asyncio.run(_with_threads_busy(flow, _request(ids=[1, vocab])))
    assert isinstance(error, InvalidRequestError) and error.field == "prompt_token_ids"
    assert error.message == f"token id {vocab} at index 1 is outside the vocabulary [0, {vocab})"
