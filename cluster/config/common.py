"""Small pieces every part of the config uses."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """A config section: frozen, and an unknown field is an error naming it (never silently ignored)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
