"""Spawns gloo process groups on this machine for multi-process tests."""
from __future__ import annotations

import os
import tempfile
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world_size, init_file, fn, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def run_gloo(fn, world_size: int, *args) -> None:
    """Runs fn(rank, world_size, *args) in `world_size` gloo processes; raises if any rank fails."""
    with tempfile.TemporaryDirectory() as d:
        # a private Inductor cache (inherited by the ranks): runs beside this one must not race on its files
        old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(d, "inductor")
        try:
            mp.start_processes(_entry, args=(world_size, os.path.join(d, "init"), fn, args), nprocs=world_size, start_method="spawn")
        finally:
            if old is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = old
