"""specdec_kernels: fused kernels and a thin loop for lossless speculative decoding.

Ops (one entry point each; `backend=` forces an implementation, None picks the best):
    tree_mask, pack_tree_mask, TokenTree       token trees and their ancestor masks
    tree_attention                              tree queries over a KV cache
    verify, verify_chain, VerifyOutput          lossless acceptance (greedy and sampled)
    verify_greedy                               greedy acceptance from each node's target token
    compact_kv_cache_                           keep the accepted path in the KV cache
    ngram_propose, ngram_propose_tree           prompt-lookup drafting
    NgramIndex                                  incremental n-gram index, one slot per sequence
    SuffixIndex                                 suffix cache over many sequences (drafts trees)
    generate, GenerateOutput                    the draft -> verify -> accept loop on HF models
    NgramDrafter, DraftModelDrafter, MergedDrafter   drafters for `generate`
    SuffixDrafter, ScoredMergedDrafter          suffix-cache drafts; scored merges
    EagleDrafter, MedusaDrafter, default_drafter     learned draft heads (specdec_kernels.heads)
    MtpDrafter                                  drafts with the target's own MTP layers (heads.mtp)
    train_draft_head                            train a head for a target (self-distillation)
(`generate` and the draft-model drafter need the optional `hf` extra: transformers >= 5;
it is imported only when they run.)
"""

from . import config
from .ops import reference
from .ops._extension import LOAD_ERROR, available_backends
from .loop.drafters import DraftModelDrafter, MergedDrafter, NgramDrafter, ScoredMergedDrafter, SuffixDrafter
from .loop.generate import GenerateOutput, GenerateStats, generate
from .heads import EagleDrafter, MedusaDrafter, MtpDrafter, default_drafter, train_draft_head
from .ops.kv_cache import compact_kv_cache_
from .ops.ngram import ngram_propose, ngram_propose_tree
from .ops.ngram_index import NgramIndex
from .ops.suffix_index import SuffixIndex
from .ops.tree import TokenTree, pack_tree_mask, tree_mask
from .ops.tree_attention import tree_attention
from .ops.verify import VerifyOutput, verify, verify_chain, verify_greedy

__version__ = "0.1.0"

__all__ = [
    "DraftModelDrafter",
    "EagleDrafter",
    "GenerateOutput",
    "GenerateStats",
    "LOAD_ERROR",
    "MedusaDrafter",
    "MergedDrafter",
    "MtpDrafter",
    "NgramDrafter",
    "NgramIndex",
    "ScoredMergedDrafter",
    "SuffixDrafter",
    "SuffixIndex",
    "TokenTree",
    "VerifyOutput",
    "available_backends",
    "compact_kv_cache_",
    "config",
    "default_drafter",
    "generate",
    "ngram_propose",
    "ngram_propose_tree",
    "pack_tree_mask",
    "reference",
    "tree_attention",
    "train_draft_head",
    "tree_mask",
    "verify",
    "verify_chain",
    "verify_greedy",
]
