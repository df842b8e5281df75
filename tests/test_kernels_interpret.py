"""The fused kernels' code paths that cannot wait, under TRITON_INTERPRET=1 on CPU: W=1, one program.

The interpreter runs programs one after another, so a spin on another program's signal would never end;
at W=1 with one program every wait is on a task the same program already ran (the stream puts producers
first), so the whole fused kernels run: publish, tiles, pushes, reduces, epochs. At W=2 rank 0 runs to its
end before rank 1 starts, which makes a missing signal: the timeout path and the error word.
fp16 (the interpreter's tl.dot on bf16 multiplies raw bits).

All cases run in ONE subprocess (TRITON_INTERPRET must be set before triton is imported and must not leak
into other tests); each test checks its case's line of the report.

Gathers / scatters along dim 1 (local batch B >= 2, the kernels' row remap): W=1 single-program cases here,
and, in a second subprocess, W = 2..4 ranks each launched from its own Python thread (one program per
rank) with the interpreter's grid index made thread-local: the ranks' programs then run concurrently, so
cross-rank waits end and the remapped pulls / pushes are checked against torch.cat / chunk references.
The same threads run the expert-parallel MoE kernels, also through the real-group launchers
(kosmos.kernels.moe_ep_group: each thread drives one rank view, as a group's process does).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CASES = ["ag_two_weights_bias", "ag_store_epilogue", "ag_row_major_rerun", "rs_sum_avg_pairs", "rs_one_pair_nobias",
         "missing_signal_raises", "peer_abort_noted", "epochs_advance", "ag_gather_dim1", "rs_scatter_dim1",
         "ag_gathered_or_not"]
# multi-rank cases, one thread per rank (see _threaded_interpreter)
THREAD_CASES = ["threads_ag_dim0", "threads_ag_dim1", "threads_rs_dim0", "threads_rs_dim1", "threads_moe_ep",
                "threads_moe_ep_group"]


def _rel(out, ref):
    return float((out.float() - ref).norm() / ref.norm())


def case_ag_two_weights_bias(torch, SimWorld):
    g = torch.Generator().manual_seed(1)
    m, K, Ns = 150, 96, [40, 264]  # ragged: m, N not multiples of the 128x256 tile
    a = torch.randn(1, m, K, generator=g).half()
    ws = [torch.randn(1, n, K, generator=g).half().transpose(1, 2) for n in Ns]  # Linear weights' w.t()
    bs = [torch.randn(1, Ns[0], generator=g).half(), None]
    outs = SimWorld(1, device="cpu").ag_gemm(a, ws, bs, return_gathered=True)
    errs = [_rel(outs[i][0], a[0].float() @ w[0].float() + (b[0].float() if b is not None else 0))
            for i, (w, b) in enumerate(zip(ws, bs))]
    assert all(e < 1e-3 for e in errs), errs
    assert torch.equal(outs[2][0], a[0]), "gathered buffer"
    return {"errs": errs}


def case_ag_store_epilogue(torch, SimWorld):
    g = torch.Generator().manual_seed(7)
    m, K, Ns = 150, 96, [40, 264]
    a = torch.randn(1, m, K, generator=g).half()
    ws = [torch.randn(1, n, K, generator=g).half().transpose(1, 2) for n in Ns]
    bs = [None, torch.randn(1, Ns[1], generator=g).half()]
    sw = SimWorld(1, device="cpu")
    outs = [torch.full((1, m, n), float("nan")).half() for n in Ns]
    sw.ag_gemm(a, ws, bs, outs=outs, epilogue="store")
    errs = [_rel(o[0], a[0].float() @ w[0].float() + (b[0].float() if b is not None else 0))
            for o, w, b in zip(outs, ws, bs)]
    assert all(e < 1e-3 for e in errs), errs
    tma = sw.ag_gemm(a, ws, bs)
    assert all(torch.equal(x, y) for x, y in zip(outs, tma)), "epilogues disagree"
    return {"errs": errs}


def case_ag_row_major_rerun(torch, SimWorld):
    g = torch.Generator().manual_seed(2)
    a = torch.randn(1, 136, 64, generator=g).half()
    w = torch.randn(1, 64, 24, generator=g).half()  # row-major [K, N]
    sw = SimWorld(1, device="cpu")
    o1 = sw.ag_gemm(a, [w])[0]
    o2 = sw.ag_gemm(a, [w])[0]
    assert torch.equal(o1, o2), "rerun not bit-identical"
    err = _rel(o1[0], a[0].float() @ w[0].float())
    assert err < 1e-3, err
    return {"err": err}


def case_rs_sum_avg_pairs(torch, SimWorld):
    g = torch.Generator().manual_seed(3)
    M, Ks, N = 200, [96, 48], 264
    xs = [torch.randn(1, M, k, generator=g).half() for k in Ks]
    wts = [torch.randn(1, N, k, generator=g).half().transpose(1, 2) for k in Ks]
    bias = torch.randn(1, N, generator=g).half()
    sw = SimWorld(1, device="cpu")
    ref = sum(x[0].float() @ w[0].float() for x, w in zip(xs, wts)) + bias[0].float()
    errs = {}
    for op in ("sum", "avg"):
        out = torch.full((1, M, N), float("nan")).half()
        out = sw.gemm_rs(xs, wts, bias, op)
        errs[op] = _rel(out[0], ref)
        assert not out.isnan().any()
    assert all(e < 1e-3 for e in errs.values()), errs
    return errs


def case_rs_one_pair_nobias(torch, SimWorld):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 130, 32, generator=g).half()
    w = torch.randn(1, 32, 40, generator=g).half()
    out = SimWorld(1, device="cpu").gemm_rs([x], [w], None, "sum")
    err = _rel(out[0], x[0].float() @ w[0].float())
    assert err < 1e-3, err
    return {"err": err}


def case_missing_signal_raises(torch, SimWorld):
    """W=2 with one program per rank: the interpreter runs rank 0's program to its end before rank 1's starts,
    so rank 0's pull of rank 1's first block waits on a signal that cannot come: it must time out, record
    (op, rank, task), abort the peer, and the host must raise at the next call and then refuse the workspace."""
    from kosmos.kernels import queue, runtime

    g = torch.Generator().manual_seed(5)
    a = torch.randn(2, 130, 32, generator=g).half()
    w = torch.randn(2, 32, 40, generator=g).half()
    runtime.set_spin_timeout(0.0002)  # the interpreter counts one spin as 1 us
    try:
        sw = SimWorld(2, device="cpu")
        sw.ag_gemm(a, [w])
        words = sw.workspace.read_device_error()
        stream = queue.ag_gemm_stream(0, 2, 2, [1], 1)
        first_pull = next(i for i, t in enumerate(stream) if t[0] == queue.PULL)
        assert words[0] == [1, runtime.OP_IDS["ag_gemm"], 0, first_pull], (words, stream)
        assert words[1][0] == 2, "peer marked aborted"
        try:
            sw.ag_gemm(a, [w])
        except runtime.KernelTimeout as e:
            assert (e.op, e.rank, e.task) == ("ag_gemm", 0, first_pull)
            msg = str(e)
        else:
            raise AssertionError("no KernelTimeout")
        try:
            sw.ag_gemm(a, [w])
        except runtime.WorkspaceBroken:
            pass
        else:
            raise AssertionError("a broken workspace took another call")
    finally:
        runtime.set_spin_timeout(None)
    return {"msg": msg}


def case_peer_abort_noted(torch, SimWorld):
    """Rank 1 of 2 as a real group's process sees it (one local rank, its own host mirror): a peer's abort in its
    control block stops its spin at the pull of rank 0's block (AG) / the fold of rank 0's partial (RS), and the
    host raises an abort (a KernelTimeout subclass), then WorkspaceBroken. With its own timeout's code in the word
    and the mirror lock taken (what record_error leaves; it fills the mirror) the aborted spin leaves the mirror
    alone."""
    from kosmos.kernels import ag_gemm as agm
    from kosmos.kernels import gemm_rs as rsm
    from kosmos.kernels import queue, runtime, signals

    g = torch.Generator().manual_seed(10)
    m, K, N = 130, 32, 40
    a = torch.randn(2, m, K, generator=g).half()
    w = torch.randn(2, N, K, generator=g).half().transpose(1, 2)
    RT = agm._RankTensor

    def run_ag(ws):
        gat = torch.empty(2, 2 * m, K).half()
        out = torch.empty(2, 2 * m, N).half()
        agm.launch(ws, 1, RT(a, a.stride(0), a.stride(1)), m, K, RT(gat, gat.stride(0), K),
                   [RT(w, w.stride(0), agm._weight_view(w[0])[1])], True, [N], [None],
                   [RT(out, out.stride(0), out.stride(1))], programs=1)

    def run_rs(ws):
        out = torch.empty(2, m // 2, N).half()
        rsm.launch(ws, 1, [RT(a, a.stride(0), a.stride(1))], [K], [RT(w, w.stride(0), agm._weight_view(w[0])[1])],
                   True, None, RT(out, out.stride(0), out.stride(1)), m, N, "sum", programs=1)

    def rank1_view(code, lock=0):
        ws = runtime.Workspace(2, [1], torch.device("cpu"))
        ctrl = ws.buffers[1][:runtime.CTRL_WORDS * 4].view(torch.int32)
        ctrl[runtime.CTRL_ERR] = code
        ctrl[runtime.CTRL_ERR + 4] = lock  # the host mirror's lock (signals.record_error)
        return ws

    nmb = -(-m // 128)
    ag_stream = queue.ag_gemm_stream(1, 2, nmb, [1], 1)
    rs_stream = queue.gemm_rs_stream(1, 2, -(-(m // 2) // 128), 1)
    want = {"ag_gemm": ag_stream.index((queue.PULL, 0, 0, 0)), "gemm_rs": rs_stream.index((queue.REDUCE, 1, 0, 0))}
    runtime.set_spin_timeout(0.0002)  # not reached: the abort ends the spin at once
    seen = {}
    try:
        for op, run in (("ag_gemm", run_ag), ("gemm_rs", run_rs)):
            ws = rank1_view(signals.ERR_ABORTED.value)
            run(ws)
            try:
                ws.check()
            except runtime.KernelTimeout as e:
                assert type(e) is not runtime.KernelTimeout, f"{op}: an abort reported as this rank's own timeout"
                assert (e.op, e.rank, e.task) == (op, 1, want[op]), (op, e.op, e.rank, e.task, want[op])
                seen[op] = f"{type(e).__name__}: {e}"
            else:
                raise AssertionError(f"{op}: no error raised after a peer's abort")
            try:
                run(ws)
            except runtime.WorkspaceBroken:
                pass
            else:
                raise AssertionError(f"{op}: an aborted workspace took another call")
            ws = rank1_view(signals.ERR_TIMEOUT.value, lock=1)
            run(ws)
            assert int(ws.err_host[0]) == 0, (op, ws.err_host.tolist(), "own timeout: the mirror is record_error's")
    finally:
        runtime.set_spin_timeout(None)
    return seen


def case_epochs_advance(torch, SimWorld):
    g = torch.Generator().manual_seed(6)
    sw = SimWorld(1, device="cpu")
    a = torch.randn(1, 128, 32, generator=g).half()
    w = torch.randn(1, 32, 16, generator=g).half()
    for i in range(3):
        sw.ag_gemm(a, [w])
        sw.gemm_rs([a], [w], None, "sum")
    ep = sw.workspace.epochs()
    ctrl = sw.workspace.buffers[0][:512].view(torch.int32)
    assert ep == [6], ep
    assert int(ctrl[0]) == 0 and int(ctrl[1]) == 0, "claim counter / done count reset on the device"
    assert int(ctrl[64]) == 6, "FINISHED[0]"
    return {"epochs": ep}


def case_ag_gather_dim1(torch, SimWorld):
    """gather_dim 1 at W=1: B batch entries of s rows; s=64 takes the 64-row tile, s=128 the config's; one
    weight (output descriptor once per program) and two (per tile); TMA and plain-store epilogues agree."""
    from kosmos.kernels.ag_gemm import ag_gemm_sim

    g = torch.Generator().manual_seed(8)
    sw = SimWorld(1, device="cpu")
    errs = []
    for B, s, K, Ns in [(3, 64, 48, [40, 24]), (2, 128, 32, [16])]:
        a = torch.randn(1, B, s, K, generator=g).half()
        ws = [torch.randn(1, n, K, generator=g).half().transpose(1, 2) for n in Ns]
        bs = [torch.randn(1, Ns[0], generator=g).half()] + [None] * (len(Ns) - 1)
        outs = [torch.full((1, B, s, n), float("nan")).half() for n in Ns]
        gat = torch.full((1, B, s, K), float("nan")).half()
        res = ag_gemm_sim(sw, a, ws, bs, return_gathered=True, outs=outs, gathered=gat, gather_dim=1)
        for o, w, b in zip(res, ws, bs):
            assert o.shape == (1, B, s, w.shape[2]) and not o.isnan().any()
            errs.append(_rel(o[0], a[0].float() @ w[0].float() + (b[0].float() if b is not None else 0)))
        assert torch.equal(res[-1][0], a[0]), "gathered buffer"
        st = ag_gemm_sim(sw, a, ws, bs, gather_dim=1, epilogue="store")
        assert all(torch.equal(x, y) for x, y in zip(st, res)), "epilogues disagree"
    assert all(e < 1e-3 for e in errs), errs
    try:
        ag_gemm_sim(sw, torch.zeros(1, 2, 96, 32).half(), [torch.zeros(1, 32, 16).half()], gather_dim=1)
    except ValueError as e:
        assert "rows per batch entry s=96" in str(e), e
    else:
        raise AssertionError("s=96 (no tile divides it) was not refused")
    return {"errs": errs}


def case_rs_scatter_dim1(torch, SimWorld):
    """scatter_dim 1 at W=1 (sum, avg; one and two pairs; a 3-d leading shape scattered along its middle dim)."""
    from kosmos.kernels.gemm_rs import gemm_rs_sim

    g = torch.Generator().manual_seed(9)
    sw = SimWorld(1, device="cpu")
    errs = {}
    for lead, Ks, N, op in [((2, 128), [32], 40, "sum"), ((3, 64), [32, 16], 24, "avg"), ((2, 2, 32), [16], 8, "sum")]:
        xs = [torch.randn(1, *lead, k, generator=g).half() for k in Ks]
        wts = [torch.randn(1, N, k, generator=g).half().transpose(1, 2) for k in Ks]
        bias = torch.randn(1, N, generator=g).half()
        out = torch.full((1, *lead, N), float("nan")).half()
        out = gemm_rs_sim(sw, xs, wts, bias, op, out=out, scatter_dim=1)
        assert out.shape == (1, *lead, N) and not out.isnan().any()
        ref = sum(x[0].float() @ w[0].float() for x, w in zip(xs, wts)) + bias[0].float()
        errs[str(lead)] = _rel(out[0], ref)
    assert all(e < 1e-3 for e in errs.values()), errs
    return errs


# ---- several ranks at once: one Python thread per rank


class _RankView:
    """Rank r's view of a SimWorld workspace, as a real group's process has it: the W buffers' table row r,
    one local rank, its own lock and error mirror (buffers sized beforehand)."""

    def __init__(self, ws, r):
        import threading

        import torch

        self.world, self.local_ranks, self.n_local = ws.world, [r], 1
        self.device = ws.device
        self.table = ws.table[r:r + 1].clone()
        self.layout = ws.layout
        self.err_host = torch.zeros(4, dtype=torch.int32)
        self.lock = threading.Lock()

    def check(self):
        assert int(self.err_host[0]) == 0, f"kernel error word {self.err_host.tolist()}"

    def after_launch(self):
        self.check()

    def ensure(self, flag_words, data_bytes):
        assert flag_words <= self.layout.flag_words and data_bytes <= self.layout.data_bytes

    def describe(self, user, text):
        pass

    def local_counters(self, words):
        import torch

        if getattr(self, "_counters", None) is None or self._counters.shape[1] < words:
            self._counters = torch.zeros(1, words, dtype=torch.int32)  # between calls: nothing is counting
        return self._counters


def _threaded_interpreter():
    """Makes the interpreter's grid index / grid size thread-local, leaves the language patched (each launch
    would otherwise restore triton.language while another thread's launch still runs) and serializes its
    first-use bookkeeping. Only for the threads subprocess."""
    import threading

    import triton.runtime.interpreter as interp

    tls = threading.local()

    def prop(name):
        return property(lambda self: getattr(tls, name, None), lambda self, v: setattr(tls, name, v))

    interp.InterpreterBuilder.grid_idx = prop("grid_idx")
    interp.InterpreterBuilder.grid_dim = prop("grid_dim")
    interp._LangPatchScope.restore = lambda self: None
    # A jit function's first rewrite copies the interpreter's globals into the function's module, and every call
    # walks that module's globals (_patch_lang): a thread switch inside the walk while another rank's thread
    # rewrites a function of that module makes the walk raise "dictionary changed size during iteration", and the
    # failed rank's peers spin on its flags for ever (the CI hangs of this subprocess). One lock around both. The
    # interpreter's warning registry is made beforehand: a first warning would insert it into the globals a
    # rewrite walks. (Its atomics need no lock: one C++ call each, made holding the GIL.)
    lock = threading.RLock()

    def locked(f):
        def g(*args, **kwargs):
            with lock:
                return f(*args, **kwargs)

        return g

    interp._patch_lang = locked(interp._patch_lang)
    interp.InterpretedFunction.rewrite = locked(interp.InterpretedFunction.rewrite)
    vars(interp).setdefault("__warningregistry__", {})
    sys.setswitchinterval(0.0005)  # a spinning rank hands the GIL over sooner


def _run_ranks(sw, fn, timeout=120.0):
    """fn(rank_view, rank) on one thread per rank, concurrently; re-raises the first failure. A rank that raises
    or is still running after `timeout` s sets every rank's error word, so the others' spins end (the spin bound
    set in _main is never reached in the interpreter); on a timeout every thread's stack goes to stderr."""
    import faulthandler
    import threading
    import time
    import traceback

    import torch

    from kosmos.kernels import runtime, signals

    sw.workspace.ensure(1 << 12, 1 << 22)
    errors = []

    def abort():
        for buf in sw.workspace.buffers:
            buf[:runtime.CTRL_WORDS * 4].view(torch.int32)[runtime.CTRL_ERR] = signals.ERR_ABORTED.value

    def body(r):
        try:
            fn(_RankView(sw.workspace, r), r)
        except Exception:  # noqa: BLE001
            errors.append(traceback.format_exc())
            abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}", daemon=True) for r in range(sw.world)]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        print(f"threads {alive} still running after {timeout:g} s:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        abort()
        for t in threads:
            t.join(10)
    assert not alive, f"{alive} still running after {timeout:g} s (stacks on stderr); {errors[:1]}"
    assert not errors, errors[0]


def _ag_ranks(torch, sw, a4, ws, bs, gather_dim, epilogue="tma", gather_local=True):
    """AG+GEMM of a4 [W, *shard] on W threads (kernel launched per rank, programs=1); outs in gathered shape."""
    from kosmos.kernels import ag_gemm as agm
    from kosmos.kernels import queue

    W = a4.shape[0]
    lead = list(a4.shape[1:-1])
    K = a4.shape[-1]
    B, s = queue.split_rows(lead, gather_dim)
    m = B * s
    a = a4.reshape(W, m, K)
    g = torch.full((W, W * m, K), float("nan")).half()
    outs = [torch.full((W, W * m, w.shape[2]), float("nan")).half() for w in ws]
    RT = agm._RankTensor

    def fn(view, r):
        agm.launch(view, r, RT(a, a.stride(0), a.stride(1)), m, K, RT(g, g.stride(0), K),
                   [RT(w, w.stride(0), agm._weight_view(w[0])[1]) for w in ws], True, [w.shape[2] for w in ws],
                   [RT(b, b.stride(0), 1) if b is not None else None for b in bs],
                   [RT(o, o.stride(0), o.stride(1)) for o in outs], programs=1, epilogue=epilogue,
                   seg=s if B > 1 else None, gather_local=gather_local)

    _run_ranks(sw, fn)
    glead = list(lead)
    glead[gather_dim] *= W
    return [o.view(W, *glead, o.shape[-1]) for o in outs], g.view(W, *glead, K)


def _check_ag_ranks(torch, SimWorld, W, lead, K, Ns, gather_dim, seed, epilogue="tma"):
    g = torch.Generator().manual_seed(seed)
    a4 = torch.randn(W, *lead, K, generator=g).half()
    ws = [torch.randn(W, n, K, generator=g).half().transpose(1, 2) for n in Ns]
    bs = [torch.randn(W, Ns[0], generator=g).half()] + [None] * (len(Ns) - 1)
    outs, gat = _ag_ranks(torch, SimWorld(W, device="cpu"), a4, ws, bs, gather_dim, epilogue)
    gathered = torch.cat(list(a4), dim=gather_dim)
    for r in range(W):
        assert torch.equal(gat[r], gathered), f"rank {r}'s gathered buffer differs from torch.cat"
    errs = []
    for o, w, b in zip(outs, ws, bs):
        assert not o.isnan().any(), "output not fully written"
        for r in range(W):
            ref = gathered.float() @ w[r].float() + (b[r].float() if b is not None else 0)
            errs.append(_rel(o[r], ref))
    assert max(errs) < 1e-3, errs
    return max(errs)


def case_threads_ag_dim0(torch, SimWorld):
    """The harness on the dim-0 path: W=2, ragged rows; then without the gathered buffer wanted (gather_local
    False): the same outputs, and each rank's own rows of its gathered buffer are left unwritten."""
    err = _check_ag_ranks(torch, SimWorld, 2, [150], 32, [40, 16], 0, seed=11)
    g = torch.Generator().manual_seed(11)
    a4 = torch.randn(2, 150, 32, generator=g).half()
    ws = [torch.randn(2, n, 32, generator=g).half().transpose(1, 2) for n in (40, 16)]
    bs = [torch.randn(2, 40, generator=g).half(), None]
    outs, gat = _ag_ranks(torch, SimWorld(2, device="cpu"), a4, ws, bs, 0)
    outs_n, gat_n = _ag_ranks(torch, SimWorld(2, device="cpu"), a4, ws, bs, 0, gather_local=False)
    assert all(torch.equal(x, y) for x, y in zip(outs, outs_n)), "outputs depend on gather_local"
    for r in range(2):
        own = slice(r * 150, (r + 1) * 150)
        assert gat_n[r, own].isnan().all(), f"rank {r} wrote its own rows of an unwanted gathered buffer"
        other = slice((1 - r) * 150, (2 - r) * 150)
        assert torch.equal(gat_n[r, other], a4[1 - r]), f"rank {r}'s pulled chunk"
    return {"err": err}


def case_ag_gathered_or_not(torch, SimWorld):
    """W=1: the shard's copy into the gathered buffer (LOCAL tasks between the tiles) is made when the buffer is
    given or returned and left out otherwise; the outputs are the same bits either way."""
    from kosmos.kernels import queue
    from kosmos.kernels.ag_gemm import ag_config, ag_gemm_sim

    g = torch.Generator().manual_seed(9)
    sw = SimWorld(1, device="cpu")
    m, K, n = 300, 32, 264  # 3 row blocks, 2 column blocks
    a = torch.randn(1, m, K, generator=g).half()
    w = torch.randn(1, n, K, generator=g).half().transpose(1, 2)
    gat = torch.full((1, m, K), float("nan")).half()
    with_g = ag_gemm_sim(sw, a, [w], None, gathered=gat, programs=1)
    assert torch.equal(gat[0], a[0]), "gathered buffer"
    ret = ag_gemm_sim(sw, a, [w], None, return_gathered=True, programs=1)
    assert torch.equal(ret[1][0], a[0]) and torch.equal(ret[0], with_g[0])
    without = ag_gemm_sim(sw, a, [w], None, programs=1)
    assert len(without) == 1 and torch.equal(without[0], with_g[0]), "outputs depend on the gathered copy"
    assert _rel(without[0][0], a[0].float() @ w[0].float()) < 1e-3
    cfg = ag_config(1, m, [n], K, torch.float16)
    nmb, nnb = -(-m // cfg.block_m), -(-n // cfg.block_n)
    kinds = [t[0] for t in queue.ag_gemm_stream(0, 1, nmb, [nnb], 1, cfg.group_m, True)]
    assert kinds.count(queue.LOCAL) == nmb and kinds[0] == queue.LOCAL and kinds[-1] == queue.TILE
    assert queue.LOCAL not in [t[0] for t in queue.ag_gemm_stream(0, 1, nmb, [nnb], 1, cfg.group_m, False)]
    return {}


def case_threads_ag_dim1(torch, SimWorld):
    """gather_dim 1, W=2 and 3: s=64 (64-row tile) with two weights and one, s=128 (the config's tile), a 3-d
    shard [B, s, h, K] gathered along dim 1, plain-store epilogue."""
    res = {}
    for W, lead, K, Ns, dim, epi in [(2, [2, 64], 32, [40, 16], 1, "tma"), (3, [3, 64], 16, [24], 1, "tma"),
                                     (2, [2, 128], 16, [8], 1, "store"), (2, [2, 16, 4], 16, [24, 8], 1, "tma")]:
        res[f"W{W}_{lead}_{epi}"] = _check_ag_ranks(torch, SimWorld, W, lead, K, Ns, dim, seed=12 + W, epilogue=epi)
    return res


def _check_rs_ranks(torch, SimWorld, W, lead, Ks, N, scatter_dim, op, seed):
    from kosmos.kernels import ag_gemm as agm
    from kosmos.kernels import gemm_rs as rsm
    from kosmos.kernels import queue

    g = torch.Generator().manual_seed(seed)
    x4 = [torch.randn(W, *lead, k, generator=g).half() for k in Ks]
    ws = [torch.randn(W, N, k, generator=g).half().transpose(1, 2) for k in Ks]
    bias = torch.randn(W, N, generator=g).half()
    B, S = queue.split_rows(lead, scatter_dim)
    M = B * S
    xs = [x.reshape(W, M, x.shape[-1]) for x in x4]
    out = torch.full((W, M // W, N), float("nan")).half()
    RT = agm._RankTensor

    def fn(view, r):
        rsm.launch(view, r, [RT(x, x.stride(0), x.stride(1)) for x in xs], [x.shape[2] for x in xs],
                   [RT(w, w.stride(0), agm._weight_view(w[0])[1]) for w in ws], True, RT(bias, bias.stride(0), 1),
                   RT(out, out.stride(0), out.stride(1)), M, N, op, programs=1, seg=S // W if B > 1 else None)

    _run_ranks(SimWorld(W, device="cpu"), fn)
    full = torch.stack([sum(x[q].float() @ w[q].float() for x, w in zip(x4, ws)) + bias[q].float()
                        for q in range(W)])
    red = full.sum(0) if op == "sum" else full.mean(0)
    chunks = red.chunk(W, dim=scatter_dim)
    olead = list(lead)
    olead[scatter_dim] //= W
    assert not out.isnan().any(), "output not fully written"
    errs = [_rel(out[r].view(*olead, N), chunks[r]) for r in range(W)]
    assert max(errs) < 1e-3, errs
    return max(errs)


def case_threads_rs_dim0(torch, SimWorld):
    return {"err": _check_rs_ranks(torch, SimWorld, 2, [260], [32], 40, 0, "sum", seed=21)}


def case_threads_rs_dim1(torch, SimWorld):
    """scatter_dim 1, W=2 and 3: s_out=64 (64-row tile) with two pairs, s_out=128 (the config's tile), avg, and
    a 3-d input [B, S, h, K] scattered along dim 1."""
    res = {}
    for W, lead, Ks, N, op in [(2, [2, 128], [32, 16], 40, "sum"), (3, [3, 192], [16], 24, "avg"),
                               (2, [2, 256], [16], 8, "sum"), (2, [3, 32, 4], [16], 24, "avg")]:
        res[f"W{W}_{lead}_{op}"] = _check_rs_ranks(torch, SimWorld, W, lead, Ks, N, 1, op, seed=22 + W)
    return res


def _moe_ep_inputs(torch, W, T, H, I, E, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(W, T, H, generator=g).half()
    rw = (torch.randn(E, H, generator=g) * 0.5).half()
    gu = (torch.randn(E, 2 * I, H, generator=g) * 0.2).half()
    d = (torch.randn(E, H, I, generator=g) * 0.2).half()
    go = torch.randn(W, T, H, generator=g).half()
    return h, rw, gu, d, go


def case_threads_moe_ep(torch, SimWorld):
    """The expert-parallel MoE kernels (kosmos.kernels.moe_ep / moe_ep_backward), W=2 and 3 ranks on threads:
    counts exchanged, rows dispatched to the owners and results combined across ranks. Forward vs the reference
    route + experts with all experts; backward vs the non-EP fused kernel per rank (d_hidden, router grads
    bit-identical) and the per-rank sums of its expert grads."""
    from kosmos.kernels.moe_backward import moe_backward
    from kosmos.kernels.moe_ep import moe_ep_forward
    from kosmos.kernels.moe_ep_backward import moe_ep_backward
    from kosmos.ops.moe_math import experts, route

    res = {}
    for W, T, E, k, hot in [(2, 21, 8, 2, False), (3, 9, 6, 2, False), (2, 15, 8, 2, True)]:
        h, rw, gu, d, go = _moe_ep_inputs(torch, W, T, 32, 16, E, seed=40 + W)
        E_loc = E // W
        rb = None
        if hot:  # every routed row of the group on the last rank; the other ranks' experts get none
            rb = torch.zeros(E, dtype=torch.float16)
            rb[E - E_loc:] = 60.0
        fwd, bwd = [None] * W, [None] * W

        def fn(view, r):
            gus, ds = gu[r * E_loc:(r + 1) * E_loc][None], d[r * E_loc:(r + 1) * E_loc][None]
            fwd[r] = moe_ep_forward(view, r, h[r:r + 1], rw, rb, None, gus, ds, k, programs=1)
            bwd[r] = moe_ep_backward(view, r, go[r:r + 1], None, h[r:r + 1], rw, rb, None, gus, ds, k, programs=1)

        _run_ranks(SimWorld(W, device="cpu"), fn)
        total = torch.zeros(E, dtype=torch.int32)
        errs = []
        sum_gu, sum_d = torch.zeros(gu.shape, dtype=torch.float64), torch.zeros(d.shape, dtype=torch.float64)
        for r in range(W):
            _, ids, w = route(h[r], rw, rb, None, k, "softmax", True, 1, 1, 1.0, None)
            ref, counts = experts(h[r], ids, w, gu, d)
            total += counts
            errs.append(_rel(fwd[r][0][0], ref))
            grads = moe_backward(go[r], None, h[r], rw, rb, None, gu, d, k, programs=1)
            assert torch.equal(bwd[r][0][0], grads[0]) and torch.equal(bwd[r][1][0], grads[1]), f"rank {r}"
            sum_gu += grads[2].double()
            sum_d += grads[3].double()
        for r in range(W):
            assert torch.equal(fwd[r][2][0], total), (r, fwd[r][2], total)
            sl = slice(r * E_loc, (r + 1) * E_loc)
            if hot and r < W - 1:
                assert bwd[r][2].abs().max() == 0 and bwd[r][3].abs().max() == 0, "experts without rows"
            else:
                errs += [_rel(bwd[r][2][0], sum_gu[sl]), _rel(bwd[r][3][0], sum_d[sl])]
        assert max(errs) < 3e-3, errs
        res[f"W{W}{'_hot_rank' if hot else ''}"] = max(errs)
    return res



def case_threads_moe_ep_group(torch, SimWorld):
    """The real-group launchers (kosmos.kernels.moe_ep_group: one rank per process, its tensors without the rank
    dim) on W=2 threads, each driving one rank view as a group's process does: bit-identical to the stacked
    launchers' results of the same rank, in the op's shapes."""
    from kosmos.kernels.moe_ep import moe_ep_forward
    from kosmos.kernels.moe_ep_backward import moe_ep_backward
    from kosmos.kernels.moe_ep_group import moe_ep_backward_group, moe_ep_forward_group

    W, T, E, k = 2, 19, 8, 2
    h, rw, gu, d, go = _moe_ep_inputs(torch, W, T, 32, 16, E, seed=50)
    E_loc = E // W
    got, want = [None] * W, [None] * W

    def fn(view, r):
        gus, ds = gu[r * E_loc:(r + 1) * E_loc], d[r * E_loc:(r + 1) * E_loc]
        fwd = moe_ep_forward_group(h[r], rw, None, None, gus, ds, k, return_router_logits=True, ws=view, rank=r,
                                   programs=1)
        bwd = moe_ep_backward_group(go[r], None, h[r], rw, None, None, gus, ds, k, ws=view, rank=r, programs=1)
        got[r] = list(fwd) + bwd
        fwd = moe_ep_forward(view, r, h[r:r + 1], rw, None, None, gus[None], ds[None], k, return_router_logits=True,
                             programs=1)
        bwd = moe_ep_backward(view, r, go[r:r + 1], None, h[r:r + 1], rw, None, None, gus[None], ds[None], k,
                              programs=1)
        want[r] = [t[0] for t in list(fwd) + bwd]

    _run_ranks(SimWorld(W, device="cpu"), fn)
    shapes = [(T, 32), (T, E), (E,), (T, 32), (E, 32), (E_loc, 32, 32), (E_loc, 32, 16)]
    for r in range(W):
        assert [tuple(t.shape) for t in got[r]] == shapes, [tuple(t.shape) for t in got[r]]
        assert all(torch.equal(a, b) for a, b in zip(got[r], want[r])), f"rank {r}"
    return {"ranks": W}

def _main() -> None:
    import faulthandler

    import torch

    from kosmos.kernels.runtime import SimWorld

    # still running near the parent's timeout: every thread's stack to stderr, then exit (the parent shows it)
    faulthandler.dump_traceback_later(_TIMEOUT_S - 30, exit=True)
    from _interp import mend_interpreter

    torch.manual_seed(0)
    mend_interpreter()
    names = sys.argv[1:]
    if names and names[0] == "--threads":
        _threaded_interpreter()
        names = names[1:]
        from kosmos.kernels import runtime

        runtime.set_spin_timeout(120.0)  # spins are counted (1 us each), and a rank may wait for the others
    results = {}
    for name in names:
        print(f"case {name}", file=sys.stderr, flush=True)
        try:
            results[name] = {"ok": True, **globals()["case_" + name](torch, SimWorld)}
        except Exception as e:  # noqa: BLE001
            import traceback

            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}
    print("RESULTS " + json.dumps(results))


_TIMEOUT_S = 300


def _run_subprocess(args):
    from _interp import REPO, interpreter_env

    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args], env=interpreter_env(),
                              capture_output=True, text=True, timeout=_TIMEOUT_S, cwd=REPO)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError(f"interpreter subprocess still running after {_TIMEOUT_S} s:\n{err[-12000:]}") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert lines, (f"interpreter subprocess failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                   f"{proc.stderr[-12000:]}")
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.fixture(scope="module")
def interpreted():
    return _run_subprocess(CASES)


@pytest.fixture(scope="module")
def interpreted_threads():
    return _run_subprocess(["--threads", *THREAD_CASES])


@pytest.mark.parametrize("case", CASES)
def test_interpreted(interpreted, case):
    res = interpreted[case]
    assert res["ok"], res.get("tb", res)


@pytest.mark.parametrize("case", THREAD_CASES)
def test_interpreted_threads(interpreted_threads, case):
    res = interpreted_threads[case]
    assert res["ok"], res.get("tb", res)


# ---- which calls fuse (fused_ops.why_not_*'s remap rule), plain CPU: shapes only


def test_remap_reason_rule(monkeypatch):
    import torch

    from kosmos.kernels import fused_ops
    from kosmos.kernels.ag_gemm import ag_config
    from kosmos.kernels.gemm_rs import rs_config

    monkeypatch.setattr(fused_ops, "REMAP_ROWS", True)  # whatever KOSMOS_REMAP_ROWS says in this environment

    def ag(lead, dim, W, ns=(264,), K=256):
        m = 1
        for d in lead:
            m *= d
        return fused_ops._remap_reason("ag_gemm", "gather_dim", lead, dim, W,
                                       lambda seg: ag_config(W, m, list(ns), K, torch.bfloat16, seg))

    def rs(lead, dim, W, ks=(256,), N=264):
        M = 1
        for d in lead:
            M *= d
        return fused_ops._remap_reason("gemm_rs", "scatter_dim", lead, dim, W,
                                       lambda seg: rs_config(M, N, list(ks), torch.bfloat16, W, seg))

    assert ag([4, 100], 0, 8) is None  # dim 0: the old path
    assert ag([1, 100], 1, 8) is None  # one batch entry: the dim-0 layout
    assert ag([2, 128], 1, 8) is None and ag([3, 64], 1, 4) is None and ag([2, 32, 4], 1, 2) is None
    r = ag([2, 8, 16], 2, 2)  # B = 16 entries of s = 16 rows: no tile divides s
    assert r is not None and "s=16" in r, r
    r = ag([2, 100], 1, 8)
    assert r is not None and "rows per batch entry s=100 not a multiple of the tile" in r, r
    assert rs([2, 1024], 1, 8) is None  # s_out = 128
    assert rs([3, 512], 1, 8) is None  # s_out = 64: the 64-row tile
    assert rs([2, 512], 1, 8, ks=(256, 128)) is None
    r = rs([2, 800], 1, 8)  # s_out = 100
    assert r is not None and "s=100" in r, r
    old = fused_ops.REMAP_ROWS
    fused_ops.REMAP_ROWS = False
    try:
        assert "REMAP_ROWS" in ag([2, 128], 1, 8)
        assert "REMAP_ROWS" in rs([2, 1024], 1, 8)
        assert ag([1, 128], 1, 8) is None and ag([4, 100], 0, 8) is None  # dim-0 layouts do not depend on it
    finally:
        fused_ops.REMAP_ROWS = old


if __name__ == "__main__":
    _main()
