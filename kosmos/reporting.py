"""What kosmos did to a model: rewrites and candidates left alone (pass time), which impl ran (run time), and the
graph breaks Dynamo counted meanwhile (code that ran eagerly, which no kosmos pass saw)."""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Optional

log = logging.getLogger("kosmos")


@dataclasses.dataclass
class PassRecord:
    """One candidate subgraph a pass looked at."""

    kind: str  # "ag_gemm", "gemm_rs", "all_reduce", "moe_layer", ...
    graph: str  # "forward", "backward", "inference" or "pre-grad"
    rewritten: bool
    reason: str  # why it was left alone, or what the rewrite covers
    nodes: tuple[str, ...] = ()  # graph nodes the candidate consisted of
    shapes: dict = dataclasses.field(default_factory=dict)
    impl: Optional[str] = None  # "fused" or "reference", for rewrites
    impl_reason: str = ""

    def line(self) -> str:
        status = "rewritten" if self.rewritten else "left alone"
        shapes = " ".join(f"{k}={v}" for k, v in self.shapes.items())
        impl = f" -> {self.impl} ({self.impl_reason})" if self.impl else ""
        return f"[{self.graph}] {self.kind}: {status}: {self.reason}{impl} {shapes}".rstrip()


@dataclasses.dataclass
class Report:
    """Snapshot of everything recorded since the last `reset()`."""

    records: list[PassRecord]
    runtime: dict  # (op, impl, reason) -> calls
    workspaces: dict = dataclasses.field(default_factory=dict)  # name -> {"bytes": n, "uses": {kernel: formula}}
    graph_breaks: dict = dataclasses.field(default_factory=dict)  # Dynamo's message -> count since reset()

    @property
    def rewrites(self) -> list[PassRecord]:
        return [r for r in self.records if r.rewritten]

    @property
    def left_alone(self) -> list[PassRecord]:
        return [r for r in self.records if not r.rewritten]

    def count(self, kind: Optional[str] = None, graph: Optional[str] = None) -> int:
        return sum(1 for r in self.rewrites if kind in (None, r.kind) and graph in (None, r.graph))

    def __str__(self) -> str:
        lines = [f"kosmos: {len(self.rewrites)} rewritten, {len(self.left_alone)} left alone"]
        lines += ["  " + r.line() for r in self.records]
        for (op, impl, reason), n in sorted(self.runtime.items()):
            lines.append(f"  run: {op} -> {impl} x{n} ({reason})")
        for name, w in sorted(self.workspaces.items()):
            lines.append(f"  workspace {name}: {w['bytes']} bytes per GPU")
            lines += [f"    {user}: {text}" for user, text in sorted(w["uses"].items())]
        if self.graph_breaks:
            lines.append("  graph breaks Dynamo counted (what they cut out ran eagerly, unseen by kosmos):")
            lines += [f"    x{n}: {_summary(msg)}" for msg, n in sorted(self.graph_breaks.items())]
        return "\n".join(lines)


def _summary(msg: str) -> str:
    """Dynamo's first line, plus its hint and debug context (they name the cause and the way around it)."""
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    keep = [ln for ln in lines[1:] if ln.startswith(("Hint:", "Developer debug context:"))]
    return " | ".join(lines[:1] + keep)


_lock = threading.Lock()
_records: list[PassRecord] = []
_runtime: collections.Counter = collections.Counter()
_breaks_at_reset: dict = {}  # Dynamo's graph-break counters when reset() ran: report() shows what came since


def dynamo_graph_breaks() -> dict:
    """Dynamo's graph-break counters of this process (all frames, any backend): message -> count."""
    from torch._dynamo.utils import counters

    return dict(counters.get("graph_break", {}))


def record(rec: PassRecord) -> None:
    with _lock:
        _records.append(rec)
    (log.info if rec.rewritten else log.debug)("%s", rec.line())


def record_run(op: str, impl: str, reason: str) -> None:
    key = (op, impl, reason)
    with _lock:
        first = key not in _runtime
        _runtime[key] += 1
    if first and impl != "fused":
        log.info("kosmos::%s runs the %s impl: %s", op, impl, reason)


def report() -> Report:
    from kosmos.kernels.runtime import workspace_report  # torch only: no Triton import

    breaks = {m: n - _breaks_at_reset.get(m, 0) for m, n in dynamo_graph_breaks().items()}
    with _lock:
        return Report(list(_records), dict(_runtime), workspace_report(), {m: n for m, n in breaks.items() if n > 0})


def reset() -> None:
    global _breaks_at_reset
    with _lock:
        _records.clear()
        _runtime.clear()
        _breaks_at_reset = dynamo_graph_breaks()
