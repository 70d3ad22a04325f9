"""What a request's headers (HTTP) or metadata (gRPC) carry besides its body: its deadline
(`x-pdserve-timeout-s`) and its session key.

The session key is for session affinity in the router (router/sessions.py). Where it comes
from, first found wins:
- the `x-session-id` HTTP header, or gRPC metadata of that name (what routers in front of vLLM
  key sticky sessions on: llm-d, the production stack's `--session-key`);
- the OpenAI body's `prompt_cache_key` (OpenAI's own routing hint for prompt-cache hits);
- the OpenAI body's `user` (the end user: their conversations share a preference).
The key only sways the choice of replicas; it never changes the output. It is capped (length,
characters) here, before the router sees it; `user` keeps its own cap (256 characters, any text).
"""

from __future__ import annotations

import math
import re
import time

from cluster.errors import InvalidRequestError

TIMEOUT_HEADER = "x-pdserve-timeout-s"  # the request's deadline, seconds from now (HTTP header or gRPC metadata)
SESSION_HEADER = "x-session-id"
_SESSION_CHARS = re.compile(r"[A-Za-z0-9._:@/+=-]+")
_ALLOWED = "letters, digits and . _ : @ / + = -"


def session_key(header: str | None, prompt_cache_key: str | None, user: str | None, max_chars: int) -> str | None:
    """The session key from its sources (None: no session), tagged by source so a header value
    and a `user` of the same text are different sessions. Raises InvalidRequestError naming the
    field past the cap or outside the allowed characters."""
    for field, value, tag in ((SESSION_HEADER, header, "s"), ("prompt_cache_key", prompt_cache_key, "s")):
        if value is None:
            continue
        if len(value) > max_chars:
            raise InvalidRequestError(field, f"longer than {max_chars} characters")
        if not _SESSION_CHARS.fullmatch(value):
            raise InvalidRequestError(field, f"must be 1 to {max_chars} characters: {_ALLOWED}")
        return f"{tag}:{value}"
    return None if not user else f"u:{user}"


def parse_deadline(value: str | None, max_chars: int = 32) -> float | None:
    """Wall-clock deadline from a timeout header; None without one."""
    if value is None:
        return None
    if len(value) > max_chars:
        raise InvalidRequestError(TIMEOUT_HEADER, f"longer than {max_chars} characters")
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise InvalidRequestError(TIMEOUT_HEADER, f"must be a positive number of seconds, got {value!r}")
    return time.time() + seconds
