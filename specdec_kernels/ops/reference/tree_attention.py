"""Reference tree attention: dense fp32 attention with the prefix + ancestor mask."""

import torch

from .tree import unpack_tree_mask


def tree_attention(q, k_cache, v_cache, tree_mask, cache_seqlens, scale: float, window: int = 0,
                   softcap: float = 0.0) -> torch.Tensor:
    """q [B, T, Hq, D]; k_cache [B, S, Hkv, D]; v_cache [B, S, Hkv, Dv]; tree_mask bool
    [B, T, T] or packed int64 [B, T, W]; cache_seqlens int [B]. Returns [B, T, Hq, Dv] in q's dtype.

    Query i of row b sees keys s < L_b (the prefix) and key L_b + j iff tree_mask[b, i, j].
    window > 0 (a sliding window): positions are those of the sequence the query belongs to,
    prefix key s at s and tree node j at L_b + depth(j) (depth = its ancestors in the mask,
    root 0), and a query at p sees a key at k only if p - k < window. softcap > 0: scores
    (already scaled) become softcap * tanh(score / softcap) before the softmax.
    NaN in q, or in a key or value a query sees, makes that query's output NaN (a value: in
    the dims it holds NaN); what a query does not see never reaches it.
    Loops over rows only; no host sync, so it also runs inside CUDA graphs.
    """
    batch, num_nodes, num_q_heads, head_dim = q.shape
    cache_len, num_kv_heads, value_dim = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    group = num_q_heads // num_kv_heads
    if tree_mask.dtype != torch.bool:
        tree_mask = unpack_tree_mask(tree_mask, num_nodes)
    key_pos = torch.arange(cache_len, device=q.device)
    out = torch.empty(q.shape[:3] + (value_dim,), dtype=q.dtype, device=q.device)  # contiguous, like every backend
    for b in range(batch):
        prefix_len = cache_seqlens[b].to(torch.int64)
        tree_col = key_pos - prefix_len  # which tree node a key is, if 0 <= tree_col < T
        in_tree = (tree_col >= 0) & (tree_col < num_nodes)
        tree_visible = tree_mask[b][:, tree_col.clamp(0, num_nodes - 1)] & in_tree  # [T, S]
        visible = (key_pos < prefix_len) | tree_visible  # [T, S]
        if window > 0:
            # A node's depth is its ancestor count; its position in its own sequence is L_b + depth.
            depth = tree_mask[b].sum(dim=1) - 1  # [T]
            query_pos = prefix_len + depth
            key_seq_pos = torch.where(in_tree, prefix_len + depth[tree_col.clamp(0, num_nodes - 1)], key_pos)
            visible = visible & (query_pos[:, None] - key_seq_pos[None, :] < window)
        # Group query heads by the KV head they share: [T, Hkv, group, D].
        qb = q[b].float().reshape(num_nodes, num_kv_heads, group, head_dim)
        kb, vb = k_cache[b].float(), v_cache[b].float()
        # A query's output depends only on what it sees (NaN in, NaN out for that query; the
        # documented contract). Invisible keys get -inf scores. Values need more care: a zero
        # probability times NaN is NaN, so non-finite values are zeroed for the product and
        # put back, as NaN, only into the outputs of the queries that see them.
        bad_v = ~torch.isfinite(vb)  # [S, Hkv, D]
        scores = torch.einsum("tkgd,skd->kgts", qb, kb) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        ob = torch.einsum("kgts,skd->tkgd", probs, vb.masked_fill(bad_v, 0.0))
        sees_bad = torch.einsum("ts,skd->tkd", visible.float(), bad_v.float()) > 0  # [T, Hkv, Dv]; no sync
        ob = ob.masked_fill(sees_bad[:, :, None, :], float("nan"))
        out[b] = ob.reshape(num_nodes, num_q_heads, value_dim).to(q.dtype)
    return out


def gather_pages(cache, block_table, num_tokens) -> torch.Tensor:
    """Dense [B, P * page_size, H, D] copy of each row's pages of a paged cache.

    cache [num_pages, page_size, H, D]; block_table int [B, P]; num_tokens int [B]: row b's
    positions 0 .. num_tokens[b] - 1 are read, so only its first ceil(num_tokens[b] /
    page_size) table entries must be page ids; the entries past them may be anything
    (padding) and are read as page 0, whose slots the callers never let a query see.
    """
    page_size = cache.shape[1]
    num_cols = block_table.shape[1]
    pages_used = (num_tokens.to(torch.int64) + page_size - 1) // page_size  # [B]
    used = torch.arange(num_cols, device=block_table.device)[None, :] < pages_used[:, None]
    pages = torch.where(used, block_table.to(torch.int64), 0)
    return cache[pages].flatten(1, 2)  # [B, P, page_size, H, D] -> [B, P * page_size, H, D]


def tree_attention_paged(q, k_cache, v_cache, tree_mask, cache_seqlens, block_table, scale: float, window: int = 0,
                         softcap: float = 0.0) -> torch.Tensor:
    """tree_attention over paged caches: k/v_cache [num_pages, page_size, Hkv, D / Dv], token s
    of row b at [block_table[b, s // page_size], s % page_size]; window, softcap as there.

    Gathers each row's pages into a dense cache and runs the dense reference on it, so the
    paged op is by construction the dense op on the same logical cache.
    """
    num_tokens = cache_seqlens.to(torch.int64) + q.shape[1]
    k_dense = gather_pages(k_cache, block_table, num_tokens)
    v_dense = gather_pages(v_cache, block_table, num_tokens)
    return tree_attention(q, k_dense, v_dense, tree_mask, cache_seqlens, scale, window, softcap)
