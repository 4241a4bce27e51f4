"""The loop's adapter to Hugging Face transformers models (needs the optional `hf` extra).

`register()` / `use_tree_attention(model)`: our tree attention as the `specdec_tree`
attention implementation; `TreeKVCache`: a preallocated ragged KV cache for `past_key_values`;
`forward(...)` / `prefill(...)`: one tree or prefill forward through a model and a `TreeKVCache`;
`LeanForward.for_model(model)`: the same tree forward with fewer ops for Llama-family models on a CPU;
`tree_step_forward(model)`: whichever of the two `generate` runs; `step_functions(model)`: that,
the prefill it runs (the lean one's fused chunks where they pay) and the `LeanForward` (greedy
steps take each node's token from its LM head's `small_linear_argmax`).
(`specdec_kernels.integrations.hf` is the other direction: our loop behind `model.generate`.)
"""

from .attention import NAME, forward, prefill, register, specdec_tree_attention, specdec_tree_mask, use_tree_attention
from .cache import TreeKVCache
from .lean import LeanForward, step_functions, tree_step_forward

__all__ = ["NAME", "LeanForward", "TreeKVCache", "forward", "prefill", "register", "specdec_tree_attention", "specdec_tree_mask",
           "step_functions", "tree_step_forward", "use_tree_attention"]
