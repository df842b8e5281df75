"""The MoE reference backward's gather of the hidden rows on a side stream (runtime.Beside,
moe_ops.gather_rows_beside, KOSMOS_GATHER_BESIDE), beside the d_act GEMM.

On the CPU: the backward forks before the d_act GEMM, starts the gather after it and joins before d_gate_up_proj's
weight gradient, and gathers in line where the kernel declines or d_gate_up_proj is frozen; the op's switch and
report lines. On a GPU: the same bits as the gather in line, eager and replayed in a CUDA graph with changing inputs.
"""
from __future__ import annotations

import pytest
import torch

from kosmos.ops import dispatch, moe_math

from test_moe_reference_grouped import make


def _case():
    torch.manual_seed(0)
    T, k, E, H, I = 6, 2, 3, 8, 4
    rows = moe_math._SortedPairs(torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2], [1, 0], [2, 1]]), E)
    w_rows = rows.gather(torch.rand(T * k), rows.pair)
    return (torch.randn(T, H), torch.randn(T, H), rows, w_rows, torch.randn(rows.token.shape[0], 2 * I),
            torch.randn(E, 2 * I, H), torch.randn(E, H, I))


def _backward(case, wgrads=(True, True)):
    grad_out, hidden, rows, w_rows, h, gate_up, down = case
    return moe_math._experts_backward_saved_(grad_out, hidden, rows, w_rows, h.clone(), gate_up, down, wgrads)


def test_backward_gathers_beside_the_d_act_gemm(monkeypatch):
    """The registered "moe_gather_rows_beside" is asked (the hidden states, the sorted pairs' token index, the
    gate_up_proj dtype) before the d_act GEMM, started after it, joined before d_gate_up_proj's gradient, whose x
    is its result; the gradients are those of the gather in line."""
    case = _case()
    want = _backward(case)
    events = []
    real_mm, real_wgrad = moe_math._grouped_mm, moe_math._grouped_wgrad
    monkeypatch.setattr(moe_math, "_grouped_mm", lambda a, b, g: events.append("mm") or real_mm(a, b, g))
    monkeypatch.setattr(moe_math, "_grouped_wgrad",
                        lambda a, b, g, like: events.append(("wgrad", like.shape)) or real_wgrad(a, b, g, like))
    grad_out, hidden, rows, *_ = case

    class FakeBeside:
        def __init__(self, t, index, dtype):
            events.append("fork")
            assert t is hidden and index is rows.token and dtype == case[5].dtype
            self.out = moe_math._SortedPairs.gather(rows, t, dtype=dtype)

        def start(self):
            events.append("start")

        def join(self):
            events.append("join")
            return self.out

    monkeypatch.setattr(dispatch, "row_kernel", lambda name, device: FakeBeside if name == "moe_gather_rows_beside"
                        else None)
    got = _backward(case)
    gate_up_shape, down_shape = case[5].shape, case[6].shape
    assert events == ["fork", "mm", "start", ("wgrad", down_shape), "join", ("wgrad", gate_up_shape)], events
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    events.clear()
    _backward(case, wgrads=(False, True))  # d_gate_up_proj frozen: no gather at all
    assert events == ["mm", ("wgrad", down_shape)], events
    events.clear()
    monkeypatch.setattr(dispatch, "row_kernel", lambda name, device: (
        (lambda *args: None) if name == "moe_gather_rows_beside" else None))
    for a, b in zip(_backward(case), want):  # declined: in line
        assert torch.equal(a, b)
    assert events == ["mm", ("wgrad", down_shape), ("wgrad", gate_up_shape)], events


def test_gather_rows_beside_switch_and_report(monkeypatch):
    """moe_ops.gather_rows_beside: a runtime.Beside of moe_rows.gather_rows (recorded), None with
    KOSMOS_GATHER_BESIDE=0 (recorded), an error for another value."""
    import kosmos
    from kosmos.kernels import moe_ops, runtime

    made = []
    monkeypatch.setattr(runtime, "Beside", lambda device, fn: made.append((device, fn)) or "beside")
    monkeypatch.delenv("KOSMOS_GATHER_BESIDE", raising=False)
    kosmos.reset_report()
    src, index = torch.zeros(4, 8), torch.zeros(3, dtype=torch.long)
    assert moe_ops.gather_rows_beside(src, index, torch.bfloat16) == "beside"
    assert made[0][0] == src.device and callable(made[0][1])
    monkeypatch.setenv("KOSMOS_GATHER_BESIDE", "0")
    assert moe_ops.gather_rows_beside(src, index, torch.bfloat16) is None
    monkeypatch.setenv("KOSMOS_GATHER_BESIDE", "on")
    with pytest.raises(ValueError, match="expected 0 or 1"):
        moe_ops.gather_rows_beside(src, index, torch.bfloat16)
    assert set(kosmos.report().runtime) == {("gather_beside", "moe_gather_rows on a side stream", "supported"),
                                            ("gather_beside", "moe_gather_rows in line", "KOSMOS_GATHER_BESIDE=0")}


# ---------------------------------------------------------------------------------------------------- GPU

needs_grouped = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10),
    reason="the reference's sync-free path (torch._grouped_mm's bf16 kernel) needs sm90/sm100")


def _saved_backward(hidden, ids, weights, gate_up, down, grad_out):
    out, _, up = moe_math.experts(hidden, ids, weights, gate_up, down, return_up=True)
    return [out, *moe_math.experts_backward(grad_out, hidden, ids, weights, gate_up, down, saved_up=up)]


@pytest.mark.gpu
@needs_grouped
@pytest.mark.parametrize("dims", [(4096, 2048, 768, 128, 8), (3000, 1024, 512, 16, 2)], ids=["qwen3_30b", "small"])
def test_gpu_beside_gives_the_in_line_bits(monkeypatch, dims):
    import kosmos
    import kosmos.kernels.fused_ops  # noqa: F401  (registers the row kernels)

    case = make(*dims, torch.bfloat16, seed=3, device="cuda")
    monkeypatch.setenv("KOSMOS_GATHER_BESIDE", "0")
    want = _saved_backward(*case)
    monkeypatch.setenv("KOSMOS_GATHER_BESIDE", "1")
    kosmos.reset_report()
    for _ in range(3):  # the side stream's pool reused across calls
        got = _saved_backward(*case)
        torch.cuda.synchronize()
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert kosmos.report().runtime.get(("gather_beside", "moe_gather_rows on a side stream", "supported")) == 3


@pytest.mark.gpu
@needs_grouped
def test_gpu_beside_in_a_cuda_graph_with_changing_inputs(monkeypatch):
    """The backward with the side-stream gather captured in a CUDA graph (the fork and join are captured) and
    replayed on new inputs: the eager bits each time."""
    import kosmos.kernels.fused_ops  # noqa: F401

    monkeypatch.setenv("KOSMOS_GATHER_BESIDE", "1")
    dims = (2000, 1024, 512, 16, 4)
    hidden, ids, weights, gate_up, down, grad_out = make(*dims, torch.bfloat16, seed=4, device="cuda")
    _, _, up = moe_math.experts(hidden, ids, weights, gate_up, down, return_up=True)
    static = [t.clone() for t in (grad_out, hidden, ids, weights, up)]
    moe_math.experts_backward(*[s.clone() for s in static[:2]], static[2], static[3], gate_up, down,
                              saved_up=static[4].clone())  # warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_grads = moe_math.experts_backward(static[0], static[1], static[2], static[3], gate_up, down,
                                            saved_up=static[4])
    for step in range(4):
        new = make(*dims, torch.bfloat16, seed=10 + step, device="cuda")
        _, _, new_up = moe_math.experts(new[0], new[1], new[2], gate_up, down, return_up=True)
        for s, t in zip(static, (new[5], new[0], new[1], new[2], new_up)):
            s.copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        eager = moe_math.experts_backward(new[5], new[0], new[1], new[2], gate_up, down, saved_up=new_up)
        for a, b in zip(g_grads, eager):
            assert torch.equal(a, b), step
