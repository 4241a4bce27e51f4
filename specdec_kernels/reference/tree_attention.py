"""Reference tree attention: dense fp32 attention with the prefix + ancestor mask."""

import torch

from .tree import unpack_tree_mask


def tree_attention(q, k_cache, v_cache, tree_mask, cache_seqlens, scale: float) -> torch.Tensor:
    """q [B, T, Hq, D]; k/v_cache [B, S, Hkv, D]; tree_mask bool [B, T, T] or packed int64
    [B, T, W]; cache_seqlens int [B]. Returns [B, T, Hq, D] in q's dtype.

    Query i of row b sees keys s < L_b (the prefix) and key L_b + j iff tree_mask[b, i, j].
    NaN in q, or in a key or value a query sees, makes that query's output NaN (a value: in
    the dims it holds NaN); what a query does not see never reaches it.
    Loops over rows only; no host sync, so it also runs inside CUDA graphs.
    """
    batch, num_nodes, num_q_heads, head_dim = q.shape
    cache_len, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if tree_mask.dtype != torch.bool:
        tree_mask = unpack_tree_mask(tree_mask, num_nodes)
    key_pos = torch.arange(cache_len, device=q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, like every backend
    for b in range(batch):
        prefix_len = cache_seqlens[b].to(torch.int64)
        tree_col = key_pos - prefix_len  # which tree node a key is, if 0 <= tree_col < T
        in_tree = (tree_col >= 0) & (tree_col < num_nodes)
        tree_visible = tree_mask[b][:, tree_col.clamp(0, num_nodes - 1)] & in_tree  # [T, S]
        visible = (key_pos < prefix_len) | tree_visible  # [T, S]
        # Group query heads by the KV head they share: [T, Hkv, group, D].
        qb = q[b].float().reshape(num_nodes, num_kv_heads, group, head_dim)
        kb, vb = k_cache[b].float(), v_cache[b].float()
        # A query's output depends only on what it sees (NaN in, NaN out for that query; the
        # documented contract). Invisible keys get -inf scores. Values need more care: a zero
        # probability times NaN is NaN, so non-finite values are zeroed for the product and
        # put back, as NaN, only into the outputs of the queries that see them.
        bad_v = ~torch.isfinite(vb)  # [S, Hkv, D]
        scores = torch.einsum("tkgd,skd->kgts", qb, kb) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        ob = torch.einsum("kgts,skd->tkgd", probs, vb.masked_fill(bad_v, 0.0))
        sees_bad = torch.einsum("ts,skd->tkd", visible.float(), bad_v.float()) > 0  # [T, Hkv, D]; no sync
        ob = ob.masked_fill(sees_bad[:, :, None, :], float("nan"))
        out[b] = ob.reshape(num_nodes, num_q_heads, head_dim).to(q.dtype)
    return out
