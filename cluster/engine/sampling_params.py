"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.errors import InvalidRequestError

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by less is numerically
# meaningless, and by a tiny enough positive number it overflows to inf.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # below SAMPLING_EPS (0 included) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self):
        _check_int("max_tokens", self.max_tokens, lo=1)
        _check_float("temperature", self.temperature, lo=0.0, hi=100.0)
        _check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_int("top_k", self.top_k, lo=0)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.seed is not None:
            _check_int("seed", self.seed, lo=-(2**63), hi=2**63 - 1)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else _as_tuple("stop", self.stop))
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids))
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop", f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, lo=0)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1


def _as_tuple(name: str, value) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise InvalidRequestError(name, f"must be a list, got {type(value).__name__}")
    return tuple(value)


def _check_int(name: str, value, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(name, f"must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise InvalidRequestError(name, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise InvalidRequestError(name, f"must be <= {hi}, got {value}")


def _check_float(name: str, value, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(name, f"must be a number, got {value!r}")
    if math.isnan(value) or math.isinf(value):
        raise InvalidRequestError(name, f"must be a finite number, got {value}")
    if (value <= lo if lo_open else value < lo) or value > hi:
        bracket = "(" if lo_open else "["
        raise InvalidRequestError(name, f"must be in {bracket}{lo}, {hi}], got {value}")
