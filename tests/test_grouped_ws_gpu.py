"""Ragged-M grouped GEMM (kosmos.kernels.grouped_ws) on an sm_90 GPU: each group's rows against a float64 reference,
both B layouts, empty groups, groups shorter than a tile, every row in one group, rows past the last group left
as they were, bit-identical reruns over grid sizes, tile orders and consumer splits, and clear errors for what the
kernel cannot take."""
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs an sm_90 GPU (wgmma)"),
]

from kosmos.kernels.gemm_ws_host import grouped_mm, grouped_unsupported  # noqa: E402


def operands(sizes, K, N, b_trans, dtype=torch.bfloat16, extra_rows=5, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    S = sum(sizes) + extra_rows
    a = torch.randn(S, K, device="cuda", generator=g).to(dtype)
    if b_trans:  # Linear-style weights [E, N, K], used as their transposes
        b = torch.randn(len(sizes), N, K, device="cuda", generator=g).to(dtype).transpose(1, 2)
    else:
        b = torch.randn(len(sizes), K, N, device="cuda", generator=g).to(dtype)
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    return a, b, ends


def check(a, b, ends, sizes, **kw):
    out = torch.full((a.shape[0], b.shape[2]), float("nan"), device="cuda", dtype=a.dtype)
    grouped_mm(a, b, ends, out=out, **kw)
    start = 0
    for e, n in enumerate(sizes):
        ref = a[start:start + n].double() @ b[e].double()
        got = out[start:start + n].double()
        assert not got.isnan().any(), f"group {e}: rows left unwritten"
        if n:
            err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            assert err < 1e-2, (e, n, err)
        start += n
    assert out[start:].isnan().all(), "rows past the last group were written"
    return out


@pytest.mark.parametrize("m_fastest,claim,config", [(False, False, "128x256"), (True, False, "128x256"),
                                                     (True, True, "128x256"), (False, False, "128x256s"),
                                                     (True, True, "128x256s")],
                         ids=["n_fastest", "m_fastest", "m_fastest_claimed", "n_fastest_split",
                              "m_fastest_claimed_split"])
@pytest.mark.parametrize("b_trans", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("sizes,K,N", [
    ([300, 0, 1, 129, 127, 128, 256, 77], 256, 512),  # empty, one-row, just over / under / exactly a tile
    ([0, 0, 1000, 0], 192, 320),  # every row in one group; N not a multiple of the 256-wide tile
    ([64] * 40, 128, 256),  # many groups shorter than a tile
])
def test_groups_match_reference(sizes, K, N, b_trans, m_fastest, claim, config):
    a, b, ends = operands(sizes, K, N, b_trans)
    check(a, b, ends, sizes, m_fastest=m_fastest, claim=claim, config=config)


@pytest.mark.parametrize("b_trans", [False, True], ids=["kn", "nk"])
def test_split_consumers_give_the_one_consumer_bits(b_trans):
    """Two consumers splitting a tile's rows (the second skipping its MMAs where its rows are all past the group's
    end: 63 / 64 / 65 rows left in a group's last tile) give the one consumer's bits, with N past the last
    column block and over grid sizes and tile orders."""
    sizes = [129, 191, 192, 193, 64, 65, 63, 1, 0, 320, 2]
    a, b, ends = operands(sizes, 320, 448, b_trans)
    rows = sum(sizes)
    one = check(a, b, ends, sizes)
    for programs, m_fastest, claim in ((None, False, False), (3, True, False), (None, True, True), (5, True, True)):
        split = check(a, b, ends, sizes, programs=programs, m_fastest=m_fastest, claim=claim, config="128x256s")
        assert torch.equal(split[:rows], one[:rows]), (programs, m_fastest, claim)


def test_fp16_and_moe_like_padded_groups():
    g = torch.Generator().manual_seed(1)
    counts = torch.multinomial(torch.ones(32), 2048 * 4, replacement=True, generator=g).bincount(minlength=32)
    sizes = (counts + 1).tolist()  # the reference's layout: each group led by a pad row
    a, b, ends = operands(sizes, 512, 384, False, dtype=torch.float16)
    check(a, b, ends, sizes)


def test_bit_identical_over_grid_sizes():
    sizes = [700, 5, 0, 513, 1024, 33]
    a, b, ends = operands(sizes, 256, 512, False)
    first = check(a, b, ends, sizes)
    for programs, m_fastest, claim, config in ((1, False, False, "128x256"), (7, True, False, "128x256"),
                                               (64, False, False, "128x256"), (64, True, False, "128x256"),
                                               (1, True, True, "128x256"), (7, True, True, "128x256"),
                                               (132, True, True, "128x256"), (1, True, True, "128x256s"),
                                               (132, True, True, "128x256s")):
        again = check(a, b, ends, sizes, programs=programs, m_fastest=m_fastest, claim=claim, config=config)
        assert torch.equal(again[:sum(sizes)], first[:sum(sizes)]), (programs, m_fastest, claim, config)


def test_claimed_tiles_replay_in_a_cuda_graph():
    """The claim counter is zeroed on every call, graph replays included, and claimed tiles (here with split
    consumers) give the static schedule's bits."""
    g = torch.Generator().manual_seed(2)
    counts = torch.multinomial(torch.ones(64), 4096, replacement=True, generator=g).bincount(minlength=64)
    sizes = (counts + 1).tolist()
    a, b, ends = operands(sizes, 512, 768, True)
    rows = sum(sizes)
    graph_out = torch.zeros(a.shape[0], b.shape[2], device="cuda", dtype=a.dtype)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_mm(a, b, ends, out=graph_out, m_fastest=True, claim=True, config="128x256s")
    for seed in (3, 4):
        a.copy_(torch.randn(a.shape, generator=torch.Generator().manual_seed(seed)).to(a.dtype))
        graph.replay()
        static = grouped_mm(a, b, ends, m_fastest=True)
        assert torch.equal(graph_out[:rows], static[:rows]), seed
        ref = torch._grouped_mm(a, b, offs=ends)[:rows].float()
        assert ((graph_out[:rows].float() - ref).norm() / ref.norm()).item() < 1e-2


def test_clear_errors():
    a, b, ends = operands([10, 20], 128, 256, False)
    assert "dtypes" in grouped_unsupported(a.float(), b.float())
    assert "multiple of 64" in grouped_unsupported(a[:, :120].contiguous(), b[:, :120].contiguous())
    assert "B strides" in grouped_unsupported(a, b[:, :, :128])
    with pytest.raises(ValueError, match="ends must be int32"):
        grouped_mm(a, b, ends.long())
    with pytest.raises(ValueError, match="dtypes"):
        grouped_mm(a.float(), b.float(), ends)
