"""One Llama-family decoder layer's tree step on a CPU, in one op (`torch.ops.specdec.decoder_layer`).

A decode step of a small model on a CPU spends, after reading the weights, most of its time
between the kernels: transformers' eager forward runs ~65 torch ops per layer from Python, and
even `loop/hf/lean.py`'s lean forward runs ~30. On the default model (30 layers, 2 threads) that
was ~10 ms of a ~32 ms step, which llama.cpp does not pay. This op runs a whole layer from C++
(`csrc/decoder_layer.cpp`): its element-wise steps (`csrc/include/specdec/decoder_layer.h`)
round where transformers' modules round (bf16: after each product and sum, as torch does) and
its SiLU is torch's own; the products are `small_linear`'s kernel (the q/k/v products in one
parallel region, gate/up in another); the attention is `tree_attention`'s CPU kernel. So it
equals the lean forward's layer with every linear routed to `small_linear` up to the order of
RMSNorm's sum of squares (python_tests/test_lean_forward.py), and agrees with the plain-torch
reference (`F.linear`, another summation order) to rounding (python_tests/test_decoder_layer.py).
"""

from typing import Optional, Sequence

import torch

from . import reference
from ._extension import _C

# The order of `weights`: None where a layer has no such parameter (only the biases and the
# per-head q/k norms may be None).
WEIGHT_NAMES = ("input_norm", "q_proj", "q_bias", "k_proj", "k_bias", "v_proj", "v_bias", "q_norm", "k_norm",
                "o_proj", "o_bias", "post_norm", "gate_proj", "up_proj", "down_proj")


def has_kernel() -> bool:
    """Whether the compiled `specdec::decoder_layer` CPU kernel is loaded."""
    return _C is not None and hasattr(torch.ops.specdec, "decoder_layer")


def decoder_layer(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  weights: Sequence[Optional[torch.Tensor]], k_cache: torch.Tensor, v_cache: torch.Tensor,
                  tree_mask: torch.Tensor, cache_seqlens: torch.Tensor, *, scale: float, eps: float,
                  blas_rows: int = 0, backend: Optional[str] = None) -> torch.Tensor:
    """One decoder layer of a Llama-family model (Llama, Mistral without sliding windows, Qwen2,
    Qwen3) over a token tree: writes the tree's keys and values into the caches and returns the
    layer's output hidden states.

    Args:
        hidden: [B, T, hidden] the layer's input (the residual stream), fp32 or bf16, contiguous, CPU.
        cos, sin: [B, T, D] the rotary embedding of each node's position (the model's rotary module).
        weights: 15 tensors in `WEIGHT_NAMES` order, hidden's dtype, contiguous: the RMSNorm
            weights [hidden], q/k/v/o projection weights ([Hq * D, hidden], [Hkv * D, hidden] x 2,
            [hidden, Hq * D]) with optional biases, optional per-head q/k RMSNorm weights [D]
            (Qwen3), the post-attention RMSNorm and the SiLU MLP's gate/up [I, hidden] and down
            [hidden, I] weights.
        k_cache, v_cache: dense [B, S, Hkv, D] caches, contiguous; the tree's keys and values
            are written at slots cache_seqlens[b] + j (j < T), which must fit (<= S).
        tree_mask: bool [B, T, T] / [T, T], or packed int64 (`tree_attention`'s forms).
        cache_seqlens: int32 [B], each row's prefix length.
        scale: the attention's softmax scale; eps: every RMSNorm's epsilon.
        blas_rows: the products of B x T >= blas_rows rows run on torch's BLAS (`torch.mm`:
            oneDNN / MKL, AMX for bf16 where the CPU has it) instead of `small_linear`'s kernel;
            0 (default): never. Callers pass where they measured torch's faster
            (`small_linear.choose_small_linear_rows`). The reference ignores it.
        backend: None or "cpu" (the compiled kernel), or "reference" (plain torch).

    Returns:
        [B, T, hidden]: hidden + attention + MLP, as transformers' decoder layer computes it.
    """
    if len(weights) != len(WEIGHT_NAMES):
        raise ValueError(f"weights: expected {len(WEIGHT_NAMES)} entries ({', '.join(WEIGHT_NAMES)}), got {len(weights)}")
    if backend == "reference":
        return reference.decoder_layer(hidden, cos, sin, weights, k_cache, v_cache, tree_mask, cache_seqlens,
                                       scale, eps)
    if backend not in (None, "cpu"):
        raise ValueError(f"backend: expected None, 'cpu' or 'reference', got {backend!r}")
    if not has_kernel():
        raise RuntimeError("decoder_layer: the compiled extension specdec_kernels._C lacks this op (rebuild it)")
    if blas_rows < 0:
        raise ValueError(f"blas_rows: expected >= 0 (0: never), got {blas_rows}")
    return torch.ops.specdec.decoder_layer(hidden, cos, sin, list(weights), k_cache, v_cache, tree_mask,
                                           cache_seqlens, float(scale), float(eps), int(blas_rows))
