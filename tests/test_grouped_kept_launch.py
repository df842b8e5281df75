"""The grouped kernels' launches kept per signature (gemm_ws_host._launch_kept): the first call of a signature
builds the launch from checked TensorDescriptors, later calls reuse it with the unchecked HostDescriptors; a new
shape, block, dtype or alignment makes a new one. No GPU: the build is a stand-in, the device a CUDA label."""
import pytest
import torch


@pytest.fixture
def kept(monkeypatch):
    from kosmos.kernels import gemm_ws_host, launch_plan

    if gemm_ws_host.gluon_missing():
        pytest.skip(gemm_ws_host.gluon_missing())
    seen = {"built": [], "launched": []}

    class Direct(launch_plan.DirectLaunch):
        def __init__(self):
            pass

        def __call__(self, args):
            seen["launched"].append(args)

    def build(kernel, grid, args, meta):
        seen["built"].append((grid, args, meta))
        return Direct() if seen.get("direct", True) else (lambda a: seen["launched"].append(a))

    monkeypatch.setattr(launch_plan, "kept_launch", build)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch_plan, "_launches", launch_plan.PlanCache())
    return gemm_ws_host, seen


def _call(host, t, block=(64, 64), **meta):
    desc = host.HostDescriptor(t, list(t.shape), t.stride(0), list(block))
    host._launch_kept("kernel", (5,), (desc, t, t.shape[1]), dict(A=1, **meta), torch.device("cuda"))
    return desc


def test_first_call_of_a_signature_builds_from_checked_descriptors(kept):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    host, seen = kept
    a, b = (torch.zeros(128, 64, dtype=torch.bfloat16) for _ in range(2))
    _call(host, a)
    d = _call(host, b)
    assert len(seen["built"]) == 1
    grid, args, meta = seen["built"][0]
    assert grid == (5,) and meta == {"A": 1} and isinstance(args[0], TensorDescriptor) and args[0].base is a
    assert list(args[0].block_shape) == [64, 64] and list(args[0].strides) == [64, 1]
    assert len(seen["launched"]) == 2 and seen["launched"][1][0] is d and seen["launched"][1][1] is b


@pytest.mark.parametrize("change", ["shape", "block", "dtype", "meta", "scalar"])
def test_a_new_signature_builds_a_new_launch(kept, change):
    host, seen = kept
    a = torch.zeros(128, 64, dtype=torch.bfloat16)
    _call(host, a)
    if change == "shape":
        _call(host, torch.zeros(256, 64, dtype=torch.bfloat16))
    elif change == "block":
        _call(host, a, block=(128, 64))
    elif change == "dtype":
        _call(host, a.half())
    elif change == "meta":
        _call(host, a, B=2)
    else:
        _call(host, torch.zeros(128, 128, dtype=torch.bfloat16)[:, :64])  # row stride 128, K 64
    assert len(seen["built"]) == 2


def test_a_misaligned_base_is_a_new_signature_whose_checks_run(kept):
    host, seen = kept
    _call(host, torch.zeros(128, 64, dtype=torch.bfloat16))
    flat = torch.zeros(128 * 64 + 8, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="16-byte aligned"):
        _call(host, flat[4:4 + 128 * 64].view(128, 64))
    assert len(seen["built"]) == 1


def test_a_jit_launch_gets_checked_descriptors_every_call(kept):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    host, seen = kept
    seen["direct"] = False
    for _ in range(2):
        _call(host, torch.zeros(128, 64, dtype=torch.bfloat16))
    assert len(seen["built"]) == 1 and all(isinstance(a[0], TensorDescriptor) for a in seen["launched"])


def test_off_cuda_the_jit_runs_each_call_with_checked_descriptors(monkeypatch):
    from kosmos.kernels import gemm_ws_host, runtime

    if gemm_ws_host.gluon_missing():
        pytest.skip(gemm_ws_host.gluon_missing())
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    t = torch.zeros(128, 64, dtype=torch.bfloat16)
    for _ in range(2):
        gemm_ws_host._launch_kept(Kernel(), (3,), (gemm_ws_host.HostDescriptor(t, [128, 64], 64, [64, 64]), t),
                                  dict(A=1), t.device)
    assert len(calls) == 2 and calls[0][0] == (3,)
    assert calls[1][2] == dict(A=1, **runtime.COMPILE_OPTIONS) and calls[1][1][0].base is t
    assert type(calls[1][1][0]).__name__ == "TensorDescriptor"
