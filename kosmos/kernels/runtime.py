"""Comm runtime of the fused kernels: symmetric workspaces per process group, and SimWorld.

A workspace gives each of W ranks one buffer that every rank can address (torch symmetric memory on a
real group; W plain buffers on one GPU for SimWorld). Layout of a rank's buffer (bytes):

    [0, 512)                control block, int32 words (kosmos.kernels.signals): claim counter, done count,
                            epoch, error word (code, op, rank, task), FINISHED[64] (peers' last epochs)
    [512, data_off)         flags: int32 epochs, one per (chunk, block) / (source rank, tile)
    [data_off, nbytes)      data: AG staging of the local shard / GEMM+RS partial slots of the W ranks

Kernels get it as `ws_table`, int64 [n_local, W]: row i = the W buffers' addresses as local rank i sees
them (buffer_ptrs of the symmetric-memory handle). Epochs and claim counters live in the control block and
advance on the device (the last program of a call resets the counter and stores the epoch), so a captured
CUDA graph replays correctly; no reset kernels, no per-call host scalars.

Allocated once per (process group, device), reused, grown when a call needs more (growth is a collective
on a real group: every rank grows at the same call, since shapes agree). `workspace_bytes()` reports the
sizes (the explain report shows them).

Errors: a spin past its bound (`set_spin_timeout`, env KOSMOS_SPIN_TIMEOUT_S, default 300 s) writes an error
word; the host reads its host-mapped mirror (no sync) at the next call on the workspace, or right after the
launch when env KOSMOS_DEBUG_SYNC=1, and raises KernelTimeout naming op, rank and task. On a real group the rank
that timed out aborts its peers; a peer whose spin then stops writes its own mirror, and its host raises KernelAborted
(a KernelTimeout). A workspace that saw an error refuses further calls (WorkspaceBroken).

`SimWorld(W)` runs W simulated ranks on one GPU with the same kernels: grid = (programs, W),
rank = program_id(1), its workspace table lists the W simulated ranks' buffers.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import warnings
from typing import Optional

import torch

log = logging.getLogger("kosmos")

# mirrored from kosmos.kernels.signals (int32 word offsets)
CTRL_WORDS = 128  # 512 bytes
CTRL_ERR = 8
CTRL_FINISHED = 64
ERR_ABORTED = 2  # error code: a peer timed out, this rank gave up
MAX_WORLD = 64
FLAGS_OFF_WORDS = CTRL_WORDS
DATA_ALIGN = 512

OP_IDS = {"ag_gemm": 1, "gemm_rs": 2, "moe_layer": 3, "moe_layer_backward": 4}
OP_NAMES = {v: k for k, v in OP_IDS.items()}

_DEFAULT_TIMEOUT_S = 300.0
_timeout_s: Optional[float] = None


class KernelTimeout(RuntimeError):
    """A fused kernel's spin passed its bound: a signal never came (a peer died, hung, or a bug)."""

    def __init__(self, op: str, rank: int, task: int, detail: str = ""):
        self.op, self.rank, self.task = op, rank, task
        super().__init__(f"kosmos::{op}: rank {rank} waited past the spin bound ({spin_timeout_s():g} s) "
                         f"in task {task}{': ' + detail if detail else ''}; the workspace is unusable from now on")


class KernelAborted(KernelTimeout):
    """A peer rank's spin passed its bound and this rank's kernel gave up with it (its outputs are not valid)."""

    def __init__(self, op: str, rank: int, task: int):
        self.op, self.rank, self.task = op, rank, task
        RuntimeError.__init__(self, f"kosmos::{op}: rank {rank} gave up in task {task} because a peer rank passed "
                              f"the spin bound ({spin_timeout_s():g} s; that rank's process raises KernelTimeout); "
                              "the workspace is unusable from now on")


class KernelDoesNotFit(ValueError):
    """A kernel build needs more than the GPU has (shared memory, registers) or its grid cannot be resident at
    once: raised before anything is launched, so the caller can take the reference path with this reason."""


class WorkspaceBroken(RuntimeError):
    """A call on a workspace that an earlier kernel left in a bad state."""


def spin_timeout_s() -> float:
    if _timeout_s is not None:
        return _timeout_s
    return float(os.environ.get("KOSMOS_SPIN_TIMEOUT_S", _DEFAULT_TIMEOUT_S))


def set_spin_timeout(seconds: Optional[float]) -> None:
    """Bound of every device spin, in seconds (None: back to env KOSMOS_SPIN_TIMEOUT_S / 300 s)."""
    global _timeout_s
    if seconds is not None and seconds <= 0:
        raise ValueError("spin timeout must be > 0")
    _timeout_s = seconds


def spin_timeout_ns() -> int:
    return int(spin_timeout_s() * 1e9)


def debug_sync() -> bool:
    return os.environ.get("KOSMOS_DEBUG_SYNC", "0") not in ("", "0")


def capturing(device: torch.device) -> bool:
    """Whether the current stream of `device` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def refuse_host_read_in_capture(device: torch.device, what: str) -> None:
    """`what` is about to read device values on the host, which no CUDA graph capture allows: kosmos's error here in
    place of CUDA's 'operation not permitted when stream is capturing'."""
    if capturing(device):
        raise RuntimeError(f"kosmos: {what} reads device values on the host, which a CUDA graph capture (e.g. "
                           "Inductor's CUDA graph trees) cannot do")


def refuse_growth_in_capture(device: torch.device, what: str) -> None:
    """A tensor the fused kernels keep between calls is about to be replaced by a larger one: not while a CUDA graph
    is captured (the graph would hold an address the next call no longer uses)."""
    if capturing(device):
        raise RuntimeError(f"kosmos: {what} must grow during CUDA graph capture; run the op once with these shapes "
                           "before capturing")


def kept_tensor(device: torch.device, make):
    """make() -> a tensor the kernels keep between calls (control counters, workspaces), allocated outside any CUDA
    graph pool. Inductor's CUDA graph trees route every allocation of the thread that warms a graph up into the graph's
    private pool, then refuse a live tensor there that no output tracks; a helper thread's allocations go to the
    ordinary pool. During a capture proper it runs here (the capture records it; growth there is refused anyway)."""
    if device.type != "cuda" or capturing(device):
        return make()
    if device.index is None:  # the helper thread's current device is not necessarily this thread's
        device = torch.device("cuda", torch.cuda.current_device())
    made: list = []

    def run() -> None:
        try:
            with torch.cuda.device(device):
                t = make()
                torch.cuda.current_stream(device).synchronize()  # its fill is done before another stream reads it
            made.append(t)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            made.append(exc)

    helper = threading.Thread(target=run, name="kosmos-kept-tensor")
    helper.start()
    helper.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def check_after_launch(device: torch.device, check) -> None:
    """In debug mode (KOSMOS_DEBUG_SYNC=1) waits for the kernel just launched and runs `check` (its error word) at
    once; outside CUDA graph capture."""
    if debug_sync() and not capturing(device):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        check()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Compile options of every kosmos launch (and of the grid check's warmup). FMA contraction stays on: triton's
# default up to 3.9, and what every GPU result of kosmos (bit-for-bit tests included) was taken with. triton 3.10
# turns that default off (3.9 warns of the change when a compile leaves it unset), which would move the kernels'
# roundings; pinned here, the kernels round the same on every triton (TRITON_FORCE_DISABLE_FP_FUSION, from 3.9, still
# wins).
COMPILE_OPTIONS = {"enable_fp_fusion": True}


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


@dataclasses.dataclass(frozen=True)
class WorkspaceLayout:
    flag_words: int
    data_bytes: int

    @property
    def data_off(self) -> int:
        return _round_up((FLAGS_OFF_WORDS + self.flag_words) * 4, DATA_ALIGN)

    @property
    def nbytes(self) -> int:
        return self.data_off + _round_up(max(self.data_bytes, 0), DATA_ALIGN)


class Workspace:
    """W ranks' buffers + the table kernels read; `local_ranks` of them are driven from this process."""

    def __init__(self, world: int, local_ranks: list[int], device: torch.device, group_name: Optional[str] = None):
        if not 1 <= world <= MAX_WORLD:
            raise ValueError(f"world size {world} outside 1..{MAX_WORLD}")
        self.world = world
        self.local_ranks = list(local_ranks)
        self.device = torch.device(device)
        self.group_name = group_name
        self.layout = WorkspaceLayout(0, 0)
        self.buffers: list[torch.Tensor] = []
        self.table: Optional[torch.Tensor] = None
        self.bad: Optional[str] = None
        self.uses: dict = {}  # kernel -> what it needs of the data region (formula and bytes), for the report
        self._local_counters: Optional[torch.Tensor] = None
        # once a launch on this workspace was captured in a CUDA graph, tensors it replaced stay allocated: the graph
        # replays on their addresses
        self.captured = False
        self._retired: list = []
        self._handle = None
        self.lock = threading.Lock()
        pin = self.device.type == "cuda"
        # host-mapped error mirror, written by the kernel, read here without a sync
        self.err_host = torch.zeros(4, dtype=torch.int32, pin_memory=pin)
        self._grow(WorkspaceLayout(64, 64 * 1024))

    @property
    def nbytes(self) -> int:
        """Bytes of one rank's buffer (what this workspace costs each GPU)."""
        return self.layout.nbytes

    @property
    def n_local(self) -> int:
        return len(self.local_ranks)

    def local_counters(self, words: int) -> torch.Tensor:
        """int32 counters [n_local, >= words] of the ranks driven here that no peer touches (a kernel's task
        counters), zeroed when allocated; a kernel that uses them zeroes them again at the end of its call. Grown
        (new, zeroed) when a call needs more, never during CUDA graph capture."""
        c = self._local_counters
        if c is None or c.shape[1] < words:
            refuse_growth_in_capture(self.device, f"the local counters of {self.group_name or 'SimWorld'} ({words} "
                                     "words)")
            if c is not None and self.captured:
                self._retired.append(c)
            width = max(words, 2 * (c.shape[1] if c is not None else 0))
            c = kept_tensor(self.device, lambda: torch.zeros(self.n_local, width, dtype=torch.int32,
                                                             device=self.device))
            self._local_counters = c
        return c

    def describe(self, user: str, text: str) -> None:
        """Records what `user` (a kernel) needs of the data region, shown by the explain report."""
        self.uses[user] = text

    def ensure(self, flag_words: int, data_bytes: int) -> None:
        """Grows the buffers (new, zeroed; epochs restart) if a call needs more flags or data. Called before every
        launch: it also notes a launch under CUDA graph capture."""
        self.captured = self.captured or capturing(self.device)
        if flag_words <= self.layout.flag_words and data_bytes <= self.layout.data_bytes:
            return
        refuse_growth_in_capture(self.device, f"the workspace of group {self.group_name!r} ({flag_words} flags, "
                                 f"{data_bytes} data bytes)")
        # grow generously so a model's layers of different shapes settle quickly
        self._grow(WorkspaceLayout(max(flag_words, 2 * self.layout.flag_words),
                                   max(data_bytes, self.layout.data_bytes + self.layout.data_bytes // 2)))

    def _grow(self, layout: WorkspaceLayout) -> None:
        old = self.buffers
        if self.captured and old:
            self._retired.append((old, self.table))
            log.warning("kosmos: workspace %s grows after a CUDA graph capture: the old %d bytes per rank stay "
                        "allocated for the graph's replays", self.group_name or "simworld", self.layout.nbytes)
        if old and self.group_name is not None and self.device.type == "cuda":
            # peers may still write FINISHED flags into the old buffers: drain before dropping them
            torch.cuda.current_stream(self.device).synchronize()
            import torch.distributed as dist
            from torch.distributed.distributed_c10d import _resolve_process_group

            dist.barrier(group=_resolve_process_group(self.group_name))
        self.layout = layout
        if self.group_name is None:  # SimWorld or an interpreter run: plain buffers
            self.buffers = kept_tensor(self.device, lambda: [torch.zeros(layout.nbytes, dtype=torch.uint8,
                                                                         device=self.device)
                                                             for _ in range(self.world)])
            ptrs = [b.data_ptr() for b in self.buffers]
            rows = [ptrs for _ in self.local_ranks]
        else:
            self.buffers, ptrs = self._symmetric(layout.nbytes)
            rows = [ptrs]
        self.table = kept_tensor(self.device, lambda: torch.tensor(rows, dtype=torch.int64).to(self.device))
        log.info("kosmos: workspace %s: %d ranks x %d bytes", self.group_name or "simworld", self.world, layout.nbytes)

    def _symmetric(self, nbytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        try:  # older torch wants the opt-in per group; 2.11+ deprecates it (a FutureWarning per call) or removes it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(self.group_name)
        except Exception:  # noqa: BLE001
            pass
        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        buf.zero_()
        torch.cuda.current_stream(self.device).synchronize()
        handle = symm_mem.rendezvous(buf, self.group_name)
        self._handle = handle
        ptrs = [int(p) for p in handle.buffer_ptrs]
        handle.barrier(channel=0)
        return [buf], ptrs

    # ---- errors ----

    def check(self) -> None:
        """Raises if a kernel on this workspace recorded an error (reads the host mirror; no sync)."""
        if self.bad is not None:
            raise WorkspaceBroken(f"kosmos: workspace of {self.group_name or 'SimWorld'} is unusable: {self.bad}")
        code = int(self.err_host[0])
        if code != 0:
            if self.device.type == "cuda" and not capturing(self.device):
                torch.cuda.synchronize(self.device)  # the details were stored before the code, not fenced
            op = OP_NAMES.get(int(self.err_host[1]), f"op{int(self.err_host[1])}")
            rank, task = int(self.err_host[2]), int(self.err_host[3])
            exc = KernelAborted(op, rank, task) if code == ERR_ABORTED else KernelTimeout(op, rank, task)
            self.bad = str(exc)
            raise exc

    def after_launch(self) -> None:
        check_after_launch(self.device, self.check)

    def read_device_error(self) -> list[int]:
        """The error words of the local ranks' control blocks (syncs; for tests and post-mortems)."""
        out = []
        for i, r in enumerate(self.local_ranks):
            buf = self.buffers[r] if self.group_name is None else self.buffers[0]
            out.append(buf[: CTRL_WORDS * 4].view(torch.int32)[CTRL_ERR:CTRL_ERR + 4].tolist())
        return out

    def epochs(self) -> list[int]:
        """Epoch of the last finished call of each local rank (syncs)."""
        out = []
        for r in self.local_ranks:
            buf = self.buffers[r] if self.group_name is None else self.buffers[0]
            out.append(int(buf[: CTRL_WORDS * 4].view(torch.int32)[2]))
        return out


# ---------------------------------------------------------------------------------------------------------
# registry of real-group workspaces

_workspaces: dict = {}
_registry_lock = threading.Lock()


def group_workspace(group_name: str, device: torch.device) -> Workspace:
    """The workspace of a real process group on `device` (created collectively on first use)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    key = (group_name, torch.device(device).index)
    with _registry_lock:
        ws = _workspaces.get(key)
        if ws is None:
            pg = _resolve_process_group(group_name)
            ws = Workspace(dist.get_world_size(pg), [dist.get_rank(pg)], device, group_name=group_name)
            _workspaces[key] = ws
        return ws


def workspace_bytes() -> dict:
    """Bytes per GPU of each live workspace: {group name (or 'simworld:<id>'): bytes}."""
    return {name: w["bytes"] for name, w in workspace_report().items()}


def workspace_report() -> dict:
    """{workspace name: {"bytes": bytes per GPU (all W ranks for a SimWorld), "uses": {kernel: formula}}}."""
    live = {f"{g}@cuda:{d}": (ws, ws.nbytes) for (g, d), ws in _workspaces.items()}
    for sw in list(_simworlds):
        live[f"simworld:{id(sw):x}"] = (sw.workspace, sw.workspace.nbytes * sw.world)
    return {name: {"bytes": n, "uses": dict(ws.uses)} for name, (ws, n) in live.items()}


# ---------------------------------------------------------------------------------------------------------
# SimWorld

import weakref  # noqa: E402

_simworlds: "weakref.WeakSet[SimWorld]" = weakref.WeakSet()


class SimWorld:
    """W simulated ranks on one GPU running the fused kernels' real code: grid = (programs, W),
    rank = program_id(1), the peer table points at the W ranks' workspace buffers.

    Per-rank tensors are passed stacked on a leading rank dim ([W, ...]); see ag_gemm / gemm_rs.
    """

    def __init__(self, world: int, device="cuda"):
        self.world = world
        self.device = torch.device(device)
        self.workspace = Workspace(world, list(range(world)), self.device)
        _simworlds.add(self)

    def default_programs(self) -> int:
        return default_programs(self.device, self.world)

    def ag_gemm(self, a, weights, biases=None, *, return_gathered=False, out_dtype=None, programs=None,
                straggler=None, drop_signal=None, lookahead=None, outs=None, gathered=None, epilogue="tma"):
        """AG+GEMM of W ranks. a: [W, m, K]; weights: list of [W, K, N_i] (or transposed views [W, N_i, K]^T
        per rank); biases: list of [W, N_i] or None. Returns outs [W, W*m, N_i] (+ gathered [W, W*m, K]).
        straggler=(rank, ns) delays that rank inside the kernel; drop_signal=(rank, task index) makes that
        task skip its release (a fault injection: consumers then time out). epilogue: "tma" (the GEMM core's
        epilogue) or "store" (plain masked stores; see benchmarks/tp_sp.py)."""
        from kosmos.kernels.ag_gemm import ag_gemm_sim

        return ag_gemm_sim(self, a, weights, biases, return_gathered=return_gathered, out_dtype=out_dtype,
                           programs=programs, straggler=straggler, drop_signal=drop_signal, lookahead=lookahead,
                           outs=outs, gathered=gathered, epilogue=epilogue)

    def gemm_rs(self, inputs, weights, bias=None, reduce_op="sum", *, out_dtype=None, programs=None,
                straggler=None, drop_signal=None, out=None):
        """GEMM+RS of W ranks. inputs: list of [W, M, K_i]; weights: list of [W, K_i, N]; bias [W, N] or None.
        Returns [W, M/W, N]: rank r's chunk of reduce_op over ranks of sum_i inputs[i][q] @ weights[i][q]."""
        from kosmos.kernels.gemm_rs import gemm_rs_sim

        return gemm_rs_sim(self, inputs, weights, bias, reduce_op, out_dtype=out_dtype, programs=programs,
                           straggler=straggler, drop_signal=drop_signal, out=out)

    def moe_layer(self, hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k,
                  scoring="softmax", norm_topk_prob=True, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                  router_dtype=None, return_router_logits=False, *, programs=None, straggler=None, drop_signal=None,
                  return_routing=False, config=None, weights_dtype=None):
        """Expert-parallel MoE forward of W ranks (kosmos::moe_layer's semantics with an EP group of W).
        hidden [W, T, H] (rank r's own tokens), router_weight [E, H] and the biases shared, gate_up_proj
        [W, E/W, 2I, H] and down_proj [W, E/W, H, I] (rank r owns experts [r*E/W, (r+1)*E/W)). Returns
        (out [W, T, H], router_logits [W, T or 0, E], tokens_per_expert [W, E], global)
        (+ (topk_ids, topk_weights) [W, T, k] with return_routing)."""
        from kosmos.kernels.moe_ep import moe_ep_forward

        return moe_ep_forward(self.workspace, 0, hidden, router_weight, router_bias, score_correction_bias,
                              gate_up_proj, down_proj, top_k, scoring, norm_topk_prob, n_group, topk_group,
                              routed_scaling_factor, router_dtype, "silu", return_router_logits, programs=programs,
                              straggler=straggler, drop_signal=drop_signal, return_routing=return_routing,
                              config=config, weights_dtype=weights_dtype)

    def moe_layer_backward(self, grad_out, grad_router_logits, hidden, router_weight, router_bias,
                           score_correction_bias, gate_up_proj, down_proj, top_k, scoring="softmax",
                           norm_topk_prob=True, n_group=1, topk_group=1, routed_scaling_factor=1.0, router_dtype=None,
                           *, programs=None, straggler=None, drop_signal=None, config=None):
        """Expert-parallel MoE backward of W ranks (shapes as moe_layer; grad_out [W, T, H], grad_router_logits
        [W, T, E] or None) -> [d_hidden [W, T, H], d_router_weight [W, E, H], d_gate_up_proj [W, E/W, 2I, H],
        d_down_proj [W, E/W, H, I]] (+ [d_router_bias [W, E]]): each rank's share, as kosmos::moe_layer_backward."""
        from kosmos.kernels.moe_ep_backward import moe_ep_backward

        return moe_ep_backward(self.workspace, 0, grad_out, grad_router_logits, hidden, router_weight, router_bias,
                               score_correction_bias, gate_up_proj, down_proj, top_k, scoring, norm_topk_prob,
                               n_group, topk_group, routed_scaling_factor, router_dtype, "silu", programs=programs,
                               straggler=straggler, drop_signal=drop_signal, config=config)


# ---------------------------------------------------------------------------------------------------------
# launch helpers shared by the fused kernels


def num_sms(device: torch.device) -> int:
    from kosmos.kernels.gemm import num_sms as _num_sms

    return _num_sms(torch.device(device))


def default_programs(device: torch.device, world_local: int) -> int:
    """Programs per rank: one per SM, split among the ranks this process drives (1 on a real group)."""
    if torch.device(device).type != "cuda":
        return 1  # interpreter: programs run one after another, so a single one never waits on another
    return max(1, num_sms(device) // max(1, world_local))


def ensure_allocator() -> None:
    """Device-side TMA descriptors need Triton's global scratch allocator; set a torch one if none is."""
    import triton
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


def _torch_scratch(size: int, alignment: int, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


_max_blocks: dict = {}


def blocks_per_sm(compiled, device: torch.device) -> int:
    """How many programs of `compiled` one SM holds at once (registers, shared memory, threads)."""
    compiled._init_handles()
    props = torch.cuda.get_device_properties(device)
    threads = compiled.metadata.num_warps * 32
    regs = max(1, compiled.n_regs) * threads
    smem = compiled.metadata.shared + 1024  # the driver reserves 1 KiB per block
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // regs
    by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // max(smem, 1)
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // threads
    return max(0, min(by_regs, by_smem, by_threads, 32))


def check_grid_fits(kernel, key, grid: tuple, device: torch.device, args: tuple, kwargs: dict) -> None:
    """Raises unless every program of `grid` can be resident at once (the forward-progress rule of the
    self-scheduling kernels: a program may wait on any program that claimed an earlier task)."""
    if interpreting() or torch.device(device).type != "cuda":
        return
    from triton.runtime.errors import OutOfResources

    name = getattr(kernel, "__name__", "kernel")
    nb = _max_blocks.get(key)
    if nb is None:
        try:
            compiled = kernel.warmup(*args, grid=grid, **kwargs, **COMPILE_OPTIONS)
            if hasattr(compiled, "result"):
                compiled = compiled.result()
            nb = blocks_per_sm(compiled, device)
            log.info("kosmos: %s holds %d programs per SM (regs %s, smem %s)", name, nb, compiled.n_regs,
                     compiled.metadata.shared)
        except OutOfResources as e:
            nb = f"{name} does not fit this GPU: {e}"
        _max_blocks[key] = nb
    if isinstance(nb, str):
        raise KernelDoesNotFit(nb)
    total = grid[0] * (grid[1] if len(grid) > 1 else 1)
    cap = nb * num_sms(device)
    if total > cap:
        raise KernelDoesNotFit(f"grid of {total} programs of {name} does not fit the GPU at once ({nb} per SM x "
                               f"{num_sms(device)} SMs = {cap}); self-scheduling kernels need every program "
                               "resident")


_streams: dict = {}


def cached_stream(key, build, device: torch.device) -> torch.Tensor:
    """The device task-stream tensor for `key`, built once by `build()` (a list of per-rank task lists).
    Uploaded from pinned memory kept alive with it, so a first build inside a CUDA graph capture replays."""
    from kosmos.kernels import queue

    t = _streams.get(key)
    if t is None:
        host = queue.to_tensor(build())
        if torch.device(device).type == "cuda":
            host = host.pin_memory()
            dev = host.to(device, non_blocking=True)
        else:
            dev = host
        _streams[key] = (host, dev)
        return dev
    return t[1]
