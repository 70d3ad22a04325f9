"""Small pieces every part of the config uses."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict, FieldSerializationInfo

S = TypeVar("S", bound=BaseModel)


class Strict(BaseModel):
    """A config section: frozen, and an unknown field is an error naming it (never silently ignored)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def overlay(base: S | None, over: S | None) -> S | None:
    """`base` with the keys `over` sets laid over it, key by key: where both hold a section (a
    nested model: `speculative`, `kv_tiers`, `autoscaling`, a pool's `engine`) it is laid over the
    same way; any other value `over` sets (a number, a list, a mapping such as `resources`, null)
    replaces the base's. A key neither sets keeps its default. The result counts both layers'
    keys as set, so another layer can go over it (app < manifest < version). How a model
    version's `engine`, `prefill` and `decode`, and a pool's `engine`, combine with the app-wide
    sections (docs/architecture.md, "Models and versions"). Raises ValueError when the result
    does not validate (e.g. `min_replicas` over a base's smaller `max_replicas`)."""
    if base is None or over is None:
        return over if base is None else base
    fields = {k: getattr(base, k) for k in base.model_fields_set}
    for k in over.model_fields_set:
        v, b = getattr(over, k), getattr(base, k)
        fields[k] = overlay(b, v) if isinstance(v, BaseModel) and isinstance(b, BaseModel) else v
    return type(base).model_validate(fields)


def as_written(section: BaseModel | None, info: FieldSerializationInfo) -> dict | None:
    """A section laid over another (`overlay`) is dumped with only the keys it sets, so the dump,
    read back, lays the same keys over (the ingress and the replicas get the config as a dump)."""
    return None if section is None else section.model_dump(mode=info.mode, exclude_unset=True)
