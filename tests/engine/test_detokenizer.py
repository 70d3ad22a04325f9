"""The incremental detokenizer against the real SmolLM2 tokenizer: its text equals transformers'
`decode` of all the output ids in tricky cases (multi-byte characters split over byte tokens,
spaces and newlines, special tokens skipped, invalid bytes), and the work per token stays bounded
however long the output (counted by a wrapper around the real tokenizer)."""

import pytest
from transformers import AutoTokenizer

from cluster.engine.tokenizer import _BYTE_OF_CHAR, IncrementalDetokenizer, Tokenizer


class CountingTokenizer:
    """The real tokenizer; each `decode` call's number of ids is recorded."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self.calls: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.calls.append(len(ids))
        return self._tok.decode(ids, skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.fixture(scope="module")
def toks(smollm2):
    return Tokenizer(smollm2), AutoTokenizer.from_pretrained(smollm2)


def byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """One byte-level token per byte (the 256 single-byte tokens of the vocabulary)."""
    char_of = {b: c for c, b in _BYTE_OF_CHAR.items()}
    return [tok.token_to_id(char_of[b]) for b in data]


def stream(tok, prompt_ids, ids) -> tuple[str, list[int]]:
    """Feed ids one at a time as the engine does; the text sent and the ids decoded per token."""
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, prompt_ids)
    text, per_token = "", []
    for i in ids:
        before = sum(counting.calls)
        detok.add(i)
        text += detok.take(final=False)
        per_token.append(sum(counting.calls) - before)
    return text + detok.take(final=True), per_token


BOUND = 3 * (IncrementalDetokenizer.CONTEXT + 2 * IncrementalDetokenizer.MAX_PENDING + 1)


def cases(tok: Tokenizer) -> dict[str, list[int]]:
    im_start, im_end, eot = (tok.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    prose = tok.encode("Grüße aus Köln!  Ça va?\n\n  indented\tcode(x) → 42 € 🙂👍🏽 日本語のテキスト ", False)
    return {
        "prose": prose * 60,
        "split characters": byte_ids(tok, "€🙂é日".encode() * 200),
        "special tokens skipped": ([im_start] * 300 + prose + [im_end, eot]) * 3,
        "invalid bytes": byte_ids(tok, b"\x80" * 400 + b"ok \xe2\x82" + b"\xf0\x9f" * 50) + prose + byte_ids(tok, b"\xe2\x82"),
        "all of it": (prose + byte_ids(tok, "€🙂".encode()) + [im_end] * 50 + byte_ids(tok, b"\xc3" * 100)) * 20,
    }


@pytest.mark.parametrize("name", ["prose", "split characters", "special tokens skipped", "invalid bytes", "all of it"])
def test_text_equals_transformers_decode_and_work_per_token_is_bounded(toks, name):
    tok, ref = toks
    ids = cases(tok)[name]
    prompt = tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False)
    text, per_token = stream(tok, prompt, ids)
    assert text == ref.decode(ids, skip_special_tokens=True)
    assert len(ids) >= 500 and max(per_token) <= BOUND, (len(ids), max(per_token))
    # the same for the last tokens as for the first: nothing grows with the output's length
    assert max(per_token[-100:]) <= BOUND and sum(per_token) <= BOUND * len(ids)


def test_a_stop_string_split_over_byte_tokens_still_ends_the_text(toks):
    tok, ref = toks
    ids = tok.encode("Answer: 42 then STOP€ and more", False)
    detok = IncrementalDetokenizer(tok, [], stop=["STOP€"])
    for i in ids[:-1] + byte_ids(tok, " tail".encode()):
        detok.add(i)
        if detok.stopped:
            break
    assert detok.stopped and detok.take(final=True) == "Answer: 42 then "
