"""Drafters: what proposes the token tree the target verifies each step.

One small interface (`Drafter`): `propose(history, lengths, sampling)` returns a `Draft`,
a `TokenTree` whose root is each row's last token, plus `draft_probs` when the drafted
children were sampled. `history [B, S]` holds every row's tokens left-aligned (prompt
without padding, then the generated tokens); `lengths [B]` counts them. Drafters that keep
state (a draft model's KV cache) derive it from `history`, so they need no accept hook.

- `NgramDrafter`: prompt lookup; a chain (`ngram_propose`) or a tree (`ngram_propose_tree`).
- `DraftModelDrafter`: a small causal LM; a chain of k tokens or a SpecInfer expansion tree.
  Greedy: the top-w distinct tokens per node (deterministic, verified with draft_probs=None).
  Sampling: siblings drawn i.i.d. from the draft's warped distribution, whose probabilities
  are passed to `verify` (multi-step speculative sampling).
- `MergedDrafter`: several drafters' proposals merged into one trie (shared prefixes once).
  It always asks its drafters for deterministic proposals (a draft model then proposes its
  top-w tokens even when sampling) and verifies with draft_probs=None, which is exact for
  any deterministic proposal set: verification samples from the target and follows the
  matching child. No draft probabilities are combined.
"""

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .ngram import ngram_propose, ngram_propose_tree
from .ngram_index import NgramIndex
from .tree import TokenTree, tree_mask


@dataclass
class Sampling:
    """How the target samples (the draft model mirrors it): temperature > 0, top_k, top_p, and
    a torch.Generator for the drafter's own random draws."""

    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    generator: torch.Generator


@dataclass
class Draft:
    """A proposal: `tree` (tokens [B, T], root = last token; parents [B, T]) and
    `draft_probs [B, T, V]` (the distribution node i's children were drawn from) or None
    for deterministic proposals (distinct siblings). `scores`: None, or fp32 [B, T], the
    drafter's estimate of the probability that each node's path is accepted (1.0 at the
    root, non-increasing along paths)."""

    tree: TokenTree
    draft_probs: Optional[torch.Tensor] = None
    scores: Optional[torch.Tensor] = None


def trimmed(tree: TokenTree) -> TokenTree:
    """`tree` without its trailing node columns that are padding in every row (a shorter
    target forward when drafts are short or missing)."""
    num_nodes = int(tree.num_nodes.max())
    return tree if num_nodes == tree.tokens.shape[1] else TokenTree(tree.tokens[:, :num_nodes], tree.parents[:, :num_nodes])


def root_tokens(history: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """int64 [B]: each row's last token."""
    return history.gather(1, (lengths.long() - 1)[:, None])[:, 0]


class Drafter:
    """Interface of a drafter used by `specdec_kernels.generate`.

    Attributes:
        max_nodes: most drafted nodes per row and step (the tree has T <= 1 + max_nodes nodes).
        models: transformers models the drafter runs (switched to tree attention by `generate`).
    """

    max_nodes: int = 0
    models: tuple = ()
    needs_hidden_states: bool = False

    def start(self, history: torch.Tensor, lengths: torch.Tensor, capacity: int) -> None:
        """Called once after the target's prefill: `history [B, capacity]`, prompt lengths [B]."""

    def propose(self, history: torch.Tensor, lengths: torch.Tensor, sampling: Optional[Sampling] = None,
                budget: Optional[torch.Tensor] = None) -> Draft:
        """Propose a tree per row continuing `history[b, :lengths[b]]` (root = its last token).
        `sampling` None asks for a deterministic proposal (draft_probs None). `budget`: None
        (the drafter's fixed size) or int64 [B], the most drafted nodes per row (0: root only)."""
        return Draft(TokenTree.chain(root_tokens(history, lengths), history.new_zeros(history.shape[0], 0)))

    def observe(self, hidden_states: torch.Tensor, accepted_nodes: Optional[torch.Tensor] = None,
                num_accepted: Optional[torch.Tensor] = None) -> None:
        """Only called when `needs_hidden_states`: the target's LM-head input [B, L, H] for
        every position a target forward computed. After the prefill: positions
        0 .. max(lengths) - 2 of the left-aligned history (row b valid for its first
        lengths[b] - 1), accepted_nodes / num_accepted None. After each verify forward: the
        tree's T nodes, with verify's accepted_nodes [B, T] and num_accepted [B] (before
        finished rows leave the batch)."""

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Called when rows finish: from now on the batch is the old rows `rows` (int64
        indices, in that order); per-row state must follow."""

    def finish(self) -> None:
        """Called when generation ends: release per-call state (caches)."""


class NgramDrafter(Drafter):
    """Prompt-lookup drafts: the tokens that followed the latest n-gram earlier in the history.

    Chains on CPU use the incremental `NgramIndex` (one slot per row, fed the tokens each
    step appended: O(max_n) per token instead of rescanning the history); trees, and
    histories on a GPU, call `ngram_propose_tree` / `ngram_propose` on the history. Both give
    the same drafts.

    Args:
        min_n, max_n: n-gram sizes tried, longest first.
        num_tokens: tokens per continuation (depth of the tree).
        tree_width: 1 for a chain (`ngram_propose`); > 1 for a tree of up to that many
            distinct continuations (`ngram_propose_tree`).
        policy: "earliest" or "latest" match, as in `ngram_propose`.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4, num_tokens: int = 5, tree_width: int = 1, policy: str = "earliest"):
        if tree_width < 1:
            raise ValueError(f"tree_width must be >= 1, got {tree_width}")
        self.min_n, self.max_n, self.num_tokens, self.tree_width, self.policy = min_n, max_n, num_tokens, tree_width, policy
        self.max_nodes = num_tokens * tree_width
        self.index = None

    def start(self, history, lengths, capacity):
        """Chains on CPU: index every row's prompt (slot b = row b)."""
        self.index = None
        if self.tree_width == 1 and history.device.type == "cpu" and NgramIndex.has_compiled_backend():
            self.index = NgramIndex(history.shape[0], max_n=self.max_n)
            for b, n in enumerate(lengths.tolist()):
                self.index.reset(b, history[b, :n])
            self.slots = torch.arange(history.shape[0])
            self.indexed = lengths.long().cpu().clone()  # tokens of each row the index holds

    def keep_rows(self, rows):
        if self.index is not None:
            self.slots, self.indexed = self.slots[rows], self.indexed[rows]

    def finish(self):
        self.index = None

    def propose(self, history, lengths, sampling=None, budget=None) -> Draft:
        """Deterministic n-gram proposal (see class docstring); `sampling` is ignored."""
        args = dict(min_n=self.min_n, max_n=self.max_n, num_tokens=self.num_tokens, policy=self.policy)
        root = root_tokens(history, lengths)
        if self.index is not None:
            # Feed each row the tokens appended since the last step, then propose.
            lengths = lengths.long()
            new = lengths - self.indexed
            j = torch.arange(max(int(new.max()), 1))
            appended = history.gather(1, (self.indexed[:, None] + j).clamp(max=history.shape[1] - 1))
            drafts, draft_lens = self.index.append_and_propose(self.slots, appended, new, **args)
            self.indexed = lengths.clone()
            return Draft(trimmed(TokenTree.chain(root, drafts, draft_lens)))
        tokens = history[:, : int(lengths.max())]
        if self.tree_width == 1:
            drafts, draft_lens = ngram_propose(tokens, lengths, **args)
            return Draft(trimmed(TokenTree.chain(root, drafts.long(), draft_lens)))
        tree = ngram_propose_tree(tokens, lengths, tree_width=self.tree_width, **args)
        tree.tokens[:, 0] = root
        return Draft(trimmed(TokenTree(tree.tokens.long(), tree.parents)))


class DraftModelDrafter(Drafter):
    """A small causal LM drafts a chain (`num_tokens=k`) or a SpecInfer expansion tree
    (`tree_widths=(w1, w2, ...)`: every node at depth d gets w_{d+1} children).

    The draft model keeps its own `TreeKVCache`, always holding history[:, :lengths - 1]
    (like the target's): each step it first feeds the tokens it has not seen (ragged, one
    forward), then expands the tree one depth per forward (feeding all drafted nodes so far
    under their tree mask), then drops the drafted entries again.

    When sampling, the children are drawn with one torch.Generator for the whole batch
    (seeded from `generate`'s seed): outputs are reproducible and exactly distributed, but a
    row's sampled tokens may depend on the other rows of its batch.

    Args:
        model: a transformers causal LM with the target's tokenizer and vocabulary size.
        num_tokens: chain length k (ignored when tree_widths is given).
        tree_widths: children per node at each depth.
    """

    def __init__(self, model, num_tokens: int = 4, tree_widths: Optional[Sequence[int]] = None):
        widths = tuple(tree_widths) if tree_widths is not None else (1,) * num_tokens
        if not widths or any(int(w) < 1 for w in widths):
            raise ValueError(f"tree_widths / num_tokens must give depths with >= 1 child each, got {widths}")
        self.model, self.widths = model, widths
        self.models = (model,)
        self.level_sizes, size = [], 1
        for w in widths:
            size *= w
            self.level_sizes.append(size)
        self.max_nodes = sum(self.level_sizes)
        self.cache = None

    def start(self, history, lengths, capacity):
        """Allocate the draft cache and prefill it with each prompt but its last token."""
        from . import hf

        self.cache = hf.TreeKVCache.for_model(self.model, history.shape[0], capacity)
        hf.prefill(self.model, self.cache, history, lengths)

    def keep_rows(self, rows):
        self.cache.keep_rows(rows)

    def finish(self):
        self.cache = None

    def _children(self, logits, width, sampling):
        """[B, F, V] logits -> (children [B, F * width], probs [B, F, V] or None)."""
        batch, num_parents, vocab = logits.shape
        if sampling is None:
            return logits.topk(width, dim=-1).indices.reshape(batch, -1), None
        from .sampling import target_probs

        flat = logits.reshape(-1, vocab)
        n = flat.shape[0]
        per_row = lambda v, dtype: torch.full((n,), v, dtype=dtype, device=flat.device)  # noqa: E731
        probs = target_probs(
            flat,
            per_row(sampling.temperature, torch.float32),
            per_row(sampling.top_k or 0, torch.int64),
            per_row(1.0 if sampling.top_p is None else sampling.top_p, torch.float32),
        )
        children = torch.multinomial(probs, width, replacement=True, generator=sampling.generator)
        return children.reshape(batch, -1), probs.reshape(batch, num_parents, vocab)

    def propose(self, history, lengths, sampling=None, budget=None) -> Draft:
        """Draft a tree (see class docstring); sampled children come with draft_probs."""
        from . import hf

        cache, device = self.cache, history.device
        batch = history.shape[0]
        lengths = lengths.long()
        # 1) Catch up: feed history[start : lengths] (ending with the root) as ragged chains.
        start = cache.seqlens.long()
        pending = lengths - start
        j = torch.arange(int(pending.max()), device=device)
        real = j[None, :] < pending[:, None]
        chain_tokens = torch.where(real, history.gather(1, (start[:, None] + j).clamp(max=history.shape[1] - 1)), -1)
        chain_parents = torch.where(real, j - 1, -1)
        logits = hf.forward(self.model, cache, chain_tokens, start[:, None] + j, tree_mask(chain_parents))
        frontier_logits = logits.gather(1, (pending - 1)[:, None, None].expand(-1, 1, logits.shape[-1]))
        cache.set_lengths(lengths)  # the root stays in while the tree grows
        # 2) Expand one depth per forward; drafted node i (tree node i + 1) sits at slot lengths + i.
        tokens, parents, depths = [root_tokens(history, lengths)[:, None]], [-1], [0]
        node_probs, frontier = {}, [0]
        for depth, width in enumerate(self.widths, start=1):
            children, probs = self._children(frontier_logits, width, sampling)
            if probs is not None:
                node_probs.update({node: probs[:, f] for f, node in enumerate(frontier)})
            first = len(parents)
            parents += [node for node in frontier for _ in range(width)]
            depths += [depth] * children.shape[1]
            tokens.append(children)
            frontier = list(range(first, len(parents)))
            if depth < len(self.widths):
                drafted = torch.cat(tokens, dim=1)[:, 1:]
                mask = tree_mask(torch.tensor(parents, device=device))[1:, 1:]
                positions = (lengths - 1)[:, None] + torch.tensor(depths[1:], device=device)
                logits = hf.forward(self.model, cache, drafted, positions, mask)
                frontier_logits = logits[:, first - 1 :]
        cache.set_lengths(lengths - 1)
        tree = TokenTree(torch.cat(tokens, dim=1), torch.tensor(parents, device=device).expand(batch, -1))
        draft_probs = None
        if sampling is not None:
            vocab = frontier_logits.shape[-1]
            draft_probs = torch.zeros(batch, len(parents), vocab, device=device)
            for node, probs in node_probs.items():
                draft_probs[:, node] = probs
        return Draft(tree, draft_probs)


class MergedDrafter(Drafter):
    """Several drafters' deterministic proposals merged into one tree per row.

    Each drafter's root-to-leaf paths are inserted, drafter by drafter, into one trie
    (`TokenTree.from_sequences`): shared prefixes appear once, siblings are distinct, and
    the tree verifies with draft_probs=None (exact for any deterministic proposal set).
    Draft models inside are asked for their top-w tokens even when generation samples.

    Args:
        drafters: the drafters to merge, in priority order (earlier ones get lower node ids).
    """

    def __init__(self, drafters: Sequence[Drafter]):
        self.drafters = list(drafters)
        if not self.drafters:
            raise ValueError("MergedDrafter needs at least one drafter")
        self.max_nodes = sum(d.max_nodes for d in self.drafters)
        self.models = tuple(m for d in self.drafters for m in d.models)

    def start(self, history, lengths, capacity):
        for d in self.drafters:
            d.start(history, lengths, capacity)

    def keep_rows(self, rows):
        for d in self.drafters:
            d.keep_rows(rows)

    def finish(self):
        for d in self.drafters:
            d.finish()

    def propose(self, history, lengths, sampling=None, budget=None) -> Draft:
        """Merge the drafters' deterministic proposals (`sampling` is not used)."""
        trees = [d.propose(history, lengths, None).tree for d in self.drafters]
        batch = history.shape[0]
        sequences = [[] for _ in range(batch)]
        for tree in trees:
            parents = tree.parents.tolist()
            for b in range(batch):
                real = [i for i, p in enumerate(parents[b]) if i == 0 or p >= 0]
                has_child = {p for p in parents[b] if p >= 0}
                sequences[b] += [tree.path_tokens(b, i)[1:] for i in real if i > 0 and i not in has_child]
        roots = root_tokens(history, lengths).tolist()
        merged = TokenTree.from_sequences(roots, sequences, self.max_nodes)
        return Draft(trimmed(merged.to(history.device)))
