"""Tree attention over paged KV caches in Triton: the split-KV kernel of tree_attention.py
with its PAGED path (key and value rows found through the block table)."""

from .tree_attention import interpreted, tree_attention

__all__ = ["interpreted", "tree_attention_paged"]


def tree_attention_paged(q, k_cache, v_cache, tree_mask, cache_seqlens, block_table, scale: float, window: int = 0,
                         softcap: float = 0.0, *, num_splits=None):
    """Same normalised arguments and result as `specdec_kernels.ops.reference.tree_attention_paged`:
    k/v_cache [num_pages, page_size, Hkv, D], block_table int32 [B, P] (validated by the
    caller). `num_splits` overrides the split heuristic (tests)."""
    return tree_attention(q, k_cache, v_cache, tree_mask, cache_seqlens, scale, window, softcap, num_splits=num_splits,
                          block_table=block_table)
