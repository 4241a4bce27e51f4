"""Tree attention: T tree queries attend to the whole cached prefix and to their ancestors."""

from typing import Optional

import torch

from . import _checks
from ._extension import run


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tree_mask: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    block_table: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Attention of a token tree's queries over a KV cache holding the prefix and the tree.

    Args:
        q: [B, T, Hq, D] queries of the T tree nodes (fp32 / bf16 / fp16).
        k_cache, v_cache: [B, S, Hkv, D], Hq % Hkv == 0, same dtype as q. Any strides with a
            contiguous last dim (HF's [B, H, S, D] caches pass as `.transpose(1, 2)` views).
            The tree's keys/values are already written at cache_seqlens[b] + j, j < T.
        tree_mask: bool [B, T, T] or [T, T] (`tree_mask(parents)`), or packed int64
            [B, T, ceil(T/64)] / [T, ceil(T/64)] (`pack_tree_mask`).
        cache_seqlens: int32 [B], the prefix length of each row; cache_seqlens[b] + T <= S.
        block_table: int32 [B, P] for paged caches (None: dense caches). Then k_cache and
            v_cache are pools of pages [num_pages, page_size, Hkv, D] (any page size >= 1) and
            token s of row b is at [block_table[b, s // page_size], s % page_size]; pages in any
            order, shared between rows for reading. Row b uses its first
            ceil((cache_seqlens[b] + T) / page_size) entries (page ids in [0, num_pages)); the
            rest are padding, never read. Same result as the dense op on the gathered cache.
        scale: softmax scale, default D ** -0.5.
        backend: force an implementation ("reference", "cuda", "triton"); None picks the best.

    Returns:
        [B, T, Hq, D] in q's dtype: query i of row b attends to keys 0 .. cache_seqlens[b]-1
        and to tree key j iff tree_mask[b, i, j].
    """
    if block_table is not None:
        from . import _paged

        return _paged.tree_attention(q, k_cache, v_cache, tree_mask, cache_seqlens, block_table, scale, backend)
    _checks.tensor("q", q, dims=4, dtypes=_checks.FLOAT_DTYPES)
    _checks.tensor("k_cache", k_cache, dims=4, dtypes=(q.dtype,))
    _checks.tensor("v_cache", v_cache, dims=4, dtypes=(q.dtype,))
    _checks.tensor("cache_seqlens", cache_seqlens, dims=1, dtypes=(torch.int32,))
    _checks.tensor("tree_mask", tree_mask, dims=(2, 3), dtypes=(torch.bool, torch.int64))
    _checks.nonempty_batch("q", q)
    batch, num_nodes, num_q_heads, head_dim = q.shape
    if num_nodes == 0:
        _checks.fail("q", f"expected T >= 1 tree nodes, got shape {tuple(q.shape)}")
    _checks.shape("k_cache", k_cache, (batch, None, None, head_dim))
    _checks.shape("v_cache", v_cache, tuple(k_cache.shape))
    num_kv_heads = k_cache.shape[2]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        _checks.fail("k_cache", f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    _checks.shape("cache_seqlens", cache_seqlens, (batch,))
    mask_cols = num_nodes if tree_mask.dtype == torch.bool else (num_nodes + 63) // 64
    mask = tree_mask if tree_mask.dim() == 3 else tree_mask.unsqueeze(0).expand(batch, -1, -1)
    _checks.shape("tree_mask", mask, (batch, num_nodes, mask_cols))
    _checks.same_device("q", q, k_cache=k_cache, v_cache=v_cache, tree_mask=tree_mask, cache_seqlens=cache_seqlens)
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _checks.last_dim_contiguous(name, x)
    if _checks.checking_values():
        cache_len = k_cache.shape[1]
        bad = (cache_seqlens < 0) | (cache_seqlens + num_nodes > cache_len)
        if bad.any():
            b = int(torch.nonzero(bad)[0, 0])
            _checks.fail(
                "cache_seqlens",
                f"row {b}: prefix {int(cache_seqlens[b])} + T={num_nodes} tree entries must fit in the cache (S={cache_len})",
            )
    if scale is None:
        scale = head_dim ** -0.5
    return run("tree_attention", backend, q.device, q, k_cache, v_cache, mask, cache_seqlens, float(scale))
