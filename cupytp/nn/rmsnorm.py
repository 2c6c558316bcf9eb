"""RMSNorm: Llama's normalization, x / sqrt(mean(x²) + eps) · weight over the last dimension."""
from cupytp import ops
from cupytp.nn.module import Module
from cupytp.tensor import Replicated, ones
from cupytp.tensor.factory import local_mesh


class RMSNorm(Module):
    """RMS normalization over the last dimension (never sharded); weight `[C]` Replicated on
    every mesh dimension (its gradient is a column sum, Partial where the rows are sharded and
    reduced when it is accumulated)."""

    def __init__(self, dim, mesh=None, eps=1e-6, dtype="fp32"):
        super().__init__()
        mesh = local_mesh() if mesh is None else mesh
        self.eps = eps
        self.weight = ones((dim,), mesh, (Replicated(),) * mesh.ndim, dtype=dtype,
                           requires_grad=True)

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)

    def parallel_layout(self, style):
        return {"replicate": (Replicated(),)}[style]


def norm_arguments(norm):
    """An ops.rms_norm's (weight, eps) of an RMSNorm module (a fused sublayer's `norm`), or
    None."""
    return None if norm is None else (norm.weight, norm.eps)
