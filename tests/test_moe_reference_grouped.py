"""The reference MoE experts of kosmos.ops.moe (`experts`, `experts_backward`) on grouped matmuls: against a
per-expert float64 loop (forward) and torch.autograd through it (backward), against a per-expert loop in the
weights' dtype (the old reference impl, whose semantics they keep), and the torch._grouped_mm path against the
per-group loop fallback, with the grouped kernel's unwritten rows and empty-group slices poisoned.

Routings: random, experts without tokens, all pairs on one expert, top-1, sentinel ids (id E: not computed,
zero gradients), no tokens at all; weights in HF's transposed layout, unaligned sizes, torch.autograd through
`experts`. The GPU tests (marked) compare both paths on CUDA bf16 at a Qwen3-30B-A3B-like
size, check that the grouped path makes no host sync, and that fp32 takes the loop.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kosmos.ops import moe, moe_math

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}  # rel. error vs float64
NAMES = ["out", "d_hidden", "d_topk_weights", "d_gate_up_proj", "d_down_proj"]


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def make(T, H, I, E, k, dtype, routing="random", seed=0, device="cpu"):
    """hidden, topk_ids, topk_weights, gate_up_proj, down_proj, grad_out; routing decides topk_ids."""
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(T, H, device=device, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, device=device, generator=g) / H**0.5).to(dtype)
    down = (torch.randn(E, H, I, device=device, generator=g) / I**0.5).to(dtype)
    grad_out = torch.randn(T, H, device=device, generator=g).to(dtype)
    weights = torch.rand(T, k, device=device, generator=g).to(dtype)
    scores = torch.rand(T, E, device=device, generator=g)
    if routing == "empty_experts":  # experts 0, 3 and E-1 get no pair
        scores[:, [0, 3, E - 1]] = -1
    ids = scores.topk(k, dim=-1).indices
    if routing == "one_expert":  # every pair on expert 2 (top-1 only: a token's ids are distinct otherwise)
        ids = torch.full_like(ids, 2)
    if routing == "sentinel":  # about a third of the pairs, and all of token 0's, belong to no expert
        ids = torch.where(torch.rand(T, k, device=device, generator=g) < 0.33, E, ids)
        ids[0] = E
    return hidden, ids, weights, gate_up, down, grad_out


def experts_float64(hidden, ids, weights, gate_up, down):
    """The module docstring's experts, one expert at a time in float64 (sentinel ids skipped)."""
    out = torch.zeros(hidden.shape, dtype=torch.float64, device=hidden.device)
    for e in range(gate_up.shape[0]):
        t, j = (ids == e).nonzero(as_tuple=True)
        gate, up = (hidden[t] @ gate_up[e].T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ down[e].T
        out = out.index_add(0, t, y * weights[t, j].unsqueeze(-1))
    return out


def reference(hidden, ids, weights, gate_up, down, grad_out):
    """[out, d_hidden, d_topk_weights, d_gate_up_proj, d_down_proj] in float64, the grads by torch.autograd."""
    leaves = [t.detach().double().requires_grad_() for t in (hidden, weights, gate_up, down)]
    out = experts_float64(leaves[0], ids, *leaves[1:])
    out.backward(grad_out.double())
    return [out.detach()] + [t.grad for t in leaves]


def experts_loop(hidden, ids, weights, gate_up, down, grad_out):
    """The previous reference impl's math: per-expert matmuls in the weights' dtype, the same dtype rules."""
    E, T, k = gate_up.shape[0], *ids.shape
    flat = ids.reshape(-1)
    product_dtype = torch.promote_types(down.dtype, weights.dtype)
    y_pairs = torch.zeros(T * k, hidden.shape[1], dtype=product_dtype)
    d_hidden = torch.zeros(hidden.shape, dtype=torch.float32)
    d_w = torch.zeros(T * k, dtype=torch.float32)
    d_gate_up, d_down = torch.zeros_like(gate_up), torch.zeros_like(down)
    for e in range(E):
        pairs = (flat == e).nonzero().squeeze(1)
        if pairs.numel() == 0:
            continue
        token = pairs // k
        x = hidden[token].to(gate_up.dtype)
        gate, up = (x @ gate_up[e].T).chunk(2, dim=-1)
        silu = F.silu(gate)
        act = (silu * up).to(down.dtype)
        y = act @ down[e].T
        w = weights.reshape(-1)[pairs].unsqueeze(-1)
        y_pairs[pairs] = y * w
        g = grad_out.to(product_dtype)[token]
        d_w[pairs] = (g * y.to(product_dtype)).float().sum(-1)
        d_y = (g * w).to(y.dtype)
        d_down[e] = d_y.T @ act
        d_act = (d_y @ down[e]).to(silu.dtype)
        sig = torch.sigmoid(gate)
        d_h = torch.cat([d_act * up * (sig * (1 + gate * (1 - sig))), d_act * silu], dim=-1)
        d_gate_up[e] = d_h.T @ x
        d_hidden.index_add_(0, token, (d_h @ gate_up[e]).float())
    out = y_pairs.view(T, k, -1).sum(1).to(hidden.dtype)
    return [out, d_hidden, d_w.view(T, k).to(weights.dtype), d_gate_up, d_down]


def run(hidden, ids, weights, gate_up, down, grad_out):
    out, counts = moe_math.experts(hidden, ids, weights, gate_up, down)
    grads = moe_math.experts_backward(grad_out, hidden, ids, weights, gate_up, down)
    return [out, *grads], counts


def run_saved(hidden, ids, weights, gate_up, down, grad_out):
    """The moe_layer path: the forward's saved up rows feed the backward (nothing of the experts recomputed; the
    backward overwrites them)."""
    out, counts, up = moe_math.experts(hidden, ids, weights, gate_up, down, return_up=True)
    forward_up = up.clone()
    grads = moe_math.experts_backward(grad_out, hidden, ids, weights, gate_up, down, saved_up=up)
    return [out, *grads], counts, forward_up


def saved_up_layout(hidden, ids, gate_up):
    """saved_up as the module docstring of kosmos.ops.moe lays it out, built pair by pair in float64: per expert a
    zero pad row, then its pairs in ascending token order, each (hidden[t] @ gate_up[e].T). Sentinel pairs: none."""
    rows = []
    for e in range(gate_up.shape[0]):
        rows.append(torch.zeros(gate_up.shape[1], dtype=torch.float64))
        for t in range(ids.shape[0]):
            if (ids[t] == e).any():
                rows.append(hidden[t].double() @ gate_up[e].double().T)
    return torch.stack(rows)


def _poisoned_grouped_mm(calls):
    """torch._grouped_mm that NaN-fills what it need not write: ragged-M rows past the last group and the
    slices of empty ragged-K groups; counts its calls."""
    real = torch._grouped_mm

    def grouped_mm(a, b, offs=None, **kwargs):
        calls.append((a.dim(), b.dim()))
        out = real(a, b, offs, **kwargs)
        if a.dim() == 2 and b.dim() == 3:
            out[int(offs[-1]) :] = float("nan")
        elif a.dim() == 2 and b.dim() == 2:
            out[torch.diff(offs, prepend=offs.new_zeros(1)) == 0] = float("nan")
        return out

    return grouped_mm


@pytest.fixture
def grouped_calls(monkeypatch):
    """The calls of the (poisoned) torch._grouped_mm made by the test."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    calls = []
    monkeypatch.setattr(torch, "_grouped_mm", _poisoned_grouped_mm(calls))
    return calls


def force_loop(monkeypatch):
    monkeypatch.setattr(moe_math, "_grouped_kernel", lambda *args: False)


def check(results, counts, case, tol_dtype, rounded_differently=False):
    """results vs the float64 reference, the old-semantics loop, dtypes/strides, counts and empty experts.
    rounded_differently (the saved-up backward, which rounds d_act rather than d_y): in a 16-bit dtype, no less
    accurate than the loop (vs float64) instead of close to it."""
    hidden, ids, weights, gate_up, down, grad_out = case
    ref = reference(*case)
    loop = experts_loop(*case)
    for name, got, r, old in zip(NAMES, results, ref, loop):
        assert torch.isfinite(got).all(), name
        assert rel_err(got, r) <= TOL[tol_dtype], (name, rel_err(got, r))
        if rounded_differently and tol_dtype != torch.float32:
            assert rel_err(got, r) <= 1.25 * rel_err(old, r), (name, rel_err(got, r), rel_err(old, r))
        else:
            assert rel_err(got, old) <= (1e-6 if old.dtype == torch.float32 else 4e-3), (name, rel_err(got, old))
        assert got.dtype == old.dtype and got.shape == old.shape, name
    for got, like in zip(results[3:], (gate_up, down)):
        assert got.stride() == torch.empty_like(like).stride()  # what the fake impl promises
    E = gate_up.shape[0]
    want = torch.bincount(ids.reshape(-1), minlength=E + 1)[:E].to(torch.int32)
    assert counts.dtype == torch.int32 and torch.equal(counts, want)
    empty = want == 0
    assert torch.equal(results[3][empty], torch.zeros_like(results[3][empty]))  # exact zeros, not tiny values
    assert torch.equal(results[4][empty], torch.zeros_like(results[4][empty]))
    sentinel = ids == E
    assert torch.equal(results[2][sentinel], torch.zeros_like(results[2][sentinel]))


ROUTINGS = [  # (T, H, I, E, k, routing)
    (48, 32, 16, 8, 2, "random"),
    (40, 32, 16, 8, 3, "empty_experts"),
    (33, 32, 16, 6, 1, "one_expert"),
    (29, 32, 16, 8, 1, "random"),
    (37, 32, 16, 8, 2, "sentinel"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROUTINGS, ids=lambda s: f"{s[5]}-k{s[4]}")
def test_grouped_path(grouped_calls, shape, dtype):
    case = make(*shape[:5], dtype, shape[5])
    results, counts = run(*case)
    # CPU torch._grouped_mm covers fp32 and bf16: forward 2 ragged-M, backward 4 ragged-M + 2 ragged-K (weight grads)
    assert grouped_calls.count((2, 3)) == 6 and grouped_calls.count((2, 2)) == 2
    check(results, counts, case, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROUTINGS, ids=lambda s: f"{s[5]}-k{s[4]}")
def test_loop_path(monkeypatch, shape, dtype):
    force_loop(monkeypatch)
    case = make(*shape[:5], dtype, shape[5])
    results, counts = run(*case)
    check(results, counts, case, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROUTINGS, ids=lambda s: f"{s[5]}-k{s[4]}")
def test_saved_up_path(grouped_calls, shape, dtype):
    case = make(*shape[:5], dtype, shape[5])
    results, counts, up = run_saved(*case)
    # forward 2 ragged-M; backward 2 ragged-M (d_act, d_x) + 2 ragged-K: no up projection, no y recomputed
    assert grouped_calls.count((2, 3)) == 4 and grouped_calls.count((2, 2)) == 2
    check(results, counts, case, dtype, rounded_differently=True)
    hidden, ids, _, gate_up, _, _ = case
    pairs = int((ids < gate_up.shape[0]).sum())
    assert up.shape == (pairs + (ids.numel() - pairs) + gate_up.shape[0], gate_up.shape[1]) and up.dtype == dtype
    want = saved_up_layout(hidden, ids, gate_up)  # sentinel pairs sort past the last group: rows never read
    assert torch.equal(up[: want.shape[0]][want.abs().sum(-1) == 0], torch.zeros_like(up[: want.shape[0]][
        want.abs().sum(-1) == 0]))
    assert rel_err(up[: want.shape[0]], want) <= TOL[dtype]


@pytest.mark.parametrize("shape", ROUTINGS, ids=lambda s: f"{s[5]}-k{s[4]}")
def test_grouped_equals_loop(monkeypatch, grouped_calls, shape):
    case = make(*shape[:5], torch.float32, shape[5])
    grouped, _ = run(*case)
    force_loop(monkeypatch)
    loop, _ = run(*case)
    for name, a, b in zip(NAMES, grouped, loop):
        assert rel_err(a, b) <= 1e-6, name


def test_transposed_weights(grouped_calls):
    """HF's is_transposed experts pass column-major views [E, 2I, H] / [E, H, I]: same math, grads in that layout."""
    hidden, ids, weights, gate_up, down, grad_out = make(40, 32, 16, 8, 2, torch.float32, "empty_experts")
    gate_up_t = gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    down_t = down.transpose(1, 2).contiguous().transpose(1, 2)
    case = (hidden, ids, weights, gate_up_t, down_t, grad_out)
    results, counts = run(*case)
    check(results, counts, case, torch.float32)
    assert results[3].stride() == gate_up_t.stride() and results[4].stride() == down_t.stride()


def test_unaligned_dims_mix_paths(grouped_calls):
    """bf16 with I = 12 (24-byte rows): the matmuls over I-wide rows loop, the others stay grouped."""
    case = make(40, 32, 12, 8, 2, torch.bfloat16, "sentinel")
    results, counts = run(*case)
    assert 0 < len(grouped_calls) < 8
    check(results, counts, case, torch.bfloat16)


def test_mixed_dtypes(grouped_calls):
    """fp32 hidden and topk_weights with bf16 weights: matmuls in bf16, products and sums as the dtype rules say."""
    hidden, ids, weights, gate_up, down, grad_out = make(48, 32, 16, 8, 2, torch.float32, "sentinel")
    case = (hidden, ids, weights, gate_up.bfloat16(), down.bfloat16(), grad_out)
    results, counts = run(*case)
    check(results, counts, case, torch.bfloat16)


def test_no_tokens(grouped_calls):
    hidden, ids, weights, gate_up, down, grad_out = make(0, 32, 16, 8, 2, torch.float32)
    results, counts = run(hidden, ids, weights, gate_up, down, grad_out)
    assert [tuple(t.shape) for t in results] == [(0, 32), (0, 32), (0, 2), tuple(gate_up.shape), tuple(down.shape)]
    assert not results[3].any() and not results[4].any() and not counts.any()


def test_autograd_through_experts(grouped_calls):
    """`experts` stays differentiable by torch.autograd (tests use it as the reference math), sentinel pairs too:
    recorded operands take the loop, whose gradients match experts_backward."""
    hidden, ids, weights, gate_up, down, grad_out = make(37, 32, 16, 8, 2, torch.float32, "sentinel")
    leaves = [t.clone().requires_grad_() for t in (hidden, weights, gate_up, down)]
    out, _ = moe_math.experts(leaves[0], ids, *leaves[1:])
    got = torch.autograd.grad(out, leaves, grad_out)
    assert grouped_calls == []
    want = moe_math.experts_backward(grad_out, hidden, ids, weights, gate_up, down)
    for name, a, b in zip(NAMES[1:], got, want):
        assert rel_err(a, b) <= 1e-6, name


def test_wgrad_unpadded_groups_zero_empty_experts(grouped_calls):
    """The EP path's groups (host sizes known, no pad rows): empty experts' slices are zeroed, whatever the kernel
    left there (the poisoned torch._grouped_mm leaves NaN)."""
    sizes = [3, 0, 5, 0, 0, 4]
    a, b = torch.randn(12, 16), torch.randn(12, 8)
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
    like = torch.empty(6, 16, 8)
    got = moe_math._grouped_wgrad(a, b, moe_math._Groups(ends, sizes), like)
    assert grouped_calls == [(2, 2)]
    want = torch.stack([a[s:e].T @ b[s:e] for s, e in zip([0, 3, 3, 8, 8, 8], ends.tolist())])
    assert torch.equal(got[[1, 3, 4]], torch.zeros(3, 16, 8)) and torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("T", [0, 1, 37])
def test_sorted_pairs_gather(T):
    """_SortedPairs.gather: a tensor's rows in the sorted order with the pad rows zero, as indexing the tensor with one
    zero row appended (what it replaces); per-pair tensors through `pair`, sentinel ids (E) included."""
    E, k = 5, 3
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, E + 1, (T, k), generator=g)  # id E: a sentinel pair
    rows = moe_math._SortedPairs(ids, E)
    hidden = torch.randn(T, 7, generator=g)
    weights = torch.rand(T * k, generator=g)
    with_zero = torch.cat([hidden, hidden.new_zeros(1, 7)])
    assert torch.equal(rows.gather(hidden), with_zero[rows.token])
    assert torch.equal(rows.gather(weights, rows.pair), torch.cat([weights, weights.new_zeros(1)])[rows.pair])
    assert torch.equal(rows.token[rows.pads], torch.full((E,), T))  # one pad row per expert


def test_capability_check():
    x = torch.randn(8, 32)
    w = torch.randn(4, 32, 16)
    if hasattr(torch, "_grouped_mm"):
        assert moe_math._grouped_kernel(x, w, 4) and moe_math._grouped_kernel(x.bfloat16(), w.bfloat16(), 4)
    assert not moe_math._grouped_kernel(x.double(), w.double(), 4)  # torch._grouped_mm has no float64
    assert not moe_math._grouped_kernel(x, w.bfloat16(), 4)
    assert not moe_math._grouped_kernel(torch.randn(8, 6), torch.randn(4, 6, 16), 4)  # 24-byte rows: not TMA-aligned


# ----------------------------------------------------------------------------------------------- GPU


def _qwen3_30b_case(seed=0):
    """Qwen3-30B-A3B-like experts (H 2048, I 768, 128 experts, top-8, T 4096) in bf16 on CUDA: experts 5, 77 and
    127 get no token, expert 0 gets every one of the first 1024 tokens."""
    hidden, ids, weights, gate_up, down, grad_out = make(4096, 2048, 768, 128, 8, torch.bfloat16, seed=seed,
                                                         device="cuda")
    scores = torch.rand(4096, 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    scores[:, [5, 77, 127]] = -1
    scores[:1024, 0] = 2
    return hidden, scores.topk(8, dim=-1).indices, weights, gate_up, down, grad_out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10),
                    reason="torch._grouped_mm's bf16 kernel needs sm90/sm100")
def test_gpu_grouped_vs_loop_bf16(monkeypatch):
    monkeypatch.delenv("KOSMOS_GROUPED_MM", raising=False)  # auto: below CLAIMED_EXPERT, torch._grouped_mm everywhere
    monkeypatch.setenv("KOSMOS_GROUPED_WGRAD", "torch")  # the weight gradients too (kosmos's by default)
    case = _qwen3_30b_case()
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    grouped, counts = run(*case)
    torch.cuda.synchronize()
    assert len(calls) == 8  # every matmul grouped
    monkeypatch.setattr(torch, "_grouped_mm", real)
    force_loop(monkeypatch)
    loop, loop_counts = run(*case)
    assert torch.equal(counts, loop_counts)
    empty = counts == 0
    assert empty.sum() == 3 and counts[0] >= 1024
    for name, a, b in zip(NAMES, grouped, loop):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) <= 1e-2, (name, rel_err(a, b))
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), name
    for a, b in zip(grouped[3:], loop[3:]):
        assert not a[empty].any() and not b[empty].any()  # exact zeros


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="kosmos's grouped GEMM needs an sm_90 GPU")
@pytest.mark.parametrize("mode,config", [("kosmos", "128x256"), ("kosmos_m", "128x256"), ("kosmos_mc", "128x256"),
                                         ("kosmos_mc", "128x256s"), ("kosmos", "128x256s")])
def test_gpu_kosmos_grouped_mm_in_the_reference(monkeypatch, mode, config):
    """KOSMOS_GROUPED_MM=kosmos / kosmos_m / kosmos_mc (and KOSMOS_GROUPED_CONFIG): the ragged-M grouped matmuls
    (forward up with its SwiGLU epilogue / down, backward d_act / d_x) run on kosmos's grouped GEMM, the weight
    gradients run on kosmos's ragged-K kernel (the default at every size), the report says so, and the results are
    those of torch._grouped_mm everywhere."""
    import kosmos

    case = _qwen3_30b_case()
    monkeypatch.setenv("KOSMOS_GROUPED_MM", "torch")
    monkeypatch.setenv("KOSMOS_GROUPED_WGRAD", "torch")
    want, _ = run(*case)
    monkeypatch.delenv("KOSMOS_GROUPED_WGRAD")
    monkeypatch.setenv("KOSMOS_GROUPED_MM", mode)
    monkeypatch.setenv("KOSMOS_GROUPED_CONFIG", config)
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    kosmos.reset_report()
    got, _ = run(*case)
    torch.cuda.synchronize()
    assert not calls
    runs = kosmos.report().runtime
    wgrads = {key[1]: n for key, n in runs.items() if key[0] == "grouped_wgrad"}
    assert sum(wgrads.values()) == 2 and all(impl.startswith("kosmos grouped_wgrad_ws") for impl in wgrads), runs
    impl = {"kosmos": "kosmos grouped_ws", "kosmos_m": "kosmos grouped_ws m-fastest",
            "kosmos_mc": "kosmos grouped_ws m-fastest claimed"}[mode] + " " + config
    # the forward's up projection and its SwiGLU in one launch (I = 768, a multiple of 128)
    assert runs.get(("grouped_mm_swiglu", impl + " swiglu", "supported")) == 1, runs
    assert runs.get(("grouped_mm", impl, "supported")) == 5, runs
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, b) <= 1e-3, (name, rel_err(a, b))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10),
                    reason="torch._grouped_mm's bf16 kernel needs sm90/sm100")
def test_gpu_grouped_no_host_sync():
    hidden, ids, weights, gate_up, down, grad_out = _qwen3_30b_case(seed=1)
    ids[:100] = 128  # sentinel pairs too
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = moe_math.experts(hidden, ids, weights, gate_up, down)
        grads = moe_math.experts_backward(grad_out, hidden, ids, weights, gate_up, down)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert not out[:100].any() and not grads[1][:100].any()  # sentinel tokens: nothing computed, zero d_weights


def test_loop_refuses_a_cuda_graph_capture(monkeypatch):
    """The per-group loop reads the group sizes on the host: inside a CUDA graph capture (runtime.capturing) it
    raises kosmos's error naming the loop, before any host read; so does the EP reference's plan, before its
    bincount and its collectives."""
    from kosmos.kernels import runtime

    monkeypatch.setattr(runtime, "capturing", lambda device: True)
    groups = moe_math._Groups(torch.tensor([2, 5], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="per-expert matmul loop .* CUDA graph capture"):
        groups.sizes()
    assert moe_math._Groups(torch.tensor([2, 5]), sizes=[2, 3]).sizes() == [2, 3]  # known sizes: no host read
    with pytest.raises(RuntimeError, match="expert-parallel reference impl's split sizes"):  # before any collective
        moe_math._EpPlan(torch.zeros(4, 2, dtype=torch.long), 2, "no_such_group", 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_loop_in_a_capture_raises_kosmos_error():
    """fp32 takes the per-group loop: captured in a CUDA graph, the backward raises kosmos's error (not CUDA's)."""
    case = make(256, 128, 64, 16, 4, torch.float32, "random", device="cuda")
    hidden, ids, weights, gate_up, down, grad_out = case
    moe_math.experts_backward(grad_out, hidden, ids, weights, gate_up, down)  # warm: allocations, kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="kosmos: .*per-expert matmul loop"):
        with torch.cuda.graph(graph):
            moe_math.experts_backward(grad_out, hidden, ids, weights, gate_up, down)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_loop_dtypes(dtype):
    """CUDA fp32/fp16 take the per-group loop (torch's own fallback would sync on every call) and stay exact."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        case = make(256, 128, 64, 16, 4, dtype, "sentinel", device="cuda")
        assert not moe_math._grouped_kernel(case[0], case[3].transpose(1, 2), 16)
        results, counts = run(*case)
        ref = reference(*case)
        for name, got, r in zip(NAMES, results, ref):
            assert rel_err(got, r) <= TOL[dtype], (name, rel_err(got, r))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("S,I,w_dtype", [(4099, 768, torch.bfloat16), (777, 1536, torch.float32), (16, 40, torch.bfloat16)])
def test_gpu_row_kernels_match_torch(monkeypatch, S, I, w_dtype):
    """kosmos.kernels.moe_rows (registered row kernels) vs the ops' torch math on the same CUDA tensors."""
    import kosmos.kernels.fused_ops  # noqa: F401  (registers the row kernels)
    from kosmos.ops import dispatch

    g = torch.Generator(device="cuda").manual_seed(S)
    h = (3 * torch.randn(S, 2 * I, device="cuda", generator=g)).to(torch.bfloat16)
    d_au = torch.randn(S, I, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.rand(S, device="cuda", generator=g).to(w_dtype)
    assert dispatch.row_kernel("moe_swiglu_rows_backward", h.device) is not None
    from kosmos.kernels import moe_rows

    apart = moe_rows.swiglu_rows_backward(h, d_au, w)  # d_h in a new tensor, no act * w
    h_fused, d_au_fused = h.clone(), d_au.clone()
    fused = moe_math._swiglu_rows_backward_(h_fused, d_au_fused, w)
    assert fused[0].data_ptr() == h_fused.data_ptr() and fused[2].data_ptr() == d_au_fused.data_ptr()  # in place
    assert torch.equal(fused[0], apart[0]) and torch.equal(fused[1], apart[1])  # in place: the same bits
    monkeypatch.setattr(dispatch, "row_kernel", lambda name, device: None)
    h_torch, d_au_torch = h.clone(), d_au.clone()
    torch_math = moe_math._swiglu_rows_backward_(h_torch, d_au_torch, w)
    assert torch_math[0].data_ptr() == h_torch.data_ptr() and torch_math[2].data_ptr() == d_au_torch.data_ptr()
    for name, a, b in zip(["d_h", "d_w", "act * w"], fused, torch_math):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, b) <= (1e-3 if name != "d_h" else 5e-3), (name, rel_err(a, b))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("S,I,dtype", [(4099, 768, torch.bfloat16), (777, 1536, torch.float32), (16, 40, torch.float16),
                                       (1, 8, torch.bfloat16)])
def test_gpu_swiglu_rows_match_torch(monkeypatch, S, I, dtype):
    """The forward's SwiGLU row kernel (moe_math._act on CUDA) vs torch's silu and mul on the same rows: 16-bit
    results equal but for a few values next to a rounding boundary (silu's exp), fp32 within its last bits."""
    import kosmos.kernels.fused_ops  # noqa: F401  (registers the row kernels)
    from kosmos.ops import dispatch

    assert dispatch.row_kernel("moe_swiglu_rows", torch.device("cuda")) is not None
    g = torch.Generator(device="cuda").manual_seed(S)
    h = (4 * torch.randn(S, 2 * I, device="cuda", generator=g)).to(dtype)
    got = moe_math._act(h, dtype)
    monkeypatch.setattr(dispatch, "row_kernel", lambda name, device: None)
    want = moe_math._act(h, dtype)
    assert got.shape == want.shape == (S, I) and got.dtype == want.dtype
    differ = (got != want).sum().item()
    err = ((got.double() - want.double()).abs() / want.double().abs().clamp(min=1e-30)).max().item()
    if dtype == torch.float32:
        assert err <= 1e-6, (differ, err)
    else:
        assert differ <= max(S * I // 1000, 1) and err <= 2.0 ** -7, (differ, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layer", ["qwen3", "deepseek_v3", "mixtral", "sigmoid_bf16"])
@pytest.mark.parametrize("T", [16384, 77])
def test_gpu_router_backward_matches_torch(monkeypatch, layer, T):
    """The backward's router at the forward's kept ids by the registered kernels (kosmos.kernels.route_backward:
    the weights, then the logits' gradient) against torch's ops: Qwen3-MoE's bf16 softmax router, DeepSeek-V3's
    fp32 sigmoid router (x2.5, with a logits gradient), Mixtral's fp32 weights on bf16 logits, a bf16 sigmoid router
    (every op rounded to bf16). Weights within 4e-6 (fp32: tl.exp's argument rounds, an error of |logit - max| *
    2^-24; 1.1e-6 seen on an H100) or one unit of bf16's last place; the logits gradient within 1e-5 (fp32) / 2^-7
    (bf16) of its largest magnitude."""
    import kosmos
    import kosmos.kernels.fused_ops  # noqa: F401
    from kosmos.ops import dispatch

    E, k, dtype, scoring, norm, scale, wd, glog = dict(
        qwen3=(128, 8, torch.bfloat16, "softmax", True, 1.0, None, False),
        deepseek_v3=(256, 8, torch.float32, "sigmoid", True, 2.5, None, True),
        mixtral=(8, 2, torch.bfloat16, "softmax", True, 1.0, torch.float32, False),
        sigmoid_bf16=(64, 6, torch.bfloat16, "sigmoid", False, 1.5, None, True))[layer]
    g = torch.Generator(device="cuda").manual_seed(T + E)
    logits = (3 * torch.randn(T, E, device="cuda", generator=g)).to(dtype)
    ids = torch.rand(T, E, device="cuda", generator=g).argsort(dim=1)[:, :k].to(torch.int32).contiguous()
    d_weights = torch.randn(T, k, device="cuda", generator=g).to(wd or dtype)
    grad_logits = torch.randn(T, E, device="cuda", generator=g).to(dtype) if glog else None

    def router(kernels: bool):
        routed = moe_math._route_forward(logits, torch.empty(E, 1, device="cuda"), None, None, k, scoring, norm, 1, 1,
                                         scale, None, ids=ids, logits=logits, weights_dtype=wd, kernels=kernels)
        return routed[2], moe_math._router_d_logits(d_weights, grad_logits, routed, scoring, scale), routed[3]

    kosmos.reset_report()
    w, dl, state = router(True)
    assert state["scores"] is None
    assert ("router_backward", "kosmos route_backward", "weights and logits gradient at the forward's choices") in \
        kosmos.report().runtime
    real = dispatch.row_kernel
    monkeypatch.setattr(dispatch, "row_kernel", lambda name, device: None if name == "moe_router_d_logits"
                        else real(name, device))
    want_w, want_dl, _ = router(False)
    assert w.dtype == want_w.dtype and dl.dtype == want_dl.dtype == dtype
    w_err = ((w.double() - want_w.double()).abs() / want_w.double().abs().clamp(min=1e-30)).max().item()
    assert w_err <= (4e-6 if w.dtype == torch.float32 else 2.0**-7), w_err
    dl_err = ((dl.double() - want_dl.double()).abs().max() / want_dl.double().abs().max()).item()
    assert dl_err <= (1e-5 if dtype == torch.float32 else 2.0**-7), dl_err
    # the weights' kernel with the gradient's declined: the torch ops recompute the scores, the same gradient
    _, fallback_dl, _ = router(True)
    assert torch.equal(fallback_dl, want_dl)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10),
                    reason="torch._grouped_mm's bf16 kernel needs sm90/sm100")
def test_gpu_saved_up_backward_bf16():
    """moe_layer's path on CUDA bf16 (grouped matmuls + row kernels, saved up rows): as accurate as the
    recomputing backward (vs a float64 reference of a slice of the tokens' gradients) and no host sync."""
    import kosmos.kernels.fused_ops  # noqa: F401

    case = _qwen3_30b_case(seed=2)
    recompute, _ = run(*case)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        saved, _, up = run_saved(*case)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert up.shape == (4096 * 8 + 128, 2 * 768)
    for name, a, b in zip(NAMES, saved, recompute):
        assert torch.isfinite(a).all(), name
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), name
        assert rel_err(a, b) <= 1e-2, (name, rel_err(a, b))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("w_dtype,out_dtype", [(None, None), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
def test_gpu_fold_kernel_matches_torch(monkeypatch, w_dtype, out_dtype):
    """The registered fold kernel gives the torch per-slot loop's bits (same fp32 sum order, same roundings), and
    with fp32 weights for a bf16 output (DeepSeek-V3's forward) the cast in the same pass."""
    import kosmos.kernels.fused_ops  # noqa: F401
    from kosmos.ops import dispatch

    T, k, H = 1000, 8, 2100
    g = torch.Generator(device="cuda").manual_seed(k)
    rows = torch.randn(T * k + 16, H, device="cuda", generator=g).to(torch.bfloat16)
    row = torch.randperm(T * k + 16, device="cuda", generator=g)[: T * k]
    weights = None if w_dtype is None else torch.rand(T, k, device="cuda", generator=g).to(w_dtype)

    def both():
        if weights is None:
            return moe_math._fold(rows, row, T, k, torch.float32)
        return moe_math._fold_weighted(rows, row, weights, out_dtype)

    fused = both()
    if weights is None:  # into a given buffer (the backward folds d_hidden into saved_up's storage): the same bits
        from kosmos.kernels import moe_rows

        scratch = torch.full((T * H * 2,), float("nan"), device="cuda", dtype=torch.bfloat16)
        into = moe_math._storage_as(scratch, (T, H), torch.float32)
        assert moe_rows.fold(rows, row.view(T, k), out=into) is into and torch.equal(into, fused)
    if out_dtype == torch.bfloat16 and w_dtype == torch.float32:  # the cast in the pass: the fp32 fold's bits cast
        from kosmos.kernels import moe_rows

        assert torch.equal(fused, moe_rows.fold(rows, row.view(T, k), weights).to(out_dtype))
    monkeypatch.setattr(dispatch, "row_kernel", lambda name, device: None)
    ref = both()
    assert fused.dtype == ref.dtype == (out_dtype or torch.float32) and fused.shape == ref.shape == (T, H)
    if w_dtype == torch.float32:  # fp32 products: the compiler may fuse product and sum into one FMA
        assert rel_err(fused, ref) <= (1e-6 if out_dtype == torch.float32 else 1e-4)
    else:
        assert torch.equal(fused, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T,k,E,H,src_dtype,dtype", [(1000, 8, 64, 2100, torch.bfloat16, None),
                                                     (333, 4, 16, 96, torch.float32, torch.bfloat16),
                                                     (0, 2, 4, 64, torch.bfloat16, None)])
def test_gpu_gather_rows_matches_torch(monkeypatch, T, k, E, H, src_dtype, dtype):
    """The registered row gather (one pass: gather, pad rows zero, cast) gives _SortedPairs.gather's torch bits,
    for token rows, per-pair elements and sentinel pairs (id E), and an empty source."""
    import kosmos.kernels.fused_ops  # noqa: F401
    from kosmos.ops import dispatch

    g = torch.Generator(device="cuda").manual_seed(T + k)
    ids = torch.randint(0, E + 1, (T, k), device="cuda", generator=g)  # E: the sentinel (a pair of no expert)
    rows = moe_math._SortedPairs(ids, E)
    src = torch.randn(T, H, device="cuda", generator=g).to(src_dtype)
    w = torch.rand(T * k, device="cuda", generator=g)
    kernel = dispatch.row_kernel("moe_gather_rows", src.device)
    assert kernel is not None
    d_w = torch.randn(T * k + E, device="cuda", generator=g)  # per-row values back to the pairs, cast (d_weights)
    fused = rows.gather(src, dtype=dtype), rows.gather(w, rows.pair), kernel(d_w, rows.row, torch.bfloat16)
    monkeypatch.setattr(dispatch, "row_kernel", lambda name, device: None)
    ref = rows.gather(src, dtype=dtype), rows.gather(w, rows.pair), d_w[rows.row].to(torch.bfloat16)
    for a, b in zip(fused, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    assert fused[0].dtype == (dtype or src_dtype) and fused[0].shape == (T * k + E, H)
    if T:
        assert (fused[0][rows.pads] == 0).all() and (fused[1][rows.pads] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T,k,E", [(16384, 8, 256), (4096, 8, 128), (1000, 2, 5), (77, 1, 300), (0, 8, 16)])
def test_gpu_sorted_pairs_match_torch(monkeypatch, T, k, E):
    """The registered counting sort (kosmos.kernels.moe_pairs) builds _SortedPairs' tensors index for index as the
    torch math does: router-like ids (distinct per token) with sentinel pairs (id E), int32 and int64 ids."""
    import kosmos.kernels.fused_ops  # noqa: F401
    from kosmos.ops import dispatch

    g = torch.Generator(device="cuda").manual_seed(T + E)
    ids = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=-1).indices
    ids[torch.rand(T, k, device="cuda", generator=g) < 0.05] = E
    assert dispatch.row_kernel("moe_sorted_pairs", ids.device) is not None
    for dtype in (torch.int32, torch.int64):
        fused = moe_math._SortedPairs(ids.to(dtype), E)
        with monkeypatch.context() as m:
            m.setattr(dispatch, "row_kernel", lambda name, device: None)
            ref = moe_math._SortedPairs(ids.to(dtype), E)
        for name in ("counts", "token", "pair", "row", "pads"):
            a, b = getattr(fused, name), getattr(ref, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
        assert fused.groups.ends.dtype == torch.int32 and torch.equal(fused.groups.ends, ref.groups.ends)


@pytest.fixture
def choices_not_kept(monkeypatch):
    """The grouped matmuls' choices made on every call (these tests patch what the choices read between calls)."""
    from kosmos.kernels import moe_ops

    monkeypatch.setattr(moe_ops, "_kept_choice", lambda key, decide: decide())


def test_grouped_choices_are_kept_per_signature(monkeypatch):
    """A grouped matmul's choice is made on its signature's first call; later calls record the same run, and
    another operand signature or switch value is decided again."""
    import kosmos
    from kosmos.kernels import gemm_ws_host, moe_ops

    decided = []
    real = gemm_ws_host.grouped_unsupported
    monkeypatch.setattr(gemm_ws_host, "grouped_unsupported", lambda a, b: decided.append(1) or real(a, b))
    monkeypatch.delenv("KOSMOS_GROUPED_MM", raising=False)
    moe_ops._choices.clear()
    a = torch.randn(10, 64, dtype=torch.bfloat16)
    b = torch.randn(2, 64, 32, dtype=torch.bfloat16)
    ends = torch.tensor([4, 10], dtype=torch.int32)
    kosmos.reset_report()
    for _ in range(3):
        assert moe_ops.grouped_rows_mm(a, b, ends) is None
    assert len(decided) == 1
    ((key, n),) = [(k, n) for k, n in kosmos.report().runtime.items() if k[0] == "grouped_mm"]
    assert key[1] == "torch._grouped_mm" and n == 3
    moe_ops.grouped_rows_mm(a[:9], b, ends)
    assert len(decided) == 2
    monkeypatch.setenv("KOSMOS_GROUPED_MM", "torch")
    assert moe_ops.grouped_rows_mm(a, b, ends) is None
    assert ("grouped_mm", "torch._grouped_mm", "KOSMOS_GROUPED_MM=torch") in kosmos.report().runtime
    monkeypatch.setenv("KOSMOS_GROUPED_MM", "fastest")
    with pytest.raises(ValueError, match="KOSMOS_GROUPED_MM"):
        moe_ops.grouped_rows_mm(a, b, ends)


def test_grouped_rows_mm_reports_which_kernel_and_why(monkeypatch, choices_not_kept):
    """The ragged-M grouped matmuls' kernel choice: KOSMOS_GROUPED_MM=torch, operands the kernel cannot take (here:
    no sm_90 GPU) and, on auto (the default), weights below WIDE_EXPERT per expert run torch._grouped_mm with the
    reason recorded; auto at WIDE_EXPERT and kosmos_m take kosmos's kernel with m-fastest tiles (auto claimed from
    CLAIM_MIN_ROWS rows per expert, and then from CLAIMED_EXPERT elements, kosmos_mc always, both then with split
    consumers), kosmos with n-fastest ones; KOSMOS_GROUPED_CONFIG overrides the tile config; an unknown mode or
    config is an error."""
    import kosmos
    from kosmos.kernels import gemm_ws_host
    from kosmos.kernels.moe_ops import CLAIMED_EXPERT, WIDE_EXPERT, grouped_rows_mm

    a = torch.randn(10, 64, dtype=torch.bfloat16)
    b = torch.randn(2, 64, 32, dtype=torch.bfloat16)
    ends = torch.tensor([4, 10], dtype=torch.int32)

    def choice(mode, b=b):
        if mode is None:
            monkeypatch.delenv("KOSMOS_GROUPED_MM", raising=False)
        else:
            monkeypatch.setenv("KOSMOS_GROUPED_MM", mode)
        kosmos.reset_report()
        out = grouped_rows_mm(a, b, ends)
        (key,) = [k for k in kosmos.report().runtime if k[0] == "grouped_mm"]
        return out, key

    assert choice("torch") == (None, ("grouped_mm", "torch._grouped_mm", "KOSMOS_GROUPED_MM=torch"))
    for mode in (None, "auto", "kosmos", "kosmos_m"):
        out, key = choice(mode)
        assert out is None and key[1] == "torch._grouped_mm", key
        assert any(why in key[2] for why in ("sm_90", "interpreter", "gluon")), key

    launched = []
    monkeypatch.setattr(gemm_ws_host, "grouped_unsupported", lambda a, b: None)
    monkeypatch.setattr(gemm_ws_host, "launch_grouped_mm",
                        lambda a, b, ends, m_fastest, claim, config: launched.append((m_fastest, claim, config)))
    qwen3_235b_up = torch.empty(2, 4096, 3072, dtype=torch.bfloat16, device="meta")
    deepseek_v3_down = torch.empty(2, 7168, 2048, dtype=torch.bfloat16, device="meta")
    assert 4096 * 3072 < WIDE_EXPERT <= 7168 * 2048
    for mode in (None, "auto"):
        out, key = choice(mode, qwen3_235b_up)
        assert key[1] == "torch._grouped_mm" and "4096 x 3072 weight per expert" in key[2], key
        assert choice(mode, deepseek_v3_down)[1] == ("grouped_mm", "kosmos grouped_ws m-fastest 128x256", "supported")
    assert choice("kosmos_m", b)[1] == ("grouped_mm", "kosmos grouped_ws m-fastest 128x256", "supported")
    assert choice("kosmos_mc", b)[1] == ("grouped_mm", "kosmos grouped_ws m-fastest claimed 128x256s", "supported")
    assert choice("kosmos", deepseek_v3_down)[1] == ("grouped_mm", "kosmos grouped_ws 128x256", "supported")
    assert launched == [(True, False, "128x256"), (True, False, "128x256"), (True, False, "128x256"),
                        (True, True, "128x256s"), (False, False, "128x256")]
    # auto claims the tiles from CLAIM_MIN_ROWS rows per expert on average (10 rows in 2 groups: 5)
    # and with claimed tiles takes kosmos's kernel from CLAIMED_EXPERT elements (Qwen3-235B's, not Qwen3-30B-A3B's)
    qwen3_30b_up = torch.empty(2, 2048, 1536, dtype=torch.bfloat16, device="meta")
    assert 2048 * 1536 < CLAIMED_EXPERT <= 4096 * 1536
    monkeypatch.setattr(gemm_ws_host, "CLAIM_MIN_ROWS", 5)
    claimed_split = ("grouped_mm", "kosmos grouped_ws m-fastest claimed 128x256s", "supported")
    assert choice("auto", deepseek_v3_down)[1] == claimed_split
    assert choice("auto", qwen3_235b_up)[1] == claimed_split
    out, key = choice("auto", qwen3_30b_up)
    assert key[1] == "torch._grouped_mm" and f"{CLAIMED_EXPERT} elements here" in key[2], key
    monkeypatch.setattr(gemm_ws_host, "CLAIM_MIN_ROWS", 6)
    assert choice("auto", deepseek_v3_down)[1] == ("grouped_mm", "kosmos grouped_ws m-fastest 128x256", "supported")
    assert choice("auto", qwen3_235b_up)[1][1] == "torch._grouped_mm"
    assert launched[-3:] == [(True, True, "128x256s"), (True, True, "128x256s"), (True, False, "128x256")]
    # KOSMOS_GROUPED_CONFIG overrides the rule; an unknown mode or config is an error
    monkeypatch.setenv("KOSMOS_GROUPED_CONFIG", "128x256s")
    assert choice("kosmos_m", b)[1] == ("grouped_mm", "kosmos grouped_ws m-fastest 128x256s", "supported")
    monkeypatch.setenv("KOSMOS_GROUPED_CONFIG", "192x256")
    with pytest.raises(ValueError, match="KOSMOS_GROUPED_CONFIG"):
        choice("kosmos_m", b)
    monkeypatch.delenv("KOSMOS_GROUPED_CONFIG")
    monkeypatch.setenv("KOSMOS_GROUPED_MM", "cutlass")
    with pytest.raises(ValueError, match="KOSMOS_GROUPED_MM"):
        grouped_rows_mm(a, b, ends)


def test_grouped_rows_wgrad_reports_which_kernel_and_why(monkeypatch, choices_not_kept):
    """The weight gradients' kernel choice: KOSMOS_GROUPED_WGRAD=torch, operands the kernel cannot take (here: no
    sm_90 GPU, or fp32) and, on auto, gradients below WGRAD_MIN_ELEMENTS (none by default) all run torch._grouped_mm
    with the reason recorded; kosmos's kernel runs the two-consumer config up to PINGPONG_MAX_ROWS rows per expert,
    the wide one above, and the report names it, with TMA's zeros for a group's last K block (one consumer, up to
    TAIL_TMA_MAX_ROWS rows per expert, or as KOSMOS_WGRAD_TAIL says); an unknown mode is an error."""
    import kosmos
    from kosmos.kernels import gemm_ws_host, moe_ops
    from kosmos.kernels.moe_ops import grouped_rows_wgrad

    a = torch.randn(10, 128, dtype=torch.bfloat16)
    b = torch.randn(10, 32, dtype=torch.bfloat16)
    ends = torch.tensor([4, 10], dtype=torch.int32)

    def reasons():
        return [k for k in kosmos.report().runtime if k[0] == "grouped_wgrad"]

    kosmos.reset_report()
    monkeypatch.setenv("KOSMOS_GROUPED_WGRAD", "torch")
    assert grouped_rows_wgrad(a, b, ends) is None
    assert reasons() == [("grouped_wgrad", "torch._grouped_mm", "KOSMOS_GROUPED_WGRAD=torch")]
    kosmos.reset_report()
    monkeypatch.setenv("KOSMOS_GROUPED_WGRAD", "kosmos")
    assert grouped_rows_wgrad(a, b, ends) is None
    (key,) = reasons()
    assert any(why in key[2] for why in ("sm_90", "interpreter", "gluon")), key
    assert "bf16 / fp16" in gemm_ws_host.grouped_wgrad_unsupported(a.float(), b.float())
    assert "multiple of 128" in gemm_ws_host.grouped_wgrad_unsupported(a[:, :96], b)
    kosmos.reset_report()
    monkeypatch.setenv("KOSMOS_GROUPED_WGRAD", "auto")
    monkeypatch.setattr(gemm_ws_host, "grouped_wgrad_unsupported", lambda a, b: None)
    assert moe_ops.WGRAD_MIN_ELEMENTS == 0  # the default: kosmos's kernel at every size
    monkeypatch.setattr(moe_ops, "WGRAD_MIN_ELEMENTS", 128 * 32 + 1)
    assert grouped_rows_wgrad(a, b, ends) is None
    (key,) = reasons()
    assert key[1] == "torch._grouped_mm" and "128 x 32 gradient per expert" in key[2], key
    monkeypatch.setattr(moe_ops, "WGRAD_MIN_ELEMENTS", 0)
    kosmos.reset_report()
    configs = []
    monkeypatch.setattr(gemm_ws_host, "launch_grouped_wgrad", lambda a, b, ends, config, tail: configs.append(config))
    for mode in ("auto", "kosmos"):
        monkeypatch.setenv("KOSMOS_GROUPED_WGRAD", mode)
        grouped_rows_wgrad(a, b, ends)
    assert configs == ["128x128pp", "128x128pp"] and reasons() == [
        ("grouped_wgrad", "kosmos grouped_wgrad_ws 128x128pp", "supported")], reasons()
    kosmos.reset_report()
    configs.clear()
    grouped_rows_wgrad(a, b, ends)
    many = torch.zeros(gemm_ws_host.PINGPONG_MAX_ROWS * 2 + 1, 128, dtype=torch.bfloat16)
    grouped_rows_wgrad(many, many[:, :32], ends)
    most = torch.zeros(gemm_ws_host.TAIL_TMA_MAX_ROWS * 2 + 1, 128, dtype=torch.bfloat16)
    grouped_rows_wgrad(most, most[:, :32], ends)
    assert configs == ["128x128pp", "128x256", "128x256"]
    # TMA's zeros past a group's rows: one-consumer configs up to TAIL_TMA_MAX_ROWS rows per group
    assert [k[1] for k in reasons()] == ["kosmos grouped_wgrad_ws 128x128pp",
                                         "kosmos grouped_wgrad_ws 128x256 tail tma", "kosmos grouped_wgrad_ws 128x256"]
    kosmos.reset_report()
    monkeypatch.setenv("KOSMOS_WGRAD_TAIL", "tma")  # every size, still not with two consumers
    for rows in (a, most):
        grouped_rows_wgrad(rows, rows[:, :32], ends)
    assert [k[1] for k in reasons()] == ["kosmos grouped_wgrad_ws 128x128pp",
                                         "kosmos grouped_wgrad_ws 128x256 tail tma"]
    kosmos.reset_report()
    monkeypatch.setenv("KOSMOS_WGRAD_TAIL", "zero")
    grouped_rows_wgrad(many, many[:, :32], ends)
    assert [k[1] for k in reasons()] == ["kosmos grouped_wgrad_ws 128x256"]
    monkeypatch.setenv("KOSMOS_WGRAD_TAIL", "nan")
    with pytest.raises(ValueError, match="KOSMOS_WGRAD_TAIL"):
        grouped_rows_wgrad(many, many[:, :32], ends)
    monkeypatch.delenv("KOSMOS_WGRAD_TAIL")
    monkeypatch.setenv("KOSMOS_GROUPED_WGRAD", "cutlass")
    with pytest.raises(ValueError, match="KOSMOS_GROUPED_WGRAD"):
        grouped_rows_wgrad(a, b, ends)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layer", ["qwen3", "deepseek_v3", "mixtral"])
@pytest.mark.parametrize("T", [16384, 77])
def test_gpu_route_select_matches_torch(monkeypatch, layer, T):
    """route() with the registered selection kernel (the fused forward's) picks the torch ops' experts with their
    weights: Qwen3-MoE's bf16 softmax router, DeepSeek-V3's fp32 group-limited sigmoid router with its correction
    bias, Mixtral's fp32 weights on bf16 logits. Rows whose k-th and next logit tie exactly (bf16 logits: the two
    break ties differently) are left out of the comparison; every other row has the same experts, torch's order
    where its topk sorts, and weights within one unit of the last place (bf16) or 1e-6 (fp32)."""
    import kosmos
    import kosmos.kernels.fused_ops  # noqa: F401
    from kosmos.ops import dispatch

    E, k, H = {"qwen3": (128, 8, 512), "deepseek_v3": (256, 8, 512), "mixtral": (8, 2, 512)}[layer]
    g = torch.Generator(device="cuda").manual_seed(T + E)
    hidden = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    router = torch.randn(E, H, device="cuda", generator=g) / H**0.5
    args = dict(qwen3=(None, k, "softmax", True, 1, 1, 1.0, None, None),
                deepseek_v3=(torch.randn(E, device="cuda", generator=g) * 0.1, k, "sigmoid", True, 8, 4, 2.5,
                             torch.float32, None),
                mixtral=(None, k, "softmax", True, 1, 1, 1.0, None, torch.float32))[layer]
    rw = router if layer == "deepseek_v3" else router.to(torch.bfloat16)
    kosmos.reset_report()
    logits, ids, weights = moe_math.route(hidden, rw, None, *args)
    assert ("router_select", "kosmos route_select", "the fused forward's selection") in kosmos.report().runtime
    real = dispatch.row_kernel
    monkeypatch.setattr(dispatch, "row_kernel", lambda name, device: None if name == "moe_route_select"
                        else real(name, device))
    ref_logits, ref_ids, ref_w = moe_math.route(hidden, rw, None, *args)
    assert torch.equal(logits, ref_logits)
    assert ids.dtype == ref_ids.dtype and weights.dtype == ref_w.dtype and ids.shape == ref_ids.shape
    if args[0] is None:  # the selection follows the logits: ties at the k-th place are ties of the logits
        top = logits.float().topk(k + 1, dim=-1).values
        decided = top[:, k - 1] != top[:, k]
        distinct = (top[:, :-1] != top[:, 1:]).all(dim=1)  # no tie anywhere in the top k + 1
    else:  # fp32 sigmoid scores plus a bias: no ties to speak of
        decided = torch.ones(T, dtype=torch.bool, device="cuda")
    assert decided.float().mean() > 0.7
    same = (ids.sort(dim=1).values == ref_ids.sort(dim=1).values).all(dim=1)
    assert same[decided].all(), (~same[decided]).sum().item()
    if args[2] == "softmax":  # torch's topk sorts: the same order where no two of the top k tie
        assert distinct.float().mean() > 0.5
        assert torch.equal(ids[distinct], ref_ids[distinct])
    order, ref_order = ids.sort(dim=1), ref_ids.sort(dim=1)
    got = weights.gather(1, order.indices)[decided].double()
    ref = ref_w.gather(1, ref_order.indices)[decided].double()
    err = ((got - ref).abs() / ref.abs().clamp(min=1e-30)).max().item()
    assert err <= (1e-6 if weights.dtype == torch.float32 else 2.0**-7), err
