"""The paged-cache paths of `tree_attention` and `compact_kv_cache_` (block_table given).

A paged cache is one pool of pages [num_pages, page_size, H, D] (the NHD page layout of
vLLM / FlashInfer), and block_table int32 [B, P] lists each row's pages in order: token s of
row b lives at [block_table[b, s // page_size], s % page_size]. Pages may come in any order
and rows may share pages for reading (a common prefix). The public functions validate here
and run the ops `tree_attention_paged` / `compact_kv_cache_paged_`, which compute exactly
what the dense ops compute on the gathered logical cache.
"""

from typing import Optional

import torch

from . import _checks
from ._extension import dispatch


def tree_attention(q, k_cache, v_cache, tree_mask, cache_seqlens, block_table, scale: Optional[float], backend,
                   window=None, softcap=None):
    """`specdec_kernels.ops.tree_attention` with block_table (see its docstring).

    Like `_checks.tree_attention`, the common case costs plain comparisons: each helper that
    builds a message runs only once its rule is broken (on a small CPU call the checks are
    otherwise a large share of the time).
    """
    _checks.tensor("q", q, 4, _checks.FLOAT_DTYPES)
    dtype = (q.dtype,)
    _checks.tensor("k_cache", k_cache, 4, dtype)
    _checks.tensor("v_cache", v_cache, 4, dtype)
    _checks.tensor("cache_seqlens", cache_seqlens, 1, _checks.INT_DTYPES)
    _checks.tensor("tree_mask", tree_mask, (2, 3), (torch.bool, torch.int64))
    _checks.nonempty_batch("q", q)
    batch, num_nodes, num_q_heads, head_dim = q.shape
    if num_nodes == 0:
        _checks.fail("q", f"expected T >= 1 tree nodes, got shape {tuple(q.shape)}")
    # [num_pages, page_size, Hkv, D]
    k_shape = k_cache.shape
    if k_shape[3] != head_dim:
        _checks.shape("k_cache", k_cache, (None, None, None, head_dim))
    if v_cache.shape[:3] != k_shape[:3]:
        _checks.shape("v_cache", v_cache, tuple(k_shape[:3]) + (None,))
    num_pages, page_size, num_kv_heads = k_shape[:3]
    if num_pages == 0 or page_size == 0:
        _checks.fail("k_cache", f"expected a [num_pages, page_size, Hkv, D] pool with pages of >= 1 slot, got {tuple(k_shape)}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        _checks.fail("k_cache", f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if cache_seqlens.shape[0] != batch:
        _checks.shape("cache_seqlens", cache_seqlens, (batch,))
    mask_cols = num_nodes if tree_mask.dtype == torch.bool else (num_nodes + 63) // 64
    mask = tree_mask if tree_mask.dim() == 3 else tree_mask.unsqueeze(0).expand(batch, -1, -1)
    if mask.shape != (batch, num_nodes, mask_cols):
        _checks.shape("tree_mask", mask, (batch, num_nodes, mask_cols))
    if not _checks._all_on(q.device, k_cache, v_cache, tree_mask, cache_seqlens):
        _checks.same_device("q", q, k_cache=k_cache, v_cache=v_cache, tree_mask=tree_mask, cache_seqlens=cache_seqlens)
    if not (type(block_table) is torch.Tensor and block_table.dtype == torch.int32 and block_table.dim() == 2
            and block_table.shape[0] == batch and block_table.shape[1] > 0 and block_table.device == q.device):
        _checks.block_table(block_table, batch=batch, device=q.device, like="q")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _checks.last_dim_contiguous(name, x)
    if _checks.checking_values():
        if (cache_seqlens < 0).any():
            b = int(torch.nonzero(cache_seqlens < 0)[0, 0])
            _checks.fail("cache_seqlens", f"row {b}: prefix length {int(cache_seqlens[b])} is negative")
        _checks.block_table_pages(block_table, cache_seqlens.to(torch.int64) + num_nodes, page_size, num_pages,
                                  what=f"cache_seqlens[b] + T (T={num_nodes})")
    scale = head_dim**-0.5 if scale is None else float(scale)
    return dispatch("tree_attention_paged", backend, q, q, k_cache, v_cache, mask,
                    _checks.as_dtype(cache_seqlens, torch.int32), block_table, scale,
                    *_checks.window_softcap(window, softcap))


def compact_kv_cache_(caches, cache_seqlens, accepted_nodes, num_accepted, block_table, backend) -> torch.Tensor:
    """`specdec_kernels.compact_kv_cache_` with block_table (see its docstring)."""
    caches = list(caches)
    if not caches:
        _checks.fail("caches", "expected at least one [num_pages, page_size, H, D] cache tensor")
    _checks.tensor("cache_seqlens", cache_seqlens, dims=1, dtypes=_checks.INT_DTYPES)
    _checks.tensor("accepted_nodes", accepted_nodes, dims=2, dtypes=_checks.INT_DTYPES)
    _checks.tensor("num_accepted", num_accepted, dims=1, dtypes=_checks.INT_DTYPES)
    _checks.nonempty_batch("cache_seqlens", cache_seqlens)
    batch, num_nodes = accepted_nodes.shape
    _checks.shape("cache_seqlens", cache_seqlens, (batch,))
    _checks.shape("num_accepted", num_accepted, (batch,))
    page_size = None
    for i, cache in enumerate(caches):
        name = f"caches[{i}]"
        _checks.tensor(name, cache, dims=4, dtypes=_checks.FLOAT_DTYPES)
        if cache.shape[0] == 0 or cache.shape[1] == 0:
            _checks.fail(name, f"expected a [num_pages, page_size, H, D] pool with pages of >= 1 slot, got {tuple(cache.shape)}")
        if page_size is None:
            page_size = cache.shape[1]
        elif cache.shape[1] != page_size:
            # One block table addresses every cache, so they share the page size.
            _checks.fail(name, f"every cache shares the block table, so its page size; expected {page_size}, got {tuple(cache.shape)}")
        _checks.last_dim_contiguous(name, cache)
        _checks.same_device("cache_seqlens", cache_seqlens, **{name: cache})
    _checks.same_device("cache_seqlens", cache_seqlens, accepted_nodes=accepted_nodes, num_accepted=num_accepted)
    _checks.block_table(block_table, batch=batch, device=cache_seqlens.device, like="cache_seqlens")
    if _checks.checking_values():
        if (cache_seqlens < 0).any():
            _checks.fail("cache_seqlens", "expected 0 <= cache_seqlens")
        if ((num_accepted < 0) | (num_accepted >= num_nodes)).any():
            _checks.fail("num_accepted", f"expected values in [0, T) = [0, {num_nodes})")
        on_path = torch.arange(num_nodes, device=accepted_nodes.device)[None, :] <= num_accepted[:, None]
        if (on_path & ((accepted_nodes < 0) | (accepted_nodes >= num_nodes))).any():
            _checks.fail("accepted_nodes", f"entries on the accepted path must be node ids in [0, {num_nodes})")
        _checks.accepted_path_order(accepted_nodes, num_accepted)
        num_pages = min(cache.shape[0] for cache in caches)
        _checks.block_table_pages(block_table, cache_seqlens.to(torch.int64) + num_nodes, page_size, num_pages,
                                  what=f"cache_seqlens[b] + T (T={num_nodes})")
        _checks.block_table_writes_exclusive(block_table, cache_seqlens, num_nodes, page_size)
    new_lens = dispatch(
        "compact_kv_cache_paged_",
        backend,
        cache_seqlens,
        caches,
        cache_seqlens.to(torch.int32),
        accepted_nodes.to(torch.int32),
        num_accepted.to(torch.int32),
        block_table,
    )
    return new_lens.to(cache_seqlens.dtype)
