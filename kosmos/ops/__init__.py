"""kosmos ops: the contract between graph passes and kernels (schemas, fake and reference impls)."""
from kosmos.ops.tp import ag_gemm, gemm_rs  # noqa: F401  (registers torch.ops.kosmos.*)
from kosmos.ops import moe  # noqa: F401  (registers torch.ops.kosmos.moe_layer, moe_experts and their backward ops)
from kosmos.ops import embedding  # noqa: F401  (registers torch.ops.kosmos.embedding and its backward op)
