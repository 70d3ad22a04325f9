"""Where engines publish their PeerInfo for the handshake. No Ray needed here; the serving layer
provides a Ray-actor store with the same interface."""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path
from typing import Protocol

from kv_transfer.handle import PeerInfo


class MetadataStore(Protocol):
    def publish(self, info: PeerInfo) -> None: ...

    def lookup(self, engine_id: str) -> PeerInfo | None: ...


class InMemoryMetadataStore:
    def __init__(self):
        self._peers: dict[str, PeerInfo] = {}

    def publish(self, info: PeerInfo) -> None:
        self._peers[info.engine_id] = info

    def lookup(self, engine_id: str) -> PeerInfo | None:
        return self._peers.get(engine_id)


class FileMetadataStore:
    """One file per engine in a shared directory; writes are atomic (rename)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, engine_id: str) -> Path:
        if not engine_id or "/" in engine_id or engine_id.startswith("."):
            raise ValueError(f"engine_id {engine_id!r} is not a valid file name")
        return self.dir / f"{engine_id}.peer"

    def publish(self, info: PeerInfo) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(info, f)
        os.replace(tmp, self._path(info.engine_id))

    def lookup(self, engine_id: str) -> PeerInfo | None:
        try:
            return pickle.loads(self._path(engine_id).read_bytes())
        except FileNotFoundError:
            return None
