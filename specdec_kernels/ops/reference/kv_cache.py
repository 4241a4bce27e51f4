"""Reference KV-cache compaction after verification."""

import torch


def compact_kv_cache_(caches, cache_seqlens, accepted_nodes, num_accepted) -> torch.Tensor:
    """Move the accepted path's entries from L_b + accepted_nodes[b, j] to L_b + j, j <= num_accepted[b].

    Node ids are bounded by the cache (L_b + node < S), not by the width of accepted_nodes.
    Every source row is gathered before anything is written, so a slot that is both a source
    and a destination is safe. Positions past the accepted path copy a slot onto itself (at
    most the last slot, S - 1, so a wide accepted_nodes never indexes past the cache), which
    keeps the op free of data-dependent shapes (no host sync). Returns L + num_accepted + 1.
    """
    width = accepted_nodes.shape[1]
    prefix = cache_seqlens.to(torch.int64)[:, None]
    j = torch.arange(width, device=accepted_nodes.device)
    on_path = j[None, :] <= num_accepted.to(torch.int64)[:, None]  # [B, W]
    on_path_src = prefix + accepted_nodes.to(torch.int64)
    for cache in caches:
        unchanged = (prefix + j[None, :]).clamp(max=cache.shape[1] - 1)  # off the path: in place
        src = torch.where(on_path, on_path_src, unchanged)
        dst = torch.where(on_path, prefix + j[None, :], unchanged)
        heads, dim = cache.shape[2], cache.shape[3]
        src_idx = src[:, :, None, None].expand(-1, -1, heads, dim)
        dst_idx = dst[:, :, None, None].expand(-1, -1, heads, dim)
        moved = cache.gather(1, src_idx)
        cache.scatter_(1, dst_idx, moved)
    return (cache_seqlens + num_accepted + 1).to(cache_seqlens.dtype)


def compact_kv_cache_paged_(caches, cache_seqlens, accepted_nodes, num_accepted, block_table) -> torch.Tensor:
    """compact_kv_cache_ on paged caches [num_pages, page_size, H, D] (token s of row b at
    [block_table[b, s // page_size], s % page_size]).

    The same moves as the dense reference, with logical positions L_b + j mapped to (page,
    slot) through the block table: every source is gathered before anything is written, and
    slots past the accepted path are written back unchanged. Returns L + num_accepted + 1.
    """
    num_nodes = accepted_nodes.shape[1]
    prefix = cache_seqlens.to(torch.int64)[:, None]
    j = torch.arange(num_nodes, device=accepted_nodes.device)
    on_path = j[None, :] <= num_accepted.to(torch.int64)[:, None]  # [B, T]
    src = prefix + torch.where(on_path, accepted_nodes.to(torch.int64), j[None, :])
    dst = prefix + j[None, :]
    table = block_table.to(torch.int64)
    for cache in caches:
        page_size = cache.shape[1]
        src_page, src_slot = table.gather(1, src // page_size), src % page_size
        dst_page, dst_slot = table.gather(1, dst // page_size), dst % page_size
        moved = cache[src_page, src_slot]  # [B, T, H, D], a copy: gathered before any write
        cache[dst_page, dst_slot] = moved
    return (cache_seqlens + num_accepted + 1).to(cache_seqlens.dtype)
