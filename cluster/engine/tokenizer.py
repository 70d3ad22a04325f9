"""Tokenizer over `tokenizer.json` (the `tokenizers` library), with streaming detokenization."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model directory {model_dir}")
        self._tok = _HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        if isinstance(token, dict):  # tokenizer_config may hold AddedToken dicts
            token = token.get("content")
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # Ids past the tokenizer's vocabulary (padded model vocabularies) decode to nothing.
        ids = [i for i in ids if i < self.vocab_size]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    Decodes a small window (prefix_offset..end) and emits what is new past the part already
    emitted (prefix_offset..read_offset); holds back text that ends in an incomplete UTF-8
    sequence (U+FFFD) until the next token completes it. Stop strings are matched on the full
    text and the last max(len(stop)) - 1 characters are held back until they cannot start a stop.
    """

    _CONTEXT = 4  # prompt tokens decoded with the first outputs, so spacing comes out right

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = ()):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-self._CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all decoded output text (after truncation at a stop string)
        self.emitted = 0  # characters of self.text already returned
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.stopped = False

    def add(self, token_id: int) -> None:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            start = len(self.text)
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            if self.stop:
                self._match_stop(max(0, start - self.hold))

    def _match_stop(self, search_from: int) -> None:
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def flush(self) -> None:
        """At the end, bytes held back as an incomplete character are emitted as they are."""
        if self.read_offset < len(self.ids) and not self.stopped:
            prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
            full = self.tok.decode(self.ids[self.prefix_offset :])
            start = len(self.text)
            self.text += full[len(prefix):]
            self.read_offset = len(self.ids)
            if self.stop:
                self._match_stop(max(0, start - self.hold))

    def take(self, final: bool) -> str:
        """The text that is safe to send now (all of it when the request is finished)."""
        if final:
            self.flush()
        end = len(self.text) if (final or self.stopped) else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
