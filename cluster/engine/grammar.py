"""Structured output (`response_format`): JSON grammars with llguidance, a matcher per request.

llguidance was measured against xgrammar and outlines-core (docs/benchmarks.md, "Grammar
libraries"): xgrammar masks a token about twice as fast, but it imports torch, so the front door
could not check a schema with the library the engines use; outlines-core has no free-form JSON
(`json_object`) and costs ~1 ms a token at a 49k vocabulary. llguidance has no dependencies, does
not import torch, builds a grammar in about a millisecond (its lexer is lazy) and checks a schema
without a tokenizer, so the ingress and the engines accept exactly the same schemas.

Whitespace is not flexible: JSON is emitted compact (`,` and `:`), so a small model cannot loop on
whitespace and every token carries content.

State rule: a request's matcher has consumed exactly its `output_token_ids[:consumed]`. Before
each mask it consumes the tokens added since (the token sampled last step; on decode the prefill's
first token; on a migrated leg every token already sent), so the state follows the request across
prefill → decode, a migration and a preemption with one code path: replay.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from threading import Lock

import llguidance as llg

from cluster.errors import InvalidRequestError

FIELD = "response_format"
_DEFAULTS = {"whitespace_flexible": False}
# Not strict: keywords llguidance does not implement (uniqueItems, not, contains, ...) are ignored
# (lenient); strict: they refuse the schema, since the output could not be guaranteed to follow it.
_LENIENT = _DEFAULTS | {"lenient": True}
JSON_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True)
class ResponseFormat:
    """A constrained output: `json_object` (any JSON object) or `json_schema` (`schema` as JSON text)."""

    kind: str  # "json_object" | "json_schema"
    schema: str = JSON_OBJECT_SCHEMA
    strict: bool = False

    def grammar(self) -> str:
        """The llguidance grammar (a JSON string); raises InvalidRequestError naming response_format.
        Cached per format: the ingress and every engine the request visits ask for it."""
        return _grammar(self)


@lru_cache(maxsize=64)  # refusals are not cached: they raise
def _grammar(fmt: ResponseFormat) -> str:
    g = _checked(fmt.schema, _LENIENT, "the JSON schema does not compile")
    return _checked(fmt.schema, _DEFAULTS, "strict: the JSON schema cannot be enforced") if fmt.strict else g


def _checked(schema: str, defaults: dict, why: str) -> str:
    try:
        g = llg.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(FIELD, f"{why}: {e}") from None
    failed, messages = llg.LLMatcher.validate_grammar_with_warnings(g)
    if failed:
        raise InvalidRequestError(FIELD, f"{why}: {'; '.join(messages)[:500]}")
    return g


def schema_depth(value) -> int:
    """Nesting depth of a parsed JSON value (iterative: a hostile depth cannot hit the recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def response_format(kind: str, schema=None, strict: bool = False, *, max_bytes: int, max_depth: int) -> ResponseFormat:
    """A client's response_format (schema parsed from JSON, as the edges get it), within the caps."""
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind != "json_schema":
        raise InvalidRequestError(FIELD, f"type must be text, json_object or json_schema, got {kind!r}")
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(FIELD, "json_schema.schema must be a JSON object")
    depth = schema_depth(schema)  # before serialising it: bounded by the body size, no recursion
    if depth > max_depth:
        raise InvalidRequestError(FIELD, f"the JSON schema nests {depth} deep; at most {max_depth} is accepted")
    text = json.dumps(schema, separators=(",", ":"), sort_keys=True)
    if len(text.encode()) > max_bytes:
        raise InvalidRequestError(
            FIELD, f"the JSON schema has {len(text.encode())} bytes; at most {max_bytes} are accepted")
    if not isinstance(strict, bool):
        raise InvalidRequestError(FIELD, f"json_schema.strict must be a boolean, got {strict!r}")
    return ResponseFormat("json_schema", text, strict)


class GrammarFailure(Exception):
    """A request's grammar state is broken (a replayed token it refuses, or nothing allowed)."""


class Grammars:
    """One engine's grammars: the tokenizer as llguidance sees it, a bounded LRU of built matchers
    per schema (a request gets a deep copy: the build is paid once per schema), a matcher per request.
    Used from the engine's step thread only, except `compile` (thread-safe)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...], cache_size: int = 64):
        """eos_token_ids: the model's EOS ids the tokenizer has (none: the tokenizer's own)."""
        # vocab_size: at least the tokenizer's (the model's may be padded past it, or cut below it).
        self._tok = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                    eos_token=list(eos_token_ids) or None)
        self.words = (self._tok.vocab_size + 31) // 32  # int32 words of one bitmask row
        self._cache: OrderedDict[ResponseFormat, llg.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = Lock()
        self._active: dict[str, tuple[llg.LLMatcher, list[int]]] = {}  # request id -> (matcher, [consumed])

    def compile(self, fmt: ResponseFormat) -> llg.LLMatcher:
        with self._lock:
            m = self._cache.get(fmt)
            if m is not None:
                self._cache.move_to_end(fmt)
                return m
        m = llg.LLMatcher(self._tok, fmt.grammar(), log_level=0)
        if m.is_error():
            raise InvalidRequestError(FIELD, f"the JSON schema does not compile: {m.get_error()[:500]}")
        with self._lock:
            self._cache[fmt] = m
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return m

    def fill(self, request_id: str, fmt: ResponseFormat, output: list[int], bitmask_row) -> None:
        """Bring the request's matcher up to `output`, then write its allowed tokens into one
        int32 row of a [*, ceil(V / 32)] bitmask (`bitmask_row`: a contiguous CPU tensor)."""
        state = self._active.get(request_id)
        if state is None:
            state = self._active[request_id] = (self.compile(fmt).deep_copy(), [0])
        m, consumed = state
        if len(output) > consumed[0]:
            if not m.consume_tokens(output[consumed[0]:]):
                raise GrammarFailure(f"the tokens generated so far do not follow response_format: {m.get_error()[:300]}")
            consumed[0] = len(output)
        if m.is_stopped() and not m.is_accepting():
            raise GrammarFailure(f"response_format: the grammar allows no further token: {m.get_error()[:300]}")
        m.unsafe_compute_mask_ptr(bitmask_row.data_ptr(), bitmask_row.numel() * 4)
        if m.is_error():
            raise GrammarFailure(f"response_format: {m.get_error()[:300]}")

    def release(self, request_id: str) -> None:
        self._active.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._active)
