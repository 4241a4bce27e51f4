"""Tree attention inside transformers models, through the public registration API.

`register()` adds, once, an attention function and a mask function named `specdec_tree` to
transformers' `AttentionInterface` / `AttentionMaskInterface` (no monkey-patching). A model
runs with it inside `use_tree_attention(model)`, which sets `config._attn_implementation` and
puts the old value back afterwards.

Tree steps pass their metadata as forward kwargs, which transformers hands down to every
attention call: `specdec_tree_mask` (bool [B, T, T] / [T, T] or packed int64) and
`specdec_cache_seqlens` (int32 [B], each row's prefix length in a `TreeKVCache`). The
attention function then calls `tree_attention` on transposed views of HF's [B, H, S, D]
tensors. Forward passes without that metadata (the prefill) fall back to SDPA.

The mask function never builds a dense mask for our loop: it returns None when no 2D
attention_mask is given (our caches are left-aligned per row, so a prefill needs only the
causal rule and a tree step only its tree mask). Given a 2D padding mask (an ordinary call
by someone else), it delegates to transformers' SDPA mask so results stay correct.
"""

import contextlib

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from ..tree_attention import tree_attention

NAME = "specdec_tree"
TREE_MASK_KWARG = "specdec_tree_mask"
SEQLENS_KWARG = "specdec_cache_seqlens"


def specdec_tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: tree attention when tree metadata is passed, else SDPA.

    Args:
        module: the attention module (for `is_causal`, `num_key_value_groups`).
        query: [B, Hq, T, D]; key, value: [B, Hkv, S, D] (views of a `TreeKVCache`'s buffers
            in tree steps).
        attention_mask: whatever our mask function returned (None in our loop).
        scaling: softmax scale; kwargs: forward kwargs, including the tree metadata.

    Returns:
        (attn_output [B, T, Hq, D], None), as transformers expects.
    """
    tree_mask = kwargs.get(TREE_MASK_KWARG)
    if tree_mask is None:
        return _fallback_sdpa(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("specdec_tree attention does not support logit soft-capping")
    window = kwargs.get("sliding_window")
    if window is not None and key.shape[2] > window:
        raise NotImplementedError(f"specdec_tree attention: context {key.shape[2]} exceeds the sliding window {window}")
    out = tree_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), tree_mask, kwargs[SEQLENS_KWARG], scale=scaling
    )
    return out, None


def _fallback_sdpa(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    """Ordinary attention. With no mask and more keys than queries (a chunk after a cached
    prefix), spell out the bottom-right causal mask, which SDPA's is_causal would misplace."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None and 1 < q_len < kv_len and getattr(module, "is_causal", True):
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        attention_mask = attention_mask[None, None]
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def specdec_tree_mask(*args, attention_mask=None, **kwargs):
    """transformers mask function: None without a padding mask (no dense mask is ever built
    for our loop), else transformers' own SDPA mask."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


_registered = False


def register() -> str:
    """Register `specdec_tree` with transformers' attention and mask interfaces (idempotent); returns the name."""
    global _registered
    if not _registered:
        AttentionInterface.register(NAME, specdec_tree_attention)
        AttentionMaskInterface.register(NAME, specdec_tree_mask)
        _registered = True
    return NAME


@contextlib.contextmanager
def use_tree_attention(*models):
    """Run `models` (transformers causal LMs) with `specdec_tree` attention inside the block."""
    register()
    old = [m.config._attn_implementation for m in models]
    try:
        for m in models:
            m.config._attn_implementation = NAME
        yield
    finally:
        for m, impl in zip(models, old):
            m.config._attn_implementation = impl


def forward(model, cache, tokens, position_ids, tree_mask=None, logits_to_keep=0, return_hidden=False):
    """One forward of `model` writing `tokens [B, T]` into `cache` at cache.seqlens[b] + j.

    Args:
        tree_mask: None for a prefill (cache.seqlens all 0, plain causal attention), else the
            ancestor mask of the T tokens, which attend to their row's prefix and ancestors.
        logits_to_keep: as in transformers (0: all positions).
        return_hidden: also return the LM head's input (the last hidden state, after the
            final norm) for all T positions (learned draft heads read it).

    Returns:
        logits [B, T or logits_to_keep, V] in fp32; with return_hidden, (logits, hidden
        [B, T, H] in the model's dtype). The caller sets the new cache lengths.
    """
    extra = {}
    if tree_mask is not None:
        extra = {TREE_MASK_KWARG: tree_mask, SEQLENS_KWARG: cache.seqlens}
    args = dict(
        input_ids=tokens.clamp(min=0),  # padding nodes (-1) become token 0; their outputs are never used
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        **extra,
    )
    if not return_hidden:
        return model(logits_to_keep=logits_to_keep, **args).logits.float()
    # The base model's output is the LM head's input; applying the LM head ourselves gives
    # the same logits as model(...) for models whose head is a plain linear map (Llama,
    # Qwen2, Mistral); models that post-process logits (soft-capping, scaling) are refused.
    _check_plain_lm_head(model)
    hidden = model.get_decoder()(**args).last_hidden_state
    kept = hidden if logits_to_keep == 0 else hidden[:, -logits_to_keep:]
    return model.get_output_embeddings()(kept).float(), hidden


def _check_plain_lm_head(model) -> None:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        value = getattr(cfg, name, None)
        if value not in (None, 1, 1.0):
            raise NotImplementedError(f"return_hidden: {type(model).__name__} post-processes its logits ({name}={value})")


def prefill(model, cache, history: torch.Tensor, lengths: torch.Tensor, return_hidden: bool = False):
    """Write every row's tokens but its last (`history[b, :lengths[b] - 1]`, left-aligned)
    into an empty `cache`, with plain causal attention; the last token becomes the first
    tree's root. Row padding lies after each row's real tokens, so causal attention never
    lets a real token see it, and later writes overwrite it.

    return_hidden: return the last hidden states [B, max(lengths) - 1, H] of the positions
    written (row b valid for its first lengths[b] - 1), else None."""
    prefix = lengths.long() - 1
    num = int(prefix.max())
    hidden = None
    if num > 0:
        positions = torch.arange(num, device=history.device)[None, :].expand(history.shape[0], -1)
        out = forward(model, cache, history[:, :num], positions, logits_to_keep=1, return_hidden=return_hidden)
        hidden = out[1] if return_hidden else None
    elif return_hidden:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        param = next(model.parameters())
        hidden = torch.zeros(history.shape[0], 0, cfg.hidden_size, dtype=param.dtype, device=param.device)
    cache.set_lengths(prefix)
    return hidden
