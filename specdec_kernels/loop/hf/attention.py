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

Per-layer options come from transformers' own kwargs: `sliding_window` (Mistral, Qwen2, the
local layers of Gemma 2/3; None on global layers) and `softcap` (Gemma 2's attention logit
soft-capping) go to `tree_attention(window=, softcap=)`; values may have their own head dim
(MLA, DeepSeek-V2/V3). A forward without tree metadata that needs either option (a prefill
longer than the window, any soft-capped prefill) runs `tree_attention` too, with a causal
mask, since SDPA has neither.

A paged `TreeKVCache` adds `specdec_block_table` (int32 [B, P], from
`TreeKVCache.attention_block_table()`): its layers then hand attention the page pools (HF's
`[num_pages, H, page_size, D]` view) instead of per-row buffers, and `tree_attention` reads
them through the block table. `forward` passes the block table whenever the cache needs it,
so a forward without a tree mask on a non-empty paged cache (which SDPA could not read) is
refused instead of computing garbage; on an empty paged cache (the prefill) the layers return
the new states themselves and SDPA runs on them as for a dense cache.

The mask function never builds a dense mask for our loop: it returns None when no 2D
attention_mask is given (our caches are left-aligned per row, so a prefill needs only the
causal rule and a tree step only its tree mask). Given a 2D padding mask (an ordinary call
by someone else), it delegates to transformers' SDPA mask so results stay correct.
"""

import contextlib
import contextvars

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from ...ops.tree_attention import tree_attention

NAME = "specdec_tree"
TREE_MASK_KWARG = "specdec_tree_mask"
SEQLENS_KWARG = "specdec_cache_seqlens"
BLOCK_TABLE_KWARG = "specdec_block_table"
# The same metadata for the forward in progress (set by `forward`): some models' decoder
# layers do not hand their forward kwargs on to attention (StableLM in transformers 5), and
# without the tree mask the attention would fall back to SDPA over every slot of the ragged
# cache, scratch included: a silent wrong answer. Kwargs win when both are there.
_TREE_STATE = contextvars.ContextVar("specdec_tree_state", default={})


def specdec_tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: tree attention when tree metadata is passed, else SDPA.

    Args:
        module: the attention module (for `is_causal`, `num_key_value_groups`).
        query: [B, Hq, T, D]; key: [B, Hkv, S, D], value: [B, Hkv, S, Dv] (views of a
            `TreeKVCache`'s buffers in tree steps; Dv may differ from D), or with a block table
            the pools' [num_pages, Hkv, page_size, D / Dv] views.
        attention_mask: whatever our mask function returned (None in our loop).
        scaling: softmax scale; kwargs: forward kwargs, including the tree metadata and the
            layer's `sliding_window` / `softcap` (None when the layer has none).

    Returns:
        (attn_output [B, T, Hq, Dv], None), as transformers expects.
    """
    if TREE_MASK_KWARG not in kwargs and BLOCK_TABLE_KWARG not in kwargs:
        kwargs = {**kwargs, **_TREE_STATE.get()}
    tree_mask = kwargs.get(TREE_MASK_KWARG)
    block_table = kwargs.get(BLOCK_TABLE_KWARG)
    window, softcap = _layer_options(kwargs)
    if tree_mask is None:
        if block_table is not None:
            raise NotImplementedError("specdec_tree attention: a paged TreeKVCache that already holds tokens is read "
                                      "only by tree steps (pass a tree mask); plain forwards run on it only when it is empty")
        if softcap is not None or (window is not None and key.shape[2] > window):
            return _fallback_options(module, query, key, value, attention_mask, scaling, window, softcap), None
        return _fallback_sdpa(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    out = tree_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), tree_mask,
                         kwargs[SEQLENS_KWARG], block_table=block_table, scale=scaling, window=window, softcap=softcap)
    return out, None


def _layer_options(kwargs):
    """(window, softcap) of this layer from transformers' attention kwargs (None: not used).
    A window of 0 or less, or a cap of 0, means none (configs spell "off" both ways)."""
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    window = int(window) if window is not None and int(window) > 0 else None
    softcap = float(softcap) if softcap is not None and float(softcap) != 0.0 else None
    return window, softcap


def _fallback_options(module, query, key, value, attention_mask, scaling, window, softcap):
    """Ordinary (non-tree) attention with a sliding window or soft-capping, which SDPA lacks.

    Without a padding mask (our loop: a prefill, or a chunk after a cached prefix with every
    row at the same offset) this is `tree_attention` with a causal "tree" (a chain): query i
    sits at position kv_len - q_len + i, exactly the rule the tree steps use. With a mask
    (someone else's call) it is eager attention on that mask (which transformers built with
    the window already)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None:
        chain = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril()
        offsets = torch.full((query.shape[0],), kv_len - q_len, dtype=torch.int32, device=query.device)
        return tree_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), chain, offsets,
                              scale=scaling, window=window, softcap=softcap)
    group = query.shape[1] // key.shape[1]
    keys, values = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query.float(), keys.float().transpose(2, 3)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask[..., :kv_len], float("-inf"))
    else:
        scores = scores + attention_mask[..., :kv_len].float()
    out = torch.matmul(torch.softmax(scores, dim=-1), values.float()).to(query.dtype)
    return out.transpose(1, 2).contiguous()


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
        cache: a `TreeKVCache`, dense or paged.
        tree_mask: None for a prefill (cache.seqlens all 0, plain causal attention), else the
            ancestor mask of the T tokens, which attend to their row's prefix and ancestors.
        logits_to_keep: as in transformers (0: all positions).
        return_hidden: also return the input of the LM head (after the final norm) at all T
            positions, for drafters that read the target's hidden states; or a tuple of
            hidden-state indices (transformers' numbering: 0 the embeddings, i the output of
            decoder layer i, the last one the LM head input) to return those, stacked.

    Returns:
        logits [B, T or logits_to_keep, V] in fp32, or (logits, hidden [B, T, H]) with
        return_hidden True, (logits, hidden [B, T, len(layers), H]) with layer indices. The
        caller sets the new cache lengths.
    """
    extra = {}
    if tree_mask is not None:
        extra = {TREE_MASK_KWARG: tree_mask, SEQLENS_KWARG: cache.seqlens}
    block_table = cache.attention_block_table()
    if block_table is not None:  # a non-empty paged cache: attention reads the pools through it
        extra[BLOCK_TABLE_KWARG] = block_table
    args = dict(input_ids=tokens.clamp(min=0),  # padding nodes (-1) become token 0; their outputs are never used
                position_ids=position_ids, past_key_values=cache, use_cache=True, **extra)
    state = _TREE_STATE.set(extra)
    try:
        if not return_hidden:
            return model(logits_to_keep=logits_to_keep, **args).logits.float()
        last, hidden = _hidden(model, args, return_hidden)
    finally:
        _TREE_STATE.reset(state)
    kept = last if logits_to_keep == 0 else last[:, -logits_to_keep:]
    return model.get_output_embeddings()(kept).float(), hidden


def _hidden(model, args, layers):
    """Run the decoder under `model` on `args`: (last hidden state, what `return_hidden`
    asked for: the last hidden state itself for True, else the `layers` stacked on dim -2)."""
    if layers is True:
        hidden = _decoder(model)(**args).last_hidden_state
        return hidden, hidden
    out = _decoder(model)(output_hidden_states=True, **args)
    return out.last_hidden_state, stack_hidden(model, out.hidden_states, layers)


def stack_hidden(model, states, layers) -> torch.Tensor:
    """The hidden states `layers` (transformers' numbering, negative from the end) of `states`
    stacked on dim -2; ValueError naming the valid range for an index outside it."""
    bad = [i for i in layers if not -len(states) <= int(i) < len(states)]
    if bad:
        raise ValueError(f"hidden layers {bad}: {type(model).__name__} has hidden states 0 .. {len(states) - 1}")
    return torch.stack([states[int(i)] for i in layers], dim=-2)


def _decoder(model):
    """The decoder under a causal LM's head; refuses models whose logits are more than
    lm_head(last hidden state) (soft-capping, scaling), where the hidden states would not
    be the LM head's input."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
        raise NotImplementedError(f"return_hidden: {type(model).__name__} post-processes its logits")
    return model.get_decoder()


# A batched prefill computes every row to the longest row's length; past this share of padded
# positions (B x max(prefix) over the real ones) the rows run one at a time instead. A row's
# forward of ~100+ tokens keeps the products near the CPU's matmul peak, so the padding is
# pure loss there: eight code-edit prompts of 151-285 tokens padded 2,280 positions for 1,749.
PADDING_LIMIT = 1.1


def prefill(model, cache, history: torch.Tensor, lengths: torch.Tensor, return_hidden: bool = False):
    """Write every row's tokens but its last (`history[b, :lengths[b] - 1]`, left-aligned)
    into an empty `cache`, with plain causal attention; the last token becomes the first
    tree's root. Rows of about one length run as one batch (row padding lies after each
    row's real tokens, so causal attention never lets a real token see it, and later writes
    overwrite it); rows whose padding would exceed `PADDING_LIMIT` of the real tokens run one
    at a time, each through `cache.row(b)`, computing no padding at all.

    Returns None, or with return_hidden the final hidden states [B, max(lengths) - 1, H]
    (row b valid for its first lengths[b] - 1, zeros past them where rows ran one at a time),
    computed without the LM head; with a tuple of layer indices (see `forward`) those layers,
    [B, max(lengths) - 1, len(layers), H].
    """
    prefix = lengths.long() - 1
    sizes = prefix.tolist()  # (one read from the device for the sizes below)
    num = max(sizes)
    if len(sizes) > 1 and num > 0 and len(sizes) * num > PADDING_LIMIT * sum(sizes):
        hidden = _prefill_rows(model, cache, history, sizes, num, return_hidden)
    else:
        hidden = _prefill(model, cache, history, num, return_hidden)
    cache.set_lengths(prefix)
    return hidden


def _prefill(model, cache, history, num, return_hidden):
    """The prefill's forward over `history[:, :num]` at positions 0 .. num - 1 (hidden states
    as `prefill` returns them, or None)."""
    if num == 0:
        if not return_hidden:
            return None
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        layers = () if return_hidden is True else (len(return_hidden),)
        return torch.zeros(history.shape[0], 0, *layers, cfg.hidden_size, dtype=next(model.parameters()).dtype,
                           device=history.device)
    positions = torch.arange(num, device=history.device)[None, :].expand(history.shape[0], -1)
    if return_hidden:
        return _hidden(model, dict(input_ids=history[:, :num], position_ids=positions, past_key_values=cache,
                                   use_cache=True), return_hidden)[1]
    forward(model, cache, history[:, :num], positions, logits_to_keep=1)
    return None


def _prefill_rows(model, cache, history, prefix, num, return_hidden):
    """`_prefill` one row at a time, row b over its own prefix[b] tokens through `cache.row(b)`;
    the rows' hidden states padded with zeros to `num` positions."""
    parts = [_prefill(model, cache.row(b), history[b: b + 1], n, return_hidden) for b, n in enumerate(prefix)]
    if not return_hidden:
        return None
    hidden = parts[0].new_zeros((len(parts), num) + tuple(parts[0].shape[2:]))
    for b, part in enumerate(parts):
        hidden[b, : part.shape[1]] = part[0]
    return hidden
