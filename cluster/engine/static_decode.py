"""The static decode path: decode-only steps on fixed-shape inputs, captured as CUDA graphs.

A decode step of a GPU engine is bound by the host: building the step's tensors from Python lists
and launching ~20 kernels a layer took 84-95% of a step on an H200 (docs/benchmarks.md, "The GPU
path"). This path removes both for the common step, every request decoding one token:

- **Persistent batch.** Each running request owns a row of a preallocated block table (host
  memory, pinned on CUDA) from its first static step until its blocks go (`forget`: it ended, was
  preempted, or took a multi-token step). A step writes only the blocks a row gained since its last
  step: one block every `block_size` steps.
- **Fixed shapes.** A step of n requests runs as a bucket of B >= n rows and a table W blocks wide
  (both from short lists, below). Per row it sends two int32s (token, position) and W block ids in
  ONE host-to-device copy; everything else (slots, context lengths) is derived on the device.
  Padding rows decode token 0 at position 0 into a sink block past the pool's end (the engine
  allocates one more block than it accounts for), so they write nothing any request reads.
- **Attention in place.** `attention/paged_decode.py`: a Triton kernel on CUDA reads K/V through
  the block table (no gather, no host read of lengths); the torch reference elsewhere.
- **Graphs.** In "graphs" mode each (B, W) is captured once, on first use, into one shared memory
  pool; a step is then one copy, one replay and the sampler's one read of the sampled ids.

Every other step (prefill chunks, mixed steps, speculative verification, prompt logprobs) takes the
runner's dynamic path. The sampler runs after the model, outside the graph, on the step's rows.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from cluster.engine.attention.metadata import AttentionMetadata
from cluster.engine.attention.paged_decode import paged_decode_torch, paged_decode_triton, triton_available
from cluster.engine.attention.torch_sdpa import TorchSDPABackend
from cluster.engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)

# Batch buckets: a step of n requests runs as the first bucket >= n (at most 1.5x the rows; the
# padding rows cost their share of the linears, nothing in attention). vLLM captures 1, 2, 4 and
# every multiple of 8; fewer buckets here capture faster, at a little more padding.
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    small = tuple(b for b in BATCH_BUCKETS if b < max_batch)
    return small + (max_batch,)


def width_bucket(blocks: int, max_blocks: int) -> int:
    """Table width for a step whose longest row needs `blocks` blocks: the next power of two."""
    return min(1 << max(blocks - 1, 0).bit_length(), max_blocks)


def static_mode(opts, device: torch.device, capturable: bool = True) -> str | None:
    """EngineOptions.static_decode resolved: "graphs", "eager", or None (every step dynamic).
    "auto" is graphs on CUDA where the step is torch's (one rank, torch attention and ops) and the
    model's family can be captured (`capturable`: Family.cuda_graphs; an MoE reads its expert
    counts on the host every layer), and the pool is the run dtype (its paged kernel reads no fp8)."""
    mode = opts.static_decode
    if mode == "graphs" and not capturable:
        raise ValueError("static_decode=graphs: this model's family reads the device from the host within a "
                         "step (MoE expert counts), which a CUDA graph cannot capture; use auto, eager or off")
    if mode == "auto":
        torch_path = (opts.tensor_parallel_size == 1 and opts.attention_backend in ("auto", "torch")
                      and opts.model_ops in ("auto", "torch") and opts.kv_cache_dtype == "auto")
        mode = "graphs" if device.type == "cuda" and torch_path and capturable else "off"
    return None if mode == "off" else mode


@dataclass
class _Row:
    index: int  # row of the persistent table
    blocks: int  # entries of the request's block table already written there
    last: int = -1  # the last of them (a Python int: the unchanged-row check reads no numpy)


class StaticDecodeBackend(TorchSDPABackend):
    """The attention backend of a static step: writes as the torch backend, reads in place."""

    name = "static"

    def __init__(self, attend_fn):
        self._attend = attend_fn

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        return self._attend(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, meta.window)


class StaticDecode:
    def __init__(self, model, kv_pool: torch.Tensor, block_size: int, max_batch: int, max_model_len: int,
                 device: torch.device, capture: bool, attention: str = "auto", fixed_width: bool | None = None):
        """kv_pool: the whole pool, sink block included ([num_blocks + 1, L, 2, block_size, H_kv, D]).
        fixed_width: every step's table is max_blocks wide on the device (one graph per batch
        bucket, all captured at start-up), the host still sending only the columns in use; the
        default with the Triton kernel, which reads only a row's own blocks. The torch reference
        gathers every column, so it keeps a graph per (bucket, width)."""
        if capture and device.type != "cuda":
            raise ValueError("static_decode=graphs captures CUDA graphs: it needs a CUDA device")
        self.model = model
        self.kv_pool = kv_pool
        self.sink = kv_pool.shape[0] - 1
        self.block_size = block_size
        self.device = device
        self.capture = capture
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.max_blocks = -(-max_model_len // block_size)
        if attention == "auto":
            attention = "triton" if device.type == "cuda" and triton_available() and _triton_builds(device) else "torch"
        self.attention = attention
        fn = paged_decode_triton if attention == "triton" else paged_decode_torch
        self.backend = StaticDecodeBackend(fn)
        self.fixed_width = attention == "triton" if fixed_width is None else fixed_width
        # The persistent batch: one row per request, written by diff.
        self._tables = np.full((self.max_batch, self.max_blocks), self.sink, dtype=np.int32)
        self._rows: dict[str, _Row] = {}
        self._free = list(range(self.max_batch - 1, -1, -1))
        # One step's inputs, [B, 2 + W] int32 (token, position, table) in one flat buffer each side.
        size = self.max_batch * (2 + self.max_blocks)
        pin = device.type == "cuda"
        self._stage = torch.empty(size, dtype=torch.int32, pin_memory=pin)
        self._stage_np = self._stage.numpy()
        self._inputs = torch.zeros(size, dtype=torch.int32, device=device)
        # fixed_width: the graphs' inputs, [max_batch, 2 + max_blocks]; a step's [B, 2 + W] lands in its corner
        self._fixed = torch.zeros(self.max_batch, 2 + self.max_blocks, dtype=torch.int32, device=device) \
            if self.fixed_width else None
        self._arange = torch.arange(self.max_batch + 1, dtype=torch.long, device=device)
        self._cu = self._arange.to(torch.int32)
        # Every step's logits land in one buffer: a graph's own output would stay allocated in the
        # pool, one [bucket, vocab] float32 tensor per captured shape (65 MB at 128 x 128256).
        self._logits = torch.empty(self.max_batch, model.lm_head.weight.shape[0], dtype=torch.float32, device=device)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.steps = 0
        log.info("static decode: %s, attention %s, batch buckets %s, table up to %d blocks",
                 "CUDA graphs" if capture else "eager", attention, self.buckets, self.max_blocks)

    @classmethod
    def for_engine(cls, model, pool: torch.Tensor, opts, max_model_len: int, device: torch.device,
                   mode: str | None) -> StaticDecode | None:
        """The engine's static path for `static_mode`'s answer (None: none), buckets captured."""
        if mode is None:
            return None
        static = cls(model, pool, opts.block_size, opts.max_num_seqs, max_model_len, device, capture=mode == "graphs")
        static.capture_all()  # one graph per batch bucket when the kernel reads tables in place
        return static

    # ---- which steps, and the persistent rows -------------------------------------------------

    def takes(self, chunks: list[ScheduledChunk]) -> bool:
        """A decode-only step of plain rows that fits the largest bucket."""
        return 0 < len(chunks) <= self.max_batch and all(
            c.num_tokens == 1 and c.samples and not c.draft and c.request.prompt_logprobs is None for c in chunks)

    def forget(self, request_id: str) -> None:
        """The request's blocks went (ended, preempted) or it took a step elsewhere: its row is free."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free.append(row.index)

    def _row(self, request_id: str, table: list[int]) -> int:
        row = self._rows.get(request_id)
        if row is None:
            row = self._rows[request_id] = _Row(self._free.pop(), 0)
        n = len(table)
        tables = self._tables[row.index]
        if n > row.blocks and (row.blocks == 0 or tables[row.blocks - 1] == table[row.blocks - 1]):
            tables[row.blocks : n] = table[row.blocks :]  # the blocks gained since the last step
        elif n != row.blocks or tables[n - 1] != table[-1]:
            tables[:n] = table  # not an extension of what the row holds: write it whole
        row.blocks = n
        row.last = table[-1] if n else -1
        return row.index

    # ---- one step -------------------------------------------------------------------------------

    def run(self, chunks: list[ScheduledChunk], block_tables: dict[str, list[int]]) -> torch.Tensor:
        """The step's logits, [len(chunks), vocab] float32, rows in `chunks` order."""
        n = len(chunks)
        bucket = next(b for b in self.buckets if b >= n)
        rows: list[int] = []
        tokens: list[int] = []
        positions: list[int] = []
        known = self._rows
        for c in chunks:
            req = c.request
            rid = req.request_id
            table = block_tables[rid]
            row = known.get(rid)
            # most steps a row is as it was: the same number of blocks, the same last one
            if row is not None and row.blocks == len(table) and row.last == table[-1]:
                rows.append(row.index)
            else:
                rows.append(self._row(rid, table))
            tokens.append(req.all_token_ids[c.start])
            positions.append(c.start)
        width = width_bucket(max(positions) // self.block_size + 1, self.max_blocks)
        size = bucket * (2 + width)
        stage = self._stage_np[:size].reshape(bucket, 2 + width)
        stage[:n, 0] = tokens
        stage[:n, 1] = positions
        stage[:n, 2:] = self._tables[rows, :width]
        stage[n:, :2] = 0
        stage[n:, 2:] = self.sink
        key = (bucket, self.max_blocks if self.fixed_width else width)
        if self.capture and key not in self._graphs:
            try:
                self._capture(key)
            except Exception:  # captured lazily, mid-serving: a failure degrades to eager, never fails requests
                log.exception("static decode: capturing batch %d x %d blocks failed; decode steps run eager", *key)
                self.capture = False
        self._inputs[:size].copy_(self._stage[:size], non_blocking=True)
        if self.fixed_width:  # columns past W hold older rows' ids: no row reads past its own blocks
            self._fixed[:bucket, : 2 + width].copy_(self._inputs[:size].view(bucket, 2 + width))
        if self.capture:
            self._replay(self._graphs[key], n)
        else:
            self._forward(*key)
        self.steps += 1
        return self._logits[:n]

    def _replay(self, graph: torch.cuda.CUDAGraph, rows: int) -> None:
        """One captured step (`rows` of its bucket real). A benchmark times it from outside
        (cluster/tools/bench/replay_timer.py)."""
        graph.replay()

    def _forward(self, bucket: int, width: int) -> None:
        """The model over the device inputs of a (bucket, width) step, its logits into the buffer;
        no host reads."""
        inputs = self._view(bucket, width)
        pos32 = inputs[:, 1]
        positions = pos32.long()
        tables = inputs[:, 2:]
        bs = self.block_size
        meta = AttentionMetadata(
            slot_blocks=tables.gather(1, (pos32 // bs)[:, None]).view(bucket).long(),
            slot_offsets=positions % bs,
            num_decode=bucket,
            prefills=(),
            cu_seqlens_q=self._cu[: bucket + 1],
            seq_lens=pos32 + 1,
            block_tables=tables,
            max_q_len=1,
            max_seq_len=width * bs,
            block_size=bs,
        )
        logits = self.model(inputs[:, 0].long(), positions, self.kv_pool, meta, self.backend, self._arange[:bucket])
        self._logits[:bucket].copy_(logits)

    def _view(self, bucket: int, width: int) -> torch.Tensor:
        """The device inputs a (bucket, width) step's model reads, [bucket, 2 + width]."""
        if self.fixed_width:
            return self._fixed[:bucket]
        return self._inputs[: bucket * (2 + width)].view(bucket, 2 + width)

    def capture_all(self) -> None:
        """Capture every batch bucket now (fixed_width: one graph per bucket), largest first so the
        pool's blocks serve the smaller ones; a failure leaves decode steps eager, logged."""
        if not (self.capture and self.fixed_width):
            return
        t0 = time.perf_counter()
        try:
            for b in reversed(self.buckets):
                self._capture((b, self.max_blocks))
        except Exception:
            log.exception("static decode: capture at start-up failed; decode steps run eager")
            self.capture = False
            return
        log.info("static decode: captured %d batch buckets in %.1f s", len(self.buckets), time.perf_counter() - t0)

    def _capture(self, key: tuple[int, int]) -> None:
        """Capture a (bucket, width) step on padding rows (they write only the sink block)."""
        bucket, width = key
        pad = self._view(bucket, width)
        pad[:, :2] = 0
        pad[:, 2:] = self.sink
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # allocations and kernel choices settle before the capture
                self._forward(bucket, width)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._forward(bucket, width)
        self._graphs[key] = graph
        log.info("static decode: captured batch %d x %d blocks (%d graphs)", bucket, width, len(self._graphs))


def _triton_builds(device: torch.device) -> bool:
    """Whether the Triton kernel builds and runs here (one row, one block): else the torch
    reference, logged loudly (tests/gpu checks the kernel itself on every lent GPU)."""
    try:
        q = torch.zeros(1, 16, 64, device=device, dtype=torch.bfloat16)
        kv = torch.zeros(2, 16, 16, 64, device=device, dtype=torch.bfloat16)
        one = torch.ones(1, 1, dtype=torch.int32, device=device)
        paged_decode_triton(q, kv, kv, one, one[0], 0.125)
        torch.cuda.synchronize(device)
        return True
    except Exception:
        log.exception("static decode: the Triton kernel does not build or run here; attention uses the torch reference")
        return False
