"""Host side of the warp-specialized GEMM (gemm_ws.py): whether this triton and device can run it, and its launch.

Kept apart from gemm.py because the kernel is written in Gluon (triton.experimental.gluon), whose API is
experimental: a triton without it, or with a different warp_specialize signature, reports why here and the
caller picks the Triton kernel instead.
"""
from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch

from kosmos.kernels import launch_plan, runtime


@functools.lru_cache(maxsize=1)
def gluon_missing() -> Optional[str]:
    """None when this triton has the Gluon pieces gemm_ws.py is written against (triton 3.6's API), else why not."""
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401

        from kosmos.kernels import gemm_ws  # noqa: F401
    except Exception as e:  # ImportError, or an API that moved: the message is the reason
        return f"triton.experimental.gluon unavailable ({type(e).__name__}: {e})"
    params = list(inspect.signature(gl.warp_specialize).parameters)
    if params[:3] != ["functions_and_args", "worker_num_warps", "worker_num_regs"]:
        return f"gluon warp_specialize takes {params[:3]}, not the (functions_and_args, ...) form of triton 3.6"
    return None


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple, dtype: torch.dtype):
    """The default NVMMA shared layout of a `block` of dtype (what the Gluon kernels allocate their shared memory
    with); kept, as it is the same for every call of a block and dtype."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def _descriptor(t: torch.Tensor, shape, lead: int, block):
    """A host TMA descriptor over t as [shape] with row stride lead, block `block`, the block's default NVMMA
    layout."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, shape, [lead, 1], block, _shared_layout(tuple(block), t.dtype))


class HostDescriptor(launch_plan.UncheckedArg):
    """_descriptor's fields without its checks: what the grouped launches build each call. A signature's first call
    launches through the JIT with the checked TensorDescriptor (`checked`); the direct launch kept for it then takes
    these as they are (Triton's launcher reads base, shape, strides and padding), their `key` holding everything
    the checks read."""
    __slots__ = ("base", "shape", "strides", "block_shape", "layout", "padding")

    def __init__(self, t: torch.Tensor, shape: list, lead: int, block: list):
        self.base, self.shape, self.strides, self.block_shape = t, shape, [lead, 1], block
        self.layout, self.padding = _shared_layout(tuple(block), t.dtype), "zero"

    def key(self) -> tuple:
        return (self.base.dtype, self.base.data_ptr() % 16, tuple(self.shape), tuple(self.strides),
                tuple(self.block_shape))

    def checked(self):
        return _descriptor(self.base, self.shape, self.strides[0], self.block_shape)


def _launch_kept(kernel, grid: tuple, args: tuple, meta: dict, device: torch.device) -> None:
    """kernel[grid](*args, **meta) through launch_plan.launch (the launch kept for this call's signature, built on
    its first call from the checked descriptors); off CUDA (the tests' stand-in kernels) through the JIT each call.
    Through the JIT each call (its binding, the descriptors' checks), a grouped matmul took 0.25 ms of host time on
    an H100's host, four of them a Qwen3-235B training step (benchmarks/moe_host_breakdown.py, RESULTS.md
    sixty-seventh session)."""
    if device.type != "cuda":
        launch_plan.JitLaunch(kernel, grid, meta)(launch_plan.checked_args(args))
        return
    launch_plan.launch(kernel, grid, args, **meta)


def cannot_run_here(a: torch.Tensor) -> Optional[str]:
    """Why a Gluon sm_90 kernel cannot run on a's device in this process, or None."""
    if runtime.interpreting():
        return "the Triton interpreter does not run Gluon kernels"
    if a.device.type != "cuda" or torch.cuda.get_device_capability(a.device) != (9, 0):
        return "wgmma needs an sm_90 GPU"
    return gluon_missing()


def unsupported(a: torch.Tensor, lay) -> Optional[str]:
    """Why the warp-specialized kernel cannot take A (with the call's GemmLayout), or None."""
    if a.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {a.dtype} (bf16 / fp16 only)"
    if lay.a_trans:
        return "A is a transposed view (the kernel loads [BLOCK_M, BLOCK_K] blocks of a row-major A)"
    return cannot_run_here(a)


def launch(a, b, bias, c, cfg, lay, plan, ws, cnt, programs: int, **overrides) -> None:
    """C = a @ b (+ bias) with gemm_ws_kernel on `programs` programs (checked by unsupported() first), on the
    schedule `plan` (gemm.plan_gemm: whole tiles, then half tiles or the stream-K tail; ws / cnt: the stream-K
    tail's partial slots and zeroed counters).
    overrides: kernel constexprs to replace (register budgets, partition sizes) when probing variants."""
    if (plan.sk_tiles or plan.half_tiles) and cfg.ws_consumers != 1:
        raise ValueError(f"gemm_ws: config {cfg.name}: a tail schedule runs with one consumer")
    from kosmos.kernels.gemm_ws import gemm_ws_kernel

    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    M, N, K = lay.M, lay.N, lay.K
    rows = BM // 2 if cfg.ws_split else BM  # a consumer's rows of a tile
    a_desc = _descriptor(a, [M, K], lay.a_lead, [rows, BK])
    if lay.b_trans:
        b_desc = _descriptor(b, [N, K], lay.b_lead, [BN, BK])
    else:
        b_desc = _descriptor(b, [K, N], lay.b_lead, [BK, BN])
    c_desc = _descriptor(c, [M, N], c.stride(0), [rows, BN])
    if plan.half_tiles:
        a_half_desc = _descriptor(a, [M, K], lay.a_lead, [BM // 2, BK])
        c_half_desc = _descriptor(c, [M, N], c.stride(0), [BM // 2, BN])
    else:
        a_half_desc, c_half_desc = a_desc, c_desc
    gemm_ws_kernel[(programs,)](a_desc, a_half_desc, b_desc, c_desc, c_half_desc, bias if bias is not None else c,
                                ws, cnt, M, N, K,
                                plan.dp_tiles, plan.sk_tiles, plan.sk_iters, plan.sk_workers, plan.sk_max_contrib,
                                BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=cfg.group_m, STAGES=cfg.num_stages,
                                B_TRANS=lay.b_trans, HAS_BIAS=bias is not None, STREAM_K=plan.sk_tiles > 0,
                                HALF_TAIL=plan.half_tiles > 0, ROW_SPLIT=cfg.ws_split,
                                **{**dict(CONSUMER_REGS=232, PRODUCER_REGS=40, NUM_CONSUMERS=cfg.ws_consumers,
                                          PRODUCER_WARPS=1, CONSUMER_WARPS=cfg.num_warps), **overrides},
                                num_warps=cfg.num_warps, **runtime.COMPILE_OPTIONS)


# ------------------------------------------------------------------------------------------- grouped (grouped_ws.py)

GROUPED_BLOCK = (128, 256, 64)  # BLOCK_M, BLOCK_N, BLOCK_K: ws256_1c's tiles (gemm.CONFIGS), three stages

# grouped_ws_kernel's launch configs: "128x256" one 8-warp consumer per tile; "128x256s" the tile's rows split
# between two 4-warp consumers that release each stage on their own (no CTA barrier across the two warpgroups in
# the K loop), the lower one skipping its MMAs where its rows are all past the group's end. SWIGLU and GATHER stay
# in every entry (launch_grouped_mm_swiglu sets them): a build that left one out would take it as a runtime argument.
GROUPED_CONFIGS = {
    "128x256": dict(NUM_CONSUMERS=1, CONSUMER_WARPS=8, CONSUMER_REGS=0, PRODUCER_REGS=40, SWIGLU=False, GATHER=False),
    "128x256s": dict(NUM_CONSUMERS=2, CONSUMER_WARPS=4, CONSUMER_REGS=232, PRODUCER_REGS=40, SWIGLU=False,
                     GATHER=False),
}


def grouped_b_trans(b: torch.Tensor) -> Optional[bool]:
    """B [E, K, N] as grouped_ws_kernel reads it: False for N contiguous ([E, K, N] storage), True for K
    contiguous (a transposed view of [E, N, K] storage), None for any other layout."""
    E, K, N = b.shape
    if b.stride() == (K * N, N, 1):
        return False
    if b.stride() == (N * K, 1, K):
        return True
    return None


def grouped_unsupported(a: torch.Tensor, b: torch.Tensor) -> Optional[str]:
    """Why grouped_ws_kernel cannot compute the ragged-M grouped product of A [S, K] and B [E, K, N], or None."""
    if a.dtype not in (torch.bfloat16, torch.float16) or b.dtype != a.dtype:
        return f"dtypes {a.dtype} x {b.dtype} (bf16 / fp16, the same for both)"
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1]:
        return f"shapes {tuple(a.shape)} x {tuple(b.shape)} (A [S, K], B [E, K, N])"
    K, N = b.shape[1], b.shape[2]
    if a.stride(1) != 1 or a.stride(0) % 8 or a.data_ptr() % 16 or b.data_ptr() % 16 or K % 8 or N % 8:
        return "A not row-major, or a row or pointer not 16-byte aligned (TMA)"
    b_trans = grouped_b_trans(b)
    if b_trans is None:
        return f"B strides {b.stride()} (N or K contiguous storage of the [E, K, N] weight)"
    if not b_trans and K % GROUPED_BLOCK[2]:
        return (f"K = {K} not a multiple of {GROUPED_BLOCK[2]} with N contiguous B (a K block would reach the next "
                "group)")
    return cannot_run_here(a)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, out: Optional[torch.Tensor] = None,
               programs: Optional[int] = None, m_fastest: bool = False, claim: bool = False,
               config: str = "128x256") -> torch.Tensor:
    """[S, N]: rows [ends[e-1], ends[e]) of A [S, K] times B[e] ([E, K, N]) for every group e; rows past ends[-1]
    are left unwritten. ends: int32 [E] on A's device, non-decreasing, ends[-1] <= S (not checked: no host
    sync). m_fastest: a group's tiles in column-block order (its m-tiles next to each other; else its column blocks
    next to each other). claim: programs take tiles from a counter as they get free (else tile t runs on program
    t % programs), so the tiles at work at any moment are neighbours in that order. config: a GROUPED_CONFIGS
    entry. Raises ValueError where grouped_unsupported says why."""
    reason = grouped_unsupported(a, b)
    if reason is not None:
        raise ValueError(f"kosmos grouped_mm: {reason}")
    return launch_grouped_mm(a, b, ends, out, programs, m_fastest, claim, config)


def launch_grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, out: Optional[torch.Tensor] = None,
                      programs: Optional[int] = None, m_fastest: bool = False, claim: bool = False,
                      config: str = "128x256") -> torch.Tensor:
    """grouped_mm for operands grouped_unsupported has already accepted (the ends / out checks still run)."""
    S, K = a.shape
    E, _, N = b.shape
    _check_ends(ends, E, a, "grouped_mm")
    if out is None:
        out = a.new_empty(S, N)
    elif out.shape != (S, N) or out.dtype != a.dtype or out.stride(1) != 1 or out.stride(0) % 8 or out.data_ptr() % 16:
        raise ValueError(f"kosmos grouped_mm: out {tuple(out.shape)} {out.dtype} strides {out.stride()} is not a "
                         f"16-byte aligned row-major [{S}, {N}] {a.dtype}")
    BM, BN, BK = GROUPED_BLOCK
    cfg = GROUPED_CONFIGS[config]
    rows = BM // cfg["NUM_CONSUMERS"]  # a consumer's rows of a tile
    b_trans = grouped_b_trans(b)
    a_desc = HostDescriptor(a, [S, K], a.stride(0), [rows, BK])
    b_desc = HostDescriptor(b, [E * N, K], K, [BN, BK]) if b_trans else HostDescriptor(b, [E * K, N], N, [BK, BN])
    c_desc = HostDescriptor(out, [S, N], out.stride(0), [rows, BN])
    if S == 0 or E == 0:
        return out
    _launch_grouped(a_desc, b_desc, c_desc, out, out.stride(0), ends, E, N, K, out, b_trans, m_fastest, claim, cfg,
                    programs, a.device)
    return out


def _launch_grouped(a_desc, b_desc, c_desc, c, ldc, ends, E, N, K, act, b_trans, m_fastest, claim, cfg, programs,
                    device, gather=None) -> None:
    """grouped_ws_kernel on its descriptors (both launchers): the claim counter, the grid, the constexprs. gather:
    (src, rows) of a GATHER build (A's row r is src[rows[r]]), else None."""
    from kosmos.kernels.gemm import num_sms
    from kosmos.kernels.grouped_ws import grouped_ws_kernel

    BM, BN, BK = GROUPED_BLOCK
    ends = ends.contiguous()
    counter = torch.zeros(1, dtype=torch.int32, device=device) if claim else ends
    src, rows = gather if gather is not None else (c, ends)  # (unused without GATHER)
    gathered = (src.shape[0], rows.shape[0], src.stride(0) // 8) if gather is not None else (0, 0, 0)
    _launch_kept(grouped_ws_kernel, (programs or num_sms(device),),
                 (a_desc, b_desc, c_desc, c, ldc, ends, counter, E, N, K, act, src, rows, *gathered),
                 dict(BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, STAGES=3, B_TRANS=b_trans, M_FASTEST=m_fastest, CLAIM=claim,
                      num_warps=cfg["CONSUMER_WARPS"], **cfg), device)


def _check_ends(ends: torch.Tensor, E: int, a: torch.Tensor, what: str) -> None:
    """Raises ValueError unless ends is int32 [E] on a's device."""
    if ends.dtype != torch.int32 or ends.shape != (E,) or ends.device != a.device:
        raise ValueError(f"kosmos {what}: ends must be int32 [{E}] on {a.device}, not {ends.dtype} "
                         f"{tuple(ends.shape)} on {ends.device}")


def swiglu_unsupported(a: torch.Tensor, b: torch.Tensor) -> Optional[str]:
    """Why grouped_ws_kernel's SWIGLU epilogue cannot compute h = [gate | up] (A [S, H] times B [E, H, 2I] per row
    group, B a K-contiguous view such as gate_up_proj.transpose(1, 2)) and act = silu(gate) * up, or None."""
    half = GROUPED_BLOCK[1] // 2
    if b.dim() == 3:
        N = b.shape[2]
        if N % (2 * half):
            return f"N = {N} is not 2I with I a multiple of {half} (a tile's column block of gate and of up)"
        if grouped_b_trans(b) is False:
            return "B with N contiguous (the SwiGLU epilogue loads K-contiguous gate / up rows: [E, 2I, H] storage)"
    return grouped_unsupported(a, b)


SWIGLU_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def launch_grouped_mm_swiglu(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, *, m_fastest: bool = False,
                             claim: bool = False, config: str = "128x256", act_dtype: Optional[torch.dtype] = None,
                             programs: Optional[int] = None, rows: Optional[torch.Tensor] = None):
    """(h [S, 2I], act [S, I]) in one launch, for operands swiglu_unsupported has already accepted: h is
    launch_grouped_mm(a, b, ends)'s [gate | up] (the same bits) and act = silu(gate) * up in act_dtype (default
    a's), rounded as moe_rows.swiglu_rows(h, act_dtype) rounds it; rows past ends[-1] are left unwritten in both.
    m_fastest / claim / config / programs: as launch_grouped_mm's. rows (int64 [S], contiguous): A is gathered in
    the launch, its row r being a[rows[r]], a zero row where rows[r] is not a row of a (as in
    moe_rows.gather_rows; the MoE pad rows carry a.shape[0]): the bits of the call on that gathered copy, which is
    never written (gather_unsupported says what it needs). Raises ValueError for ends, act_dtype, rows, or a B
    whose shape or layout the epilogue cannot take."""
    S, K = a.shape if rows is None else (rows.shape[0], a.shape[1])
    E, _, N = b.shape
    BM, BN, BK = GROUPED_BLOCK
    _check_ends(ends, E, a, "grouped_mm_swiglu")
    reason = None if rows is None else gather_unsupported(a, rows)
    if reason is not None:
        raise ValueError(f"kosmos grouped_mm_swiglu: {reason}")
    if N % BN:
        raise ValueError(f"kosmos grouped_mm_swiglu: N = {N} is not 2I with I a multiple of {BN // 2}")
    if grouped_b_trans(b) is not True:
        raise ValueError(f"kosmos grouped_mm_swiglu: B strides {b.stride()} (a K-contiguous view of [E, 2I, H] "
                         "storage expected)")
    act_dtype = act_dtype or a.dtype
    if act_dtype not in SWIGLU_ACT_DTYPES:
        raise ValueError(f"kosmos grouped_mm_swiglu: act_dtype {act_dtype} (one of {SWIGLU_ACT_DTYPES})")
    h = a.new_empty(S, N)
    act = torch.empty(S, N // 2, dtype=act_dtype, device=a.device)
    if S == 0 or E == 0 or N == 0:
        return h, act
    cfg = {**GROUPED_CONFIGS[config], "SWIGLU": True}
    if rows is not None:
        cfg.update(GATHER=True, PRODUCER_REGS=GATHER_PRODUCER_REGS)
    tile_rows = BM // cfg["NUM_CONSUMERS"]  # a consumer's rows of a tile
    # (gathered, a_desc only gives the kernel A's dtype and shared layout)
    a_desc = HostDescriptor(a, [a.shape[0], K], a.stride(0), [tile_rows, BK])
    b_desc = HostDescriptor(b, [E * N, K], K, [BN // 2, BK])  # a gate or an up block: half a stage
    c_desc = HostDescriptor(h, [S, N], N, [tile_rows, BN // 2])
    _launch_grouped(a_desc, b_desc, c_desc, h, N, ends, E, N, K, act, True, m_fastest, claim, cfg, programs,
                    a.device, None if rows is None else (a, rows))
    return h, act


# The gathering producer's registers: its four warps' cp.async addressing spills at 40 (sm_90 build on the CPU,
# forty-fourth session), not at 56; the first consumer still gets 216 then (the kernel is built for 168).
GATHER_PRODUCER_REGS = 56


def gather_unsupported(src: torch.Tensor, rows: torch.Tensor) -> Optional[str]:
    """Why launch_grouped_mm_swiglu cannot gather A's rows from src by rows, or None: rows a contiguous int64 [S] on
    src's device; src row-major, its rows a multiple of the K block long (the gathered copies have no column mask)
    and 16-byte aligned (each thread copies 16 bytes)."""
    if rows.dtype != torch.int64 or rows.dim() != 1 or not rows.is_contiguous() or rows.device != src.device:
        return (f"gather rows must be a contiguous int64 [S] on {src.device}, not {rows.dtype} {tuple(rows.shape)} "
                f"on {rows.device}")
    if src.dim() != 2 or src.shape[1] % GROUPED_BLOCK[2] or src.stride(0) % 8 or src.stride(1) != 1:
        return (f"gathered rows of shape {tuple(src.shape)}, strides {src.stride()} (row-major, 16-byte aligned rows "
                f"of a multiple of {GROUPED_BLOCK[2]} elements)")
    return None


# From this many rows per group on average, tiles claimed from a counter pay: with 132 tiles at work in the static
# order (tile t on program t % programs) the programs drift apart, the m-tiles sharing a weight's column block
# no longer run together, and DeepSeek-V3's up GEMM at 513 rows per expert read 36.6 GB from DRAM for 15 GB of
# weights; claimed, 18.3 GB, and its four expert GEMMs ran 2.2-9% faster. At 257 rows (T = 8192) they ran 1.4-14%
# faster and the layer's fwd+bwd 2.3% (thirty-fifth session); at 129 rows (T = 4096) claiming was 1.3-5.7% slower
# (RESULTS.md, thirty-third session).
CLAIM_MIN_ROWS = 192


def grouped_claim(rows: int, groups: int) -> bool:
    """Whether the MoE ops' ragged-M grouped matmuls over `rows` rows in `groups` groups claim their tiles."""
    return rows >= CLAIM_MIN_ROWS * max(groups, 1)


def grouped_config(claim: bool) -> str:
    """The GROUPED_CONFIGS entry the MoE ops run. With claimed tiles the split consumers were 1.9-5.3% faster on
    DeepSeek-V3's four expert GEMMs at 257 and 513 rows per expert (and its layer's fwd+bwd 0.8% at T = 8192); in the
    static order at 129 rows, 4-26% slower (RESULTS.md, thirty-sixth session)."""
    return "128x256s" if claim else "128x256"


# ------------------------------------------------------------------------------- ragged K (grouped_wgrad_ws.py)

# BM, BN, BK, stages, warps a consumer, consumers. The "pp" ones have two consumers taking turns by tile, so one's
# epilogue runs under the other's MMAs.
WGRAD_CONFIGS = {"128x256": (128, 256, 64, 3, 8, 1), "128x128": (128, 128, 64, 4, 4, 1),
                 "128x128pp": (128, 128, 64, 4, 4, 2), "64x256pp": (64, 256, 64, 3, 4, 2)}

# Up to this many rows per group on average, a tile's k-loop is short enough that hiding its epilogue pays more than
# the wider tile. On the H200 (RESULTS.md, thirty-second session) 128x128pp beat 128x256 on DeepSeek-V3's experts
# alone at 129 and 257 rows per expert and lost at 513; in the layer it was faster fwd+bwd at 129 rows (T = 4096)
# and 0.6% slower at 257 (T = 8192, three A/B pairs).
PINGPONG_MAX_ROWS = 192


def wgrad_config(rows: int, groups: int) -> str:
    """The WGRAD_CONFIGS entry the MoE ops run for `rows` grouped rows in `groups` groups."""
    return "128x128pp" if rows <= PINGPONG_MAX_ROWS * max(groups, 1) else "128x256"


# Up to this many rows per group on average a one-consumer config has TMA zero-fill a group's last K block (the
# zeroing in shared memory is a larger share of a short tile). DeepSeek-V3's layer on an H100 (RESULTS.md,
# fifty-first session): at 257 rows (T = 8192) fwd+bwd 4% faster (44.40 / 44.57 against 46.24 / 46.51 ms, two
# processes), at 513 rows (T = 16384) 2.4% slower.
TAIL_TMA_MAX_ROWS = 384


def wgrad_tail(config: str, rows: int, groups: int) -> str:
    """How a config's kernel clears a group's last K block past the group's rows: "zero" (zeroed in shared memory
    before the MMA) or "tma" (loaded through descriptors over the group's rows built on the device, which TMA fills
    past them with zeros); the same bits. Two-consumer configs always zero (with TMA's zeros they ran 6-31% slower);
    one-consumer ones take "tma" up to TAIL_TMA_MAX_ROWS rows per group on average. KOSMOS_WGRAD_TAIL=zero / tma
    sets it for every size (auto: the rule)."""
    from kosmos.kernels.moe_ops import env_choice

    mode = env_choice("KOSMOS_WGRAD_TAIL", ("auto", "zero", "tma"), "auto")
    if WGRAD_CONFIGS[config][5] != 1:
        return "zero"
    if mode == "auto":
        return "tma" if rows <= TAIL_TMA_MAX_ROWS * max(groups, 1) else "zero"
    return mode


def grouped_wgrad_unsupported(a: torch.Tensor, b: torch.Tensor, block_m: int = 128) -> Optional[str]:
    """Why grouped_wgrad_kernel cannot compute out[e] = A_e^T @ B_e for A [S, M] and B [S, N], or None."""
    if a.dtype not in (torch.bfloat16, torch.float16) or b.dtype != a.dtype:
        return f"dtypes {a.dtype} x {b.dtype} (bf16 / fp16, the same for both)"
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
        return f"shapes {tuple(a.shape)} x {tuple(b.shape)} (A [S, M], B [S, N])"
    M, N = a.shape[1], b.shape[1]
    if M % block_m:
        return f"M = {M} not a multiple of {block_m} (a tile would reach the next group's rows of out)"
    if (a.stride(1) != 1 or b.stride(1) != 1 or a.stride(0) % 8 or b.stride(0) % 8 or a.data_ptr() % 16
            or b.data_ptr() % 16 or N % 8):
        return "A or B not row-major, or a row or pointer not 16-byte aligned (TMA)"
    return cannot_run_here(a)


def grouped_wgrad(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, out: Optional[torch.Tensor] = None,
                  programs: Optional[int] = None, config: str = "128x256") -> torch.Tensor:
    """[E, M, N]: out[e] = A[rows of group e]^T @ B[rows of group e] (rows [ends[e-1], ends[e]) of A [S, M] and
    B [S, N]); zeros for a group without rows. ends: int32 [E] on A's device, non-decreasing, ends[-1] <= S (not
    checked: no host sync). Raises ValueError where grouped_wgrad_unsupported says why."""
    reason = grouped_wgrad_unsupported(a, b, WGRAD_CONFIGS[config][0])
    if reason is not None:
        raise ValueError(f"kosmos grouped_wgrad: {reason}")
    return launch_grouped_wgrad(a, b, ends, out, programs, config)


def launch_grouped_wgrad(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, out: Optional[torch.Tensor] = None,
                         programs: Optional[int] = None, config: str = "128x256",
                         tail: Optional[str] = None) -> torch.Tensor:
    """grouped_wgrad for operands grouped_wgrad_unsupported has already accepted (the ends / out checks still
    run); tail: wgrad_tail's answer where the caller has it."""
    from kosmos.kernels.gemm import num_sms
    from kosmos.kernels.grouped_wgrad_ws import grouped_wgrad_kernel

    BM, BN, BK, stages, warps, consumers = WGRAD_CONFIGS[config]
    (S, M), N, E = a.shape, b.shape[1], ends.numel()
    if ends.dtype != torch.int32 or ends.dim() != 1 or ends.device != a.device:
        raise ValueError(f"kosmos grouped_wgrad: ends must be int32 [E] on {a.device}, not {ends.dtype} "
                         f"{tuple(ends.shape)} on {ends.device}")
    if out is None:
        out = a.new_empty(E, M, N)
    elif out.shape != (E, M, N) or out.dtype != a.dtype or not out.is_contiguous() or out.data_ptr() % 16:
        raise ValueError(f"kosmos grouped_wgrad: out {tuple(out.shape)} {out.dtype} is not a contiguous 16-byte "
                         f"aligned [{E}, {M}, {N}] {a.dtype}")
    if E == 0 or M == 0 or N == 0:
        return out
    a_desc = HostDescriptor(a, [S, M], a.stride(0), [BK, BM])
    b_desc = HostDescriptor(b, [S, N], b.stride(0), [BK, BN])
    c_desc = HostDescriptor(out.view(E * M, N), [E * M, N], N, [BM, BN])
    tiles = E * (M // BM) * -(-N // BN)
    tail_by_tma = (tail or wgrad_tail(config, S, E)) == "tma"
    if tail_by_tma:
        runtime.ensure_allocator()
    _launch_kept(grouped_wgrad_kernel, (min(tiles, programs or num_sms(a.device)),),
                 (a_desc, b_desc, c_desc, ends.contiguous(), E, M, N, a, b, a.stride(0), b.stride(0)),
                 dict(BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, STAGES=stages, PRODUCER_REGS=40, CONSUMER_WARPS=warps,
                      NUM_CONSUMERS=consumers, CONSUMER_REGS=232, TAIL_BY_TMA=tail_by_tma, num_warps=warps), a.device)
    return out
