"""The loop: draft -> tree-verify -> accept on Hugging Face causal LMs.

`generate` (the loop), `drafters` (n-gram, draft-model and merged drafters), `planner` and
`cost_model` (how many draft nodes each row verifies), `logits_processing` (HF's processors
per tree node), `memory` (CPU weights in 2 MB pages), `hf/` (our tree attention and KV cache
inside a transformers model).
Imports the ops only; the heads and integrations build on it.
"""
