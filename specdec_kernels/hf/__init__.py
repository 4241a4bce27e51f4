"""Hugging Face transformers integration (needs the optional `hf` extra: transformers >= 5).

`register()` / `use_tree_attention(model)`: our tree attention as the `specdec_tree`
attention implementation; `TreeKVCache`: a preallocated ragged KV cache for `past_key_values`;
`forward(...)`: one prefill or tree forward through a model and a `TreeKVCache`;
`speculative_generate(model, ...)` / `CUSTOM_GENERATE_DIR`: our loop behind transformers'
`model.generate` arguments (the helper, or `model.generate(custom_generate=...)`).
"""

from .attention import NAME, forward, prefill, register, specdec_tree_attention, specdec_tree_mask, use_tree_attention
from .cache import TreeKVCache
from .transformers_generate import CUSTOM_GENERATE_DIR, speculative_generate

__all__ = ["CUSTOM_GENERATE_DIR", "NAME", "TreeKVCache", "forward", "prefill", "register", "specdec_tree_attention",
           "specdec_tree_mask", "speculative_generate", "use_tree_attention"]
