"""KV transfer between tensor-parallel degrees: which bytes each decode rank reads, and from whom.

Every rank registers its own pool with its own NIXL agent (rank 0's is the engine's transport;
ranks 1..N-1 make a RankAgent when the driver says so, cluster/engine/distributed/step.py), and
the engine publishes all of them in its PeerInfo.ranks. To start a pull, rank 0 of the decode
engine (the driver) broadcasts its small inputs: the block ids and the peer's PeerInfo (a few
hundred bytes a rank). Each rank plans its own READs from them and the head map
(kv_transfer/head_map.py) and posts them from its own agent; the descriptors never cross the group
(at 80 layers x 256 blocks a rank's are ~31 MB). The pull is done when every rank's part is: the
driver polls its own part locally and asks the workers only once that is done (MappedPull).

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
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from cluster.engine.distributed import step
from cluster.engine.distributed.step import KVPoll, KVRead, KVRegister, KVRelease
from kv_transfer.handle import KVLayout, PeerInfo, RankPeer
from kv_transfer.head_map import HeadSlice, head_map

log = logging.getLogger(__name__)

# Once rank 0's part of a pull is done the driver asks the workers (one broadcast and one gather);
# each waits up to SETTLE_WAIT_S for its own part (checked every SETTLE_POLL_S), and a part still
# running is asked about again RECHECK_S later, doubling up to MAX_RECHECK_S. The engine's step
# waits in that gather: the wait is short, and the parts, posted together, usually end together.
SETTLE_WAIT_S = 0.02
SETTLE_POLL_S = 0.0005
RECHECK_S = 0.005
MAX_RECHECK_S = 0.16


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


def check_blocks(peer: PeerInfo, local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> None:
    """ValueError for blocks a pull between degrees cannot read: lists of unequal length, or a block
    outside the peer's pool (a prefill host tier is not mapped between degrees)."""
    if len(local_blocks) != len(remote_blocks) or any(not 0 <= b < peer.num_blocks for b in remote_blocks):
        raise ValueError(f"blocks {list(remote_blocks)} are not all in {peer.engine_id}'s pool of {peer.num_blocks} "
                         "(a host tier's slots are not read between tensor-parallel degrees)")


def plan_rank_reads(layout: KVLayout, rank: int, base_addr: int, device_id: int, peer: PeerInfo,
                    local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> list[RankRead]:
    """Decode rank `rank`'s READs (one per prefill rank it reads from) of the heads it owns of
    remote_blocks[i] into local_blocks[i] of its pool at `base_addr`. Every rank computes its own
    from the same small inputs (the pull's block ids, the peer's published ranks): the descriptors,
    L x 2 x bs a block and head slice, never cross the group. Raises as check_blocks."""
    check_blocks(peer, local_blocks, remote_blocks)
    theirs = peer.kv_layout
    ranks = peer.ranks or (RankPeer(peer.agent_name, peer.agent_metadata, peer.base_addr),)
    lb = np.asarray(local_blocks, dtype=np.int64)
    rb = np.asarray(remote_blocks, dtype=np.int64)
    slices = head_map(layout.num_kv_heads, theirs.tensor_parallel_size, layout.tensor_parallel_size)[rank]
    reads = []
    for src, group in itertools.groupby(slices, key=lambda s: s.src_rank):
        pairs = np.concatenate([slice_pairs(layout, theirs, s) for s in group])  # [runs, 3]
        n = len(lb) * len(pairs)
        loc, rem = np.empty((n, 3), dtype=np.uint64), np.empty((n, 3), dtype=np.uint64)
        loc[:, 0] = (base_addr + lb[:, None] * layout.block_bytes + pairs[None, :, 0]).ravel()
        rem[:, 0] = (ranks[src].base_addr + rb[:, None] * theirs.block_bytes + pairs[None, :, 1]).ravel()
        loc[:, 1] = rem[:, 1] = np.tile(pairs[:, 2], len(lb))
        loc[:, 2], rem[:, 2] = device_id, peer.device_id
        reads.append(RankRead(ranks[src].agent_name, ranks[src].agent_metadata, peer.mem_type, loc, rem))
    return reads


def plan_reads(layout: KVLayout, local: Sequence[RankPeer], device_id: int, peer: PeerInfo,
               local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> list[list[RankRead]]:
    """Every decode rank's READs, rank by rank (as each computes its own; for tests and tools)."""
    return [plan_rank_reads(layout, r, p.base_addr, device_id, peer, local_blocks, remote_blocks)
            for r, p in enumerate(local)]


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
    """A worker rank's pool registered with its own NIXL agent, and its parts of the driver's pulls.

    A prefill rank's agent is read by peers and must progress UCX for their READs to complete (a
    READ's flush waits for the target), but the worker's thread blocks in the group's broadcast
    between steps: a thread progresses the agent every `progress_s` (a sleep, not a spin)."""

    def __init__(self, name: str, rank: int, kv_cache, layout: KVLayout, progress_s: float = 0.002):
        from nixl._api import nixl_agent, nixl_agent_config  # noqa: PLC0415 — lazy: heavy import

        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
        self._kv = kv_cache
        self._reg = self.agent.register_memory(kv_cache)
        self.name, self.rank, self.layout = name, rank, layout  # the decode pool's layout: its part is planned for it
        self.base_addr = kv_cache.data_ptr()
        self.device_id = (kv_cache.device.index or 0) if kv_cache.is_cuda else 0
        self.poster = ReadPoster(self.agent, "VRAM" if kv_cache.is_cuda else "DRAM")
        self._pulls: dict[int, tuple[list, int]] = {}  # posted, not seen done: pull id -> (handles, bytes)
        self._failed: set[int] = set()  # not posted (nothing in flight) until the driver releases the pull
        self.bytes_read = 0  # of completed READs
        self._lock = threading.Lock()  # NIXL agents are not thread-safe
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._progress, args=(progress_s,), daemon=True,
                                        name=f"{name}-progress")
        self._thread.start()

    def peer(self) -> RankPeer:
        return RankPeer(self.name, self.agent.get_agent_metadata(), self.base_addr)

    def _progress(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            with self._lock:
                try:
                    self.agent.get_new_notifs()
                except Exception as e:  # noqa: BLE001
                    log.debug("UCX progress: %s", e)

    def post(self, pull_id: int, peer: PeerInfo, local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> None:
        """Plan this rank's part of a pull and post it; a failure shows as ERR when the driver asks."""
        with self._lock:
            try:
                reads = plan_rank_reads(self.layout, self.rank, self.base_addr, self.device_id, peer,
                                        local_blocks, remote_blocks)
                self._pulls[pull_id] = (self.poster.post(reads), sum(r.num_bytes for r in reads))
            except Exception as e:  # noqa: BLE001 — the driver's next ask reports it
                log.warning("rank READ %d not posted: %s", pull_id, e)
                self._failed.add(pull_id)

    def state(self, pull_id: int) -> str:
        """DONE once every READ of the part is (released and forgotten here: the driver does not
        ask again), PROC while one runs, ERR when one failed or the part was never posted."""
        with self._lock:
            if pull_id in self._failed or pull_id not in self._pulls:
                return "ERR"
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
        return state

    def settle(self, pull_id: int, wait_s: float) -> str:
        """The part's state, waiting up to wait_s while it runs (the driver asks once its own part
        is done, and the ranks' parts, posted together, usually end together)."""
        deadline = time.monotonic() + wait_s
        while (state := self.state(pull_id)) == "PROC" and time.monotonic() < deadline:
            time.sleep(SETTLE_POLL_S)
        return state

    def release(self, pull_id: int) -> bool:
        """Let go of a pull (cancelling it); False when NIXL refuses (it may still be writing)."""
        with self._lock:
            self._failed.discard(pull_id)
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
    """A worker's answer to the driver's ask about one pull."""

    rank: int
    state: str  # DONE | PROC | ERR
    bytes_read: int  # this rank's completed READs so far, all pulls


class MappedPull:
    """A pull across ranks: rank 0's READs on the driver's agent, the workers' on theirs. The
    transport treats it as one transfer handle (state, release).

    The driver polls its own part locally, every time the engine polls. Once it is done it asks the
    workers whose part it has not seen done (one broadcast and one gather; each waits up to the
    reader's settle_wait_s for its part), and while one still runs asks again recheck_s later,
    doubling up to MAX_RECHECK_S: a pull's collectives do not grow with the engine's polls."""

    def __init__(self, reader: "MappedReader", pull_id: int, handles: list, nbytes: int, workers: int):
        self.id = pull_id
        self.reader, self.handles, self.nbytes = reader, handles, nbytes
        self.pending = tuple(range(1, workers + 1))  # worker ranks whose part is not known to be done
        self._done0 = False
        self._ask_at, self._recheck_s = 0.0, reader.recheck_s

    def state(self) -> str:
        r = self.reader
        if not self._done0:
            s0 = r.poster.state(self.handles)
            if s0 == "ERR":
                log.warning("pull %d: rank 0's READ failed", self.id)
                return "ERR"
            if s0 != "DONE":
                return "PROC"
            self._done0 = True
            r.bytes_by_rank[0] += self.nbytes
            r.poster.release(self.handles)
            self.handles = []
        if not self.pending:
            return "DONE"
        if r.clock() < self._ask_at:
            return "PROC"
        answers = r.driver.kv_poll(self.id, self.pending, r.settle_wait_s)
        for answer in answers:
            r.bytes_by_rank[answer.rank] = answer.bytes_read
        if any(a.state == "ERR" for a in answers):
            log.warning("pull %d: a rank's READ failed (rank states %s)", self.id,
                        {a.rank: a.state for a in answers})
            return "ERR"
        self.pending = tuple(a.rank for a in answers if a.state != "DONE")
        if not self.pending:
            return "DONE"
        self._ask_at = r.clock() + self._recheck_s
        self._recheck_s = min(2 * self._recheck_s, MAX_RECHECK_S)
        return "PROC"

    def release(self) -> bool:
        """Every rank lets go (cancelling what still runs); False while one cannot (retried). A
        worker that answered DONE has let go already: a pull done everywhere costs no collective."""
        self.handles = self.reader.poster.release(self.handles)
        ok = not self.handles
        if self.pending:
            workers_ok = all(self.reader.driver.kv_release(self.id))
            if workers_ok:
                self.pending = ()
            ok = workers_ok and ok
        return ok


class MappedReader:
    """The driver's side: its ranks' registered pools, and the pulls between degrees it starts."""

    _ids = itertools.count(1)

    def __init__(self, agent, mem_type: str, device_id: int, layout: KVLayout, rank0: RankPeer, driver=None,
                 settle_wait_s: float = SETTLE_WAIT_S, recheck_s: float = RECHECK_S, clock=time.monotonic):
        self.poster = ReadPoster(agent, mem_type)
        self.layout, self.device_id, self.mem_type = layout, device_id, mem_type
        self.driver = driver  # TensorParallelDriver, None at tp=1
        self.settle_wait_s, self.recheck_s, self.clock = settle_wait_s, recheck_s, clock
        workers = driver.kv_register(rank0.agent_name, layout) if driver is not None else []
        self.ranks: tuple[RankPeer, ...] = (rank0, *workers)
        self.bytes_by_rank = [0] * len(self.ranks)  # pulled by each rank, from completed READs

    def applies(self, peer: KVLayout) -> bool:
        """Between degrees, or between tp > 1 pools: every rank reads its own part."""
        return self.layout.tensor_parallel_size > 1 or peer.tensor_parallel_size > 1

    def start(self, peer: PeerInfo, local_blocks: Sequence[int], remote_blocks: Sequence[int],
              loaded_agent: str = "") -> MappedPull:
        """`loaded_agent`: the peer's rank-0 agent, already loaded on ours by the handshake. Raises
        ValueError (a block outside the peer's pool) before any rank posts, or what NIXL raised
        posting rank 0's part; the workers' parts posted by then are released."""
        local_blocks, remote_blocks = tuple(map(int, local_blocks)), tuple(map(int, remote_blocks))
        check_blocks(peer, local_blocks, remote_blocks)
        pull_id, workers = next(self._ids), len(self.ranks) - 1
        self.poster.loaded.add(loaded_agent)
        if workers:  # first: their READs run while rank 0 plans and posts its own
            self.driver.kv_read(pull_id, peer, local_blocks, remote_blocks)
        try:
            reads = plan_rank_reads(self.layout, 0, self.ranks[0].base_addr, self.device_id, peer, local_blocks,
                                    remote_blocks)
            handles = self.poster.post(reads)
        except Exception:
            if workers:
                self.driver.kv_release(pull_id)
            raise
        return MappedPull(self, pull_id, handles, sum(r.num_bytes for r in reads), workers)


class RankKV:
    """A worker rank's part of KV transfer between degrees (cluster/engine/distributed/worker.py's
    RankExtension): its NIXL agent over the rank's pool, its parts of the driver's pulls. Given to
    the ranks by whoever starts them (a Serve replica, a test); picklable until its first message."""

    def __init__(self):
        self.agent: RankAgent | None = None

    def handles(self, msg) -> bool:
        return isinstance(msg, (KVRegister, KVRead, KVPoll, KVRelease))

    def handle(self, msg, rank: int, shard) -> None:
        if isinstance(msg, KVRegister):
            self.close()
            self.agent = RankAgent(f"{msg.agent_name}-rank{rank}", rank, shard.kv_cache, msg.layout)
            step.gather_reports(self.agent.peer())
        elif isinstance(msg, KVRead):
            self.agent.post(msg.pull_id, msg.peer, msg.local_blocks, msg.remote_blocks)
        elif isinstance(msg, KVPoll):
            answer = None
            if rank in msg.ranks:
                answer = RankPullState(rank, self.agent.settle(msg.pull_id, msg.wait_s), self.agent.bytes_read)
            step.gather_reports(answer)
        else:
            step.gather_reports(self.agent.release(msg.pull_id))

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
