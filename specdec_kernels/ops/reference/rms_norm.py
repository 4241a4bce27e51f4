"""Plain-torch reference of `rms_norm`: Llama's RMSNorm as transformers computes it."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See `specdec_kernels.ops.rms_norm.rms_norm`: the row in fp32, normalised, rounded to x's
    dtype, times the weight (broadcast over x's leading dims)."""
    xf = x.to(torch.float32)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
