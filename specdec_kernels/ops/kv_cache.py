"""KV-cache compaction: keep the accepted path's keys/values, contiguous after the prefix."""

from typing import Optional, Sequence

import torch

from . import _checks
from ._extension import dispatch


def compact_kv_cache_(
    caches: Sequence[torch.Tensor],
    cache_seqlens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
    *,
    block_table: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """In place, move each row's accepted tree entries right after its prefix, in every cache.

    Args:
        caches: [B, S, H, D] tensors (all layers' keys and values; any strides with a
            contiguous last dim). The tree's entries sit at cache_seqlens[b] + node.
        cache_seqlens: int32/int64 [B], prefix lengths, 0 <= cache_seqlens[b] < S.
        accepted_nodes: int [B, W], the accepted path (`VerifyOutput.accepted_nodes`): it
            starts at node 0 and strictly increases; node ids are bounded by the cache
            (cache_seqlens[b] + node < S), not by W, so a narrower tensor holding the path
            is fine. Entries past the path are ignored.
        num_accepted: int [B] in [0, W) (`VerifyOutput.num_accepted`).
        block_table: int32 [B, P] for paged caches (None: dense caches). Then every cache is
            a pool of pages [num_pages, page_size, H, D] (one page size for all) and token s of
            row b is at [block_table[b, s // page_size], s % page_size]. Rows may share pages
            for reading, but the slots of each row's tree must be its own (checked).
        backend: force an implementation ("reference", "cpu", "cuda"); None picks the best.

    Returns:
        The new lengths cache_seqlens + num_accepted + 1 (root and accepted drafts), in
        cache_seqlens' dtype. Entry cache_seqlens[b] + accepted_nodes[b, j] moved to
        cache_seqlens[b] + j for j <= num_accepted[b]; all in one launch per call. With value
        checks on, a path that breaks these rules gets a ValueError naming the argument.
    """
    if block_table is not None:
        from . import paged

        return paged.compact_kv_cache_(caches, cache_seqlens, accepted_nodes, num_accepted, block_table, backend)
    args = _checks.compact_kv_cache_(caches, cache_seqlens, accepted_nodes, num_accepted)
    new_lens = dispatch("compact_kv_cache_", backend, cache_seqlens, *args)
    return new_lens if new_lens.dtype == cache_seqlens.dtype else new_lens.to(cache_seqlens.dtype)
