"""A request's own speculation state, kept on the Request (so it ends with it: nothing to leak)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecState:
    k: int  # drafts to ask for next (adaptive, 1..options.k)
    off_reason: str | None = None  # set: this request never speculates (its sampling needs the plain path)
    acceptance: float = 0.5  # recent drafts accepted / proposed (EWMA over verified steps)
    verified_steps: int = 0  # since speculation last (re)started for it
    paused_until: int = 0  # no drafts until it has this many output tokens
    pauses: int = 0  # times paused for low acceptance (the pause doubles each time)
    proposer: dict = field(default_factory=dict)  # the proposer's per-request index
