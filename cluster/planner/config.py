"""What the simulator is asked: a cluster configuration and an SLO."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClusterConfig:
    prefill_replicas: int
    decode_replicas: int
    chunk_tokens: int = 512  # max_num_batched_tokens of every engine
    skip_prefill_tokens: int = 64  # routing.local_prefill_threshold: shorter prompts prefill on decode
    decode_blocks: int = 1024  # KV blocks per decode replica
    max_num_seqs: int = 64  # per decode replica

    @property
    def replicas(self) -> int:
        return self.prefill_replicas + self.decode_replicas

    def label(self) -> str:
        if self.prefill_replicas == 0:  # no prefill pool: the threshold means nothing
            return f"0P+{self.decode_replicas}D colocated chunk={self.chunk_tokens}"
        return (f"{self.prefill_replicas}P+{self.decode_replicas}D chunk={self.chunk_tokens} "
                f"skip<{self.skip_prefill_tokens}")


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
