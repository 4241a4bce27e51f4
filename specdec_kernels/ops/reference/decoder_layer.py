"""Plain-torch reference of `decoder_layer`: one Llama-family decoder layer's tree step, as
transformers' modules compute it (RMSNorm, q/k/v projections, optional per-head q/k norms,
rotary embedding, tree attention over a dense cache, o projection, residual, SiLU MLP)."""

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .rms_norm import rms_norm as _rms_norm
from .tree_attention import tree_attention


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb, x * cos + rotate_half(x) * sin, on x [B, T, H, D]
    with cos/sin [B, T, 1, D]: element for element the same as in transformers' [B, H, T, D]
    layout (so the lean forward using it stays bit-identical to the model's own)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def decoder_layer(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  weights: Sequence[Optional[torch.Tensor]], k_cache: torch.Tensor, v_cache: torch.Tensor,
                  tree_mask: torch.Tensor, cache_seqlens: torch.Tensor, scale: float, eps: float) -> torch.Tensor:
    """See `specdec_kernels.ops.decoder_layer.decoder_layer` (writes the caches, returns the new hidden)."""
    (input_norm, q_w, q_b, k_w, k_b, v_w, v_b, q_norm, k_norm, o_w, o_b, post_norm,
     gate_w, up_w, down_w) = weights
    batch, num_nodes, _ = hidden.shape
    head_dim = k_cache.shape[3]
    x = _rms_norm(hidden, input_norm, eps)
    q = F.linear(x, q_w, q_b).view(batch, num_nodes, -1, head_dim)
    k = F.linear(x, k_w, k_b).view(batch, num_nodes, -1, head_dim)
    v = F.linear(x, v_w, v_b).view(batch, num_nodes, -1, head_dim)
    if q_norm is not None:
        q = _rms_norm(q, q_norm, eps)
    if k_norm is not None:
        k = _rms_norm(k, k_norm, eps)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    slots = cache_seqlens.long()[:, None] + torch.arange(num_nodes, device=hidden.device)
    rows = torch.arange(batch, device=hidden.device)[:, None]
    k_cache[rows, slots] = k
    v_cache[rows, slots] = v
    out = tree_attention(q, k_cache, v_cache, tree_mask, cache_seqlens, scale)
    h = hidden + F.linear(out.reshape(batch, num_nodes, -1), o_w, o_b)
    y = _rms_norm(h, post_norm, eps)
    return h + F.linear(F.silu(F.linear(y, gate_w)) * F.linear(y, up_w), down_w)
