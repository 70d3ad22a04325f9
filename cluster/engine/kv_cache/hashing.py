"""Chained content hashes of full KV blocks.

A block's identity is h(parent_hash, token_ids, salt): two blocks are interchangeable iff the
whole prefix up to and including them is equal under the same model and salt. The hash is
BLAKE2b over bytes, so it is identical across processes and machines (never Python's hash()).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

BlockHash = bytes  # 16-byte digest

_ROOT = b"pdserve-kv-v1"


def extend_salt(salt: bytes, extra: str) -> bytes:
    """A salt with one more part (a deployment's or a tenant's cache salt); hashed down when it
    would pass BLAKE2b's 64-byte key limit, so no part is ever cut off."""
    if not extra:
        return salt
    raw = salt + b"|" + extra.encode()
    return raw if len(raw) <= 64 else hashlib.blake2b(raw, digest_size=32).digest()


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], salt: bytes) -> BlockHash:
    h = hashlib.blake2b(digest_size=16, key=salt)  # a salt over 64 bytes raises: see extend_salt
    h.update(parent if parent is not None else _ROOT)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


def hash_request_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: bytes,
    known: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, extending the already-known prefix `known`."""
    hashes = list(known)
    parent = hashes[-1] if hashes else None
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], salt)
        hashes.append(parent)
    return hashes
