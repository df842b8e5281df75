"""`python -m kosmos.demo`: TP+SP training of an unmodified HF Qwen3 proxy compiled with kosmos, next to eager.

Builds a small Qwen3ForCausalLM from a config (random weights from --seed; nothing is downloaded),
spawns --world-size ranks (gloo on CPU by default; NCCL when --device cuda, or auto with >= 2 GPUs),
shards it with `kosmos.parallelize`, compiles it with `torch.compile(backend="kosmos")` and trains
--steps AdamW steps on a copy task (each sequence repeats a random 8-token block, so the loss falls
once the model learns to look one period back). The same model and data run unsharded in eager mode
in this process first. Rank 0's results are printed here: what kosmos rewrote (forward and backward
graphs), each step's loss beside the eager loss, and a final line with the largest relative loss
difference; the exit status is 1 when that is above --tol.

    python -m kosmos.demo                    # 2 gloo ranks on CPU, 8 steps
    python -m kosmos.demo --world-size 4
"""
from __future__ import annotations

import argparse
import multiprocessing.util
import os
import sys
import tempfile
import time

import torch

BATCH, SEQ, PERIOD, TOKENS = 4, 32, 8, 64  # copy task: tokens < TOKENS, sequences repeat every PERIOD
VOCAB, LR = 256, 1e-2


def proxy_config(world_size: int):
    """A 2-layer Qwen3 proxy whose heads and kv heads divide by `world_size`."""
    from transformers import Qwen3Config

    heads = max(4, world_size)
    kv_heads = max(2, world_size)
    return Qwen3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=32,
        max_position_embeddings=SEQ, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )


def build_model(world_size: int, seed: int, device: str):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(proxy_config(world_size)).to(device)


def copy_task_batches(seed: int, n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    blocks = [torch.randint(0, TOKENS, (BATCH, PERIOD), generator=g) for _ in range(n)]
    return [b.repeat(1, SEQ // PERIOD) for b in blocks]


def train(model, batches, steps: int, device: str, params=None) -> tuple[list[float], list[float]]:
    opt = torch.optim.AdamW(params if params is not None else model.parameters(), lr=LR)
    losses, times = [], []
    for step in range(steps):
        ids = batches[step % len(batches)].to(device)
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t)
    return losses, times


def _rank_main(rank: int, world_size: int, args: argparse.Namespace, store_path: str, result_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import kosmos
    import kosmos.parallel

    _quiet()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    device = f"cuda:{rank}" if cuda else "cpu"
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(store_path, world_size),
                            rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cuda" if cuda else "cpu", (world_size,))
        model = kosmos.parallelize(build_model(world_size, args.seed, device), mesh)
        kosmos.reset_report()
        compiled = torch.compile(model, backend="kosmos")
        # DTensor and plain parameters in separate groups: the foreach AdamW (CUDA's default) needs that
        groups = kosmos.parallel.param_groups(model)
        losses, times = train(compiled, copy_task_batches(args.seed), args.steps, device, groups)
        if rank == 0:
            torch.save({"losses": losses, "times": times, "report": str(kosmos.report()),
                        "rewrites": kosmos.report().count()}, result_path)
    finally:
        dist.destroy_process_group()
    # torch 2.13's static destructors now and then abort a finished gloo rank at interpreter exit
    # ("terminate called without an active exception"); the work is saved, so leave without them.
    multiprocessing.util._exit_function()  # multiprocessing's own exit handlers (semaphores, queues)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kosmos.demo", description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="TP ranks (default 2)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: NCCL on GPUs when there are >= 2, else gloo on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-4, help="largest allowed relative loss difference (fp32)")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "cpu"
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        p.error(f"--world-size {args.world_size} needs as many GPUs, found {torch.cuda.device_count()}")
    if args.world_size < 1 or VOCAB % args.world_size or SEQ % args.world_size:
        p.error(f"--world-size must divide {VOCAB} and the sequence length {SEQ}")
    _quiet()
    import transformers

    backend = "nccl" if args.device == "cuda" else "gloo"
    print(f"kosmos demo: Qwen3 proxy (2 layers, hidden 128), TP+SP over {args.world_size} {backend} ranks, "
          f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)

    # the unsharded eager run, here, before the ranks start
    ref_device = "cuda:0" if args.device == "cuda" else "cpu"
    t = time.perf_counter()
    ref_losses, _ = train(build_model(args.world_size, args.seed, ref_device), copy_task_batches(args.seed),
                          args.steps, ref_device)
    print(f"unsharded eager run: {time.perf_counter() - t:.1f} s", flush=True)

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="kosmos_demo_") as tmp:
        result_path = os.path.join(tmp, "rank0.pt")
        t = time.perf_counter()
        mp.spawn(_rank_main, args=(args.world_size, args, os.path.join(tmp, "store"), result_path),
                 nprocs=args.world_size, join=True)
        res = torch.load(result_path, weights_only=False)
    print(f"TP+SP run with backend='kosmos' (compile included): {time.perf_counter() - t:.1f} s\n")
    print("what kosmos rewrote (forward and backward graphs of rank 0):")
    print(res["report"])
    print()
    print(f"{'step':>4}  {'kosmos TP+SP loss':>18}  {'eager unsharded':>16}  {'rel diff':>9}  {'step time':>9}")
    worst = 0.0
    for i, (a, b, dt) in enumerate(zip(res["losses"], ref_losses, res["times"])):
        rel = abs(a - b) / max(abs(b), 1e-30)
        worst = max(worst, rel)
        print(f"{i + 1:>4}  {a:>18.6f}  {b:>16.6f}  {rel:>9.2e}  {dt:>8.2f}s")
    ok = worst <= args.tol and res["rewrites"] > 0
    verdict = "OK" if ok else "FAILED"
    why = "" if res["rewrites"] > 0 else " (kosmos rewrote nothing)"
    print(f"\n{verdict}: max relative loss difference {worst:.2e} (tolerance {args.tol:.0e}), "
          f"loss {res['losses'][0]:.3f} -> {res['losses'][-1]:.3f}, kosmos rewrites: {res['rewrites']}{why}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
