"""The NIXL transport: one agent per engine, the whole KV pool registered once.

DRAM on CPU and VRAM on GPU take the same path: the pool tensor is registered as it is. A
prefill engine that serves leases from its host tier (kv_tiers.lease_from_host) registers that
arena too (DRAM pools only): a handle's block id num_blocks + s is host slot s, read in the same
READ as device blocks. Decode pulls (NIXL READ) the blocks it lacks, one descriptor per run of
blocks contiguous on both sides (kv_transfer/runs.py: a block of all layers is one contiguous
region; each side's list prepared once, one descriptor a block, which NIXL merges into the runs
given the order runs.py lists them in); once the READ is done, a notice tells prefill it may
release the lease. Notices go out from a second agent that posts no transfers
(kv_transfer/notices.py: on the READ's own agent each pull waited for the peer's loop). Remote
agents are cached per engine id and replaced when the peer comes back as a new incarnation. A
peer whose KV dtype or fp8 scales differ from ours is read into a staging arena and converted into
the pool once the READ is done (kv_transfer/convert.py).

A READ that its request no longer waits for (aborted, failed, timed out) may still be writing
the local blocks, on RDMA long after the request is gone. Such a pull is *abandoned*: the caller
quarantines its local blocks (engine.quarantine) and hands the pull here with the quarantine's
token; `poll_abandoned` keeps polling it and returns the token once NIXL says the transfer is
done or failed, or once its deadline passed and NIXL agreed to cancel it (release_xfer_handle
succeeds only when the transfer is over or cancelled). Only then may the blocks be reused.

Not thread-safe (NIXL agents are not): one engine loop thread owns it.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass

import torch

from kv_transfer.convert import Conversion, Converter
from kv_transfer.errors import KVTransferError
from kv_transfer.handle import KVHandle, KVLayout, PeerInfo, RankPeer
from kv_transfer.metadata_store import MetadataStore
from kv_transfer.notices import DONE, RELEASE, LeaseNotices, NoticeSender
from kv_transfer.rank_reads import MappedPull, MappedReader
from kv_transfer.runs import BlockSpace, block_runs
from kv_transfer.stats import TransferStats
from kv_transfer.transports import check_required, enable_cuda_ipc_reads

log = logging.getLogger(__name__)


@dataclass
class _Remote:
    info: PeerInfo
    agent_name: str
    space: BlockSpace  # where its block ids are: its pool, then its host arena's slots
    dlist: object  # prepared descriptor list over all of them, one descriptor a block (None: mapped pulls)


@dataclass
class PendingPull:
    request_id: str
    peer: str  # engine id
    peer_agent: str  # its agent's name: where the "done" notice goes
    handle: object  # NIXL transfer handle (None: a converting pull still waiting for staging slots)
    num_blocks: int
    num_bytes: int
    num_runs: int  # descriptors posted: runs of blocks contiguous on both sides
    started: float
    deadline: float
    settled: bool = False  # NIXL is done with it (done, failed, or cancelled and released)
    conversion: Conversion | None = None  # READ into staging, converted once done (kv_transfer/convert.py)
    # Where a pull's time went, filled by MeasuredTransport only (benchmarks; kv_transfer/measured.py):
    posted: float = 0.0  # time.monotonic() once transfer() returned
    first_poll: float = 0.0  # ... at the first poll
    polls: int = 0


def _check_environment(kv_cache: torch.Tensor, required_transports, ucx_proto_info: bool) -> list[str]:
    """The UCX transports available (refused if a required one is not), CUDA IPC enabled for a
    VRAM pool; the pool must be one contiguous tensor. Before the agent exists."""
    if ucx_proto_info:
        os.environ.setdefault("UCX_PROTO_INFO", "y")  # UCX logs its choice per endpoint
    available = check_required(list(required_transports))
    if kv_cache.is_cuda:
        enable_cuda_ipc_reads()
    if not kv_cache.is_contiguous():
        raise ValueError("the KV pool must be one contiguous tensor to register it")
    return available


class NixlTransport:
    capture_telemetry = False  # NIXL's per-transfer telemetry (MeasuredTransport turns it on: benchmarks)
    notice_sender = NoticeSender  # what sends lease notices (fault injection wraps it: cluster/serving/faults.py)

    def __init__(
        self,
        engine_id: str,
        kv_cache: torch.Tensor,  # [num_blocks, ...], contiguous: block i at base + i * block_bytes
        layout: KVLayout,
        store: MetadataStore,
        required_transports: list[str] = (),
        ucx_proto_info: bool = False,
        num_threads: int = 0,
        progress_thread: bool = False,
        host_cache: torch.Tensor | None = None,  # [slots, ...] laid out like kv_cache: served to peers
        tensor_parallel=None,  # the engine's TensorParallelDriver: its workers register their pools too
    ):
        available = _check_environment(kv_cache, required_transports, ucx_proto_info)
        self.engine_id = engine_id
        self.incarnation = uuid.uuid4().hex[:12]
        self.layout = layout
        self.store = store
        self.stats = TransferStats()
        self.block_bytes = kv_cache[0].numel() * kv_cache.element_size()
        if self.block_bytes != layout.block_bytes:
            raise ValueError(f"pool block is {self.block_bytes} bytes, layout says {layout.block_bytes}")
        self.num_blocks = kv_cache.shape[0]
        self.mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self.device_id = (kv_cache.device.index or 0) if kv_cache.is_cuda else 0
        self.agent_name = f"{engine_id}-{self.incarnation}"
        self.agent = self._make_agent(num_threads, progress_thread)
        self._kv = kv_cache  # keep the registered memory alive
        self._reg = self.agent.register_memory(kv_cache)
        self.base_addr = kv_cache.data_ptr()
        self._register_host(host_cache)
        self._space = BlockSpace((self.base_addr,), (self.num_blocks,), self.block_bytes, self.device_id)
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self._space.block_descs(), self.mem_type)
        self._remotes: dict[str, _Remote] = {}
        self._notices: NoticeSender | None = None  # made with the first peer (decode side only)
        self._unsent: list[tuple[str, str, str]] = []  # "done" notices of completed READs (send_notices)
        self._abandoned: dict[int, PendingPull] = {}  # quarantine token -> unsettled READ
        self._converter = Converter(self.agent, kv_cache, layout, self.mem_type, self.device_id)
        # Every rank's pool, and pulls between degrees planned per rank (kv_transfer/rank_reads.py).
        self.mapped = MappedReader(self.agent, self.mem_type, self.device_id, layout,
                                   RankPeer(self.agent_name, self.agent.get_agent_metadata(), self.base_addr),
                                   tensor_parallel)
        store.publish(self.info())
        log.info(
            "NIXL agent %s: %s pool of %d blocks x %d bytes registered; UCX transports available: %s",
            self.agent_name, self.mem_type, self.num_blocks, self.block_bytes, ", ".join(available),
        )

    def _make_agent(self, num_threads: int, progress_thread: bool):
        from nixl._api import nixl_agent, nixl_agent_config  # noqa: PLC0415 — lazy: heavy import

        # NIXL's progress thread busy-polls a whole core even when idle; without it UCX progresses
        # whenever we poll (decode: every step; prefill: every loop turn), which suffices.
        return nixl_agent(self.agent_name, nixl_agent_config(
            backends=["UCX"], capture_telemetry=self.capture_telemetry, num_threads=num_threads,
            enable_prog_thread=progress_thread))

    def _register_host(self, host_cache: torch.Tensor | None) -> None:
        """The host tier's arena, registered beside the pool where leases are served from it."""
        self._host, self._host_reg, self.host_base_addr, self.host_num_blocks = None, None, 0, 0
        if host_cache is None:
            return
        if self.mem_type != "DRAM" or host_cache.is_cuda or not host_cache.is_contiguous():
            raise ValueError("serving leases from a host tier needs a DRAM pool and a contiguous host arena "
                             "(a VRAM pool's host slots would need a descriptor list of their own)")
        if host_cache[0].numel() * host_cache.element_size() != self.block_bytes:
            raise ValueError("the host arena's slots are not the pool's block size")
        self._host, self._host_reg = host_cache, self.agent.register_memory(host_cache)
        self.host_base_addr, self.host_num_blocks = host_cache.data_ptr(), host_cache.shape[0]

    def info(self) -> PeerInfo:
        return PeerInfo(
            self.engine_id, self.incarnation, self.agent_name, self.agent.get_agent_metadata(),
            self.base_addr, self.num_blocks, self.mem_type, self.device_id, self.layout,
            self.host_base_addr, self.host_num_blocks,
            self.mapped.ranks if self.layout.tensor_parallel_size > 1 else (),
        )

    # ---- decode side -------------------------------------------------------------------------

    def _remote(self, handle: KVHandle) -> _Remote:
        """The peer's agent, loaded once per incarnation (a restarted peer replaces the entry)."""
        cached = self._remotes.get(handle.engine_id)
        if cached is not None and cached.info.incarnation == handle.incarnation:
            return cached
        if cached is not None:
            self._forget(handle.engine_id)
            self.stats.peer_refreshes += 1
        info = self.store.lookup(handle.engine_id)
        if info is None or info.incarnation != handle.incarnation:
            seen = None if info is None else info.incarnation
            raise KVTransferError(
                f"prefill engine {handle.engine_id} incarnation {handle.incarnation} is gone "
                f"(published: {seen})"
            )
        self.layout.check_compatible(info.kv_layout, f"engine {info.engine_id}")
        try:
            name = self.agent.add_remote_agent(info.agent_metadata)
            name = name.decode() if isinstance(name, bytes) else name
            bases, sizes = (info.base_addr,), (info.num_blocks,)
            if info.host_num_blocks:  # its host tier's slots follow its blocks (DRAM peers only)
                bases, sizes = bases + (info.host_base_addr,), sizes + (info.host_num_blocks,)
            space = BlockSpace(bases, sizes, info.kv_layout.block_bytes, info.device_id)  # ours, or converted
            dlist = None  # between degrees each rank's READ has descriptors of its own (rank_reads.py)
            if not self.mapped.applies(info.kv_layout):
                dlist = self.agent.prep_xfer_dlist(name, space.block_descs(), info.mem_type)
            if self._notices is None:
                self._notices = self.notice_sender(f"{self.agent_name}-notices")
            self._notices.add_peer(info.agent_metadata)
        except Exception as e:  # unreachable or dead peer
            for agent in (self.agent, self._notices.agent if self._notices else None):
                try:
                    if agent is not None:
                        agent.remove_remote_agent(info.agent_name)
                except Exception:  # noqa: BLE001 — it may never have been added
                    pass
            raise KVTransferError(f"handshake with {handle.engine_id} failed: {e}") from e
        remote = self._remotes[handle.engine_id] = _Remote(info, name, space, dlist)
        return remote

    def _forget(self, engine_id: str) -> None:
        remote = self._remotes.pop(engine_id, None)
        if remote is None:
            return
        for release in (lambda: remote.dlist is None or self.agent.release_dlist_handle(remote.dlist),
                        lambda: self.agent.remove_remote_agent(remote.agent_name),
                        lambda: self._notices.remove_peer(remote.agent_name)):
            try:
                release()
            except Exception as e:  # a dead peer's state is dropped whatever NIXL says
                log.debug("releasing state of %s: %s", engine_id, e)

    def check_peer(self, handle: KVHandle) -> None:
        """Handshake (cached): refuses an incompatible peer with IncompatiblePeerError."""
        self.layout.check_compatible(handle.kv_layout, f"engine {handle.engine_id}")
        self._remote(handle)

    def start_pull(
        self, handle: KVHandle, remote_blocks: list[int], local_blocks: list[int], timeout_s: float
    ) -> PendingPull:
        """Post one READ of remote_blocks[i] into local_blocks[i], one descriptor per run of blocks
        contiguous on both sides; its completion (poll) notifies the prefill side. No notice rides
        on the READ itself: see kv_transfer/notices.py."""
        remote = self._remote(handle)
        if self.layout.converts(remote.info.kv_layout):
            return self._start_converting_pull(handle, remote, remote_blocks, local_blocks, timeout_s)
        if self.mapped.applies(remote.info.kv_layout):
            return self._start_mapped_pull(handle, remote, remote_blocks, local_blocks, timeout_s)
        started = time.monotonic()  # before posting: over shared memory the copy runs inside transfer()
        try:
            runs = block_runs(local_blocks, remote_blocks, self._space.sizes, remote.space.sizes)
        except ValueError as e:
            raise KVTransferError(f"READ from {handle.engine_id} not posted: {e}") from e
        local, remote_ids = runs.indices()
        try:
            xfer = self.agent.make_prepped_xfer("READ", self._local, local, remote.dlist, remote_ids)
            state = self.agent.transfer(xfer)
        except Exception as e:
            self._forget(handle.engine_id)
            raise KVTransferError(f"posting READ from {handle.engine_id} failed: {e}") from e
        if state == "ERR":
            self._forget(handle.engine_id)
            raise KVTransferError(f"posting READ from {handle.engine_id} failed")
        return PendingPull(handle.request_id, handle.engine_id, remote.agent_name, xfer, len(local_blocks),
                           len(local_blocks) * self.block_bytes, len(runs), started, started + timeout_s)

    def _start_converting_pull(self, handle: KVHandle, remote: _Remote, remote_blocks: list[int],
                               local_blocks: list[int], timeout_s: float) -> PendingPull:
        """From a pool of another dtype or scales: READ into staging slots (posted by poll while too
        few are free), converted into local_blocks once done."""
        started = time.monotonic()
        peer = remote.info.kv_layout
        conversion = self._converter.begin(peer, list(remote_blocks), list(local_blocks), handle.engine_id)
        pull = PendingPull(handle.request_id, handle.engine_id, remote.agent_name, None, len(local_blocks),
                           len(local_blocks) * peer.block_bytes, 0, started, started + timeout_s,
                           conversion=conversion)
        self._post_conversion(pull)
        return pull

    def _post_conversion(self, pull: PendingPull) -> None:
        remote = self._remotes[pull.peer]
        try:
            pull.handle = pull.conversion.post(self.agent, remote.dlist, remote.space.sizes)
            if pull.handle is None:
                return
            pull.num_runs = len(pull.conversion.slots)
            if self.agent.transfer(pull.handle) == "ERR":
                raise RuntimeError("NIXL refused the READ")
        except ValueError as e:
            self._release(pull)
            raise KVTransferError(f"READ from {pull.peer} not posted: {e}") from e
        except Exception as e:
            self._release(pull)
            self._forget(pull.peer)
            raise KVTransferError(f"posting READ from {pull.peer} failed: {e}") from e

    def _start_mapped_pull(self, handle: KVHandle, remote: _Remote, remote_blocks: list[int],
                           local_blocks: list[int], timeout_s: float) -> PendingPull:
        """Between tensor-parallel degrees: every rank reads its heads from the ranks holding them."""
        started = time.monotonic()
        try:
            xfer = self.mapped.start(remote.info, local_blocks, remote_blocks, remote.agent_name)
        except ValueError as e:
            raise KVTransferError(f"READ from {handle.engine_id} not posted: {e}") from e
        except Exception as e:
            self._forget(handle.engine_id)
            raise KVTransferError(f"posting READ from {handle.engine_id} failed: {e}") from e
        return PendingPull(handle.request_id, handle.engine_id, remote.agent_name, xfer, len(local_blocks),
                           len(local_blocks) * self.block_bytes * self.layout.tensor_parallel_size, 0,
                           started, started + timeout_s)

    def _state(self, xfer) -> str:
        if xfer is None:  # a converting pull not posted yet
            return "WAIT"
        return xfer.state() if isinstance(xfer, MappedPull) else self.agent.check_xfer_state(xfer)

    def poll(self, pull: PendingPull) -> bool:
        """True when done; raises KVTransferError on failure or past the deadline. After a raise,
        `pull.settled` says whether NIXL let go of the transfer; if not, the caller must
        quarantine its blocks and `abandon` it."""
        if pull.handle is None and pull.conversion is not None and time.monotonic() <= pull.deadline:
            try:
                self._post_conversion(pull)
            except KVTransferError:
                self.stats.pulls_failed += 1  # settled: nothing was posted
                raise
        try:
            state = self._state(pull.handle)
        except Exception as e:
            self._abandon(pull)
            self.stats.pulls_failed += 1
            raise KVTransferError(f"READ from {pull.peer} failed: {e}") from e
        if state == "DONE":
            if pull.conversion is not None:  # the bytes are in staging: into our pool, our dtype
                self._converter.finish(pull.conversion)
                self.stats.blocks_converted += pull.num_blocks
            took = time.monotonic() - pull.started  # posted -> seen complete (cleanup after)
            self._before_release(pull)
            self._release(pull)
            self._unsent.append((pull.peer_agent, DONE, pull.request_id))  # the lease may end now
            self.stats.pulls_ok += 1
            self.stats.blocks_pulled += pull.num_blocks
            self.stats.bytes_pulled += pull.num_bytes
            self.stats.last_pull_s = took
            self.stats.pull_seconds_sum += took
            self.stats.pull_seconds_max = max(self.stats.pull_seconds_max, took)
            return True
        if state == "ERR":
            self._abandon(pull)
            self.stats.pulls_failed += 1
            raise KVTransferError(f"READ from {pull.peer} failed")
        if time.monotonic() > pull.deadline:
            self._abandon(pull)
            self.stats.pulls_timed_out += 1
            raise KVTransferError(f"READ from {pull.peer} timed out")
        return False

    def _before_release(self, pull: PendingPull) -> None:
        """A completed READ, just before its handle goes (once a pull; MeasuredTransport reads
        NIXL's telemetry of it here)."""

    def _release(self, pull: PendingPull) -> bool:
        """Free the NIXL handle (cancelling the transfer if it is still active). False when NIXL
        refuses: the transfer may still be running."""
        try:
            if pull.handle is None:  # a converting pull never posted
                pass
            elif isinstance(pull.handle, MappedPull):
                if not pull.handle.release():
                    raise RuntimeError("a rank's READ is still active")
            else:
                self.agent.release_xfer_handle(pull.handle)
        except Exception as e:
            log.warning("transfer for %s could not be released (still active?): %s", pull.request_id, e)
            return False
        pull.settled = True
        if pull.conversion is not None:
            pull.conversion.release()  # its staging slots: nothing writes them any more
        return True

    def _abandon(self, pull: PendingPull) -> None:
        if self._release(pull):
            self._forget(pull.peer)  # a failed peer is re-validated from the store next time

    def abandon(self, pull: PendingPull, token: int) -> None:
        """The request no longer waits for this READ, whose local blocks are quarantined under
        `token`: keep polling it until it settles (see poll_abandoned)."""
        if pull.settled:
            raise ValueError(f"pull of {pull.request_id} already settled")
        self._abandoned[token] = pull
        self.stats.pulls_abandoned += 1

    def send_notices(self) -> None:
        """Tell prefill engines which READs completed since the last call (their leases end).
        Called once a loop turn, not from poll: posting a notice costs this thread ~0.1 ms on a
        CPU (docs/benchmarks.md), which a pulled request need not wait for to join its batch."""
        if self._unsent:
            unsent, self._unsent = self._unsent, []
            self._notices.send(unsent)

    def poll_abandoned(self) -> list[int]:
        """Tokens of abandoned READs that settled since the last call (their quarantine may end):
        NIXL reported them done or failed, or their deadline passed and NIXL cancelled them."""
        # Also progress UCX: a notice sent with nothing else to progress it (a release after a
        # fallback, a "done" while the loop only decodes) would otherwise sit in the worker.
        # Every turn, for as long as the loop runs: progressing only for 0.25 s after a send
        # (ca3335a, reverted) left notices unsent when an idle loop turned rarely, so leases ran
        # to expiry (four Ray tests failed); nor was it where an engine pull's time went.
        if self._notices is not None:
            self._notices.progress()
        try:
            self.agent.get_new_notifs()  # decode receives none; this only makes progress
        except Exception as e:  # noqa: BLE001
            log.debug("UCX progress: %s", e)
        settled = []
        now = time.monotonic()
        for token, pull in list(self._abandoned.items()):
            try:
                state = self._state(pull.handle)
            except Exception as e:  # noqa: BLE001 — unknown: only a successful release settles it
                log.debug("state of abandoned READ for %s: %s", pull.request_id, e)
                state = "ERR"
            if state in ("DONE", "ERR") or now > pull.deadline or pull.handle is None:  # None: never posted
                if self._release(pull):
                    del self._abandoned[token]
                    settled.append(token)
        self.stats.abandoned_settled += len(settled)
        return settled

    @property
    def num_abandoned(self) -> int:
        return len(self._abandoned)

    @property
    def unsent_notices(self) -> int:
        """"Done" notices queued for the next send_notices()."""
        return len(self._unsent)

    def progress_notices(self) -> None:
        """Push out lease notices UCX has not sent yet, without reading this agent's own
        notifications (a prefill role's: they are its lease notices). A no-op on an engine that
        never pulled; one whose role flipped from decode to prefill still owes its last notices."""
        if self._notices is not None:
            self._notices.progress()

    def notify_release(self, handle: KVHandle, read_settled: bool = True) -> None:
        """Best effort: tell prefill we will not pull (fallback, abort), so it ends the lease
        early. `read_settled` False: a READ of ours may still be reading those blocks (abandoned),
        so prefill keeps them for its grace period before reuse."""
        try:
            remote = self._remote(handle)
        except Exception as e:  # noqa: BLE001 — best effort: the lease expires instead
            log.debug("release notification to %s not sent: %s", handle.engine_id, e)
            return
        self._notices.send([(remote.agent_name, DONE if read_settled else RELEASE, handle.request_id)])

    # ---- prefill side ------------------------------------------------------------------------

    def lease_notices(self) -> LeaseNotices:
        """What decode engines said about leases since the last call (from notifications)."""
        return LeaseNotices.parse(self.agent.get_new_notifs())

    def close(self) -> None:
        for engine_id in list(self._remotes):
            self._forget(engine_id)
        self._converter.close()
        try:
            self.agent.release_dlist_handle(self._local)
            self.agent.deregister_memory(self._reg)
            if self._host_reg is not None:
                self.agent.deregister_memory(self._host_reg)
        except Exception as e:
            log.debug("closing NIXL agent: %s", e)
