"""KV transfer between tensor-parallel degrees: which bytes each decode rank reads, and from whom.

Every rank registers its own pool with its own NIXL agent (rank 0's is the engine's transport;
ranks 1..N-1 make a RankAgent when the driver says so, cluster/engine/distributed/step.py), and
the engine publishes all of them in its PeerInfo.ranks. Rank 0 of the decode engine (the driver)
plans every rank's READ from the head map (kv_transfer/head_map.py) and the block ids; each rank
posts its own part from its own agent, and the pull is done when every rank's part is.

Descriptors. A rank's block is [L, 2, bs, H_rank, D]: heads are the second-fastest axis, so a
head slice of a block is L * 2 * bs runs of count * D elements. Where the slice is the whole
block on both sides (equal degrees, or one replicated head to one replicated head) a block is one
descriptor; otherwise each run is one (rows = L * 2 * bs descriptors per block and slice; a run is
count * D * elem bytes: 256 B for one bf16 head of 128). NIXL needs the two sides' descriptors
pairwise equal in size, so a slice that is whole on one side only is cut into rows on that side
too. Each rank reads exactly its heads' bytes: no staging buffer and no relayout. The price is the
descriptor count; a pool laid out head-major ([L, 2, H, bs, D]) would make a slice L * 2 runs of
bs * D, which the attention kernels do not read today.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from cluster.engine.distributed import step
from cluster.engine.distributed.step import KVPoll, KVRead, KVRegister, KVRelease
from kv_transfer.handle import KVLayout, PeerInfo, RankPeer
from kv_transfer.head_map import HeadSlice, head_map

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankRead:
    """One decode rank's READ from one prefill rank: descriptors pairwise equal in size."""

    remote_agent: str
    remote_metadata: bytes
    remote_mem_type: str
    local: np.ndarray  # [n, 3] uint64 (address, bytes, device) in the decode rank's pool
    remote: np.ndarray  # [n, 3] in the prefill rank's pool

    @property
    def num_bytes(self) -> int:
        return int(self.local[:, 1].sum())


def slice_pairs(layout: KVLayout, peer: KVLayout, s: HeadSlice) -> np.ndarray:
    """[runs, 3] (offset in the decode block, offset in the prefill block, bytes) of one slice."""
    rows = layout.num_layers * layout.parts * layout.block_size  # K and V, or the one latent entry
    head = layout.head_dim * layout.elem_bytes
    dst_heads, src_heads = layout.rank_kv_heads, peer.rank_kv_heads
    if s.count == dst_heads == src_heads:
        return np.array([[0, 0, rows * s.count * head]], dtype=np.int64)
    r = np.arange(rows, dtype=np.int64)
    out = np.empty((rows, 3), dtype=np.int64)
    out[:, 0] = r * dst_heads * head + s.dst_head * head
    out[:, 1] = r * src_heads * head + s.src_head * head
    out[:, 2] = s.count * head
    return out


def plan_reads(layout: KVLayout, local: Sequence[RankPeer], device_id: int, mem_type: str, peer: PeerInfo,
               local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> list[list[RankRead]]:
    """For each local (decode) rank, its READs (one per prefill rank it reads from) of the heads it
    owns of remote_blocks[i] into local_blocks[i]. Raises ValueError for a block outside a pool
    (a prefill host tier is not mapped between degrees)."""
    theirs = peer.kv_layout
    ranks = peer.ranks or (RankPeer(peer.agent_name, peer.agent_metadata, peer.base_addr),)
    lb = np.asarray(local_blocks, dtype=np.int64)
    rb = np.asarray(remote_blocks, dtype=np.int64)
    if len(lb) != len(rb) or (len(rb) and (rb.max() >= peer.num_blocks or rb.min() < 0)):
        raise ValueError(f"blocks {list(remote_blocks)} are not all in {peer.engine_id}'s pool of {peer.num_blocks} "
                         "(a host tier's slots are not read between tensor-parallel degrees)")
    plan = []
    for rank, slices in enumerate(head_map(layout.num_kv_heads, theirs.tensor_parallel_size,
                                           layout.tensor_parallel_size)):
        reads = []
        for src, group in itertools.groupby(slices, key=lambda s: s.src_rank):
            pairs = np.concatenate([slice_pairs(layout, theirs, s) for s in group])  # [runs, 3]
            n = len(lb) * len(pairs)
            loc, rem = np.empty((n, 3), dtype=np.uint64), np.empty((n, 3), dtype=np.uint64)
            loc[:, 0] = (local[rank].base_addr + lb[:, None] * layout.block_bytes + pairs[None, :, 0]).ravel()
            rem[:, 0] = (ranks[src].base_addr + rb[:, None] * theirs.block_bytes + pairs[None, :, 1]).ravel()
            loc[:, 1] = rem[:, 1] = np.tile(pairs[:, 2], len(lb))
            loc[:, 2], rem[:, 2] = device_id, peer.device_id
            reads.append(RankRead(ranks[src].agent_name, ranks[src].agent_metadata, peer.mem_type, loc, rem))
        plan.append(reads)
    return plan


class ReadPoster:
    """Posts and tracks RankReads on one NIXL agent (remote agents loaded once by name)."""

    def __init__(self, agent, mem_type: str):
        self.agent = agent
        self.mem_type = mem_type
        self.loaded: set[str] = set()

    def post(self, reads: Sequence[RankRead]) -> list:
        handles = []
        try:
            for read in reads:
                if read.remote_agent not in self.loaded:
                    self.agent.add_remote_agent(read.remote_metadata)
                    self.loaded.add(read.remote_agent)
                xfer = self.agent.initialize_xfer(
                    "READ", self.agent.get_xfer_descs(read.local, self.mem_type),
                    self.agent.get_xfer_descs(read.remote, read.remote_mem_type), read.remote_agent)
                handles.append(xfer)
                if self.agent.transfer(xfer) == "ERR":
                    raise RuntimeError(f"posting a READ from {read.remote_agent} failed")
        except Exception:
            self.release(handles)  # best effort: one NIXL will not release is logged
            raise
        return handles

    def state(self, handles: list) -> str:
        """DONE when every READ is, ERR when one failed, else PROC."""
        states = [self.agent.check_xfer_state(h) for h in handles]
        return "ERR" if "ERR" in states else "DONE" if all(s == "DONE" for s in states) else "PROC"

    def release(self, handles: list) -> list:
        """Release (cancelling) each READ; returns those NIXL would not let go of (still active)."""
        kept = []
        for h in handles:
            try:
                self.agent.release_xfer_handle(h)
            except Exception as e:  # noqa: BLE001 — still active: the caller keeps it quarantined
                log.warning("READ could not be released (still active?): %s", e)
                kept.append(h)
        return kept


class RankAgent:
    """A worker rank's pool registered with its own NIXL agent, and the READs the driver gives it.

    A prefill rank's agent is read by peers and must progress UCX for their READs to complete (a
    READ's flush waits for the target), but the worker's thread blocks in the group's broadcast
    between steps: a thread progresses the agent every `progress_s` (a sleep, not a spin)."""

    def __init__(self, name: str, kv_cache, progress_s: float = 0.002):
        from nixl._api import nixl_agent, nixl_agent_config  # noqa: PLC0415 — lazy: heavy import

        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
        self._kv = kv_cache
        self._reg = self.agent.register_memory(kv_cache)
        self.name = name
        mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self.poster = ReadPoster(self.agent, mem_type)
        self._pulls: dict[int, tuple[list, int]] = {}  # pull id -> (handles, bytes)
        self._done: set[int] = set()  # done here, the pull not yet released (other ranks may still read)
        self.bytes_read = 0  # of completed READs
        self._lock = threading.Lock()  # NIXL agents are not thread-safe
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._progress, args=(progress_s,), daemon=True,
                                        name=f"{name}-progress")
        self._thread.start()

    def peer(self) -> RankPeer:
        return RankPeer(self.name, self.agent.get_agent_metadata(), self._kv.data_ptr())

    def _progress(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            with self._lock:
                try:
                    self.agent.get_new_notifs()
                except Exception as e:  # noqa: BLE001
                    log.debug("UCX progress: %s", e)

    def post(self, pull_id: int, reads: Sequence[RankRead]) -> str:
        """Post this rank's part of a pull; "ERR" when posting failed (nothing left in flight)."""
        with self._lock:
            try:
                self._pulls[pull_id] = (self.poster.post(reads), sum(r.num_bytes for r in reads))
            except Exception as e:  # noqa: BLE001 — the driver's poll reports it
                log.warning("rank READ %d not posted: %s", pull_id, e)
                return "ERR"
        return "PROC"

    def state(self, pull_id: int) -> str:
        with self._lock:
            if pull_id not in self._pulls:
                return "DONE" if pull_id in self._done else "ERR"
            handles, nbytes = self._pulls[pull_id]
            try:
                state = self.poster.state(handles)
            except Exception as e:  # noqa: BLE001
                log.warning("rank READ %d failed: %s", pull_id, e)
                state = "ERR"
            if state == "DONE":
                self.bytes_read += nbytes
                self.poster.release(handles)
                del self._pulls[pull_id]
                self._done.add(pull_id)
        return state

    def release(self, pull_id: int) -> bool:
        """Let go of a pull (cancelling it); False when NIXL refuses (it may still be writing)."""
        with self._lock:
            self._done.discard(pull_id)
            entry = self._pulls.get(pull_id)
            if entry is None:
                return True
            kept = self.poster.release(entry[0])
            if not kept:
                del self._pulls[pull_id]
                return True
            self._pulls[pull_id] = (kept, entry[1])
            return False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1)
        with self._lock:
            try:
                self.agent.deregister_memory(self._reg)
            except Exception as e:  # noqa: BLE001
                log.debug("closing rank agent: %s", e)


@dataclass
class RankPullState:
    """A worker's answer to the driver's poll of one pull."""

    rank: int
    state: str  # DONE | PROC | ERR
    bytes_read: int  # this rank's completed READs so far, all pulls


class MappedPull:
    """A pull across ranks: rank 0's READs on the driver's agent, the workers' through the group.
    The transport treats it as one transfer handle (state, release)."""

    def __init__(self, reader: "MappedReader", pull_id: int, handles: list, nbytes: int, workers: bool):
        self.id = pull_id
        self.reader, self.handles, self.nbytes, self.workers = reader, handles, nbytes, workers
        self._done0 = False

    def state(self) -> str:
        r = self.reader
        if not self._done0:
            s0 = r.poster.state(self.handles)
            if s0 == "ERR":
                log.warning("pull %d: rank 0's READ failed", self.id)
                return "ERR"
            if s0 == "DONE":
                self._done0 = True
                r.bytes_by_rank[0] += self.nbytes
                r.poster.release(self.handles)
                self.handles = []
        states = ["DONE" if self._done0 else "PROC"]
        if self.workers:
            for answer in r.driver.kv_poll(self.id):
                r.bytes_by_rank[answer.rank] = answer.bytes_read
                states.append(answer.state)
        if "ERR" in states:
            log.warning("pull %d: a rank's READ failed (rank states %s)", self.id, states)
            return "ERR"
        return "DONE" if all(s == "DONE" for s in states) else "PROC"

    def release(self) -> bool:
        """Every rank lets go (cancelling what still runs); False while one cannot (retried)."""
        self.handles = self.reader.poster.release(self.handles)
        ok = not self.handles
        if self.workers:
            ok = all(self.reader.driver.kv_release(self.id)) and ok
        return ok


class MappedReader:
    """The driver's side: its ranks' registered pools, and pulls planned from the head map."""

    _ids = itertools.count(1)

    def __init__(self, agent, mem_type: str, device_id: int, layout: KVLayout, rank0: RankPeer, driver=None):
        self.poster = ReadPoster(agent, mem_type)
        self.layout, self.device_id, self.mem_type = layout, device_id, mem_type
        self.driver = driver  # TensorParallelDriver, None at tp=1
        workers = driver.kv_register(rank0.agent_name) if driver is not None else []
        self.ranks: tuple[RankPeer, ...] = (rank0, *workers)
        self.bytes_by_rank = [0] * len(self.ranks)  # pulled by each rank, from completed READs

    def applies(self, peer: KVLayout) -> bool:
        """Between degrees, or between tp > 1 pools: every rank reads its own part."""
        return self.layout.tensor_parallel_size > 1 or peer.tensor_parallel_size > 1

    def start(self, peer: PeerInfo, local_blocks: Sequence[int], remote_blocks: Sequence[int],
              loaded_agent: str = "") -> MappedPull:
        """`loaded_agent`: the peer's rank-0 agent, already loaded on ours by the handshake. Raises
        ValueError (a block outside the peer's pool) or what NIXL raised posting rank 0's part; the
        workers' parts posted by then are released."""
        plan = plan_reads(self.layout, self.ranks, self.device_id, self.mem_type, peer, local_blocks, remote_blocks)
        pull_id, workers = next(self._ids), len(plan) > 1
        self.poster.loaded.add(loaded_agent)
        if workers:
            self.driver.kv_read(pull_id, plan)  # first: their READs run while rank 0 posts its own
        try:
            handles = self.poster.post(plan[0])
        except Exception:
            if workers:
                self.driver.kv_release(pull_id)
            raise
        return MappedPull(self, pull_id, handles, sum(r.num_bytes for r in plan[0]), workers)


class RankKV:
    """A worker rank's part of KV transfer between degrees (cluster/engine/distributed/worker.py's
    RankExtension): its NIXL agent over the rank's pool, the READs the driver plans for it. Given to
    the ranks by whoever starts them (a Serve replica, a test); picklable until its first message."""

    def __init__(self):
        self.agent: RankAgent | None = None

    def handles(self, msg) -> bool:
        return isinstance(msg, (KVRegister, KVRead, KVPoll, KVRelease))

    def handle(self, msg, rank: int, shard) -> None:
        if isinstance(msg, KVRegister):
            self.close()
            self.agent = RankAgent(f"{msg.agent_name}-rank{rank}", shard.kv_cache)
            step.gather_reports(self.agent.peer())
        elif isinstance(msg, KVRead):
            self.agent.post(msg.pull_id, msg.reads[rank])
        elif isinstance(msg, KVPoll):
            step.gather_reports(RankPullState(rank, self.agent.state(msg.pull_id), self.agent.bytes_read))
        else:
            step.gather_reports(self.agent.release(msg.pull_id))

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
