"""Which version of a model serves a request: weighted splits, sticky keys, tenant overrides and
shadow traffic (issue 18's traffic policy; the ingress will call it once per request, before the
replica choice, so a request's prefill and decode are picked from one version's pools).

- **Split**: versions with weights (90/10 canary, 50/50 A/B). A request without a key draws at
  random; a request with a key (a user or session id) is placed by a hash of it, so the key keeps
  its version while the split stands.
- **Stability across changes**: each version owns an interval of [0, 1) in the order the split
  lists them, so moving weight from one version to the next (90/10 -> 80/20) moves only the keys
  in the slice that changes hands; every other key keeps its version.
- **Tenant overrides**: a tenant pinned to a version (an internal tenant on the canary, a
  customer held on the old version) gets it whatever the split says.
- **Shadow**: a fraction of requests is also mirrored to a candidate version; the caller runs the
  mirror at the lowest priority, never returns its output and never bills it.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

_SCALE = 2.0**64


@dataclass(frozen=True)
class Shadow:
    version: str
    fraction: float  # of requests (those already on `version` are never mirrored to it)


@dataclass(frozen=True)
class TrafficPolicy:
    split: tuple[tuple[str, float], ...]  # (version, weight) in order; weights >= 0, sum > 0
    tenant_overrides: dict[str, str] = field(default_factory=dict)
    shadow: Shadow | None = None
    salt: str = ""  # per model: one key lands independently in two models' splits

    def __post_init__(self):
        names = [v for v, _ in self.split]
        if not names:
            raise ValueError("split: give at least one version")
        if len(set(names)) != len(names):
            raise ValueError(f"split: a version is listed twice ({names})")
        if any(not w >= 0 for _, w in self.split) or sum(w for _, w in self.split) <= 0:
            raise ValueError(f"split: weights must be >= 0 with a positive sum, got {dict(self.split)}")
        for tenant, version in self.tenant_overrides.items():
            if version not in names:
                raise ValueError(f"tenant_overrides.{tenant}: unknown version {version!r} (known: {names})")
        if self.shadow is not None:
            if self.shadow.version not in names:
                raise ValueError(f"shadow.version: unknown version {self.shadow.version!r} (known: {names})")
            if not 0 <= self.shadow.fraction <= 1:
                raise ValueError(f"shadow.fraction: must be in [0, 1], got {self.shadow.fraction}")

    @classmethod
    def of(cls, split: dict[str, float], **kw) -> "TrafficPolicy":
        return cls(tuple(split.items()), **kw)

    @property
    def versions(self) -> list[str]:
        return [v for v, _ in self.split]

    def point(self, key: str) -> float:
        """Where a key falls in [0, 1): the same for the same key, salt and nothing else."""
        digest = hashlib.sha256(f"{self.salt}\x00{key}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / _SCALE

    def version_at(self, u: float) -> str:
        total = sum(w for _, w in self.split)
        edge = 0.0
        for version, weight in self.split:
            edge += weight / total
            if u < edge:
                return version
        return next(v for v, w in reversed(self.split) if w > 0)  # u within rounding of 1.0

    def choose(self, key: str | None, tenant: str, rng: random.Random) -> "Assignment":
        """The version that serves the request, and the version it is mirrored to (or None)."""
        if tenant in self.tenant_overrides:
            version, why = self.tenant_overrides[tenant], "tenant"
        elif key is not None:
            version, why = self.version_at(self.point(key)), "sticky"
        else:
            version, why = self.version_at(rng.random()), "random"
        mirror = None
        if self.shadow is not None and self.shadow.version != version and rng.random() < self.shadow.fraction:
            mirror = self.shadow.version
        return Assignment(version, why, mirror)


@dataclass(frozen=True)
class Assignment:
    version: str
    why: str  # "tenant" | "sticky" | "random": logged with the decision
    shadow: str | None = None
