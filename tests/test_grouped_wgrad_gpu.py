"""Ragged-K grouped GEMM (kosmos.kernels.grouped_wgrad_ws, the MoE weight gradients) on an sm_90 GPU: each group's
out[e] = A_e^T @ B_e against a float64 reference and bit for bit against torch._grouped_mm, empty and one-row
groups, groups ending inside a K block, rows past the last group ignored, bit-identical reruns over grid sizes,
the MoE backward's weight gradients with the kernel on and off, and clear errors for what it cannot take."""
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs an sm_90 GPU (wgmma)"),
]

from kosmos.kernels.gemm_ws_host import WGRAD_CONFIGS, grouped_wgrad  # noqa: E402


def operands(sizes, M, N, dtype=torch.bfloat16, extra_rows=5, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    S = sum(sizes) + extra_rows
    a = torch.randn(S, M, device="cuda", generator=g).to(dtype)
    b = torch.randn(S, N, device="cuda", generator=g).to(dtype)
    return a, b, torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)


@pytest.mark.parametrize("tail", ["tma", "zero"])
@pytest.mark.parametrize("config", list(WGRAD_CONFIGS))
@pytest.mark.parametrize("sizes,M,N", [
    ([0, 1, 63, 64, 65, 200, 0, 7], 256, 384),  # empty, one row, around one K block, N not a multiple of 256
    ([0, 0, 1000, 0], 128, 512),  # every row in one group
    ([3] * 40, 384, 256),  # many groups shorter than a K block
])
def test_groups_match_reference(sizes, M, N, config, tail, monkeypatch):
    """tail: a group's last K block past its rows zeroed in shared memory (KOSMOS_WGRAD_TAIL=zero) or zero-filled
    by TMA through descriptors over the group's rows built on the device (=tma; two-consumer configs keep
    zeroing)."""
    monkeypatch.setenv("KOSMOS_WGRAD_TAIL", tail)
    a, b, ends = operands(sizes, M, N)
    out = grouped_wgrad(a, b, ends, config=config)
    start = 0
    for e, n in enumerate(sizes):
        ref = a[start:start + n].double().t() @ b[start:start + n].double()
        if n:
            err = ((out[e].double() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (e, n, err)
        else:
            assert not out[e].any(), f"group {e} has no rows: its gradient must be zeros"
        start += n
    assert torch.equal(out, torch._grouped_mm(a.t(), b, ends)), "not the same bits as torch._grouped_mm"
    assert torch.equal(out, grouped_wgrad(a, b, ends, config=config, programs=3)), "bits depend on the grid"


def test_fp16_and_moe_sized_groups():
    """fp16 (the descriptors' element type follows the operands) at a MoE layer's row counts."""
    g = torch.Generator().manual_seed(1)
    sizes = (torch.multinomial(torch.ones(64), 4096, replacement=True, generator=g).bincount(minlength=64)
             + 1).tolist()
    a, b, ends = operands(sizes, 512, 768, dtype=torch.float16)
    out = grouped_wgrad(a, b, ends)
    ref = torch._grouped_mm(a.t(), b, ends)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("config", ["128x256", "128x128pp"])
@pytest.mark.parametrize("tail", ["tma", "zero"])
@pytest.mark.parametrize("operand", ["a", "b"])
def test_non_finite_rows_of_the_next_group_stay_out(operand, tail, config, monkeypatch):
    """A group's last K block reaches into the next group's rows; they come in as zeros in both blocks (by TMA past
    the group's end, or zeroed in shared memory), so an inf there cannot reach this group's gradient through a zero
    row of the other operand (0 * inf would be nan); the groups after it still get their rows."""
    monkeypatch.setenv("KOSMOS_WGRAD_TAIL", tail)
    a, b, ends = operands([10, 70, 3, 0, 130], 256, 512)
    {"a": a, "b": b}[operand][10:80] = float("inf")
    out = grouped_wgrad(a, b, ends, config=config)
    assert torch.isfinite(out[0]).all()
    assert torch.equal(out[2:], torch._grouped_mm(a.t(), b, ends)[2:])


def test_errors_name_the_problem():
    a, b, ends = operands([4, 4], 128, 256)
    with pytest.raises(ValueError, match="bf16 / fp16"):
        grouped_wgrad(a.float(), b.float(), ends)
    with pytest.raises(ValueError, match="multiple of 128"):
        grouped_wgrad(a[:, :96].contiguous(), b, ends)
    with pytest.raises(ValueError, match="int32"):
        grouped_wgrad(a, b, ends.long())
    with pytest.raises(ValueError, match="out"):
        grouped_wgrad(a, b, ends, out=torch.empty(2, 256, 128, device="cuda", dtype=a.dtype))


@pytest.mark.parametrize("mode", ["kosmos", "torch"])
def test_moe_backward_weight_gradients_by_either_kernel(mode, monkeypatch):
    """The experts' backward (reference impl, saved up rows) gives the same weight gradients with the weight
    gradients on kosmos's kernel as on torch's, and the report says which ran."""
    import kosmos
    from kosmos.ops import moe_math

    monkeypatch.setenv("KOSMOS_GROUPED_WGRAD", mode)
    torch.manual_seed(0)
    T, H, I, E, k = 512, 256, 128, 8, 2
    hidden = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, E, (T, k), device="cuda")
    weights = torch.rand(T, k, device="cuda")
    gate_up = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.05
    down = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.05
    grad = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    kosmos.reset_report()
    _, _, d_gate_up, d_down = moe_math.experts_backward(grad, hidden, ids, weights, gate_up, down)
    monkeypatch.setenv("KOSMOS_GROUPED_WGRAD", "torch")
    _, _, ref_gate_up, ref_down = moe_math.experts_backward(grad, hidden, ids, weights, gate_up, down)
    assert torch.equal(d_gate_up, ref_gate_up) and torch.equal(d_down, ref_down)
    impls = {key[1] for key in kosmos.report().runtime if key[0] == "grouped_wgrad"}
    assert any(impl.startswith("kosmos grouped_wgrad_ws") for impl in impls) == (mode == "kosmos")


def test_moe_layer_gradients_by_either_kernel(monkeypatch):
    """kosmos::moe_layer's default backward (the forward's saved up rows, DeepSeek-V3-style sigmoid routing) gives
    bit-equal gradients with the weight gradients on kosmos's kernel and on torch's."""
    import kosmos  # noqa: F401  (registers the ops)

    torch.manual_seed(0)
    T, H, I, E, k = 1024, 256, 128, 16, 4
    dev, bf = "cuda", torch.bfloat16
    params = dict(hidden=torch.randn(T, H, device=dev, dtype=bf), router=torch.randn(E, H, device=dev) * 0.05,
                  gate_up=torch.randn(E, 2 * I, H, device=dev, dtype=bf) * 0.05,
                  down=torch.randn(E, H, I, device=dev, dtype=bf) * 0.05)
    grad_out = torch.randn(T, H, device=dev, dtype=bf)
    grads = {}
    for mode in ("torch", "kosmos"):
        monkeypatch.setenv("KOSMOS_GROUPED_WGRAD", mode)
        leaves = {n: p.detach().clone().requires_grad_() for n, p in params.items()}
        out = torch.ops.kosmos.moe_layer(leaves["hidden"], leaves["router"], None, None, leaves["gate_up"],
                                         leaves["down"], k, "sigmoid", True, 1, 1, 2.5, torch.float32)[0]
        out.backward(grad_out)
        grads[mode] = [leaves[n].grad for n in params]
    for name, a, b in zip(params, grads["kosmos"], grads["torch"]):
        assert torch.equal(a, b), name
