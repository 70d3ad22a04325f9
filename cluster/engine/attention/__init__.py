"""Attention backends, resolved once by name ("auto" -> cpu_paged on CPU float32 when it builds, else torch)."""

from cluster.engine.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSpan
from cluster.engine.attention.registry import AttentionBackend, resolve_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "DecodeGroup", "PrefillSpan", "resolve_backend"]
