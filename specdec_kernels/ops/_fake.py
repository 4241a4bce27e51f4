"""Fake (meta) implementations: output shapes and dtypes of every op, for torch.compile tracing.

Every op has static output shapes (no data-dependent sizes), so these are one-liners.
"""

import torch


@torch.library.register_fake("specdec::tree_mask")
def _tree_mask_fake(parents):
    batch, num_nodes = parents.shape
    return parents.new_empty((batch, num_nodes, num_nodes), dtype=torch.bool)


@torch.library.register_fake("specdec::pack_tree_mask")
def _pack_tree_mask_fake(mask):
    batch, num_nodes, num_keys = mask.shape
    return mask.new_empty((batch, num_nodes, (num_keys + 63) // 64), dtype=torch.int64)


@torch.library.register_fake("specdec::tree_attention")
def _tree_attention_fake(q, k_cache, v_cache, tree_mask, cache_seqlens, scale, window=0, softcap=0.0):
    return q.new_empty(q.shape[:3] + (v_cache.shape[3],))


@torch.library.register_fake("specdec::verify")
def _verify_fake(target_logits, tree_tokens, parents, draft_probs, temperature, top_k, top_p, seed):
    batch, num_nodes, _ = target_logits.shape
    accepted_nodes = tree_tokens.new_empty((batch, num_nodes), dtype=torch.int32)
    num_accepted = tree_tokens.new_empty((batch,), dtype=torch.int32)
    output_tokens = tree_tokens.new_empty((batch, num_nodes), dtype=torch.int64)
    return accepted_nodes, num_accepted, output_tokens


@torch.library.register_fake("specdec::compact_kv_cache_")
def _compact_kv_cache_fake(caches, cache_seqlens, accepted_nodes, num_accepted):
    return torch.empty_like(cache_seqlens)


@torch.library.register_fake("specdec::ngram_propose")
def _ngram_propose_fake(tokens, lengths, min_n, max_n, num_tokens, policy):
    batch = tokens.shape[0]
    return tokens.new_empty((batch, num_tokens)), tokens.new_empty((batch,), dtype=torch.int32)


@torch.library.register_fake("specdec::ngram_propose_tree")
def _ngram_propose_tree_fake(tokens, lengths, min_n, max_n, num_tokens, tree_width, max_nodes, policy):
    batch = tokens.shape[0]
    tree_tokens = tokens.new_empty((batch, 1 + max_nodes))
    parents = tokens.new_empty((batch, 1 + max_nodes), dtype=torch.int64)
    return tree_tokens, parents


@torch.library.register_fake("specdec::tree_attention_paged")
def _tree_attention_paged_fake(q, k_cache, v_cache, tree_mask, cache_seqlens, block_table, scale, window=0, softcap=0.0):
    return q.new_empty(q.shape[:3] + (v_cache.shape[3],))


@torch.library.register_fake("specdec::compact_kv_cache_paged_")
def _compact_kv_cache_paged_fake(caches, cache_seqlens, accepted_nodes, num_accepted, block_table):
    return torch.empty_like(cache_seqlens)


if hasattr(torch.ops.specdec, "small_linear"):  # (an extension built before the op existed lacks it)

    @torch.library.register_fake("specdec::small_linear")
    def _small_linear_fake(x, weight, bias):
        return x.new_empty((x.shape[0], weight.shape[0]))


if hasattr(torch.ops.specdec, "small_linear_argmax"):  # (an extension built before the op existed lacks it)

    @torch.library.register_fake("specdec::small_linear_argmax")
    def _small_linear_argmax_fake(x, weight, weight_int8, row_stats):
        return x.new_empty((x.shape[0],), dtype=torch.int64)


if hasattr(torch.ops.specdec, "decoder_layer"):  # (an extension built before the op existed lacks it)

    @torch.library.register_fake("specdec::decoder_layer")
    def _decoder_layer_fake(hidden, cos, sin, weights, k_cache, v_cache, tree_mask, cache_seqlens, scale, eps,
                            blas_rows=0):
        return torch.empty_like(hidden)


if hasattr(torch.ops.specdec, "rms_norm"):  # (an extension built before the op existed lacks it)

    @torch.library.register_fake("specdec::rms_norm")
    def _rms_norm_fake(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)
