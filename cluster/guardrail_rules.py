"""Built-in guardrail rules compiled once: a word list or a regular expression, matched with the
`regex` module (which takes a timeout per search, so a pattern that backtracks catastrophically
costs at most that long), and the longest text a match can depend on.

That span is what makes an output check exact: with every output rule's span at most the hold-back
window, a match that touches text not yet released lies wholly within the last `window`
characters plus what is held, so it is found before any of it goes out
(router/ingress/gateway/guardrails.py). The span is computed on Python's own parse of the pattern (`re`
syntax: the `regex` module's extensions are accepted for input-only rules). A match is "settled"
once `lookahead` characters follow it: one for the word boundaries and `$` a rule may end with,
or the longest lookahead assertion's width (it reads text after the match); `lookbehind` is how
far before a match's start it reads.

Word lists match normalised text (`fold`) and are compiled as a trie (`(?:b(?:ad|omb))`), so a
search costs about the same per character however many words there are (10,000 words: ~0.3 us
per character, where a flat alternation costs ~15 us): the input check is linear in the prompt."""

from __future__ import annotations

import re
import re._constants as C  # noqa: N812
import re._parser as sre
import unicodedata
from dataclasses import dataclass
from functools import lru_cache

import regex


class RuleError(ValueError):
    """A rule that does not compile."""


@dataclass(frozen=True)
class CompiledRule:
    pattern: "regex.Pattern"
    span: int | None  # longest match + lookahead, in characters; None: unbounded (input-only)
    lookahead: int  # characters that must follow a match before it is settled (>= 1)
    why_unbounded: str = ""
    lookbehind: int = 1  # characters before a match's start it may read (output rules: fixed width)


# Removed before matching: they are invisible, so a word split by them reads as the word.
INVISIBLE = "\u200b\u200c\u200d\u2060\ufeff\u00ad"  # zero-width space, non-joiner, joiner, word joiner, BOM, soft hyphen
_DROP = dict.fromkeys(map(ord, INVISIBLE))


def fold(text: str) -> str:
    """What a word rule sees, and how its words are read: invisible characters (zero-width, soft
    hyphen) removed, NFKC (compatibility forms such as full width become plain, decomposed
    accents are composed), casefolded. Never what is delivered."""
    if text.isascii():
        return text.lower()  # NFKC leaves ASCII as is; casefold is lower
    return unicodedata.normalize("NFKC", text.translate(_DROP)).casefold()


def _trie(words: set[str]) -> str:
    """An alternation of `words` factored by common prefixes (regex tries them in one pass)."""
    root: dict = {}
    for w in words:
        node = root
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict) -> str:
        alternatives = [re.escape(ch) + emit(node[ch]) for ch in sorted(k for k in node if k)]
        if not alternatives:
            return ""
        if len(alternatives) == 1 and "" not in node:
            return alternatives[0]
        body = "(?:" + "|".join(alternatives) + ")"
        return body + "?" if "" in node else body
    return emit(root)


def _words_pattern(words: tuple[str, ...]) -> str:
    """Whole words, matched against folded text (`fold`), so the words are folded the same way
    (the span is the folded one)."""
    return r"(?i)(?<!\w)(?:" + _trie({fold(w.strip()) for w in words}) + r")(?!\w)"


def _assert_width(tree, ahead: bool) -> int | None:
    """The widest lookahead (`ahead`) or lookbehind assertion in a parsed pattern (None: unbounded)."""
    widest = 0
    for op, av in tree:
        subs = []
        if op in (C.ASSERT, C.ASSERT_NOT):
            direction, sub = av
            if (direction == 1) == ahead:
                hi = sub.getwidth()[1]
                if hi >= C.MAXREPEAT:
                    return None
                widest = max(widest, hi)
            subs = [sub]
        elif op == C.BRANCH:
            subs = av[1]
        elif op in (C.MAX_REPEAT, C.MIN_REPEAT, C.POSSESSIVE_REPEAT):
            subs = [av[2]]
        elif op in (C.SUBPATTERN, C.ATOMIC_GROUP):
            subs = [av[-1]]
        elif op == C.GROUPREF_EXISTS:
            subs = [s for s in av[1:] if s is not None]
        for sub in subs:
            w = _assert_width(sub, ahead)
            if w is None:
                return None
            widest = max(widest, w)
    return widest


@lru_cache(maxsize=1024)
def _compile(words: tuple[str, ...], pattern: str | None) -> CompiledRule:
    source = _words_pattern(words) if words else pattern
    try:
        compiled = regex.compile(source, regex.V0)
    except (regex.error, OverflowError, RecursionError) as e:
        raise RuleError(f"does not compile: {e}") from None
    try:
        tree = sre.parse(source)
    except (re.error, OverflowError, RecursionError) as e:
        if compiled.search("") is not None:
            raise RuleError("matches the empty string") from None
        return CompiledRule(compiled, None, 1, f"not in Python re syntax ({e})")
    lo, hi = tree.getwidth()
    if lo == 0:
        raise RuleError("matches the empty string")
    ahead, behind = _assert_width(tree, True), _assert_width(tree, False)
    if hi >= C.MAXREPEAT or ahead is None or behind is None:
        return CompiledRule(compiled, None, 1, "a repetition without an upper bound")
    settle = max(1, ahead)  # an end assertion (\b, $, a lookahead) reads at most this far past the match
    return CompiledRule(compiled, hi + settle, settle, lookbehind=max(1, behind))  # \b reads one before


def compile_rule(words: list[str] | tuple[str, ...], pattern: str | None) -> CompiledRule:
    """A rule's compiled form (cached: each distinct rule is compiled once per process)."""
    return _compile(tuple(words), pattern)
