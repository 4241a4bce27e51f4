"""The named decoding methods that `specdec generate` and the end-to-end benchmark share:
`make_drafter(method, ...)` builds the drafter of one of METHODS; `stop_ids` and
`first_difference` give both sides of a comparison with HF `generate` the same stopping rule
and say where two outputs part.
"""

import torch

from .heads import default_drafter
from .loop.drafters import DraftModelDrafter, MergedDrafter, NgramDrafter

# `specdec generate --method`; "default": `heads.default_drafter` (the target's trained head
# merged with n-gram drafts, or n-gram alone for a target without one)
# "mtp": MtpDrafter (the target's own MTP layers, or a trained MTP head given as head)
METHODS = ("default", "none", "ngram", "ngram-tree", "draft", "draft-tree", "merged", "mtp")
NEEDS_DRAFT_MODEL = frozenset({"draft", "draft-tree", "merged"})
NGRAM_TREE_WIDTH = 3  # default --ngram-tree-width: continuations of an n-gram tree
DRAFT_TREE_WIDTHS = (2, 2, 1)  # default --draft-tree-widths: a draft-model tree's children per depth


def stop_ids(model, tokenizer):
    """(eos, pad) that HF `generate` and ours are both given: the model's generation_config
    eos id(s), and its pad id, else the tokenizer's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    pad = getattr(model.generation_config, "pad_token_id", None)
    return eos, pad if pad is not None else tokenizer.pad_token_id


def first_difference(a, b):
    """Index of the first position where two token sequences (lists or 1-D tensors) differ; the
    shorter one's length when one is a prefix of the other; None when they are identical."""
    a = a.tolist() if isinstance(a, torch.Tensor) else list(a)
    b = b.tolist() if isinstance(b, torch.Tensor) else list(b)
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


def make_drafter(method: str, *, draft_model=None, num_tokens=None, ngram_tree_width: int = NGRAM_TREE_WIDTH,
                 draft_tree_widths=DRAFT_TREE_WIDTHS, target=None, head=None):
    """The drafter of one of METHODS (None for "none"): the `specdec generate --method` choices,
    also built by the e2e benchmark for its ours_* methods.

    num_tokens: draft length of n-gram drafts (chains and trees) and of draft-model chains (None:
    the drafter's default); ngram_tree_width: continuations of an n-gram tree (ngram-tree,
    merged); draft_tree_widths: children per depth of a draft-model tree (draft-tree, merged).
    draft_model is needed by draft, draft-tree and merged; target (and optionally head, a
    head directory to use instead of the target's own) by default and by mtp (head: a trained
    MTP head directory; None: the MTP layers of the target's own checkpoint).
    """
    if method not in METHODS:
        raise ValueError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")
    if method in NEEDS_DRAFT_MODEL and draft_model is None:
        raise ValueError(f"draft_model: method {method!r} needs a draft model")
    if method == "default":
        if target is None:
            raise ValueError("target: method 'default' needs the target (its trained head is looked up)")
        return default_drafter(target, head=head)
    if method == "mtp":
        if target is None:
            raise ValueError("target: method 'mtp' needs the target (its MTP layers are loaded)")
        from .heads import MtpDrafter

        return MtpDrafter(target, head)
    if head is not None:
        raise ValueError(f"head: only methods 'default' and 'mtp' use a head, not {method!r}")
    k = {"num_tokens": num_tokens} if num_tokens is not None else {}
    if method == "none":
        return None
    if method == "ngram":
        return NgramDrafter(**k)
    if method == "ngram-tree":
        return NgramDrafter(tree_width=ngram_tree_width, **k)
    if method == "draft":
        return DraftModelDrafter(draft_model, **k)
    if method == "draft-tree":
        return DraftModelDrafter(draft_model, tree_widths=draft_tree_widths)
    # merged: prompt lookup and the draft model's tree in one deduplicated tree
    return MergedDrafter([NgramDrafter(tree_width=ngram_tree_width, **k),
                             DraftModelDrafter(draft_model, tree_widths=draft_tree_widths)])
