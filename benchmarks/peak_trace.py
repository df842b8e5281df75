"""What is allocated at a CUDA step's memory peak, by source line: the caching allocator's history over one call,
replayed to the moment the live total peaks, the live blocks grouped by their first frames in kosmos, Inductor's
generated code or transformers (benchmarks/model_step.py --peak-trace)."""
from __future__ import annotations

import collections

import torch

_SOURCES = ("kosmos/", "torchinductor", "icache", "transformers/", "output_code")


def _source(frames: list, depth: int = 2) -> str:
    """The first `depth` frames from the sources above ("file:line:function <- ..."), or the innermost frame."""
    keep = [f"{f['filename'].split('/')[-1]}:{f.get('line')}:{f.get('name')}" for f in frames
            if any(s in f.get("filename", "") for s in _SOURCES)][:depth]
    if keep:
        return " <- ".join(keep)
    return f"{frames[0].get('filename', '?').split('/')[-1]}:{frames[0].get('name', '?')}" if frames else "?"


def live_at_peak(fn, top: int = 12) -> tuple[int, list, str]:
    """Runs fn() once with the allocator's history recorded -> (peak bytes above the live total before the call,
    [(bytes, blocks, source)] of the blocks live at the peak, largest first, and the source of the allocation that
    reached the peak)."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=500000)
    try:
        fn()
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live, total, best, at_peak, peak_event = {}, 0, 0, {}, None
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
            total += event["size"]
            if total > best:
                best, at_peak, peak_event = total, dict(live), event
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    sizes, blocks = collections.Counter(), collections.Counter()
    for size, frames in at_peak.values():
        key = _source(frames)
        sizes[key] += size
        blocks[key] += 1
    rows = [(size, blocks[key], key) for key, size in sizes.most_common(top)]
    return best, rows, _source(peak_event.get("frames", [])) if peak_event else "?"
