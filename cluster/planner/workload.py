"""What the simulator replays: requests with an arrival time, a prompt length and an output length.

Two sources: a trace in the load generator's JSONL format (`timestamp` in ms, `input_length`,
`output_length`; `hash_ids` are read but prefix sharing is not simulated yet), or a synthetic
workload (Poisson or gamma arrivals, lengths uniform in a range), seeded."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RequestSpec:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def read_trace(path: str | Path, time_scale: float = 1.0) -> list[RequestSpec]:
    """A load generator trace (cluster/tools/loadgen/files.py's format), times from its first request."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            out.append(RequestSpec(float(d["timestamp"]) / 1000 * time_scale, int(d["input_length"]),
                                   int(d["output_length"])))
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"{path}:{n}: a trace line needs timestamp, input_length, output_length ({e})") from e
    out.sort(key=lambda r: r.arrival_s)
    t0 = out[0].arrival_s if out else 0.0
    return [RequestSpec(r.arrival_s - t0, r.prompt_tokens, r.output_tokens) for r in out]


def _span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


@dataclass(frozen=True)
class SyntheticWorkload:
    """`rate` requests/s (gamma gaps with shape `burstiness`; 1 = Poisson), `n` requests, prompt and
    output lengths uniform in [lo, hi]."""

    rate: float
    n: int
    prompt: tuple[int, int]
    output: tuple[int, int]
    burstiness: float = 1.0
    seed: int = 0

    @classmethod
    def parse(cls, text: str) -> "SyntheticWorkload":
        """`rate=8,n=1000,prompt=128:384,output=64[,burstiness=1][,seed=0]`."""
        try:
            kv = dict(item.split("=", 1) for item in text.split(",") if item)
            w = cls(float(kv.pop("rate")), int(kv.pop("n")), _span(kv.pop("prompt")), _span(kv.pop("output")),
                    float(kv.pop("burstiness", 1.0)), int(kv.pop("seed", 0)))
        except (KeyError, ValueError) as e:
            raise ValueError(f"workload {text!r}: expected rate=R,n=N,prompt=LO:HI,output=LO:HI ({e})") from e
        if kv:
            raise ValueError(f"workload {text!r}: unknown keys {sorted(kv)}")
        if w.rate <= 0 or w.n <= 0 or w.burstiness <= 0 or min(*w.prompt, *w.output) < 1:
            raise ValueError(f"workload {text!r}: rate, n, burstiness and lengths must be positive")
        return w

    def requests(self) -> list[RequestSpec]:
        rng = random.Random(self.seed)
        t, out = 0.0, []
        for _ in range(self.n):
            t += rng.gammavariate(self.burstiness, 1.0 / (self.rate * self.burstiness))
            out.append(RequestSpec(t, rng.randint(*self.prompt), rng.randint(*self.output)))
        return out
