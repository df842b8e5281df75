"""Device-side signalling for the fused kernels: release stores, bounded acquire spins, the error word.

Protocol (DESIGN.md, "Signals"):
- producer: every thread of the program stores its data, `fence.proxy.async.global` (the data may next be
  read by TMA, the async proxy), CTA barrier, then ONE release atomic of the epoch value into the flag
  (`sys` scope when a peer reads it, `gpu` when only this GPU does);
- consumer: spin on an acquire load until the flag has reached the epoch, CTA barrier, proxy fence.

Flags hold epochs that grow by one per call and are never reset; "reached" is serial-number arithmetic
(`flag - epoch >= 0` in int32), so the int32 wrap after 2^31 calls is harmless.

Every decision that steers control flow is made uniform across the program's threads: each lane of a
[LANES] vector loads the flag (or reads %globaltimer) and a reduction combines them, so no warp can leave a
spin while another stays in it.

Spins are bounded in wall time (%globaltimer). Past the bound the program records an error word
(code, op id, rank, task) in its workspace control block and in a host-mapped mirror the host reads
without a sync, marks every peer's word "aborted" so their spins end too, and leaves. Any spin that sees
its own error word set leaves at once. `USE_ASM=False` (the Triton interpreter, which has no inline asm)
replaces the acquire loads by acquire atomics and the wall clock by a spin count (1 spin ~ 1 us).

Workspace control block (int32 words at the start of every rank's workspace) — see runtime.WorkspaceLayout.
"""
from __future__ import annotations

import triton
import triton.language as tl

# int32 word offsets in a rank's workspace control block (mirrored in kosmos.kernels.runtime)
CTRL_COUNTER = tl.constexpr(0)  # task claim counter of the running call
CTRL_DONE = tl.constexpr(1)  # programs done with the running call
CTRL_EPOCH = tl.constexpr(2)  # epoch of the last finished call (this call signals CTRL_EPOCH + 1)
CTRL_ERR = tl.constexpr(8)  # error word: code, op id, rank, task
CTRL_FINISHED = tl.constexpr(64)  # FINISHED[q] = last epoch peer q finished (peers write it here)

ERR_TIMEOUT = tl.constexpr(1)  # a spin of this rank passed its bound
ERR_ABORTED = tl.constexpr(2)  # a peer timed out; this rank gave up

LANES = tl.constexpr(128)


@triton.jit
def now_ns(USE_ASM: tl.constexpr):
    """%globaltimer in ns, the same value in every thread (max over the lanes' reads). 0 without asm."""
    if USE_ASM:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [tl.zeros([LANES], tl.int32)],
                                      dtype=tl.int64, is_pure=False, pack=1)
        return tl.max(t, axis=0)
    else:
        return tl.zeros([], tl.int64)


@triton.jit
def _backoff(USE_ASM: tl.constexpr):
    if USE_ASM:
        tl.inline_asm_elementwise("nanosleep.u32 64; mov.u32 $0, 0;", "=r,r", [tl.zeros([LANES], tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def proxy_fence(USE_ASM: tl.constexpr):
    """fence.proxy.async.global in every thread: generic-proxy global writes <-> TMA (async proxy) reads."""
    if USE_ASM:
        tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r,r", [tl.zeros([LANES], tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _load_acquire_lanes(ptr, SCOPE: tl.constexpr, USE_ASM: tl.constexpr):
    ptrs = ptr + tl.zeros([LANES], tl.int32)
    if USE_ASM:
        if SCOPE == "sys":
            v = tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ptrs],
                                          dtype=tl.int32, is_pure=False, pack=1)
        else:
            v = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptrs],
                                          dtype=tl.int32, is_pure=False, pack=1)
    else:
        v = tl.atomic_add(ptrs, 0, sem="acquire", scope=SCOPE)
    return v


@triton.jit
def flag_gap(ptr, target, SCOPE: tl.constexpr, USE_ASM: tl.constexpr):
    """min over lanes of (flag - target) as int32 (>= 0: reached), uniform across the program."""
    v = _load_acquire_lanes(ptr, SCOPE, USE_ASM)
    return tl.min(v - target, axis=0)


@triton.jit
def load_uniform(ptr):
    """A volatile int32 load whose value is the same in every thread (max over lanes)."""
    return tl.max(tl.load(ptr + tl.zeros([LANES], tl.int32), volatile=True), axis=0)


@triton.jit
def wait_flag(ptr, target, err_ptr, timeout_ns, SCOPE: tl.constexpr, USE_ASM: tl.constexpr):
    """Spins until *ptr has reached `target`. Returns 0 (reached), ERR_TIMEOUT (past `timeout_ns`) or
    ERR_ABORTED (this rank's error word is set: another program gave up). Ends with a CTA barrier."""
    status = 0
    gap = flag_gap(ptr, target, SCOPE, USE_ASM)
    if gap < 0:
        t0 = now_ns(USE_ASM)
        spins = 0
        while (gap < 0) & (status == 0):
            _backoff(USE_ASM)
            gap = flag_gap(ptr, target, SCOPE, USE_ASM)
            if gap < 0:
                spins += 1
                if load_uniform(err_ptr) != 0:
                    status = ERR_ABORTED
                elif USE_ASM:
                    if now_ns(USE_ASM) - t0 > timeout_ns:
                        status = ERR_TIMEOUT
                elif spins.to(tl.int64) * 1000 > timeout_ns:
                    status = ERR_TIMEOUT
    tl.debug_barrier()
    proxy_fence(USE_ASM)
    return status


@triton.jit
def signal_flag(ptr, value, SCOPE: tl.constexpr, USE_ASM: tl.constexpr):
    """Publishes this program's prior writes: proxy fence, CTA barrier, one release exchange of `value`."""
    proxy_fence(USE_ASM)
    tl.debug_barrier()
    tl.atomic_xchg(ptr, value, sem="release", scope=SCOPE)


@triton.jit
def delay_ns(ns, USE_ASM: tl.constexpr):
    """Spins `ns` nanoseconds on %globaltimer (the straggler knob of the tests); no-op without asm."""
    if USE_ASM:
        t0 = now_ns(USE_ASM)
        t = t0
        while t - t0 < ns:
            _backoff(USE_ASM)
            t = now_ns(USE_ASM)


@triton.jit
def _fill_mirror(err_host, ws_row, rank_base, code, op_id, rank, task):
    """The process's host mirror gets (code, op, rank, task) unless another rank of the process filled it first
    (a lock word in the workspace of rank `rank_base`); plain stores, code last: host memory takes no atomics, and
    the host syncs before reading the details."""
    lock = tl.load(ws_row + rank_base).to(tl.pointer_type(tl.int32)) + CTRL_ERR + 4
    if tl.atomic_cas(lock, 0, 1, sem="acq_rel", scope="gpu") == 0:
        tl.store(err_host + 1, op_id)
        tl.store(err_host + 2, rank)
        tl.store(err_host + 3, task)
        tl.debug_barrier()
        tl.store(err_host, code)


@triton.jit
def record_error(ctrl, err_host, ws_row, rank_base, world, op_id, rank, task):
    """First timeout of this rank wins its error word; the first of this process's ranks also fills the
    host mirror (_fill_mirror). Every peer's word is set to ERR_ABORTED so its spins stop. ws_row: int64
    workspace bases of all ranks as this rank sees them."""
    old = tl.atomic_cas(ctrl + CTRL_ERR, 0, ERR_TIMEOUT, sem="acq_rel", scope="sys")
    if old == 0:
        tl.store(ctrl + CTRL_ERR + 1, op_id)
        tl.store(ctrl + CTRL_ERR + 2, rank)
        tl.store(ctrl + CTRL_ERR + 3, task)
        _fill_mirror(err_host, ws_row, rank_base, ERR_TIMEOUT, op_id, rank, task)
    for q in range(world):
        if q != rank:
            peer = tl.load(ws_row + q).to(tl.pointer_type(tl.int32))
            tl.atomic_cas(peer + CTRL_ERR, 0, ERR_ABORTED, sem="relaxed", scope="sys")


@triton.jit
def record_local_error(err, err_host, op_id, task):
    """The single-GPU kernels' record_error: the first timeout of the launch fills its error words (code, op id,
    task at err) and the host mirror (code, op id, -, task; code last). No peers to abort."""
    if tl.atomic_cas(err, 0, ERR_TIMEOUT, sem="acq_rel", scope="gpu") == 0:
        tl.store(err + 1, op_id)
        tl.store(err + 2, task)
        tl.store(err_host + 1, op_id)
        tl.store(err_host + 3, task)
        tl.debug_barrier()
        tl.store(err_host, ERR_TIMEOUT)


@triton.jit
def record_status(status, ctrl, err_host, ws_row, rank_base, world, op_id, rank, task):
    """After a wait that failed: a timeout is recorded (record_error). An abort (a peer timed out first) goes to
    this process's host mirror too (if no rank of the process wrote it yet), so the host raises for this rank as
    well instead of returning what the aborted call left in its outputs."""
    if status == ERR_TIMEOUT:
        record_error(ctrl, err_host, ws_row, rank_base, world, op_id, rank, task)
    elif tl.atomic_add(ctrl + CTRL_ERR, 0, sem="acquire", scope="sys") == ERR_ABORTED:  # set by a peer, not by
        # another program of this rank (its record_error fills the mirror)
        _fill_mirror(err_host, ws_row, rank_base, ERR_ABORTED, op_id, rank, task)


@triton.jit
def claim(ctrl):
    """Next task index of this call (one relaxed atomic; the value is the same in every thread)."""
    return tl.atomic_add(ctrl + CTRL_COUNTER, 1, sem="relaxed", scope="gpu")


@triton.jit
def count_out(ctrl):
    """Counts this program out of the call; True in the rank's last program (which must then end the call)."""
    tl.debug_barrier()
    old = tl.atomic_add(ctrl + CTRL_DONE, 1, sem="acq_rel", scope="sys")
    return old == tl.num_programs(0) - 1


@triton.jit
def publish_finished(ctrl, ws_row, rank, world, epoch):
    """Ends the call (the rank's last program): resets the claim counter and done count, stores the epoch and tells
    every peer (FINISHED[rank] = epoch in its workspace) that this rank no longer touches their buffers."""
    tl.atomic_xchg(ctrl + CTRL_COUNTER, 0, sem="relaxed", scope="gpu")
    tl.atomic_xchg(ctrl + CTRL_DONE, 0, sem="relaxed", scope="gpu")
    tl.atomic_xchg(ctrl + CTRL_EPOCH, epoch, sem="relaxed", scope="gpu")
    for q in range(world):
        peer = tl.load(ws_row + q).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(peer + CTRL_FINISHED + rank, epoch, sem="release", scope="sys")


@triton.jit
def finish_call(ctrl, ws_row, rank, world, epoch):
    """count_out + publish_finished: the end of every program of a call."""
    if count_out(ctrl):
        publish_finished(ctrl, ws_row, rank, world, epoch)


@triton.jit
def wait_peers_finished(ctrl, err_ptr, world, rank, target, timeout_ns, USE_ASM: tl.constexpr):
    """Waits until every peer has finished the call with epoch `target` (so it no longer reads or writes
    this rank's buffers from that call). Returns a wait_flag status."""
    status = 0
    for q in range(world):
        if status == 0:
            if q != rank:
                status = wait_flag(ctrl + CTRL_FINISHED + q, target, err_ptr, timeout_ns, "sys", USE_ASM)
    return status
