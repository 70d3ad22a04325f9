"""The text a guardrail's output checks read, and the hold-back window measured on it.

A `MatchView` turns a stream's text, as it grows, into the two texts checks match:

- `plain`: the text as the client reads it. With `decode_json` (an output the client parses as
  JSON: a tool call's arguments, a JSON response format) JSON string escapes are decoded, so
  `"\\u0062omb"` is read as the `bomb` the client's parser yields. Patterns and the classifier
  read it.
- `folded`: `plain` folded (cluster/guardrail_rules.py `fold`: zero-width characters and soft
  hyphens removed, NFKC, casefold). Word lists read it.

Both are built unit by unit: a unit is a character (a JSON escape decoded to one) with the
combining marks, invisible characters and conjoining jamo after it, so a decomposed accent is
composed with its letter and a word split by zero-width characters reads whole. The last unit
may still grow (the next delta may start with a combining mark): it is read as it stands
(`provisional`) but never counted as text that follows a delta.

`HoldBack` releases a delta once `window` characters of every view's texts follow it. Positions
are the views' own: a match of n folded characters may cover any number of generated ones
(`b\\u200bo\\u200bm\\u200bb`), so the window is measured where rules match, never on the raw text.
Why nothing flagged leaks: a delta's end in a view is the end of the unit holding its last
character; it is released only when `window` committed characters follow that end, so every
match touching it (at most `window` long with its lookahead) lies in committed text and was
settled, and found, by the check before the release; the check scans from `window` before what
was released."""

from __future__ import annotations

import unicodedata
from collections import deque

from cluster.guardrail_rules import INVISIBLE, fold

_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")
PLAIN, FOLDED = 0, 1  # the texts of a view, as `MatchView.texts` orders them


def joins(c: str) -> bool:
    """A character that belongs to the unit before it (it may compose with it, or vanish)."""
    return c in INVISIBLE or unicodedata.combining(c) != 0 or "\u1160" <= c <= "\u11ff"


def _hex4(raw: str, i: int) -> int | None:
    digits = raw[i:i + 4]
    return int(digits, 16) if len(digits) == 4 and _HEX.issuperset(digits) else None


def json_atom(raw: str, i: int, final: bool) -> tuple[str, int] | None:
    """The character(s) raw[i:] starts with as a JSON string escape decodes, and where the next
    starts; None when raw ends inside an escape that more text may complete. Text that is not a
    valid escape is read as written (a JSON parser would refuse it; the client gets it as text)."""
    if raw[i] != "\\":
        return raw[i], i + 1
    if i + 1 >= len(raw):
        return None if not final else ("\\", i + 1)
    e = raw[i + 1]
    if e in _ESCAPES:
        return _ESCAPES[e], i + 2
    if e != "u":
        return "\\", i + 1
    if len(raw) < i + 6 and not final:
        return None
    cp = _hex4(raw, i + 2)
    if cp is None:
        return "\\", i + 1
    if 0xD800 <= cp < 0xDC00:  # a high surrogate: with a low one after it, one character
        rest = raw[i + 6:i + 12]
        if len(rest) < 6 and not final and "\\u".startswith(rest[:2]) and _HEX.issuperset(rest[2:]):
            return None  # a low surrogate's escape may be coming
        low = _hex4(raw, i + 8) if raw[i + 6:i + 8] == "\\u" else None
        if low is not None and 0xDC00 <= low < 0xE000:
            return chr(0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00)), i + 12
    return chr(cp), i + 6


class MatchView:
    """One reading of a stream's text (module docstring). `feed` reads what was added; a delta's
    end is resolved to the view's positions once the unit holding its last character is complete.
    Positions count from the stream's start; only the tail the checks still read is kept (`trim`)."""

    def __init__(self, decode_json: bool = False):
        self.decode_json = decode_json
        self.raw_pos = 0  # raw characters read into units
        self._raw = ""  # raw characters not read yet (the start of an escape more text completes)
        self.text = ["", ""]  # plain, folded: complete units, from base on
        self.base = [0, 0]  # characters trimmed from the front of each
        self._unit = ""  # the open unit, decoded
        self._marks: deque[tuple[int, list]] = deque()  # (raw end, where to write its positions)

    @property
    def pending(self) -> bool:
        """Raw text not read yet: an escape that more text may complete."""
        return bool(self._raw)

    def length(self, which: int) -> int:
        """Committed characters (complete units) of a text."""
        return self.base[which] + len(self.text[which])

    def tail(self, which: int, start: int) -> str:
        """The committed text from `start` (or from what is kept)."""
        return self.text[which][max(0, start - self.base[which]):]

    def trim(self, which: int, start: int) -> None:
        """Forget the committed text before `start`."""
        cut = start - self.base[which]
        if cut > 0:
            self.text[which], self.base[which] = self.text[which][cut:], start

    def clone(self, keep: int) -> "MatchView":
        """This view's last `keep` committed characters and what is open, without marks: to read
        text that may follow (an alternative token). Positions as this view's."""
        other = MatchView(self.decode_json)
        for w in (PLAIN, FOLDED):
            other.text[w] = self.text[w][-keep:] if keep else ""
            other.base[w] = self.length(w) - len(other.text[w])
        other._raw, other._unit = self._raw, self._unit
        return other

    def mark(self, raw_end: int, into: list) -> None:
        """Append to `into` this view's (plain, folded) end of the unit holding raw_end - 1, once known."""
        self._marks.append((raw_end, into))

    def feed(self, more: str, final: bool) -> "MatchView":
        """Read `more`; `final`: no more will come."""
        raw, i = self._raw + more, 0
        while i < len(raw):
            atom = json_atom(raw, i, final) if self.decode_json else (raw[i], i + 1)
            if atom is None:
                break
            text, i_next = atom
            if self._unit and not joins(text[0]):
                self._commit(self.raw_pos + i)
            self._unit += text
            i = i_next
        self._raw, self.raw_pos = raw[i:], self.raw_pos + i
        if final:
            self._commit(self.raw_pos + 1)
        return self

    def _commit(self, next_start: int) -> None:
        """The open unit is complete; marks that end before `next_start` are resolved."""
        self.text[PLAIN] += self._unit
        self.text[FOLDED] += fold(self._unit)
        self._unit = ""
        while self._marks and self._marks[0][0] <= next_start:
            self._marks.popleft()[1].append((self.length(PLAIN), self.length(FOLDED)))

    def provisional(self, which: int) -> str:
        return self._unit if which == PLAIN else fold(self._unit)

    def window_text(self, which: int, start: int, context: int) -> tuple[str, int]:
        """(text, start in it): the committed text from `context` before `start` (what a rule's
        lookbehind reads), then the open unit as it stands."""
        begin = max(self.base[which], start - context)
        return self.tail(which, begin) + self.provisional(which), start - begin


class HoldBack:
    """The hold-back window over one stream's deltas (anything with `.text`), read through
    `views` (one plain view when none are given): a delta is released once `window` committed
    characters of every view's texts follow its end, or when the stream ends."""

    def __init__(self, window: int, views: tuple[MatchView, ...] | None = None, context: int = 64):
        """`context`: characters before a scan's start that a check may read (its lookbehind)."""
        self.window = window
        self.context = context
        self.views = views or (MatchView(),)
        # the stream's raw text as its deltas' parts: `text += delta.text` copied everything held
        # at every delta (quadratic in a long output); joined only when read
        self._parts: list[str] = []
        self.length = 0  # raw characters added
        self.released = 0  # raw characters released to the client
        self.released_at = [(0, 0) for _ in self.views]  # each view's (plain, folded) end of what was released
        self._pending: deque[tuple[int, object, list]] = deque()  # (raw end, delta, each view's end once known)

    @property
    def text(self) -> str:
        """The raw text added so far."""
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add(self, delta, final: bool = False) -> None:
        self._parts.append(delta.text)
        self.length += len(delta.text)
        ends: list = []
        self._pending.append((self.length, delta, ends))
        for view in self.views:
            view.mark(self.length, ends)
            view.feed(delta.text, final)

    def scan_from(self, view: int, which: int) -> int:
        """Where a check of a view's text starts: a match touching unreleased text starts at most
        `window` before what was released."""
        return max(0, self.released_at[view][which] - self.window)

    def _settled(self, ends: list) -> bool:
        return len(ends) == len(self.views) and all(
            v.length(w) - end[w] >= self.window for v, end in zip(self.views, ends) for w in (PLAIN, FOLDED))

    def release(self, final: bool) -> list:
        out = []
        while self._pending and (final or self._settled(self._pending[0][2])):
            self.released, d, ends = self._pending.popleft()
            if len(ends) == len(self.views):
                self.released_at = ends
            out.append(d)
        for v, at in zip(self.views, self.released_at):  # no scan reads before this again
            for w in (PLAIN, FOLDED):
                v.trim(w, at[w] - self.window - self.context)
        return out

    @property
    def held(self) -> int:
        return self.length - self.released
