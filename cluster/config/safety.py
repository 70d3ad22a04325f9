"""Guardrail policies (rules, the classifier) and the response cache."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from cluster.config.common import Strict


class GuardrailRule(Strict):
    """A built-in check: a word list (whole words, matched on normalised text: zero-width
    characters and soft hyphens removed, NFKC, casefolded: any case, full-width or decomposed form
    of a word, or one split by invisible characters) or a regular expression (on the text as
    generated). Output a client parses as JSON (tools, a JSON response format) is also read with
    its string escapes decoded, by both kinds.
    Compiled once (router/ingress/gateway/guardrails.py) with the `regex` module and run with a timeout.
    A rule that checks output must have a bounded match length that fits the policy's hold-back
    window (so no match can reach released text): refused at load otherwise. Output rules use
    Python `re` syntax (how their length is bounded); lookbehind is fine, lookahead adds its width."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Metric label and audit name")
    words: list[str] = Field(default_factory=list, max_length=10_000, description="Whole words or phrases")
    pattern: str | None = Field(None, max_length=4096, description="A regular expression (instead of words)")
    applies_to: Literal["input", "output", "both"] = "both"

    @model_validator(mode="after")
    def _one_kind(self) -> "GuardrailRule":
        if bool(self.words) == (self.pattern is not None):
            raise ValueError(f"rule {self.name!r}: give words or pattern (exactly one)")
        if any(not w.strip() or len(w) > 256 for w in self.words):
            raise ValueError(f"rule {self.name!r}: words must be non-blank, at most 256 characters")
        return self


class ClassifierCheckOptions(Strict):
    """A policy's call to the guardrail classifier deployment (AppConfig.guardrail_classifier):
    flagged when its score is >= threshold. A call that fails or runs past timeout_s follows the
    policy's on_error. On output it is called once per release (each delta), over the window. A
    prompt is sent in overlapping chunks, `input_concurrency` calls at a time, each bounded by
    timeout_s: the input check's bound is timeout_s x ceil(chunks / input_concurrency), so a
    long prompt is neither refused (closed) nor passed unchecked (open) for its length."""

    name: str = Field("classifier", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Metric label and audit name")
    threshold: float = Field(0.5, gt=0, le=1)
    timeout_s: float = Field(0.5, gt=0, le=30, description="Bound on one call (input and output alike)")
    applies_to: Literal["input", "output", "both"] = "both"
    input_chunk_chars: int = Field(4096, ge=64, le=200_000, description="A prompt is classified in chunks this long")
    input_overlap_chars: int = Field(256, ge=0, description="Characters a chunk shares with the next")
    input_concurrency: int = Field(8, ge=1, le=256, description="A prompt's chunks classified at once")

    @model_validator(mode="after")
    def _overlap_fits(self) -> "ClassifierCheckOptions":
        if self.input_overlap_chars >= self.input_chunk_chars:
            raise ValueError("input_overlap_chars must be less than input_chunk_chars")
        return self


class ClassifierDeploymentOptions(Strict):
    """The guardrail classifier, its own Serve deployment with its own resources (never an engine's
    step). Deployed when a policy names a classifier. kind keyword_stand_in: a RULE-BASED STAND-IN
    for a classifier model (cluster/serving/classifier.py), scoring 1.0 when one of `words` occurs."""

    kind: Literal["keyword_stand_in"] = "keyword_stand_in"
    words: list[str] = Field(default_factory=list, max_length=10_000)
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.25, ge=0)
    max_text_chars: int = Field(200_000, ge=1, description="Longer texts are refused by the deployment (an error)")


class GuardrailPolicy(Strict):
    """Checks on a tenant's prompt (before any engine work) and output stream. Output reaches
    the client only after the checks covering it passed: the last `holdback_chars` characters
    are held back until more text (or the end) comes."""

    rules: list[GuardrailRule] = Field(default_factory=list, max_length=256)
    classifier: ClassifierCheckOptions | None = Field(None, description="Also ask the classifier deployment")
    holdback_chars: int = Field(
        64, ge=1, le=4096, description="Hold-back window, in characters of output text: at least every "
        "output rule's longest match plus its lookahead (one character for word boundaries)")
    rule_timeout_s: float = Field(
        0.05, gt=0, le=1, description="Bound on one rule's scan of an output delta, and of each 4,096-character "
        "chunk of a prompt (the `regex` module's timeout, wall clock: a loaded machine needs slack); a prompt's "
        "bound grows with its length, and a word list costs about 0.3 us per character however many words")
    on_error: Literal["closed", "open"] = Field(
        "closed", description="A check that times out or fails: closed = treat as flagged, open = pass (counted)")

    @model_validator(mode="after")
    def _rules_fit(self) -> "GuardrailPolicy":
        names = [r.name for r in self.rules] + ([self.classifier.name] if self.classifier else [])
        if len(set(names)) != len(names):
            raise ValueError("guardrail rule names must be unique within a policy")
        from cluster.guardrail_rules import compile_rule, RuleError  # noqa: PLC0415

        for rule in self.rules:
            try:
                compiled = compile_rule(rule.words, rule.pattern)
            except RuleError as e:
                raise ValueError(f"rule {rule.name!r}: {e}") from None
            if rule.applies_to != "input":
                if compiled.span is None:
                    raise ValueError(f"rule {rule.name!r}: an output rule needs a bounded match length "
                                     f"(no *, + or {{n,}}): {compiled.why_unbounded}")
                if compiled.span > self.holdback_chars:
                    raise ValueError(f"rule {rule.name!r}: a match and its lookahead span up to {compiled.span} "
                                     f"characters, more than holdback_chars {self.holdback_chars}")
        return self


class ResponseCacheOptions(Strict):
    """The response cache (router/ingress/gateway/response_cache.py): each ingress replica keeps finished
    temperature-0 completions of the tenants that opt in, keyed by tenant, model, prompt token
    ids and every sampling parameter."""

    default_tenant: bool = Field(False, description="The 'default' tenant (no tenants configured) opts in")
    ttl_s: float = Field(60.0, gt=0, le=86_400, description="An entry is served for this long after it was stored")
    max_entries: int = Field(1024, ge=1, description="Entries per ingress replica (least recently used go first)")
    max_bytes: int = Field(16 * 2**20, ge=1024, description="Bytes of stored text, token ids and logprobs")
    max_entry_bytes: int = Field(256 * 2**10, ge=256, description="A larger completion is not stored")
