"""Test helpers: trace models with the kosmos backend on a fake process group and capture post-grad graphs."""
from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.distributed as dist
from torch._inductor.custom_graph_pass import CustomGraphPass

import kosmos
from kosmos.passes import post_grad

# Checked on torch 2.11 without torch.compile: the same error is raised in eager.
needs_dtensor_seq_shard_linear = pytest.mark.skipif(
    torch.__version__ < (2, 12),
    reason="torch 2.11 DTensor cannot run nn.Linear on a sequence-sharded (Shard(1)) input: sharding propagation "
    "of its aten.view raises 'Attempted to flatten multiple dimensions, with dimension 1 being sharded' in eager too")


class Captured:
    """One post-grad graph as the kosmos passes left it, with its code at that moment."""

    def __init__(self, code, graph):
        self.code, self.graph = code, graph


class _Capture(CustomGraphPass):
    """Runs after the kosmos passes (as the user's own post-grad pass) and keeps each graph."""

    def __init__(self):
        self.captured: list[Captured] = []

    def __call__(self, graph):
        self.captured.append(Captured(graph.python_code("self").src, graph))

    def uuid(self):
        return None  # never cache: the capture must see every graph


@contextlib.contextmanager
def fake_world(world_size: int):
    """A fake process group of `world_size` ranks (this process is rank 0); collectives do nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _torch_212_first_trace_bug(e: Exception) -> bool:
    """Whether e is torch 2.12's failure of a process's first Dynamo trace of nn.Linear on a sequence-sharded
    (Shard(1)) DTensor input: PendingUnbackedSymbolNotFound on every backend, eager included, where a second trace
    passes (benchmarks/results/torch212_dtensor_first_trace_repro.py.txt; torch 2.13 and 2.14.1 trace it at once)."""
    return (2, 12) <= torch.__version__ < (2, 13) and "PendingUnbackedSymbolNotFound" in str(e)


def compile_and_capture(fn, *args, backward=True, backend="kosmos", options=None, fullgraph=False):
    """Compiles and runs fn(*args) (and backward of its first output); returns the captured graphs by kind,
    {"forward" / "backward" / "inference": [Captured, ...]}. On torch 2.12 a first trace that hits its DTensor
    bug (_torch_212_first_trace_bug; it fails in Dynamo, before any backend runs) is traced again once."""
    torch._dynamo.reset()
    kosmos.reset_report()
    cap = _Capture()
    with torch._inductor.config.patch(post_grad_custom_post_pass=cap, fx_graph_cache=False):
        compiled = torch.compile(fn, backend=backend, options=options, fullgraph=fullgraph)
        try:
            out = compiled(*args)
        except torch._dynamo.exc.InternalTorchDynamoError as e:
            if not _torch_212_first_trace_bug(e):
                raise
            torch._dynamo.reset()
            kosmos.reset_report()
            cap.captured.clear()
            compiled = torch.compile(fn, backend=backend, options=options, fullgraph=fullgraph)
            out = compiled(*args)
        if backward:
            o = out if isinstance(out, torch.Tensor) else out[0]
            if hasattr(o, "to_local"):
                o = o.to_local()
            o.float().sum().backward()
    graphs: dict[str, list[Captured]] = {}
    for c in cap.captured:
        graphs.setdefault(post_grad.graph_kind(c.graph), []).append(c)
    return graphs


_KEEP = re.compile(r"torch\.ops\.(kosmos|_c10d_functional)\.|aten\.(mm|addmm|bmm)\.")


def skeleton(code: str, kosmos_only: bool = False) -> str:
    """The communication + matmul lines of a graph (what the TP+SP pass changes), without `x = None` frees.

    Intermediate names are renumbered in order of appearance (t0, t1, ...) so that snapshots compare
    structure, not the counters torch versions give node names (tangents keep theirs)."""
    lines = _skeleton_lines(code)
    if kosmos_only:
        lines = "\n".join(line for line in lines.splitlines() if "torch.ops.kosmos." in line)
    return _renumber(lines)


_TOKEN = re.compile(r"(?<![.\w'])[a-z_][a-z0-9_]*(?![\w'.])")
_KWARG = re.compile(r"(?<=[(,] )[a-z_][a-z0-9_]*(?= = )")  # a keyword argument's name (auto_functionalized calls)


def _renumber(text: str) -> str:
    names: dict[str, str] = {}

    def sub(m):
        tok = m.group(0)
        if tok.startswith("tangents") or _KWARG.match(m.string, m.start()):
            return tok  # primals_N numbering differs between torch versions; tangents_N does not
        return names.setdefault(tok, f"t{len(names)}")

    return "\n".join(_TOKEN.sub(sub, line) for line in text.splitlines())


def _skeleton_lines(code: str) -> str:
    lines = []
    kosmos_names = set()
    for line in code.splitlines():
        line = line.strip()
        if not line or line.startswith("def ") or line.startswith("return"):
            continue
        line = line.split(";")[0]
        name, _, rhs = line.partition(" = ")
        if _KEEP.search(rhs):
            lines.append(line)
            if "torch.ops.kosmos." in rhs:
                kosmos_names.add(name)
        elif rhs.split("[")[0] in kosmos_names:
            lines.append(line)
    return "\n".join(lines)


def count_ops(code: str, op: str) -> int:
    """Calls of kosmos::`op` in a graph's code, direct or through auto_functionalized (an op that mutates an input,
    as moe_layer_backward does saved_up, is functionalized in post-grad graphs)."""
    return len(re.findall(rf"torch\.ops\.kosmos\.{op}\.default[(,]", code))


_MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")
_MOVES = (
    "aten.view.", "aten.reshape.", "aten._unsafe_view.", "aten.split.", "aten.split_with_sizes.", "getitem",
    "aten.cat.", "aten.slice.", "aten.narrow.", "aten.index.", "aten.as_strided.", "aten.clone.",
    "prims.convert_element_type.", "aten.permute.", "aten.t.", "aten.expand.", "aten.squeeze.",
    "aten.unsqueeze.", "_c10d_functional.wait_tensor.", "aten.add.Tensor",
)


def _name(node) -> str:
    return str(node.target)


def unfused_pairs(graph: torch.fx.Graph) -> list[str]:
    """All-gathers that still reach a matmul, and matmuls that still reach a reduce-scatter, through any
    data movement (checked independently of the pass's own matcher)."""
    found = []
    for node in graph.nodes:
        if "all_gather_into_tensor" in _name(node):
            stack, seen = [node], set()
            while stack:
                n = stack.pop()
                for u in n.users:
                    if u in seen:
                        continue
                    seen.add(u)
                    if any(m in _name(u) for m in _MATMULS):
                        found.append(f"{node.name} -> {u.name}")
                    elif any(m in _name(u) for m in _MOVES) and "add.Tensor" not in _name(u):
                        stack.append(u)
        if "reduce_scatter_tensor" in _name(node):
            stack, seen = [node.args[0]], set()
            while stack:
                n = stack.pop()
                if n in seen or not isinstance(n, torch.fx.Node):
                    continue
                seen.add(n)
                if any(m in _name(n) for m in _MATMULS):
                    found.append(f"{n.name} -> {node.name}")
                elif any(m in _name(n) for m in _MOVES):
                    stack.extend(n.all_input_nodes)
    return found
