"""KV-cache compaction: keep the accepted path's keys/values, contiguous after the prefix."""

from typing import Optional, Sequence

import torch

from . import _checks
from ._extension import run


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
        cache_seqlens: int32/int64 [B], prefix lengths; cache_seqlens[b] + T <= S.
        accepted_nodes: int [B, T], the accepted path (`VerifyOutput.accepted_nodes`).
        num_accepted: int [B] (`VerifyOutput.num_accepted`).
        block_table: int32 [B, P] for paged caches (None: dense caches). Then every cache is
            a pool of pages [num_pages, page_size, H, D] (one page size for all) and token s of
            row b is at [block_table[b, s // page_size], s % page_size]. Rows may share pages
            for reading, but the slots of each row's tree must be its own (checked).
        backend: force an implementation ("reference", "cpu", "cuda"); None picks the best.

    Returns:
        The new lengths cache_seqlens + num_accepted + 1 (root and accepted drafts), in
        cache_seqlens' dtype. Entry cache_seqlens[b] + accepted_nodes[b, j] moved to
        cache_seqlens[b] + j for j <= num_accepted[b]; all in one launch per call.
    """
    if block_table is not None:
        from . import _paged

        return _paged.compact_kv_cache_(caches, cache_seqlens, accepted_nodes, num_accepted, block_table, backend)
    caches = list(caches)
    if not caches:
        _checks.fail("caches", "expected at least one [B, S, H, D] cache tensor")
    _checks.tensor("cache_seqlens", cache_seqlens, dims=1, dtypes=_checks.INT_DTYPES)
    _checks.tensor("accepted_nodes", accepted_nodes, dims=2, dtypes=_checks.INT_DTYPES)
    _checks.tensor("num_accepted", num_accepted, dims=1, dtypes=_checks.INT_DTYPES)
    _checks.nonempty_batch("cache_seqlens", cache_seqlens)
    batch, num_nodes = accepted_nodes.shape
    _checks.shape("cache_seqlens", cache_seqlens, (batch,))
    _checks.shape("num_accepted", num_accepted, (batch,))
    for i, cache in enumerate(caches):
        _checks.tensor(f"caches[{i}]", cache, dims=4, dtypes=_checks.FLOAT_DTYPES)
        _checks.shape(f"caches[{i}]", cache, (batch, None, None, None))
        _checks.last_dim_contiguous(f"caches[{i}]", cache)
        _checks.same_device("cache_seqlens", cache_seqlens, **{f"caches[{i}]": cache})
    _checks.same_device("cache_seqlens", cache_seqlens, accepted_nodes=accepted_nodes, num_accepted=num_accepted)
    if _checks.checking_values():
        min_len = min(cache.shape[1] for cache in caches)
        if ((cache_seqlens < 0) | (cache_seqlens + num_nodes > min_len)).any():
            _checks.fail("cache_seqlens", f"expected 0 <= cache_seqlens and cache_seqlens + T ({num_nodes}) <= S ({min_len})")
        if ((num_accepted < 0) | (num_accepted >= num_nodes)).any():
            _checks.fail("num_accepted", f"expected values in [0, T) = [0, {num_nodes})")
        on_path = torch.arange(num_nodes, device=accepted_nodes.device)[None, :] <= num_accepted[:, None]
        if (on_path & ((accepted_nodes < 0) | (accepted_nodes >= num_nodes))).any():
            _checks.fail("accepted_nodes", f"entries on the accepted path must be node ids in [0, {num_nodes})")
    new_lens = run(
        "compact_kv_cache_",
        backend,
        cache_seqlens.device,
        caches,
        cache_seqlens.to(torch.int32),
        accepted_nodes.to(torch.int32),
        num_accepted.to(torch.int32),
    )
    return new_lens.to(cache_seqlens.dtype)
