"""API keys: `authorization: Bearer <key>` (gRPC metadata or HTTP header)."""

from __future__ import annotations

import hmac
from typing import Iterable

from router.flow import ServingError


class ApiKeyAuth:
    def __init__(self, keys: Iterable[str]):
        self.keys = tuple(keys)  # empty: auth off (the demo)

    def check(self, authorization: str | None) -> None:
        if not self.keys:
            return
        value = (authorization or "").strip()
        key = value[len("Bearer "):].strip() if value.lower().startswith("bearer ") else ""
        # compare_digest on every key: the time taken does not depend on which key matched
        if not key or not any(hmac.compare_digest(key, k) for k in self.keys):
            raise ServingError("UNAUTHENTICATED", "missing or unknown API key (authorization: Bearer <key>)")
