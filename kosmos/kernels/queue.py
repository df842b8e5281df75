"""Task streams of the fused TP+SP kernels, laid out on the host in the order consumers need data.

A fused kernel's programs claim task indices 0, 1, 2, ... of their rank's stream with one atomic counter and
take whatever role the task has. The stream is an int32 tensor [ranks, tasks, 4]; each row is
(kind, x, y, z):

    PUBLISH (0, block, 0, 0)         copy rows block*BM.. of the local shard into this rank's symmetric
                                     staging buffer (peers pull from it) and into its gathered buffer (W > 1)
    PULL    (1, src, block, 0)       copy rows block*BM.. of rank src's staging into the gathered buffer
    TILE    (2, chunk, mblock, wi<<16 | nblock)
                                     AG+GEMM: output tile of weight wi over gathered chunk `chunk`;
                                     GEMM+RS: (2, owner, mblock, nblock) partial tile pushed to `owner`
    REDUCE  (3, rank, mblock, nblock) GEMM+RS: the own tile (as TILE, into the own slot) and right behind it,
                                     in the same program, the fold of the W partials of that tile in rank
                                     order 0..W-1 (bitwise deterministic whatever program runs it)
    LOCAL   (4, block, 0, 0)         AG+GEMM at W = 1: copy rows block*BM.. of the shard into the gathered
                                     buffer (nobody waits for it)

Orders (DESIGN.md, "Queue ordered by consumer demand"):
- AG+GEMM on rank r: PUBLISH of every local block first (peers wait for them), then the tiles of the local
  chunk, then chunks in arrival order r+1, r+2, ... (rank r pulls from r+1 first, so each rank is read by
  one peer at a time). The PULLs of chunk c_{j+1} sit just before the last `lookahead` tiles of chunk c_j.
  At W = 1 no peer waits: the shard's copy into the gathered buffer (only when the caller wants that buffer)
  is LOCAL tasks spread evenly among the tiles, so the copies' memory traffic overlaps compute-bound tiles
  (all at the end, the copy costs its whole HBM time; all at the start, it delays the first wave).
- Tiles of one chunk in the GEMM core's grouped order (`grouped`).
- GEMM+RS on rank r: tiles in the order their owners need them, owners r+1, ..., r+W-1, r (the own chunk
  last: its partial never leaves the GPU); the own chunk's tiles are REDUCE tasks: each fold runs right
  behind the tile it folds, in the program that computed it, so no program ever waits on a tile that
  another program has just claimed.

Forward progress: every wait is on a flag set by a task that precedes the waiter in its own rank's stream
(claimed earlier, hence by a running program), or on a peer's task that never waits on this call
(PUBLISH; GEMM+RS tiles), or on the previous call of a peer. `simulate` checks this by running the
streams with P programs per rank.

Pure Python + torch (host side); no Triton here.
"""
from __future__ import annotations

import dataclasses
import heapq
import random
from typing import Iterable, Optional, Sequence

import torch

PUBLISH, PULL, TILE, REDUCE, LOCAL = 0, 1, 2, 3, 4
KIND_NAMES = {PUBLISH: "publish", PULL: "pull", TILE: "tile", REDUCE: "reduce", LOCAL: "local"}
FIELDS = 4
WEIGHT_SHIFT = 16

Task = tuple[int, int, int, int]


def chunk_order(rank: int, world: int) -> list[int]:
    """Chunks in the order AG+GEMM on `rank` consumes them: the local one, then r+1, r+2, ... (arrival order)."""
    return [(rank + j) % world for j in range(world)]


def owner_order(rank: int, world: int) -> list[int]:
    """Owners in the order GEMM+RS on `rank` computes their tiles: r+1, ..., r+W-1, then r itself."""
    return [(rank + 1 + j) % world for j in range(world)]


def tile_task(chunk: int, mblock: int, weight: int, nblock: int) -> Task:
    return (TILE, chunk, mblock, (weight << WEIGHT_SHIFT) | nblock)


def decode_tile(task: Task) -> tuple[int, int, int, int]:
    """(chunk, mblock, weight, nblock) of an AG+GEMM TILE task."""
    _, c, mb, z = task
    return c, mb, z >> WEIGHT_SHIFT, z & ((1 << WEIGHT_SHIFT) - 1)


def grouped(m_blocks: int, cols: Sequence, group_m: int) -> list[tuple[int, object]]:
    """(m-block, column) pairs of one chunk in the GEMM core's grouped order (kosmos.kernels.gemm.tile_coords):
    `group_m` m-blocks at a time, walked column by column, so the tiles running at once share the weight's
    column blocks in L2 instead of streaming the whole weight per wave (group_m=1: row by row)."""
    g = max(1, group_m)
    return [(mb, col) for g0 in range(0, m_blocks, g) for col in cols for mb in range(g0, min(g0 + g, m_blocks))]


def ag_gemm_stream(rank: int, world: int, m_blocks: int, n_blocks: Sequence[int], lookahead: int,
                   group_m: int = 1, gather_local: bool = True) -> list[Task]:
    """Task stream of AG+GEMM on `rank`: m_blocks row blocks per shard, n_blocks[i] column blocks of weight i;
    a chunk's tiles in grouped order (`grouped`), the columns of every weight side by side. gather_local:
    the shard's own rows of the gathered buffer are wanted (at W = 1 they cost LOCAL tasks; at W > 1 the
    PUBLISH writes them anyway)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world {world}")
    if m_blocks < 1 or not n_blocks or min(n_blocks) < 1:
        raise ValueError(f"empty AG+GEMM: m_blocks={m_blocks}, n_blocks={list(n_blocks)}")
    if max(n_blocks) >= 1 << WEIGHT_SHIFT or len(n_blocks) > 4:
        raise ValueError(f"too many column blocks or weights: {list(n_blocks)}")
    order = chunk_order(rank, world)
    stream: list[Task] = [(PUBLISH, mb, 0, 0) for mb in range(m_blocks)] if world > 1 else []
    for j, c in enumerate(order):
        cols = [(wi, nb) for wi, nn in enumerate(n_blocks) for nb in range(nn)]
        tiles = [tile_task(c, mb, wi, nb) for mb, (wi, nb) in grouped(m_blocks, cols, group_m)]
        if j + 1 < world:
            pulls = [(PULL, order[j + 1], mb, 0) for mb in range(m_blocks)]
            cut = max(0, len(tiles) - max(0, lookahead))
            tiles = tiles[:cut] + pulls + tiles[cut:]
        stream += tiles
    if world == 1 and gather_local:
        stream = interleave_local(stream, m_blocks)
    return stream


def interleave_local(tiles: Sequence[Task], m_blocks: int) -> list[Task]:
    """LOCAL copy i of the m_blocks placed right before tile i * len(tiles) // m_blocks."""
    at = {i * len(tiles) // m_blocks: [] for i in range(m_blocks)}
    for i in range(m_blocks):
        at[i * len(tiles) // m_blocks].append((LOCAL, i, 0, 0))
    out: list[Task] = []
    for j, t in enumerate(tiles):
        out += at.get(j, [])
        out.append(t)
    return out


def gemm_rs_stream(rank: int, world: int, m_blocks: int, n_blocks: int, group_m: int = 1) -> list[Task]:
    """Task stream of GEMM+RS on `rank`: m_blocks x n_blocks tiles per owner chunk, in grouped order."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world {world}")
    if m_blocks < 1 or n_blocks < 1:
        raise ValueError(f"empty GEMM+RS: m_blocks={m_blocks}, n_blocks={n_blocks}")
    stream: list[Task] = []
    for o in owner_order(rank, world):
        kind = REDUCE if o == rank else TILE
        stream += [(kind, o, mb, nb) for mb, nb in grouped(m_blocks, range(n_blocks), group_m)]
    return stream


def split_rows(lead: Sequence[int], dim: int) -> tuple[int, int]:
    """(B, s) of an operand whose leading (non-K) dims are `lead`, gathered / scattered along `dim`:
    B = prod(lead[:dim]) batch entries of s = prod(lead[dim:]) rows each (dim 0: B = 1, s = all rows)."""
    if not 0 <= dim < len(lead):
        raise ValueError(f"dim {dim} outside the leading dims {tuple(lead)}")
    B = 1
    for d in lead[:dim]:
        B = B * d
    s = 1
    for d in lead[dim:]:
        s = s * d
    return B, s


def gathered_row(chunk: int, row: int, seg: int, world: int) -> int:
    """Row remap of a gather / scatter along a dim > 0 (host mirror of ag_gemm.gathered_row): row `row` of rank
    `chunk`'s shard [B*seg rows, batch-major] is row b*world*seg + chunk*seg + i of the gathered operand
    [B*world*seg rows] (b, i = divmod(row, seg)). seg = the shard's row count (B = 1) is the dim-0 layout,
    chunk*seg + row. GEMM+RS uses it the other way round: owner `chunk`'s output row `row` (out [B*seg])
    is input row gathered_row(chunk, row, seg, world) of the full [B*world*seg] operand."""
    b, i = divmod(row, seg)
    return b * world * seg + chunk * seg + i


def fold_order(world: int) -> list[int]:
    """Rank order in which a REDUCE task sums the partials of its tile (fixed: bitwise deterministic)."""
    return list(range(world))


def to_tensor(streams: Sequence[Sequence[Task]], device=None, pin: bool = False) -> torch.Tensor:
    """int32 [len(streams), tasks, 4]. All streams must have the same length (they do for one op/shape)."""
    lengths = {len(s) for s in streams}
    if len(lengths) != 1:
        raise ValueError(f"streams of different lengths {sorted(lengths)}")
    t = torch.tensor([list(map(list, s)) for s in streams], dtype=torch.int32).reshape(len(streams), -1, FIELDS)
    if pin and torch.cuda.is_available():
        t = t.pin_memory()
    if device is not None:
        t = t.to(device, non_blocking=pin)
    return t


# ----------------------------------------------------------------------------------------------------------
# dependencies (what each task waits for and what it signals), used by the simulator and the tests


@dataclasses.dataclass(frozen=True)
class Flag:
    """A flag: `table` in rank `owner`'s workspace, entry `key`."""

    owner: int
    table: str
    key: tuple


def ag_gemm_deps(rank: int, world: int, task: Task) -> tuple[list[Flag], list[Flag]]:
    """(flags the task waits for, flags it sets) for AG+GEMM on `rank` (previous-call waits left out)."""
    kind = task[0]
    if kind == PUBLISH:
        return [], [Flag(rank, "ready", (rank, task[1]))]
    if kind == LOCAL:
        return [], []
    if kind == PULL:
        src, mb = task[1], task[2]
        return [Flag(src, "ready", (src, mb))], [Flag(rank, "ready", (src, mb))]
    if kind == TILE:
        c, mb, _, _ = decode_tile(task)
        return ([] if c == rank else [Flag(rank, "ready", (c, mb))]), []
    raise ValueError(f"AG+GEMM has no task kind {kind}")


def gemm_rs_deps(rank: int, world: int, task: Task) -> tuple[list[Flag], list[Flag]]:
    """(flags the task waits for, flags it sets) for GEMM+RS on `rank` (previous-call waits left out)."""
    kind, x, mb, nb = task
    if kind == TILE:
        return [], [Flag(x, "partial", (rank, mb, nb))]
    if kind == REDUCE:  # its own partial is made by this very task
        return [Flag(rank, "partial", (q, mb, nb)) for q in fold_order(world) if q != rank], []
    raise ValueError(f"GEMM+RS has no task kind {kind}")


@dataclasses.dataclass
class SimResult:
    finished: bool
    time: float
    claimed_by: dict  # (rank, task index) -> (program, start, end)
    stuck: list  # (rank, program, task index) of programs still waiting when nothing could move


def simulate(streams: Sequence[Sequence[Task]], deps, programs: int, seed: int = 0,
             durations: Optional[dict] = None) -> SimResult:
    """Runs the ranks' streams with `programs` programs per rank, claiming in stream order, every program
    resident (the grid fits). A waiting program blocks until its flags are set. Random task durations
    (per kind) and random start skew per rank stand in for stragglers. Returns whether everything finished."""
    rng = random.Random(seed)
    world = len(streams)
    dur = {PUBLISH: (0.5, 2.0), PULL: (1.0, 4.0), TILE: (1.0, 3.0), REDUCE: (0.3, 1.0), LOCAL: (0.5, 2.0)}
    if durations:
        dur.update(durations)
    set_flags: set = set()
    next_task = [0] * world
    claimed_by: dict = {}
    # events: (time, seq, rank, program) = program becomes free at time
    events: list = []
    seq = 0
    for r in range(world):
        skew = rng.uniform(0, 5.0)
        for p in range(programs):
            heapq.heappush(events, (skew + rng.uniform(0, 0.1), seq, r, p))
            seq += 1
    waiting: dict = {}  # (r, p) -> (task index, waits, sets)
    now = 0.0
    while events or waiting:
        progressed = False
        # wake waiting programs whose flags are all set
        for key in list(waiting):
            t_idx, waits, sets = waiting[key]
            if all(f in set_flags for f in waits):
                r, p = key
                del waiting[key]
                lo, hi = dur[streams[r][t_idx][0]]
                end = now + rng.uniform(lo, hi)
                claimed_by[(r, t_idx)] = (p, now, end)
                heapq.heappush(events, (end, seq, r, p, sets))
                seq += 1
                progressed = True
        if not events:
            if not progressed:
                stuck = [(r, p, waiting[(r, p)][0]) for (r, p) in waiting]
                return SimResult(False, now, claimed_by, stuck)
            continue
        ev = heapq.heappop(events)
        now = ev[0]
        r, p = ev[2], ev[3]
        if len(ev) > 4:
            set_flags.update(ev[4])
        if next_task[r] >= len(streams[r]):
            continue  # program done
        t_idx = next_task[r]
        next_task[r] += 1
        waits, sets = deps(r, world, streams[r][t_idx])
        waiting[(r, p)] = (t_idx, waits, sets)
    return SimResult(True, now, claimed_by, [])


def check_producers_first(streams: Sequence[Sequence[Task]], deps) -> list[str]:
    """Problems with the rule 'a task's same-rank producers precede it in the stream' (empty: none)."""
    problems = []
    world = len(streams)
    for r, stream in enumerate(streams):
        made_at = {}
        for i, task in enumerate(stream):
            for f in deps(r, world, task)[1]:
                if f.owner == r:
                    made_at[f] = i
        for i, task in enumerate(stream):
            for f in deps(r, world, task)[0]:
                if f.owner == r and f not in made_at:
                    # made by a peer (a pushed partial): its producer never waits in this call
                    continue
                if f.owner == r and made_at[f] >= i:
                    problems.append(f"rank {r} task {i} {task} waits on {f} made later at {made_at[f]}")
    return problems


def describe(task: Task) -> str:
    kind = task[0]
    if kind == TILE:
        return f"tile(chunk/owner={task[1]}, mblock={task[2]}, z={task[3]})"
    if kind == PULL:
        return f"pull(src={task[1]}, block={task[2]})"
    if kind == PUBLISH:
        return f"publish(block={task[1]})"
    if kind == LOCAL:
        return f"local copy(block={task[1]})"
    if kind == REDUCE:
        return f"tile+reduce(mblock={task[2]}, nblock={task[3]})"
    return f"task{tuple(task)}"


def all_tasks(streams: Iterable[Sequence[Task]]) -> list[Task]:
    return [t for s in streams for t in s]
