"""Hugging Face transformers integration (needs the optional `hf` extra: transformers >= 5).

`register()` / `use_tree_attention(model)`: our tree attention as the `specdec_tree`
attention implementation; `TreeKVCache`: a preallocated ragged KV cache for `past_key_values`;
`forward(...)`: one prefill or tree forward through a model and a `TreeKVCache`;
`small_linears(model, rows_range)`: few-row fp32 linears through our CPU kernel where the
cost model measured it faster than `F.linear` (`hf.linear`);
`speculative_generate(model, ...)` / `CUSTOM_GENERATE_DIR`: our loop behind transformers'
`model.generate` arguments (the helper, or `model.generate(custom_generate=...)`).
"""

from .attention import NAME, forward, prefill, register, specdec_tree_attention, specdec_tree_mask, use_tree_attention
from .cache import TreeKVCache
from .linear import choose_small_linear_rows, linear_weights, small_linear, small_linears
from .transformers_generate import CUSTOM_GENERATE_DIR, speculative_generate

__all__ = ["CUSTOM_GENERATE_DIR", "NAME", "choose_small_linear_rows", "linear_weights", "small_linear", "small_linears", "TreeKVCache", "forward", "prefill", "register", "specdec_tree_attention",
           "specdec_tree_mask", "speculative_generate", "use_tree_attention"]
