"""The embedding's backward alone: aten's kernel (kosmos::embedding_backward) against Inductor's decomposition
(an fp32 [V, H] buffer of atomic adds, then a cast), at the vocabularies of the models in model_step.py: time per
call and the memory each allocates beyond its [V, H] result.

    PYTHONPATH=.:benchmarks python3 benchmarks/embedding_backward.py --tokens 8192
"""
from __future__ import annotations

import argparse
import json

import torch

from measure import bench_calls

SHAPES = {"qwen3_30b_a3b": (151936, 2048), "qwen3_235b": (151936, 4096), "deepseek_v3": (129280, 7168)}


def _extra_gib(fn) -> float:
    """GiB allocated at fn's peak beyond its result's bytes."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
    return extra / 2**30


def run(name: str, tokens: int, args) -> dict:
    import kosmos  # noqa: F401  (registers torch.ops.kosmos.embedding_backward)

    vocab, dim = SHAPES[name]
    gen = torch.Generator("cuda").manual_seed(0)
    ids = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    grad = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    aten = lambda: torch.ops.kosmos.embedding_backward(grad, ids, vocab, -1, False)  # noqa: E731
    torch._dynamo.reset()
    inductor = torch.compile(lambda: torch.ops.aten.embedding_dense_backward(grad, ids, vocab, -1, False))
    ref = aten().float()
    res = {"model": name, "vocab": vocab, "dim": dim, "tokens": tokens}
    for label, fn in (("aten", aten), ("inductor", inductor)):
        fn()
        res[f"rel_err_{label}"] = ((fn().float() - ref).norm() / ref.norm()).item()
        res[f"extra_gib_{label}"] = _extra_gib(fn)
        res[f"ms_{label}"] = bench_calls(fn, args.warmup, args.rep, args.min_reps)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(SHAPES))
    p.add_argument("--tokens", default="8192", help="comma-separated token counts")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--rep", type=int, default=300)
    p.add_argument("--min-reps", type=int, default=10)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    results = [run(m, int(t), args) for m in args.models.split(",") for t in args.tokens.split(",")]
    print(f"{'model':>14} {'V x H':>14} {'tokens':>6} | {'aten ms':>8} {'Inductor ms':>11} | "
          f"{'extra GiB aten':>14} {'Inductor':>8} | rel err Inductor vs aten")
    for r in results:
        print(f"{r['model']:>14} {r['vocab']:>7}x{r['dim']:<6} {r['tokens']:>6} | {r['ms_aten']:>8.3f} "
              f"{r['ms_inductor']:>11.3f} | {r['extra_gib_aten']:>14.3f} {r['extra_gib_inductor']:>8.3f} | "
              f"{r['rel_err_inductor']:.1e}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
