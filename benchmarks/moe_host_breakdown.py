"""Host time of one MoE training step under backend="kosmos", split by the reference backward's pieces (perf_counter
wrappers around kosmos.ops.moe functions) and by op (torch.profiler, CPU self time). Without a GPU it runs tiny dims.

    PYTHONPATH=.:benchmarks python3 benchmarks/moe_host_breakdown.py qwen3_30b_a3b 4096 [--cprofile] [--gc freeze|off]

--cprofile adds cProfile's view of the same steps (Python functions by own time, and the kosmos ones by
cumulative time), finer than the wrappers and the profiler's aten ops. --gc freeze: gc.freeze() after the warm-up
steps (the objects alive then never scanned again); --gc off: gc.disable() for the timed steps (Python's cyclic
collector runs inside whatever call allocates, so its pauses land in the ops' host time).
"""
from __future__ import annotations

import cProfile
import gc
import io
import pstats
import sys
import time

import torch

from moe import build_block
from moe_host_probe import timed_calls

PIECES = ("_SortedPairs", "experts_backward_saved_rows", "_router_d_logits", "_grouped_mm", "_fold_saved",
          "_router_param_grads", "_route_forward", "_check_saved_state", "_check_saved_logits", "_backward_outputs",
          "_grouped_wgrad", "_swiglu_rows_backward_")


class _Slot:
    """A dict entry as an attribute, so timed_calls can wrap the callables dispatch keeps in its tables."""

    def __init__(self, table: dict, key, index=None):
        self.table, self.key, self.index = table, key, index

    def __getattr__(self, _):
        v = self.table[self.key]
        return v if self.index is None else v[self.index]

    def __setattr__(self, name, value):
        if name in ("table", "key", "index"):
            return object.__setattr__(self, name, value)
        if self.index is None:
            self.table[self.key] = value
        else:
            v = list(self.table[self.key])
            v[self.index] = value
            self.table[self.key] = tuple(v)


def _kernel_targets() -> list:
    """The CUDA path's pieces: the fused ops' why_not / run (dispatch's table), the row kernels, the forward
    kernel's host steps and its Triton launch."""
    from kosmos.ops import dispatch

    if not torch.cuda.is_available():
        return []
    from kosmos.kernels import moe as kmoe, runtime

    out = [(_Slot(dispatch._fused, op, i), "fn", f"{op}.{what}") for op in dispatch._fused
           for i, what in ((0, "why_not"), (1, "run"))]
    out += [(_Slot(dispatch._row_kernels, name), "fn", f"row kernel {name}") for name in dispatch._row_kernels]
    out += [(kmoe, "_moe_forward", "kernels.moe._moe_forward"), (runtime, "check_grid_fits", "runtime.check_grid_fits"),
            (kmoe._Control, "launch", "moe._Control.launch (Triton launch)"),
            (kmoe._Control, "launch_direct", "moe._Control.launch_direct (a plan's compiled kernel)"),
            (kmoe, "forward_configs", "kernels.moe.forward_configs"), (dispatch, "try_fused", "dispatch.try_fused")]
    return out


def cprofile_text(step, sync, steps: int, top: int = 40) -> str:
    """cProfile of `steps` calls of step(): the top functions by own time, then kosmos's by cumulative time (ms per
    step)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    sync()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats("kosmos", top)
    return f"cProfile over {steps} steps (times are totals, divide by {steps}):\n" + out.getvalue()


def main(layer: str, T: int, steps: int = 20, cprofile: bool = False, gc_mode: str = "on") -> None:
    import kosmos  # noqa: F401  (registers the backend)
    from kosmos.ops import moe as om, moe_math as mm
    from torch.profiler import ProfilerActivity, profile

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    block, d = build_block(layer, dev, torch.bfloat16, tiny=dev == "cpu")
    T = T if dev == "cuda" else 64
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    x = torch.randn(1, T, d["H"], device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    params = [x] + list(block.parameters())
    f = torch.compile(block, backend="kosmos")
    # module globals, looked up at each call: the op's body (kosmos.ops.moe) and its math (moe_math) bind their own
    targets = [(mod, name, name) for name in PIECES for mod in (om, mm) if name in vars(mod)]
    targets += _kernel_targets()

    def step():
        out = f(x)
        t1 = time.perf_counter()
        torch.autograd.grad(out, params, g, allow_unused=True)
        return t1

    for _ in range(5):
        step()
    sync()
    if gc_mode == "freeze":
        gc.freeze()
    elif gc_mode == "off":
        gc.disable()
    t_fwd = t_bwd = 0.0
    with timed_calls(targets) as spent:
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            t1 = step()
            t2 = time.perf_counter()
            t_fwd += t1 - t0
            t_bwd += t2 - t1
        sync()
    print(f"{layer} T={T} (gc {gc_mode}): host fwd {t_fwd / steps * 1e3:.3f} ms, "
          f"bwd {t_bwd / steps * 1e3:.3f} ms per step")
    for name, v in sorted(spent.items(), key=lambda kv: -sum(kv[1])):
        print(f"   {name:32s} {sum(v) / steps:.3f} ms")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
        sync()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    if cprofile:
        print(cprofile_text(step, sync, steps))


if __name__ == "__main__":
    rest = sys.argv[3:]
    main(sys.argv[1], int(sys.argv[2]), cprofile="--cprofile" in rest,
         gc_mode=rest[rest.index("--gc") + 1] if "--gc" in rest else "on")
