"""What one request measured, on the client, with `time.perf_counter`.

TTFT runs from sending the request to the first response message that carries a token. A message
may carry several tokens (the server merges deltas that queue up), so inter-token latencies are
the gaps between token-carrying messages, and `message_tokens` keeps how many tokens each one
carried (throughput over time needs it). TPOT is derived later: (e2e - ttft) / (tokens - 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Literal

Status = Literal["pending", "ok", "failed", "incomplete"]


@dataclass
class RequestRecord:
    index: int  # order in which requests were sent
    session: int
    turn: int
    arrival_at: float  # perf_counter: when the request was due (sessions' arrival, or previous turn's end)
    max_tokens: int
    prompt_len: int | None = None  # tokens the client sent (token-id prompts); the server's count is prompt_tokens
    sent_at: float = 0.0  # perf_counter: just before the call was made
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    message_tokens: list[int] = field(default_factory=list)
    latency_s: float | None = None
    prompt_tokens: int = 0  # the server's usage (final message)
    output_tokens: int = 0
    cached_tokens: int = 0
    status: Status = "pending"
    code: str = ""  # "" on success; a gRPC status name, "HTTP 503", ...
    error: str = ""
    _last_at: float = 0.0
    clock: ClassVar[Callable[[], float]] = time.perf_counter  # tests set a fake one on the instance

    def sent(self) -> None:
        self.sent_at = self._last_at = self.clock()

    def on_tokens(self, n: int) -> None:
        """Called as soon as a message carrying `n` >= 1 tokens arrives."""
        now = self.clock()
        if self.ttft_s is None:
            self.ttft_s = now - self.sent_at
        else:
            self.itls_s.append(now - self._last_at)
        self._last_at = now
        self.message_tokens.append(n)

    def finish(self, prompt_tokens: int, output_tokens: int, cached_tokens: int) -> None:
        self.latency_s = self.clock() - self.sent_at
        self.prompt_tokens, self.output_tokens, self.cached_tokens = prompt_tokens, output_tokens, cached_tokens
        self.status = "ok"

    def fail(self, code: str, error: str) -> None:
        self.latency_s = self.clock() - self.sent_at
        self.status, self.code, self.error = "failed", code, error

    @property
    def queue_s(self) -> float:
        """Time the request waited on the client (the concurrency cap) before it was sent."""
        return max(0.0, self.sent_at - self.arrival_at)

    @property
    def tpot_s(self) -> float | None:
        if self.status != "ok" or self.output_tokens < 2 or self.ttft_s is None:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)
