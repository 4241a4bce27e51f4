"""RMSNorm on the CPU in one op (`torch.ops.specdec.rms_norm`).

The learned heads draft a few rows per forward, and on a CPU such a forward is mostly the
torch ops around its products: transformers' RMSNorm alone is ~8 of them (upcast, square,
mean, add, rsqrt, product, downcast, weight), ~60 us a call inside the decode loop on the
2-core machine. This op is one (`csrc/rms_norm.cpp`, the decoder layer's own RMSNorm): it rounds
where transformers' module rounds (the normalised row to x's dtype, then the product with the
weight) and equals it up to the order of the sum of squares (python_tests/test_rms_norm.py).
"""

from typing import Optional

import torch

from . import reference
from ._extension import _C


def has_kernel() -> bool:
    """Whether the compiled `specdec::rms_norm` CPU kernel is loaded."""
    return _C is not None and hasattr(torch.ops.specdec, "rms_norm")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: Optional[str] = None) -> torch.Tensor:
    """Llama's RMSNorm of x over its last dim: weight * round(x * rsqrt(mean(x^2) + eps)), the
    mean and the product in fp32, rounded to x's dtype before the weight (as transformers'
    `LlamaRMSNorm` computes it).

    Args:
        x: [..., D] fp32 or bf16 CPU tensor.
        weight: x's dtype, the shape of x's trailing dims ([D], or [G, D] for x [..., G, D]:
            row g of the weight normalises x[..., g, :]; several norms of one eps in one call).
        eps: added to the mean square (>= 0).
        backend: None or "cpu" (the compiled kernel), or "reference" (plain torch).

    Returns:
        A new contiguous tensor of x's shape and dtype.
    """
    if backend == "reference":
        return reference.rms_norm(x, weight, eps)
    if backend not in (None, "cpu"):
        raise ValueError(f"backend: expected None, 'cpu' or 'reference', got {backend!r}")
    if not has_kernel():
        raise RuntimeError("rms_norm: the compiled extension specdec_kernels._C lacks this op (rebuild it)")
    return torch.ops.specdec.rms_norm(x, weight, float(eps))
