"""Ordering properties of the fused kernels' task streams (kosmos.kernels.queue), plain Python on CPU."""
from __future__ import annotations

import random

import pytest

from kosmos.kernels import queue as q


def _random_ag(rng: random.Random):
    world = rng.choice([1, 2, 3, 4, 8])
    m_blocks = rng.randint(1, 6)
    n_blocks = [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]
    lookahead = rng.choice([0, 1, 3, 16, 1000])
    return world, m_blocks, n_blocks, lookahead


def _grouped_ref(m_blocks, n_cols, group_m):
    """The GEMM core's tile order (kosmos.kernels.gemm.tile_coords) as (m-block, column index) pairs."""
    order = []
    for tile_id in range(m_blocks * n_cols):
        in_group = group_m * n_cols
        first = (tile_id // in_group) * group_m
        size = min(m_blocks - first, group_m)
        order.append((first + tile_id % size, (tile_id % in_group) // size))
    return order


@pytest.mark.parametrize("seed", range(40))
def test_ag_gemm_stream_order(seed):
    rng = random.Random(seed)
    world, mb_n, n_blocks, la = _random_ag(rng)
    group_m = rng.choice([1, 2, 8])
    gather_local = rng.random() < 0.7
    per_chunk = mb_n * sum(n_blocks)
    cols = [(wi, nb) for wi, nn in enumerate(n_blocks) for nb in range(nn)]
    for rank in range(world):
        s = q.ag_gemm_stream(rank, world, mb_n, n_blocks, la, group_m, gather_local)
        # every task exactly once
        tiles = [t for t in s if t[0] == q.TILE]
        assert len(tiles) == len(set(tiles)) == world * per_chunk
        pulls = [t for t in s if t[0] == q.PULL]
        assert sorted((t[1], t[2]) for t in pulls) == sorted(
            (c, b) for c in range(world) if c != rank for b in range(mb_n))
        locals_ = [t for t in s if t[0] == q.LOCAL]
        if world > 1:
            # publishes lead (peers wait on them); no LOCAL copies (a PUBLISH writes the gathered rows too)
            assert sorted(t[1] for t in s if t[0] == q.PUBLISH) == list(range(mb_n))
            assert all(t[0] == q.PUBLISH for t in s[:mb_n])
            assert not locals_
        else:
            # nobody waits: no publish; the gathered copy, if wanted, spread evenly among the tiles
            assert not [t for t in s if t[0] == q.PUBLISH]
            assert [t[1] for t in locals_] == (list(range(mb_n)) if gather_local else [])
            for t in locals_:
                tiles_before = sum(1 for u in s[:s.index(t)] if u[0] == q.TILE)
                assert tiles_before == t[1] * len(tiles) // mb_n
        # each chunk's tiles in the GEMM core's grouped order
        for c in range(world):
            got = [(mb, cols.index((wi, nb))) for (cc, mb, wi, nb) in map(q.decode_tile, tiles) if cc == c]
            assert got == _grouped_ref(mb_n, len(cols), group_m)
        # local chunk's tiles first, then chunks in arrival order rank+1, rank+2, ...
        chunk_seq = [q.decode_tile(t)[0] for t in tiles]
        order = q.chunk_order(rank, world)
        assert chunk_seq == [c for c in order for _ in range(per_chunk)]
        # pulls arrive in the same order the chunks are consumed
        assert [t[1] for t in pulls] == [c for c in order[1:] for _ in range(mb_n)]
        # a pulled block precedes every tile that reads it
        pos = {(t[1], t[2]): i for i, t in enumerate(s) if t[0] == q.PULL}
        for i, t in enumerate(s):
            if t[0] == q.TILE:
                c, mb, _, _ = q.decode_tile(t)
                if c != rank:
                    assert pos[(c, mb)] < i
        # lookahead: the pulls of chunk c_{j+1} sit right before the last `lookahead` tiles of chunk c_j
        for j in range(world - 1):
            c, nxt = order[j], order[j + 1]
            idx_c = [i for i, t in enumerate(s) if t[0] == q.TILE and t[1] == c]
            idx_p = [i for i, t in enumerate(s) if t[0] == q.PULL and t[1] == nxt]
            assert idx_p == list(range(idx_p[0], idx_p[0] + mb_n)), "a chunk's pulls are contiguous"
            tiles_after = sum(1 for i in idx_c if i > idx_p[-1])
            assert tiles_after == min(la, per_chunk)
        assert not q.check_producers_first([s], lambda r, w, t: q.ag_gemm_deps(rank, world, t))


@pytest.mark.parametrize("seed", range(40))
def test_gemm_rs_stream_order(seed):
    rng = random.Random(1000 + seed)
    world = rng.choice([1, 2, 3, 4, 8])
    mb_n, nb_n = rng.randint(1, 5), rng.randint(1, 5)
    group_m = rng.choice([1, 2, 8])
    for rank in range(world):
        s = q.gemm_rs_stream(rank, world, mb_n, nb_n, group_m)
        tiles = [t for t in s if t[0] in (q.TILE, q.REDUCE)]
        assert len(tiles) == len(set(tiles)) == len(s) == world * mb_n * nb_n
        for o in range(world):
            assert [(t[2], t[3]) for t in tiles if t[1] == o] == _grouped_ref(mb_n, nb_n, group_m)
        # owners in the order they need their data: rank+1, ..., rank (own chunk last)
        owners = [t[1] for t in tiles]
        order = q.owner_order(rank, world)
        assert order[-1] == rank
        assert owners == [o for o in order for _ in range(mb_n * nb_n)]
        # the own chunk's tiles are the reduces: each fold runs right behind (in the same task as) its tile
        reduces = [t for t in s if t[0] == q.REDUCE]
        assert len(reduces) == mb_n * nb_n and all(t[1] == rank for t in reduces)
        assert all(t[1] != rank for t in s if t[0] == q.TILE)
        # every pushed partial a reduce waits for is made by a peer's TILE (which never waits this call)
        for t in reduces:
            waits, _ = q.gemm_rs_deps(rank, world, t)
            assert sorted(f.key[0] for f in waits) == [r for r in range(world) if r != rank]
    assert q.fold_order(world) == list(range(world))


def test_stream_tensor_roundtrip():
    s = [q.ag_gemm_stream(r, 4, 3, [2, 5], 4) for r in range(4)]
    t = q.to_tensor(s)
    assert tuple(t.shape) == (4, len(s[0]), q.FIELDS)
    assert [tuple(x) for x in t[2].tolist()] == s[2]
    c, mb, wi, nb = q.decode_tile(q.tile_task(3, 2, 1, 4))
    assert (c, mb, wi, nb) == (3, 2, 1, 4)
    with pytest.raises(ValueError):
        q.to_tensor([s[0], s[0][:-1]])


@pytest.mark.parametrize("seed", range(30))
def test_streams_finish_without_deadlock(seed):
    """Every rank's programs claim in stream order and wait on flags; with any number of programs per rank,
    random task times and random start skew (stragglers), every task finishes."""
    rng = random.Random(2000 + seed)
    world, mb_n, n_blocks, la = _random_ag(rng)
    programs = rng.choice([1, 2, 3, 7, 32])
    group_m = rng.choice([1, 8])
    ag = [q.ag_gemm_stream(r, world, mb_n, n_blocks, la, group_m, seed % 2 == 0) for r in range(world)]
    res = q.simulate(ag, q.ag_gemm_deps, programs, seed=seed)
    assert res.finished, res.stuck
    assert len(res.claimed_by) == sum(len(s) for s in ag)
    rs = [q.gemm_rs_stream(r, world, mb_n, len(n_blocks), group_m) for r in range(world)]
    res = q.simulate(rs, q.gemm_rs_deps, programs, seed=seed)
    assert res.finished, res.stuck
    assert len(res.claimed_by) == sum(len(s) for s in rs)


def test_simulator_detects_a_deadlock():
    """A consumer placed before its producer, with one program, must hang in the simulator (the check is real)."""
    s = q.ag_gemm_stream(0, 2, 1, [1], 0)
    bad = [[t for t in s if t[0] != q.PULL] + [t for t in s if t[0] == q.PULL], q.ag_gemm_stream(1, 2, 1, [1], 0)]
    res = q.simulate(bad, q.ag_gemm_deps, 1, seed=0)
    assert not res.finished
    assert q.check_producers_first(bad[:1], lambda r, w, t: q.ag_gemm_deps(0, 2, t))


def test_invalid_streams_rejected():
    with pytest.raises(ValueError):
        q.ag_gemm_stream(2, 2, 1, [1], 0)
    with pytest.raises(ValueError):
        q.ag_gemm_stream(0, 2, 0, [1], 0)
    with pytest.raises(ValueError):
        q.ag_gemm_stream(0, 2, 1, [1] * 5, 0)
    with pytest.raises(ValueError):
        q.gemm_rs_stream(0, 2, 1, 0)


# ------------------------------------------------------------------------------------------------ row remap


@pytest.mark.parametrize("lead,dim,world", [([6, 10], 0, 4), ([2, 10], 1, 4), ([3, 4, 5], 1, 2), ([3, 4, 5], 2, 3),
                                            ([1, 7], 1, 8), ([2, 3, 2, 2], 2, 1)])
def test_gathered_row_matches_cat_along_dim(lead, dim, world):
    """queue.gathered_row (the kernels' gathered_row mirror) = where torch.cat(shards, dim) puts each row."""
    import torch

    B, s = q.split_rows(lead, dim)
    m = B * s
    # shard r's rows tagged r * m + row, gathered the way kosmos::ag_gemm defines it
    shards = [torch.arange(r * m, (r + 1) * m).view(*lead) for r in range(world)]
    gathered = torch.cat(shards, dim=dim).reshape(-1)
    for r in range(world):
        for row in range(m):
            assert int(gathered[q.gathered_row(r, row, s, world)]) == r * m + row
    # GEMM+RS: owner o's output row -> input row of the full operand chunked along dim
    full_lead = list(lead)
    full_lead[dim] *= world
    full = torch.arange(world * m).view(*full_lead)
    for o, chunk in enumerate(full.chunk(world, dim=dim)):
        rows = chunk.reshape(-1)
        for row in range(m):
            assert int(rows[row]) == q.gathered_row(o, row, s, world)


def test_split_rows():
    assert q.split_rows([8, 100], 0) == (1, 800)
    assert q.split_rows([2, 128], 1) == (2, 128)
    assert q.split_rows([2, 3, 4, 5], 2) == (6, 20)
    with pytest.raises(ValueError):
        q.split_rows([2, 3], 2)
