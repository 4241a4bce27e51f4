"""Tree attention: T tree queries attend to the whole cached prefix and to their ancestors."""

from typing import Optional

import torch

from . import _checks
from ._extension import dispatch


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tree_mask: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    block_table: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Attention of a token tree's queries over a KV cache holding the prefix and the tree.

    Args:
        q: [B, T, Hq, D] queries of the T tree nodes (fp32 / bf16 / fp16).
        k_cache: [B, S, Hkv, D], v_cache: [B, S, Hkv, Dv] (Dv may differ from D: MLA as
            transformers runs DeepSeek-V2/V3), Hq % Hkv == 0, same dtype as q. Any strides with a
            contiguous last dim (HF's [B, H, S, D] caches pass as `.transpose(1, 2)` views).
            The tree's keys/values are already written at cache_seqlens[b] + j, j < T.
        tree_mask: bool [B, T, T] or [T, T] (`tree_mask(parents)`), or packed int64
            [B, T, ceil(T/64)] / [T, ceil(T/64)] (`pack_tree_mask`).
        cache_seqlens: int32 or int64 [B], the prefix length of each row; cache_seqlens[b] + T <= S.
        block_table: int32 [B, P] for paged caches (None: dense caches). Then k_cache and
            v_cache are pools of pages [num_pages, page_size, Hkv, D] (any page size >= 1) and
            token s of row b is at [block_table[b, s // page_size], s % page_size]; pages in any
            order, shared between rows for reading. Row b uses its first
            ceil((cache_seqlens[b] + T) / page_size) entries (page ids in [0, num_pages)); the
            rest are padding, never read. Same result as the dense op on the gathered cache.
        scale: softmax scale, default D ** -0.5.
        window: None, or a sliding window (int >= 1, as transformers applies Mistral's and
            Gemma's local layers): a query at position p sees a key at position j only if
            p - j < window. Positions are those of the query's own sequence: prefix key s is
            at s, tree node j at cache_seqlens[b] + depth(j) (its ancestor count in the mask).
            Tree keys need the tree mask and the window.
        softcap: None, or a float > 0: the scaled scores become softcap * tanh(score / softcap)
            before the softmax (Gemma 2's attention logit soft-capping).
        backend: force an implementation ("reference", "cuda", "triton"); None picks the best.

    Returns:
        [B, T, Hq, Dv] in q's dtype: query i of row b attends to keys 0 .. cache_seqlens[b]-1
        and to tree key j iff tree_mask[b, i, j].

    Non-finite inputs (not checked: it would read the whole cache): NaN in, NaN out for the
    affected rows. NaN in q[b, i, h], or in a key that query (b, i, h) sees, makes
    out[b, i, h] NaN; NaN in a value it sees makes those dims of out[b, i, h] NaN. Other
    queries are unaffected: cache slots a query does not see (past the tree, or tree nodes
    that are not its ancestors) may hold anything, NaN included; except on the CPU and CUDA
    kernels, where a NaN or inf *tree* value also makes NaN those dims of the outputs of
    queries of that KV head that do not see it (CPU: its row's; CUDA: those in the same tile
    of 64 or 128 (node, head) rows, when some query of the tile sees it; 0 * NaN in the tree
    tile, a known gap). +-inf in a value a query sees makes those dims NaN (reference,
    Triton) or +-inf (CPU and CUDA kernels, IEEE where its weight is > 0); +-inf in q or k
    gives what IEEE arithmetic gives (a score of +inf or NaN makes the output NaN, -inf a
    zero weight; a query whose every score is -inf gets NaN, a softmax over nothing).
    """
    if block_table is not None:
        from . import paged

        return paged.tree_attention(q, k_cache, v_cache, tree_mask, cache_seqlens, block_table, scale, backend,
                                    window, softcap)
    args = _checks.tree_attention(q, k_cache, v_cache, tree_mask, cache_seqlens, scale)
    return dispatch("tree_attention", backend, q, *args, *_checks.window_softcap(window, softcap))
