"""A synthetic profile whose step times are exact in binary floating point:

    prefill(tokens, context) = 1/16 + tokens / 1024            (context does not matter)
    decode(batch, context)   = 1/64 + (batch - 1) / 1024        (context does not matter)
    transfer(bytes)          = 1/8 + bytes / 2**20              (1 KiB per token: 1/1024 s per token)
"""

from __future__ import annotations

import pytest

from cluster.planner.profile import Curve, Profile, Transfer


def prefill_s(tokens: int) -> float:
    return 1 / 16 + tokens / 1024


def decode_s(batch: int) -> float:
    return 1 / 64 + (batch - 1) / 1024


def transfer_s(tokens: int) -> float:
    return 1 / 8 + tokens * 1024 / 2**20


def synthetic_profile(max_tokens: int = 4096, max_context: int = 8192, max_batch: int = 65) -> Profile:
    return Profile(
        model={"path": "synthetic"}, device={"kind": "none"}, versions={},
        engine={"block_size": 16, "kv_block_bytes": 16 * 1024},
        prefill=Curve("prefill", "tokens", "context", [0, max_tokens], [0, max_context],
                      [[prefill_s(0)] * 2, [prefill_s(max_tokens)] * 2]),
        decode=Curve("decode", "batch", "context", [1, max_batch], [0, max_context],
                     [[decode_s(1)] * 2, [decode_s(max_batch)] * 2]),
        transfer=Transfer(1 / 8, 2**20),
    )


@pytest.fixture
def profile() -> Profile:
    return synthetic_profile()
