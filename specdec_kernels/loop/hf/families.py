"""Which transformers model families the loop can run, and why not the others.

The loop plugs its tree attention and `TreeKVCache` into a model through transformers' public
interfaces: the attention function registry (every attention call of the model must go
through it) and the `Cache` API (every layer's state must be keys and values that a tree step
appends and `compact_kv_cache_` can cut back to the accepted path). A family that breaks
either assumption would crash deep inside a forward, or worse, compute something else; so
`check_supported(model)` refuses it up front, naming the family and the reason.

Refused today:
- recurrent layers (linear attention, state-space / Mamba, convolutions: Qwen3-Next, Jamba,
  Falcon-H1, Nemotron-H, ...). Their state after a token is one fixed-size summary of
  everything before it: the T nodes of a tree cannot each see their own ancestors through
  one shared state, and even a chain would need the state rolled back (or recomputed) to
  the accepted length after verification, which the loop does not do.
- attention written inside the model instead of through the attention interface (Falcon,
  Bloom: ALiBi and their own eager / SDPA code): the tree mask never reaches it.
- chunked attention (Llama 4's local layers): not implemented in tree attention.

Sliding windows (Mistral, Gemma 2/3 local layers, Qwen2 with `use_sliding_window`),
attention logit soft-capping (Gemma 2) and a value head dim different from the key head dim
(MLA: DeepSeek-V2/V3) run: transformers hands each layer's `sliding_window` / `softcap` to
the attention function, which passes them to `tree_attention`.
"""

import sys
from typing import Optional

# transformers' layer types whose state is not a growing list of keys and values.
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "mamba2",
                                   "recurrent", "ssm"})


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def layer_types(config) -> list:
    """Each decoder layer's type as transformers' caches see it ("full_attention",
    "sliding_attention", "linear_attention", ...), from the config alone."""
    cfg = _text_config(config)
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        return list(get_layer_types_and_kwargs(cfg)[0])
    except (ImportError, AttributeError, TypeError, ValueError):  # older transformers: the config's own list
        return list(getattr(cfg, "layer_types", None) or [])


def family(model_or_config) -> str:
    """The family name to show a user: the config's model_type and the model class."""
    config = getattr(model_or_config, "config", model_or_config)
    name = getattr(_text_config(config), "model_type", None) or getattr(config, "model_type", "?")
    cls = type(model_or_config).__name__ if hasattr(model_or_config, "config") else type(config).__name__
    return f"{name} ({cls})"


# Why a family is refused, by kind (the coverage table in docs/models.md quotes these).
REASONS = {
    "recurrent layers": ("recurrent layers (linear attention / state-space): their state is one summary of all "
                         "tokens so far, so the nodes of a token tree cannot share it, and a chain would need the "
                         "state rolled back to the accepted length after each verification, which this loop does "
                         "not do"),
    "attention interface": ("its attention is computed in the model's own code, not through transformers' attention "
                            "interface (AttentionInterface), so tree attention cannot be plugged in and the tree mask "
                            "would never reach it"),
    "chunked attention": ("chunked attention (local attention in fixed chunks, Llama 4) is not implemented in tree "
                          "attention"),
}


def unsupported_reason(model) -> Optional[str]:
    """None if the loop can run `model` (a transformers causal LM), else why not (one of
    REASONS, with the details of this model)."""
    types = layer_types(model.config)
    recurrent = sorted({t for t in types if t in RECURRENT_LAYER_TYPES})
    if recurrent:
        return f"{REASONS['recurrent layers']} (layer types {recurrent})"
    if "chunked_attention" in types:
        return REASONS["chunked attention"]
    module = sys.modules.get(type(model).__module__)
    decoder = getattr(model, "model", None) or getattr(model, "transformer", None)
    modules = [module] + ([sys.modules.get(type(decoder).__module__)] if decoder is not None else [])
    if module is not None and not any(hasattr(m, "ALL_ATTENTION_FUNCTIONS") for m in modules if m is not None):
        return REASONS["attention interface"]
    return None


def check_supported(model) -> None:
    """Raise NotImplementedError naming `model`'s family and the reason if the loop cannot run it."""
    why = unsupported_reason(model)
    if why is not None:
        raise NotImplementedError(f"specdec_kernels cannot run {family(model)}: {why}")
