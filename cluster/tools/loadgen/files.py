"""Workloads read from files: a ShareGPT-format conversation dump, and a request trace to replay.

ShareGPT: a JSON list of `{"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
"value": ...}, ...]}`; the first message is the prompt and the second's length is the output
length (counted with `--tokenizer`, or fixed by `--sharegpt-output-len`).

Trace (JSONL, one request per line, the Mooncake trace format): `{"timestamp": MS, "input_length":
N, "output_length": M, "hash_ids": [...]}` with `timestamp` in milliseconds and `hash_ids`
optional. Equal hash ids stand for equal blocks of `block_size` prompt tokens, so a trace's prefix
sharing is replayed; the rest of each prompt is random. Requests start at their own timestamps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cluster.tools.loadgen.datasets import Prompt, Session, Turn, random_ids

MIN_SHAREGPT_TOKENS = 4  # vLLM's filter: drop prompts or answers shorter than this


@dataclass(frozen=True)
class ShareGPTDataset:
    """Text prompts from a ShareGPT dump, sampled in a seeded random order."""

    path: str
    output_len: int | None  # None: the recorded answer's length, counted with the tokenizer
    tokenizer: object | None
    max_model_len: int
    name: str = "sharegpt"

    def __post_init__(self):
        if self.output_len is None and self.tokenizer is None:
            raise ValueError("the sharegpt dataset needs --tokenizer (to count answer lengths) "
                             "or --sharegpt-output-len")

    def pairs(self) -> list[tuple[str, str]]:
        data = json.loads(Path(self.path).read_text())
        return [(c["conversations"][0]["value"], c["conversations"][1]["value"]) for c in data
                if len(c.get("conversations", [])) >= 2 and c["conversations"][0].get("value")]

    def sample(self, num_requests: int, rng: np.random.Generator) -> list[Session]:
        pairs = self.pairs()
        sessions = []
        for i in rng.permutation(len(pairs)):
            if len(sessions) == num_requests:
                break
            prompt, answer = pairs[int(i)]
            out_len = self.output_len
            if self.tokenizer is not None:
                in_len = len(self.tokenizer.encode(prompt))
                out_len = out_len or len(self.tokenizer.encode(answer, add_special_tokens=False))
                if min(in_len, out_len) < MIN_SHAREGPT_TOKENS or in_len + out_len > self.max_model_len:
                    continue
            sessions.append(Session((Turn(Prompt(text=prompt), out_len),)))
        return sessions


@dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()


def read_trace(path: str) -> list[TraceRecord]:
    records = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            records.append(TraceRecord(float(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                                       tuple(int(h) for h in d.get("hash_ids", ()))))
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"{path}:{n}: a trace line needs timestamp, input_length, output_length ({e})") from e
    return sorted(records, key=lambda r: r.timestamp_ms)


@dataclass(frozen=True)
class TraceDataset:
    """Replays a trace: its lengths, its prefix sharing (hash ids), its timing (scaled)."""

    path: str
    vocab_size: int
    block_size: int = 512  # tokens per hash id (Mooncake's traces use 512)
    time_scale: float = 1.0  # 0.5 replays twice as fast
    name: str = "trace"

    def sample(self, num_requests: int, rng: np.random.Generator) -> list[Session]:
        """The trace's first `num_requests` requests, in time order."""
        records = read_trace(self.path)[:num_requests]
        if not records:
            return []
        blocks: dict[int, tuple[int, ...]] = {}  # hash id -> its tokens, drawn on first sight
        t0 = records[0].timestamp_ms
        sessions = []
        for r in records:
            ids: tuple[int, ...] = ()
            for h in r.hash_ids:
                if h not in blocks:
                    blocks[h] = random_ids(rng, self.block_size, self.vocab_size)
                ids += blocks[h]
            ids = ids[:r.input_length]
            ids += random_ids(rng, r.input_length - len(ids), self.vocab_size)
            sessions.append(Session((Turn(Prompt(ids), r.output_length),),
                                    arrival_s=(r.timestamp_ms - t0) / 1000.0 * self.time_scale))
        return sessions
