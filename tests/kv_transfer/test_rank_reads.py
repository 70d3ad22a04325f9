"""The per-rank READ plan between tensor-parallel degrees (no NIXL): which bytes each decode rank
reads from which prefill rank, with descriptors pairwise equal in size."""

from __future__ import annotations

import numpy as np
import pytest

from kv_transfer.errors import IncompatiblePeerError
from kv_transfer.handle import MLA_LAYOUT, KVLayout, PeerInfo, RankPeer
from kv_transfer.rank_reads import plan_reads

L, BS, D = 2, 4, 8  # rows = L * 2 * bs = 16; a head's run = 8 floats = 32 bytes
ROWS, HEAD = 16, 32


def layout(tp: int, kv_heads: int = 2) -> KVLayout:
    return KVLayout("fp", BS, "float32", L, kv_heads, D, tensor_parallel_size=tp)


def peer(tp: int, kv_heads: int = 2) -> PeerInfo:
    ranks = tuple(RankPeer(f"p{r}", b"md", 1_000_000 * (r + 1)) for r in range(tp))
    return PeerInfo("p", "inc", "p0", b"md", ranks[0].base_addr, 10, "DRAM", 0, layout(tp, kv_heads), ranks=ranks)


def decode_ranks(tp: int) -> list[RankPeer]:
    return [RankPeer(f"d{r}", b"md", 50_000_000 * (r + 1)) for r in range(tp)]


def test_prefill_tp2_to_decode_tp1_reads_each_prefill_ranks_whole_block_into_its_head():
    plan = plan_reads(layout(1), decode_ranks(1), 0, peer(2), [3, 4], [7, 2])
    (reads,) = plan
    assert [r.remote_agent for r in reads] == ["p0", "p1"]
    src_block, dst_block = ROWS * HEAD, ROWS * 2 * HEAD  # one head there, two here
    for h, read in enumerate(reads):
        assert read.local.shape == read.remote.shape == (2 * ROWS, 3)  # a run per row: whole there, strided here
        assert (read.local[:, 1] == HEAD).all() and (read.remote[:, 1] == HEAD).all()
        # block 3 <- block 7: row i of head h here, row i of the prefill rank's only head there
        assert read.local[1, 0] == 50_000_000 + 3 * dst_block + 1 * 2 * HEAD + h * HEAD
        assert read.remote[1, 0] == 1_000_000 * (h + 1) + 7 * src_block + 1 * HEAD
        assert read.remote[ROWS, 0] == 1_000_000 * (h + 1) + 2 * src_block
    assert sum(r.num_bytes for r in reads) == 2 * dst_block  # exactly the pulled blocks


def test_prefill_tp1_to_decode_tp2_each_decode_rank_reads_its_half():
    plan = plan_reads(layout(2), decode_ranks(2), 0, peer(1), [0, 1, 2], [5, 6, 9])
    src_block, dst_block = ROWS * 2 * HEAD, ROWS * HEAD
    for rank, reads in enumerate(plan):
        (read,) = reads
        assert read.remote_agent == "p0" and read.num_bytes == 3 * dst_block  # its share of 3 blocks
        assert read.remote[0, 0] == 1_000_000 + 5 * src_block + rank * HEAD
        assert read.local[0, 0] == 50_000_000 * (rank + 1)


def test_equal_degrees_and_replicated_heads_read_whole_blocks():
    (r0,), (r1,) = plan_reads(layout(2), decode_ranks(2), 0, peer(2), [0, 1], [5, 6])
    assert (r0.remote_agent, r1.remote_agent) == ("p0", "p1")
    assert r0.local[:, 1].tolist() == [ROWS * HEAD] * 2  # one descriptor a block
    # one KV head: replicated on both decode ranks, each reads the whole (one-head) block
    (a,), (b,) = plan_reads(layout(2, 1), decode_ranks(2), 0, peer(1, 1), [0], [5])
    assert a.remote[:, 0].tolist() == b.remote[:, 0].tolist() == [1_000_000 + 5 * ROWS * HEAD]
    assert a.num_bytes == b.num_bytes == ROWS * HEAD


def test_a_latent_block_is_read_whole_once_per_decode_rank_from_one_prefill_rank():
    """MLA: every rank holds the whole latent, [L, 1, bs, 1, C + R]: each decode rank reads each block
    whole, one descriptor, its bytes exactly the block's (not a K and a V part: 2x, into the next
    block), from the prefill rank of its index (spread over the prefill ranks)."""
    c = 40

    def latent(tp: int) -> KVLayout:
        return KVLayout("fp", BS, "float32", L, 1, c, layout=MLA_LAYOUT, tensor_parallel_size=tp, latent_dim=c)

    block = L * BS * c * 4
    assert latent(2).block_bytes == block
    for src_tp, agents in ((1, ["p0", "p0"]), (2, ["p0", "p1"])):
        peer_info = PeerInfo("p", "inc", "p0", b"md", 1_000_000, 10, "DRAM", 0, latent(src_tp),
                             ranks=tuple(RankPeer(f"p{r}", b"md", 1_000_000 * (r + 1)) for r in range(src_tp)))
        plan = plan_reads(latent(2), decode_ranks(2), 0, peer_info, [0, 3], [5, 6])
        assert [[r.remote_agent for r in reads] for reads in plan] == [[a] for a in agents]
        for rank, (read,) in enumerate(plan):
            assert read.local[:, 1].tolist() == read.remote[:, 1].tolist() == [block, block]
            assert read.local[:, 0].tolist() == [50_000_000 * (rank + 1), 50_000_000 * (rank + 1) + 3 * block]
            assert read.remote[0, 0] == 1_000_000 * (int(agents[rank][1]) + 1) + 5 * block


def test_blocks_outside_the_peer_pool_are_refused():
    with pytest.raises(ValueError, match="host tier"):
        plan_reads(layout(1), decode_ranks(1), 0, peer(2), [0], [10])


def test_the_handshake_maps_degrees_and_refuses_what_cannot_map():
    layout(1).check_compatible(layout(2), "engine p")
    layout(2).check_compatible(layout(1), "engine p")
    layout(2, 1).check_compatible(layout(1, 1), "engine p")
    with pytest.raises(IncompatiblePeerError) as e:
        KVLayout("fp", BS, "float32", L, 4, D, tensor_parallel_size=1).check_compatible(
            KVLayout("fp", BS, "float32", L, 4, D, tensor_parallel_size=3), "engine p")
    assert str(e.value) == ("refusing KV from engine p: cannot map KV heads: the prefill pool's tensor_parallel_size 3 "
                            "neither divides the model's 4 KV heads nor is a multiple of them")
    assert np.array([layout(2).block_bytes, layout(1).block_bytes]).tolist() == [ROWS * HEAD, ROWS * 2 * HEAD]
