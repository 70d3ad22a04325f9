"""Built-in guardrail rules compiled once: a word list or a regular expression, matched with the
`regex` module (which takes a timeout per search, so a pattern that backtracks catastrophically
costs at most that long), and the longest text a match can depend on.

That span is what makes an output check exact: with every output rule's span at most the hold-back
window, a match that touches text not yet released lies wholly within the last `window`
characters plus what is held, so it is found before any of it goes out
(router/ingress/gateway/guardrails.py). The span is computed on Python's own parse of the pattern (`re`
syntax: the `regex` module's extensions are accepted for input-only rules). A match is "settled"
once `lookahead` characters follow it: one for the word boundaries and `$` a rule may end with,
or the longest lookahead assertion's width (it reads text after the match)."""

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


def _words_pattern(words: tuple[str, ...]) -> str:
    """Whole words, matched against folded text (router/ingress/gateway/guardrails.py `fold`: NFKC and
    casefold per character), so the words are folded the same way (the span is the folded one)."""
    alternatives = sorted({"".join(unicodedata.normalize("NFKC", c).casefold() for c in w.strip()) for w in words},
                          key=lambda w: (-len(w), w))
    return r"(?i)(?<!\w)(?:" + "|".join(re.escape(w) for w in alternatives) + r")(?!\w)"


def _lookahead_width(tree) -> int | None:
    """The longest lookahead assertion in a parsed pattern (None: unbounded)."""
    widest = 0
    for op, av in tree:
        subs = []
        if op in (C.ASSERT, C.ASSERT_NOT):
            direction, sub = av
            if direction == 1:
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
            w = _lookahead_width(sub)
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
    ahead = _lookahead_width(tree)
    if hi >= C.MAXREPEAT or ahead is None:
        return CompiledRule(compiled, None, 1, "a repetition without an upper bound")
    settle = max(1, ahead)  # an end assertion (\b, $, a lookahead) reads at most this far past the match
    return CompiledRule(compiled, hi + settle, settle)


def compile_rule(words: list[str] | tuple[str, ...], pattern: str | None) -> CompiledRule:
    """A rule's compiled form (cached: each distinct rule is compiled once per process)."""
    return _compile(tuple(words), pattern)
