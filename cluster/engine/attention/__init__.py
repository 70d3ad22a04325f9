"""Attention backends, resolved once by name ("auto" -> torch; the others are opt-in)."""

from cluster.engine.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSpan
from cluster.engine.attention.registry import AttentionBackend, resolve_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "DecodeGroup", "PrefillSpan", "resolve_backend"]
