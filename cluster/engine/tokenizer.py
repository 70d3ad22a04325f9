"""Tokenizer over `tokenizer.json` (the `tokenizers` library), with streaming detokenization.

Reads a checkpoint as transformers (5) does: the tokens tokenizer_config.json's `added_tokens_decoder`
(or the legacy added_tokens.json) adds beyond tokenizer.json, the named special tokens (which a chat
template sees), and the chat templates (cluster/engine/chat_template.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer

from cluster.engine.chat_template import DEFAULT, load_chat_templates, special_pattern

# The named special tokens a chat template sees as variables (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model directory {model_dir}")
        self._tok = _HFTokenizer.from_file(str(path))
        self.config = _read_json(model_dir / "tokenizer_config.json")
        added = self.config.get("added_tokens_decoder")
        # A checkpoint without added_tokens_decoder is legacy: transformers then reads
        # special_tokens_map.json (which wins over tokenizer_config.json) and added_tokens.json.
        legacy = _read_json(model_dir / "special_tokens_map.json") if added is None else {}
        named = {name: _content(legacy.get(name) or self.config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        self.special_tokens: dict[str, str] = {name: tok for name, tok in named.items() if tok}
        if added is None:
            added = {str(i): {"content": tok, "special": tok in self.special_tokens.values()}
                     for tok, i in _read_json(model_dir / "added_tokens.json").items()}
        self._add_missing_tokens(added)
        self.chat_templates: dict[str, str] = load_chat_templates(model_dir, self.config)
        self.chat_template: str | None = self.chat_templates.get(DEFAULT)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # ids `decode` drops (skip_special_tokens, the default): special tokens
        specials = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self.skipped_ids = frozenset(specials)
        self.control_tokens: tuple[str, ...] = tuple(sorted(specials.values(), key=len, reverse=True))
        self._plain: _HFTokenizer | None = None  # this tokenizer with special tokens read as text
        self._byte_level = _is_byte_level(json.loads(path.read_text(encoding="utf-8")).get("decoder"))

    def _add_missing_tokens(self, added: dict[str, dict]) -> None:
        """Add what `added_tokens_decoder` lists and tokenizer.json lacks, at the ids it states."""
        for token_id, spec in sorted(added.items(), key=lambda kv: int(kv[0])):
            content = spec["content"]
            if self._tok.token_to_id(content) is not None:
                continue
            special = spec.get("special", False)
            token = AddedToken(content, single_word=spec.get("single_word", False), lstrip=spec.get("lstrip", False),
                               rstrip=spec.get("rstrip", False), normalized=spec.get("normalized", not special),
                               special=special)
            (self._tok.add_special_tokens if special else self._tok.add_tokens)([token])
            if self._tok.token_to_id(content) != int(token_id):
                raise ValueError(f"tokenizer_config.json adds {content!r} as id {token_id}, but the tokenizer "
                                 f"gives it id {self._tok.token_to_id(content)}")

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text, with the tokens tokenizer_config.json added."""
        return self._tok.to_str()

    def token_to_id(self, token: str | dict | None) -> int | None:
        token = _content(token)
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        """The ids of a chat rendered as pieces (chat_template.render_chat_pieces): the template's
        special tokens as their ids, the text between them as plain text, where a special token's
        string is ordinary characters (a client cannot forge a role). When no text piece holds
        one, the joined text is encoded as transformers encodes it: the same ids."""
        if not any(self._has_special(t) for t, special in pieces if not special):
            return self.encode("".join(t for t, _ in pieces), add_special_tokens=False)
        if self._plain is None:
            plain = _HFTokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True  # its own setting: the shared tokenizer's stays
            self._plain = plain
        ids: list[int] = []
        for text, special in pieces:
            ids += [self._tok.token_to_id(text)] if special else self._plain.encode(text, add_special_tokens=False).ids
        return ids

    def _has_special(self, text: str) -> bool:
        return bool(self.control_tokens) and special_pattern(self.control_tokens).search(text) is not None

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (OpenAI's logprobs `bytes`): a byte-level BPE piece mapped back
        to its bytes, a byte-fallback piece <0xNN> as that byte, any other piece as UTF-8 with
        SentencePiece's word mark as a space. Ids the tokenizer lacks (a padded vocabulary): b""."""
        piece = self._tok.id_to_token(token_id) if token_id < self.vocab_size else None
        if piece is None:
            return b""
        if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """One token's text (OpenAI's logprobs `token`): its bytes, a partial character as U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # Ids past the tokenizer's vocabulary (padded model vocabularies) decode to nothing.
        if len(ids) and max(ids) >= self.vocab_size:  # a C loop: the copy only when there is one
            ids = [i for i in ids if i < self.vocab_size]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte, inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(
        range(ord("\xae"), ord("\xff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_OF_CHAR = _bytes_to_unicode()


def _is_byte_level(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_is_byte_level(d) for d in decoder.get("decoders") or ())


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _content(token: str | dict | None) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, with work per token bounded whatever the
    output's length (vLLM's prefix_offset / read_offset scheme, with the window kept bounded).

    It keeps only a window of ids: the last committed run (decoded for context: spacing, merges)
    then the pending ids. Each token decodes the window with and without the pending ids and
    commits what is new once it does not end in an incomplete UTF-8 sequence (U+FFFD), which the
    next token may complete. Two things could stall the window and make each token decode the
    whole output (quadratic): ids that decode to nothing (special tokens, skipped as decode skips
    them: never added), and invalid bytes at the end that no later token fixes (a random or
    broken model). For the latter, past MAX_PENDING pending ids the text of all but the last
    STRADDLE of them is committed as soon as the whole window's text starts with it (a character
    is at most 4 bytes and every token carries one: what those ids decode to can no longer
    change). So the text emitted equals `tokenizer.decode(output ids)` (with the prompt's last
    ids as context), and a token costs at most three decodes of at most
    CONTEXT + 2 * MAX_PENDING + 1 ids.

    Stop strings are matched on the full text and the last max(len(stop)) - 1 characters are held
    back until they cannot start a stop.
    """

    CONTEXT = 4  # prompt tokens decoded with the first outputs, so spacing comes out right
    MAX_PENDING = 8  # ids past the committed text before those that can no longer change are committed
    STRADDLE = 3  # trailing ids that may still complete a character (4 bytes at most, >= 1 per id)

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = ()):
        self.tok = tokenizer
        self._skipped = tokenizer.skipped_ids
        self.ids = [i for i in prompt_ids if i not in self._skipped][-self.CONTEXT:]  # the window
        self.read_offset = len(self.ids)  # ids before it are committed (decoded for context only)
        self.text = ""  # all decoded output text (after truncation at a stop string)
        self.emitted = 0  # characters of self.text already returned
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.stopped = False

    def add(self, token_id: int) -> None:
        if token_id in self._skipped or token_id >= self.tok.vocab_size:  # decodes to nothing (decode drops it)
            return
        ids = self.ids
        ids.append(token_id)
        decode = self.tok.decode
        prefix = decode(ids[: self.read_offset])
        full = decode(ids)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._commit(full[len(prefix):], len(ids))
        elif len(ids) - self.read_offset > self.MAX_PENDING:  # stalled: commit what cannot change
            end = len(ids) - self.STRADDLE
            settled = decode(ids[:end])
            if full.startswith(settled) and settled.startswith(prefix):
                self._commit(settled[len(prefix):], end)

    def _commit(self, text: str, end: int) -> None:
        """`text` is what ids[read_offset:end] add: append it; those ids become the context."""
        start = len(self.text)
        self.text += text
        del self.ids[: self.read_offset]
        self.read_offset = end - self.read_offset
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
            prefix = self.tok.decode(self.ids[: self.read_offset])
            full = self.tok.decode(self.ids)
            self._commit(full[len(prefix):], len(self.ids))

    def take(self, final: bool) -> str:
        """The text that is safe to send now (all of it when the request is finished)."""
        if final:
            self.flush()
        end = len(self.text) if (final or self.stopped) else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
