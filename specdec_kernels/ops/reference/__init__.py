"""Plain-torch reference implementations of every op: the ground truth for tests and the
fallback where no compiled kernel exists. Written for clarity, not speed.

Each function takes already-validated, already-normalised inputs (the public API in
`specdec_kernels` does that once for every backend).
"""

from .decoder_layer import decoder_layer
from .kv_cache import compact_kv_cache_, compact_kv_cache_paged_
from .ngram import ngram_propose, ngram_propose_tree
from .ngram_index import NgramIndex
from .rms_norm import rms_norm
from .tree import pack_tree_mask, tree_mask, unpack_tree_mask
from .tree_attention import tree_attention, tree_attention_paged
from .verify import verify

__all__ = [
    "NgramIndex",
    "compact_kv_cache_",
    "compact_kv_cache_paged_",
    "decoder_layer",
    "ngram_propose",
    "ngram_propose_tree",
    "pack_tree_mask",
    "rms_norm",
    "tree_attention",
    "tree_attention_paged",
    "tree_mask",
    "unpack_tree_mask",
    "verify",
]
