"""What the simulator is asked: a cluster configuration and an SLO."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ClusterConfig:
    prefill_replicas: int
    decode_replicas: int
    chunk_tokens: int = 512  # max_num_batched_tokens of every engine
    skip_prefill_tokens: int = 64  # routing.local_prefill_threshold: shorter prompts prefill on decode
    decode_blocks: int = 1024  # KV blocks per decode replica
    max_num_seqs: int = 64  # per decode replica
    # Cores the engine processes share (one machine's CPUs, as in this repo's validation runs):
    # while n steps run at once each progresses at 1 / profile.slowdown(n, cores) of its profiled
    # pace (measured, or n / cores when > 1). None: every replica has its own device (GPUs).
    cores: float | None = None

    @property
    def replicas(self) -> int:
        return self.prefill_replicas + self.decode_replicas

    def label(self) -> str:
        if self.prefill_replicas == 0:  # no prefill pool: the threshold means nothing
            return f"0P+{self.decode_replicas}D colocated chunk={self.chunk_tokens}"
        return (f"{self.prefill_replicas}P+{self.decode_replicas}D chunk={self.chunk_tokens} "
                f"skip<{self.skip_prefill_tokens}")

    @classmethod
    def parse(cls, text: str, base: "ClusterConfig | None" = None) -> "ClusterConfig":
        """`1P+2D` (0P: colocated), optionally `:chunk=256,skip=64`; the rest from `base`."""
        m = re.fullmatch(r"(\d+)P\+(\d+)D(?::(.*))?", text.strip())
        if not m:
            raise ValueError(f"configuration {text!r}: expected NP+MD[:chunk=T,skip=T]")
        keys = {"chunk": "chunk_tokens", "skip": "skip_prefill_tokens"}
        try:
            extra = {keys[k]: int(v) for k, v in (kv.split("=", 1) for kv in (m[3] or "").split(",") if kv)}
        except (KeyError, ValueError) as e:
            raise ValueError(f"configuration {text!r}: options are chunk=T and skip=T ({e})") from e
        return replace(base or cls(0, 1), prefill_replicas=int(m[1]), decode_replicas=int(m[2]), **extra)

    def app_doc(self, model: str, block_size: int) -> dict:
        """This configuration as a `pdserve up` app config (AppConfig's fields)."""
        doc = {
            "mode": "colocated" if self.prefill_replicas == 0 else "disaggregated",
            "model": model,
            "engine": {"block_size": block_size, "num_blocks": self.decode_blocks, "max_num_seqs": self.max_num_seqs,
                       "max_num_batched_tokens": self.chunk_tokens},
            "prefill": {"num_replicas": self.prefill_replicas},
            "decode": {"num_replicas": self.decode_replicas},
        }
        if self.prefill_replicas:
            doc["routing"] = {"local_prefill_threshold": self.skip_prefill_tokens}
        return doc


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    @classmethod
    def parse(cls, text: str) -> "SLO":
        """`ttft=0.5,tpot=0.05` (seconds; a trailing `ms` is read as milliseconds)."""
        kv = dict(item.split("=", 1) for item in text.split(",") if item)
        try:
            vals = {k: float(v[:-2]) / 1000 if v.endswith("ms") else float(v.removesuffix("s"))
                    for k, v in kv.items()}
            return cls(vals.pop("ttft"), vals.pop("tpot"))
        except (KeyError, ValueError) as e:
            raise ValueError(f"slo {text!r}: expected ttft=SECONDS,tpot=SECONDS ({e})") from e
