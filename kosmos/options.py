"""Backend settings, passed as torch.compile(..., backend="kosmos", options={...})."""
from __future__ import annotations

import dataclasses
import json
from typing import Optional


@dataclasses.dataclass(frozen=True)
class KosmosOptions:
    tp_sp: bool = True  # fuse all-gather -> matmul and matmul -> reduce-scatter
    moe: bool = True  # fuse whole MoE blocks (pre-grad)
    move_cast_before_gather: bool = True  # gather bf16 instead of fp32 when the matmul casts anyway
    aten_embedding_backward: bool = True  # F.embedding -> kosmos::embedding: no fp32 [V, H] buffer in its backward
    inductor_config: dict = dataclasses.field(default_factory=dict)  # passed to Inductor as config_patches

    @classmethod
    def from_dict(cls, options: Optional[dict]) -> "KosmosOptions":
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown kosmos options {unknown}; known: {sorted(known)}")
        return cls(**options)

    def key(self) -> str:
        """Stable text of the settings that change what the passes produce (for the FX graph cache key)."""
        d = dataclasses.asdict(self)
        d["inductor_config"] = sorted(d["inductor_config"])
        return json.dumps(d, sort_keys=True, default=str)
