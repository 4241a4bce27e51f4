"""Drafters: what proposes the token tree the target verifies each step.

One small interface (`Drafter`): `propose(history, lengths, sampling, budget)` returns a
`Draft`, a `TokenTree` whose root is each row's last token, plus `draft_probs` when the
drafted children were sampled and `scores` (the drafter's estimate that each node is
accepted) where it has a confidence. `history [B, S]` holds every row's tokens left-aligned
(prompt without padding, then the generated tokens); `lengths [B]` counts them; `budget [B]`
(adaptive speculation, see `planner`) caps each row's drafted nodes. Drafters that keep
state (a draft model's KV cache) derive it from `history`, so they need no accept hook;
drafters that read the target's hidden states (learned heads) set `needs_hidden_states`
and get them through `observe`.

- `NgramDrafter`: prompt lookup; a chain (`ngram_propose`) or a tree (`ngram_propose_tree`).
- `DraftModelDrafter`: a small causal LM; a chain of k tokens or a SpecInfer expansion tree.
  Greedy: the top-w distinct tokens per node (deterministic, verified with draft_probs=None).
  Sampling: siblings drawn i.i.d. from the draft's warped distribution, whose probabilities
  are passed to `verify` (multi-step speculative sampling).
- `SuffixDrafter`: trees from a cache of every sequence seen (`SuffixIndex`): this call's
  rows (siblings draft from each other), earlier calls' prompts and outputs, added texts.
- `MergedDrafter`: several drafters' proposals merged into one trie (shared prefixes once).
  `ScoredMergedDrafter`: the same for drafters with scores, each node scored by the best of
  its sources (what the planner prunes by).
  It always asks its drafters for deterministic proposals (a draft model then proposes its
  top-w tokens even when sampling) and verifies with draft_probs=None, which is exact for
  any deterministic proposal set: verification samples from the target and follows the
  matching child. No draft probabilities are combined.
"""

import copy
import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..ops._extension import COMPILED
from ..ops.ngram import ngram_propose, ngram_propose_tree
from ..ops.ngram_index import NgramIndex
from ..ops.suffix_index import SuffixIndex
from ..ops.tree import TokenTree, tree_mask
from ..ops.trie import merge_scored_trees
from .cost_model import cost_identity, cost_twin, model_identity


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
    """A proposal: `tree` (tokens [B, T], root = last token; parents [B, T]),
    `draft_probs [B, T, V]` (the distribution node i's children were drawn from) or None
    for deterministic proposals (distinct siblings), and `scores`: None or fp32 [B, T], the
    drafter's estimate that each node would be accepted (its path probability from the
    root: 1.0 at the root, non-increasing along a path; padding nodes anything)."""

    tree: TokenTree
    draft_probs: Optional[torch.Tensor] = None
    scores: Optional[torch.Tensor] = None


def keep_nodes(draft: Draft, keep: torch.Tensor):
    """`draft` reduced to the nodes `keep [B, T]` marks (the root and every kept node's
    parent must be kept), renumbered in their order with the padding trailing.

    Returns:
        (Draft, new_index [B, T]): new_index[b, i] is kept node i's index in the new tree.
    """
    tree = draft.tree
    device = tree.tokens.device
    keep_host = keep.cpu().numpy()
    tokens, parents, old = _kept_layout(tree.tokens.cpu().numpy().astype(np.int64),
                                       tree.parents.cpu().numpy().astype(np.int64), keep_host)
    old = torch.from_numpy(old).to(device)
    probs = None
    if draft.draft_probs is not None:
        probs = draft.draft_probs.gather(1, old[:, :, None].expand(-1, -1, draft.draft_probs.shape[2]))
    scores = None if draft.scores is None else draft.scores.gather(1, old)
    new_tree = TokenTree(torch.from_numpy(tokens).to(device, tree.tokens.dtype),
                         torch.from_numpy(parents).to(device, tree.parents.dtype))
    return Draft(new_tree, probs, scores), torch.from_numpy(keep_host.cumsum(1) - 1).to(device)


def _kept_layout(tokens: np.ndarray, parents: np.ndarray, keep: np.ndarray):
    """`keep_nodes`' renumbering on host arrays (int64 tokens and parents [B, T], bool keep):
    (tokens, parents, old) int64 [B, W], old[b, i] = the old index of new node i (padding:
    node 0). In numpy on the host: a few dozen numbers per row (a numpy op ~1 us, a torch op
    5-10 us inside the decode loop on a CPU; the planner prunes through it every step)."""
    rows, num_nodes = keep.shape
    new_index = keep.cumsum(1) - 1
    width = int(keep.sum(1).max())
    dest = np.where(keep, new_index, width)  # dropped nodes go to a sink column, cut below
    row = np.arange(rows)[:, None]
    new_parents = np.full((rows, width + 1), -1, dtype=np.int64)
    new_parents[row, dest] = np.where(parents >= 0, new_index[row, np.maximum(parents, 0)], -1)
    new_tokens = np.full((rows, width + 1), -1, dtype=np.int64)
    new_tokens[row, dest] = tokens
    old = np.zeros((rows, width + 1), dtype=np.int64)
    old[row, dest] = np.arange(num_nodes)
    new_tokens, new_parents, old = new_tokens[:, :width], new_parents[:, :width], old[:, :width]
    new_tokens[new_parents < 0] = -1
    new_tokens[:, 0] = tokens[:, 0]  # (the root has parent -1 too)
    return new_tokens, new_parents, old


def rank_nodes(estimate: torch.Tensor, real: torch.Tensor):
    """Each row's nodes ordered by `estimate [B, T]`, highest first, the root first of all.

    An estimate that never exceeds the parent's makes every prefix of the order
    ancestor-closed: the sort is stable, so a parent (a lower index) precedes a child with
    the same estimate. Keep row b's first n drafted nodes with `position <= n`.

    Returns:
        (order [B, T]: node ids in rank order, padding last; position [B, T]: each node's
        place in that order, root 0).
    """
    order, position = rank_order(estimate.detach().cpu().double().numpy(), real.cpu().numpy())
    return torch.from_numpy(order).to(estimate.device), torch.from_numpy(position).to(estimate.device)


def rank_order(estimate: np.ndarray, real: np.ndarray):
    """`rank_nodes` on host arrays (float estimate, bool real [B, T]): (order, position) int64."""
    ranked = np.where(real, estimate.astype(np.float64), -1.0)
    ranked[:, 0] = 2.0  # the root first
    order = np.argsort(-ranked, axis=1, kind="stable")  # descending, ties in node order
    position = np.empty_like(order)
    position[np.arange(order.shape[0])[:, None], order] = np.arange(order.shape[1])
    return order, position


def first_nodes(draft: Draft, counts: torch.Tensor) -> Draft:
    """`draft` with each row's first counts[b] drafted nodes (in node order, which is
    topological: a prefix is ancestor-closed) and padding after, trimmed. The choice looks
    at no drafted token, so it keeps sampled children exact."""
    tree = draft.tree
    node = torch.arange(tree.tokens.shape[1], device=tree.tokens.device)
    drop = node[None, :] > counts.to(tree.tokens.device)[:, None]
    parents = tree.parents.masked_fill(drop, -1)
    tokens = tree.tokens.masked_fill(drop, -1)
    width = max(int((~drop & ((parents >= 0) | (node == 0))).sum(1).max()), 1)
    probs = None if draft.draft_probs is None else draft.draft_probs[:, :width]
    scores = None if draft.scores is None else draft.scores[:, :width]
    return Draft(TokenTree._from_op(tokens[:, :width], parents[:, :width]), probs, scores)


def trimmed(tree: TokenTree) -> TokenTree:
    """`tree` without its trailing node columns that are padding in every row (a shorter
    target forward when drafts are short or missing)."""
    num_nodes = int(tree.num_nodes.max())
    return tree if num_nodes == tree.tokens.shape[1] else TokenTree._from_op(tree.tokens[:, :num_nodes], tree.parents[:, :num_nodes])


def root_tokens(history: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """int64 [B]: each row's last token."""
    return history.gather(1, (lengths.long() - 1)[:, None])[:, 0]


def no_draft(history: torch.Tensor, lengths: torch.Tensor) -> Draft:
    """Each row's root alone: a step that drafts nothing."""
    return Draft(TokenTree.chain(root_tokens(history, lengths), history.new_zeros(history.shape[0], 0)))


def upkeep_seconds(drafter) -> float:
    """`drafter.upkeep_seconds()`, or 0 for a drafter written without it (the interface
    gained it late; duck-typed drafters keep working)."""
    method = getattr(drafter, "upkeep_seconds", None)
    return 0.0 if method is None else float(method())


class Drafter:
    """Interface of a drafter used by `specdec_kernels.loop.generate`.

    Attributes:
        max_nodes: most drafted nodes per row and step (the tree has T <= 1 + max_nodes nodes).
        models: transformers models the drafter runs (switched to tree attention by `generate`).
        needs_hidden_states: `generate` calls `observe` with the target's hidden states
            (otherwise it never computes them for the drafter).
        hidden_layers: None (observe gets the LM head's input), or which of the target's
            hidden states observe gets, stacked (transformers' numbering: 0 the embeddings,
            i the output of decoder layer i, the last one the LM head's input).
        drafts_for_free: drafting its full size costs next to nothing (n-gram lookup), so the
            adaptive planner asks for the full draft and prunes it by the drafter's scores,
            instead of capping it beforehand from the rows' history alone.
        learning: its proposals change with what it serves (an online head): the adaptive
            planner then starts every call from its neutral acceptance prior instead of what
            earlier calls of drafters of its kind accepted (and does not record this one's).
    """

    max_nodes: int = 0
    models: tuple = ()
    needs_hidden_states: bool = False
    hidden_layers: Optional[tuple] = None
    drafts_for_free: bool = False
    learning: bool = False

    def start(self, history: torch.Tensor, lengths: torch.Tensor, capacity: int) -> None:
        """Called once after the target's prefill: `history [B, capacity]`, prompt lengths [B]."""

    def propose(self, history: torch.Tensor, lengths: torch.Tensor, sampling: Optional[Sampling] = None,
                budget: Optional[torch.Tensor] = None) -> Draft:
        """Propose a tree per row continuing `history[b, :lengths[b]]` (root = its last token).

        sampling: None asks for a deterministic proposal (draft_probs None).
        budget: None (the drafter's fixed size) or int64 [B], the most drafted nodes row b may
            return (0: the root only). A sampled tree must choose its nodes without looking
            at the sampled tokens (see `planner`).
        """
        return no_draft(history, lengths)

    def observe(self, hidden_states: torch.Tensor, accepted_nodes: Optional[torch.Tensor] = None,
                num_accepted: Optional[torch.Tensor] = None) -> None:
        """The target's hidden states (the input of its LM head, after the final norm), only
        for drafters with `needs_hidden_states`.

        After the prefill: `hidden_states [B, L, H]` at positions 0 .. max(lengths) - 2 of
        the left-aligned history (row b valid for its first lengths[b] - 1), with
        accepted_nodes / num_accepted None. After every verify forward: the tree's T nodes
        `[B, T, H]` with verify's accepted_nodes [B, T] and num_accepted [B], before finished
        rows leave the batch (`keep_rows` follows). With `hidden_layers`, [B, L or T,
        len(hidden_layers), H] instead.
        """

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Called when rows finish: from now on the batch is the old rows `rows` (int64
        indices, in that order); per-row state must follow."""

    def finish(self) -> None:
        """Called when generation ends: release per-call state (caches)."""

    def upkeep_seconds(self) -> float:
        """Seconds this drafter has spent so far (cumulative, over its life) on its own upkeep
        inside `propose` rather than on the step's draft: an online head's updates. The
        adaptive planner leaves them out of the step times it learns its costs from (a step
        that also trained the head would otherwise look like an expensive tree width)."""
        return 0.0

    def cost_identity(self) -> dict:
        """What sets this drafter's cost per step, the key of its measured drafting cost
        (`cost_model.DraftCost`, cached on disk): its kind, size and the shapes of the models it
        runs, never object ids (the measurement serves later processes). Drafters with
        settings that change their cost add them."""
        return {"drafter": type(self).__name__, "max_nodes": int(self.max_nodes),
                "models": [model_identity(m) for m in self.models]}

    def cost_twin(self) -> "Drafter":
        """A drafter that drafts like this one at the same cost and shares no state with it
        that outlives a call: the cost calibration runs it on made-up rows. A shallow copy
        (`start` gives it its own per-call state); drafters whose state outlives calls (a
        suffix cache, an online head) return a twin without it."""
        return copy.copy(self)


class NgramDrafter(Drafter):
    """Prompt-lookup drafts: the tokens that followed the latest n-gram earlier in the history.

    Chains use the incremental `NgramIndex` (one slot per row, fed the tokens each step
    appended: O(max_n) per token instead of rescanning the history); trees call
    `ngram_propose_tree` on the history. Both give the same drafts. A history on a GPU is
    matched there when the extension has a compiled kernel for that GPU, else on the host
    (the index, or the tree op on a copy of the history) and the drafts are moved to the
    GPU: the GPU's fallback, the plain-torch reference, is a Python loop with host syncs.

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
        self.drafts_for_free = tree_width == 1  # chains carry scores to prune by (trees: capped by history)
        self.index = None

    def start(self, history, lengths, capacity):
        """Chains matched on the host: index every row's prompt (slot b = row b)."""
        self.index = None
        on_host = history.is_cpu or _no_compiled_kernel(history.device, "ngram_propose")
        if self.tree_width == 1 and on_host and NgramIndex.has_compiled_backend():
            self.index = NgramIndex(history.shape[0], max_n=self.max_n)
            for b, n in enumerate(lengths.tolist()):
                self.index.reset(b, history[b, :n])
            self.slots = torch.arange(history.shape[0])
            self.indexed = lengths.long().cpu().clone()  # tokens of each row the index holds

    def keep_rows(self, rows):
        if self.index is not None:
            self.slots, self.indexed = self.slots[rows], self.indexed[rows]

    def cost_identity(self):
        return {**super().cost_identity(), "min_n": self.min_n, "max_n": self.max_n, "num_tokens": self.num_tokens,
                "tree_width": self.tree_width, "policy": self.policy}

    def finish(self):
        self.index = None

    def propose(self, history, lengths, sampling=None, budget=None) -> Draft:
        """Deterministic n-gram proposal (see class docstring); `sampling` is ignored. With a
        `budget`, chains are cut to it and trees keep their best-ranked nodes (the kernel
        numbers them by how many matches give the continuation).

        Chains come with `scores` (`match_scores`): how likely each node is accepted, from
        the length of the n-gram the continuation was found with. Trees have none (the
        planner judges them by each row's acceptance history)."""
        most = self.max_nodes if budget is None else min(int(budget.max()), self.max_nodes)
        args = dict(min_n=self.min_n, max_n=self.max_n, policy=self.policy)
        depth = min(self.num_tokens, max(most, 1))  # a chain of `most` nodes at most
        root = root_tokens(history, lengths)
        if self.tree_width > 1:
            tokens = history[:, : int(lengths.max())]
            if _no_compiled_kernel(tokens.device, "ngram_propose_tree") and "CPU" in COMPILED["ngram_propose_tree"]:
                tree = ngram_propose_tree(tokens.cpu(), lengths.cpu(), num_tokens=self.num_tokens,
                                          tree_width=self.tree_width, max_nodes=most, **args).to(tokens.device)
            else:
                tree = ngram_propose_tree(tokens, lengths, num_tokens=self.num_tokens, tree_width=self.tree_width,
                                          max_nodes=most, **args)
            tree.tokens[:, 0] = root
            draft = Draft(TokenTree(tree.tokens.long(), tree.parents))
            return first_nodes(draft, budget) if budget is not None else Draft(trimmed(draft.tree))
        if self.index is not None:
            # Feed each row the tokens appended since the last step, then propose (on the host:
            # a GPU history sends only the appended tokens).
            host_lengths = lengths.long().cpu()
            new = host_lengths - self.indexed
            j = torch.arange(max(int(new.max()), 1))
            gather_at = (self.indexed[:, None] + j).clamp(max=history.shape[1] - 1)
            appended = history.gather(1, gather_at.to(history.device))
            drafts, draft_lens = self.index.append_and_propose(self.slots, appended, new, num_tokens=depth, **args)
            self.indexed = host_lengths

            def found_with(min_n):  # which rows have a match of min_n tokens or more
                return self.index.propose(self.slots, min_n=min_n, max_n=self.max_n, num_tokens=1)[1] > 0
        else:
            tokens = history[:, : int(lengths.max())]
            drafts, draft_lens = ngram_propose(tokens, lengths, num_tokens=depth, **args)

            def found_with(min_n):
                return ngram_propose(tokens, lengths, min_n=min_n, max_n=self.max_n, num_tokens=1)[1] > 0
        draft_lens = _cut(draft_lens, budget)
        # The matched n-gram's length: 1 + how many longer minimum lengths still find a match
        # (the search tries the longest n first, so a match of >= m tokens is the same match).
        # On the host in numpy: a few numbers per row, where each torch op costs 5-10 us
        # inside the decode loop on a CPU (one host read per query on a GPU).
        found = draft_lens.cpu().numpy() > 0
        matched = np.where(found, self.min_n, 0)
        for m in range(self.min_n + 1, self.max_n + 1):
            matched += found & found_with(m).cpu().numpy()
        # Rows matching the longest n-gram: how far the match really goes (a copy in progress
        # matches dozens of tokens, and its drafts are far likelier to hold than a 4-gram's).
        longest = np.flatnonzero(found & (matched >= self.max_n))
        if longest.size:
            rows = torch.from_numpy(longest).to(history.device)
            history_rows = history[rows, : int(lengths[rows].max())]
            extended = suffix_match_lengths(history_rows, lengths[rows], drafts[rows, 0].to(history.device))
            matched[longest] = np.maximum(matched[longest], extended.cpu().numpy())
        # Host-matched drafts join the history's device here, once, cut to the longest chain
        # (a chain built at its width keeps the depths it knows; a cut one would recompute them).
        width = 1 + int(draft_lens.max()) if draft_lens.numel() else 1
        tree = TokenTree.chain(root, drafts[:, : width - 1].long().to(root.device), draft_lens.to(root.device))
        scores = match_scores(torch.from_numpy(matched).to(root.device), width - 1)
        return Draft(tree, scores=scores)


def _no_compiled_kernel(device: torch.device, op: str) -> bool:
    """Whether `op` on `device` tensors would run the plain-torch reference (no compiled
    kernel for that device): on a GPU a per-row Python loop with a host sync per match."""
    return device.type not in ("cpu", "meta") and device.type.upper() not in COMPILED[op]


def suffix_match_lengths(history: torch.Tensor, lengths: torch.Tensor, first_tokens: torch.Tensor,
                         longest: int = 32) -> torch.Tensor:
    """int64 [B]: how many of each row's last tokens (at most `longest`) also occur earlier in
    its history right before an occurrence of `first_tokens[b]` (the draft's first token):
    the length of the longest earlier context that predicts the draft. 0 where none does.

    A history on the CPU is matched in numpy, at the occurrences of each row's first token
    only (O(occurrences * longest) per row); elsewhere one comparison per (earlier position,
    suffix token) on the device, O(B * S * longest) elementwise work (no host reads).
    """
    if history.device.type == "cpu":
        return _suffix_match_lengths_host(history.numpy(), lengths.long().numpy(), first_tokens.long().cpu().numpy(),
                                          longest)
    return _suffix_match_lengths_device(history, lengths, first_tokens, longest)


def _suffix_match_lengths_host(history: np.ndarray, lengths: np.ndarray, first_tokens: np.ndarray,
                               longest: int) -> torch.Tensor:
    """`suffix_match_lengths` in numpy, row by row: the earlier positions e followed by the
    row's first token (e + 1 < its length), each compared backwards with its last tokens."""
    out = np.zeros(history.shape[0], dtype=np.int64)
    back = np.arange(longest)
    for b, (n, first) in enumerate(zip(lengths.tolist(), first_tokens.tolist())):
        row = history[b, :n]
        ends = np.flatnonzero(row[1:] == first)  # e with row[e + 1] == first, e + 1 < n
        if ends.size == 0:
            continue
        suffix = row[::-1][:longest]  # the row's last tokens, last first
        at = ends[:, None] - back[None, : suffix.size]  # [E, s]: positions e, e - 1, ...
        same = (at >= 0) & (row[np.maximum(at, 0)] == suffix[None, :])
        out[b] = np.cumprod(same, axis=1).sum(1).max()
    return torch.from_numpy(out)


def _suffix_match_lengths_device(history: torch.Tensor, lengths: torch.Tensor, first_tokens: torch.Tensor,
                                 longest: int) -> torch.Tensor:
    """`suffix_match_lengths` in torch ops on the history's device (no host reads)."""
    rows, width = history.shape
    lengths = lengths.long()
    j = torch.arange(longest, device=history.device)
    # suffix[b, j] = the row's (j + 1)-th last token (-1 before its start)
    back = lengths[:, None] - 1 - j[None, :]
    suffix = torch.where(back >= 0, history.gather(1, back.clamp(min=0)), -1)
    # windows[b, e, j] = history[b, e - j]: the tokens ending at earlier position e, backwards
    padded = torch.cat([history.new_full((rows, longest - 1), -2), history], 1)
    windows = padded.unfold(1, longest, 1).flip(2)  # [B, S, longest]
    same = windows == suffix[:, None, :]
    run = same.long().cumprod(2).sum(2)  # [B, S]: matching tokens backwards from position e
    e = torch.arange(width, device=history.device)
    following = history.gather(1, (e + 1).clamp(max=width - 1).expand(rows, -1))
    # An earlier occurrence ends before the suffix's own last token and is followed by the draft.
    usable = (e[None, :] + 1 < lengths[:, None]) & (following == first_tokens.long()[:, None])
    return torch.where(usable, run, 0).amax(1)


# Acceptance of n-gram drafts by matched length n (greedy, fixed 10-token chains, dev prompts
# 10-19 of code completion, code edit and summarisation, none of the benchmarked ones; n
# beyond max_n from `suffix_match_lengths`; 870 steps): the first drafted token was accepted
# 21 % of the time after a 1-token match, 47 % after 2, 62 % after 3, 80 % after 4, 77 % after
# 5-6 and 91-100 % after 7 or more; each further token, once the one before it was, 77 % (n =
# 1), 83-86 % (n = 2-4) and 90-94 % (n >= 10). These curves follow those numbers (only their
# ratios matter much: the planner rescales scores by what each row accepted).
def match_scores(matched: torch.Tensor, depth: int) -> torch.Tensor:
    """float32 [B, 1 + depth]: estimated acceptance of a chain's nodes (root 1, then depth
    1..depth) for rows whose drafts were found with a match of `matched [B]` tokens (0: no
    draft): first(n) * next(n) ** (d - 1), first(n) = 0.93 - 0.72 * 0.6 ** (n - 1) and
    next(n) = 0.94 - 0.17 * 0.8 ** (n - 1)."""
    # A lookup in a table of every match length up to the largest asked (two ops a step
    # instead of ~20 small ones: host time that a GPU step waits on).
    rows = max(int(matched.max()) + 1 if matched.numel() else 1, 33)
    return _score_table(rows, depth, matched.device)[matched.long().clamp(min=0)]


@functools.lru_cache(maxsize=64)
def _score_table(rows: int, depth: int, device: torch.device) -> torch.Tensor:
    """float32 [rows, 1 + depth]: `match_scores` for matched = 0 .. rows - 1 (computed in
    float64, as the formula is written)."""
    matched = torch.arange(rows, dtype=torch.float64)
    n = matched.clamp(min=1)[:, None]
    d = torch.arange(1, depth + 1, dtype=torch.float64)[None, :]
    first, later = 0.93 - 0.72 * 0.6 ** (n - 1), 0.94 - 0.17 * 0.8 ** (n - 1)
    scores = torch.where(matched[:, None] > 0, first * later ** (d - 1), 0.0)
    return torch.cat([scores.new_ones(rows, 1), scores], 1).float().to(device)


def _cut(draft_lens: torch.Tensor, budget: Optional[torch.Tensor]) -> torch.Tensor:
    """Chain lengths cut to the per-row budget."""
    return draft_lens if budget is None else torch.minimum(draft_lens.long(), budget.to(draft_lens.device))


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

    def cost_identity(self):
        return {**super().cost_identity(), "widths": list(self.widths)}

    def _children(self, logits, width, sampling):
        """[B, F, V] logits -> (children [B, F * width], their draft probabilities [B, F * width],
        probs [B, F, V] they were sampled from, or None when chosen greedily)."""
        batch, num_parents, vocab = logits.shape
        if sampling is None:
            top = logits.topk(width, dim=-1)
            # Confidence of a greedy child: its probability under the draft at temperature 1.
            chosen = torch.softmax(logits, dim=-1).gather(-1, top.indices)
            return top.indices.reshape(batch, -1), chosen.reshape(batch, -1), None
        from ..ops.sampling import target_probs

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
        chosen = probs.gather(1, children)
        return children.reshape(batch, -1), chosen.reshape(batch, -1), probs.reshape(batch, num_parents, vocab)

    def propose(self, history, lengths, sampling=None, budget=None) -> Draft:
        """Draft a tree (see class docstring); sampled children come with draft_probs; scores
        are the draft's path probabilities. With a `budget`, only the depths some row needs
        are drafted (a forward per depth), then a greedy tree keeps each row's best nodes by
        score and a sampled tree its first nodes in node order (never chosen by the samples)."""
        from . import hf

        cache, device = self.cache, history.device
        batch = history.shape[0]
        lengths = lengths.long()
        root = root_tokens(history, lengths)[:, None]
        most = self.max_nodes if budget is None else min(int(budget.max()), self.max_nodes)
        if most == 0:  # no row drafts: no forward (the cache catches up at the next draft)
            return Draft(TokenTree(root, root.new_full((batch, 1), -1)), scores=torch.ones(batch, 1, device=device))
        num_depths = next(d for d, size in enumerate(self.level_sizes, start=1) if sum(self.level_sizes[:d]) >= most)
        widths = self.widths[:num_depths]
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
        tokens, parents, depths = [root], [-1], [0]
        scores = [torch.ones(batch, 1, device=device)]
        node_probs, frontier = {}, [0]
        for depth, width in enumerate(widths, start=1):
            children, chosen, probs = self._children(frontier_logits, width, sampling)
            if probs is not None:
                node_probs.update({node: probs[:, f] for f, node in enumerate(frontier)})
            parent_scores = torch.cat(scores, dim=1)[:, frontier]
            scores.append(parent_scores.repeat_interleave(width, dim=1) * chosen)
            first = len(parents)
            parents += [node for node in frontier for _ in range(width)]
            depths += [depth] * children.shape[1]
            tokens.append(children)
            frontier = list(range(first, len(parents)))
            if depth < len(widths):
                drafted = torch.cat(tokens, dim=1)[:, 1:]
                mask = tree_mask(torch.tensor(parents, device=device))[1:, 1:]
                positions = (lengths - 1)[:, None] + torch.tensor(depths[1:], device=device)
                logits = hf.forward(self.model, cache, drafted, positions, mask)
                frontier_logits = logits[:, first - 1 :]
        cache.set_lengths(lengths - 1)
        tree = TokenTree(torch.cat(tokens, dim=1), torch.tensor(parents, device=device).expand(batch, -1))
        scores = torch.cat(scores, dim=1).float()
        draft_probs = None
        if sampling is not None:
            vocab = frontier_logits.shape[-1]
            draft_probs = torch.zeros(batch, len(parents), vocab, device=device)
            for node, probs in node_probs.items():
                draft_probs[:, node] = probs
        draft = Draft(tree, draft_probs, scores)
        if budget is None or bool((budget >= tree.tokens.shape[1] - 1).all()):
            return draft
        if sampling is not None:
            return first_nodes(draft, budget)
        real = tree.parents >= 0
        _, position = rank_nodes(scores, real)
        keep = (position <= budget[:, None]) & (real | (position == 0))
        return keep_nodes(draft, keep)[0]


MERGE, PROBE, SKIP = "merge", "probe", "skip"  # what a merged drafter does with a source at a step (`SourceJudge`)


class SourceJudge:
    """Judges a merged drafter's sources by what the rows emitted after their drafts: which
    sources to merge at each step, and how much each source's scores are worth.

    Why: a source that rarely adds an accepted token the others did not also draft costs its
    lookup, its share of the merge and the planner's attention at every step for nothing (a
    suffix cache of unrelated requests); and sources score on their own scales (a head's path
    probability; a suffix cache's continuation counts times match-length odds, which overrate
    a sibling's sampled token against the target's likelier one), so the best raw score may
    not be the likeliest node.

    What is measured: each step, every source asked at the step before is judged against the
    tokens each row emitted since, whether or not the planner verified its nodes.
    - Its *reach*: how many of those tokens its tree holds as a path from the root. The
      sources' paths along the emitted tokens are prefixes of one path, so a source adds
      max(0, its reach - the largest other asked source's reach) tokens; decayed counts of
      added tokens and of rows judged give its rate (added tokens per row and step).
    - Its first pick: the depth-1 node it scored highest, a hit when that is the first emitted
      token; decayed sums of hits and of those nodes' scores give its factor (hits + prior) /
      (scores + prior), by which its scores are multiplied before merging (a row's first-level
      scores kept <= 1). An optional source counts only the first picks no other asked source
      made (what it adds to the merge).

    What is done (`plan`): `required` sources are always merged. Another is asked without being
    merged (a probe: its drafts are judged, never verified, so the planner's acceptance
    history only sees merged nodes) for its first `warmup` judged rows and every
    `probe_every`-th step after, merged while its rate is at least `min_rate`, and otherwise
    skipped. A skipped source loses nothing: the incremental drafters (n-gram index, suffix
    cache) take every token appended since they were last asked. What is merged and how it is
    scored depend on past outcomes only, so verification stays exact. The counts belong to the
    drafter object (kept across `generate` calls, like a suffix cache's contents; a seed
    reproduces a sampled output with a fresh drafter, or the same state).

    Args:
        required: per source, whether it is always merged.
        min_rate: added tokens per row and step at or above which an optional source is merged
            (0.02: one token in 50 row-steps, about what a lookup costs at batch 1 on a CPU).
        decay: multiplies the counts at each judged step (0.97: about the last 30 steps count).
        warmup: rows an optional source is judged on (as a probe) before it may be merged.
        probe_every: a source not merged is probed at every probe_every-th step.
        prior: weight of the factor's prior of 1, in first picks' scores.
    """

    def __init__(self, required: Sequence[bool], *, min_rate: float = 0.02, decay: float = 0.97,
                 warmup: int = 32, probe_every: int = 16, prior: float = 2.0):
        self.required = [bool(r) for r in required]
        self.min_rate, self.decay, self.warmup, self.probe_every, self.prior = min_rate, decay, warmup, probe_every, prior
        sources = len(self.required)
        self.added, self.judged = [0.0] * sources, [0.0] * sources  # decayed tokens added, rows judged
        self.first_hits, self.first_scores = [0.0] * sources, [0.0] * sources  # decayed first picks' hits, scores
        self.seen = [0] * sources  # rows each source was judged on, in all
        self.steps = 0
        # The last step's lengths [B] and per source (None: not asked) its tree (tokens,
        # parents [B, T]) and first pick (token, score [B]; token -1: none), numpy.
        self._last = None

    def cost_twin(self) -> "SourceJudge":
        """The judge of a drafter's cost twin: fresh counts, optional sources probed only (made-up
        rows match nothing; the calibrated cost is that of steps where they are not merged)."""
        return SourceJudge(self.required, min_rate=float("inf"), decay=self.decay, warmup=0,
                           probe_every=self.probe_every, prior=self.prior)

    def rates(self) -> list:
        """Each source's added tokens per row and step (decayed)."""
        return [added / max(judged, 1e-9) for added, judged in zip(self.added, self.judged)]

    def factors(self) -> list:
        """Each source's score factor (its first picks' hits over their scores, with the prior)."""
        return [(hits + self.prior) / (scores + self.prior) for hits, scores in zip(self.first_hits, self.first_scores)]

    def plan(self) -> list:
        """What to do with each source at this step (one call per step): MERGE, PROBE or SKIP."""
        self.steps += 1
        probe = self.steps % self.probe_every == 0
        out = []
        for required, seen, rate in zip(self.required, self.seen, self.rates()):
            if required or (seen >= self.warmup and rate >= self.min_rate):
                out.append(MERGE)
            else:
                out.append(PROBE if probe or seen < self.warmup else SKIP)
        return out

    def scaled(self, source: int, draft: Draft) -> torch.Tensor:
        """float32 [B, T]: `draft`'s path scores (unscored: 0.5 ** depth) times the source's
        factor, capped per row so that no first-level score exceeds 1."""
        # (in numpy on the host: a few numbers per row, where each torch op costs 5-10 us in the loop)
        depths = draft.tree.depths.cpu().numpy()
        scores = draft.scores.float().cpu().numpy() if draft.scores is not None else \
            np.float32(0.5) ** np.maximum(depths, 0).astype(np.float32)
        first = np.where(depths == 1, scores, np.float32(0.0)).max(1, keepdims=True)
        factor = np.minimum(np.float32(self.factors()[source]), np.float32(1.0) / np.maximum(first, np.float32(1e-9)))
        return torch.from_numpy(np.where(depths >= 1, scores * factor, scores).astype(np.float32))

    def start(self) -> None:
        """A new call: its first step has nothing to judge (the counts stay)."""
        self._last = None

    def keep_rows(self, rows: torch.Tensor) -> None:
        if self._last is not None:
            lengths, drafts = self._last
            rows = rows.cpu().numpy()
            self._last = (lengths[rows], [None if d is None else tuple(a[rows] for a in d) for d in drafts])

    def observe(self, drafts: Sequence[Optional[Draft]], history: torch.Tensor, lengths: torch.Tensor) -> None:
        """Judge the last step's drafts against what the rows emitted since, then keep `drafts`
        (this step's, raw scores; None for a source not asked) for the next step."""
        lengths = lengths.cpu().numpy().astype(np.int64)
        self._judge(history, lengths)
        kept = []
        for draft in drafts:
            if draft is None:
                kept.append(None)
                continue
            tokens, parents = draft.tree.tokens.cpu().numpy(), draft.tree.parents.cpu().numpy()
            scores = draft.scores.float().cpu().numpy() if draft.scores is not None else np.full(tokens.shape, 0.5)
            rows, pick = np.arange(tokens.shape[0]), np.where(parents == 0, scores, -1.0).argmax(1)
            picked = parents[rows, pick] == 0  # the row has a depth-1 node
            kept.append((tokens, parents, np.where(picked, tokens[rows, pick], -1), np.where(picked, scores[rows, pick], 0.0)))
        self._last = (lengths, kept)

    def _judge(self, history: torch.Tensor, lengths: np.ndarray) -> None:
        if self._last is None:
            return
        before, drafts = self._last
        count = np.maximum(lengths - before, 0)  # tokens each row emitted since
        width = int(count.max()) if count.size else 0
        if width == 0:
            return
        at = np.minimum(before[:, None] + np.arange(width), history.shape[1] - 1)
        emitted = history.gather(1, torch.from_numpy(at).to(history.device)).cpu().numpy()  # [B, width]
        judged = count > 0
        reach = {}
        for source, draft in enumerate(drafts):
            if draft is None:
                continue
            tokens, parents, pick, pick_score = draft
            node = np.zeros(count.shape[0], dtype=np.int64)  # where each row's walk stands (the root)
            walking, reached = judged.copy(), np.zeros(count.shape[0], dtype=np.int64)
            for depth in range(width):  # one emitted token deeper per round
                child = (parents == node[:, None]) & (tokens == emitted[:, depth : depth + 1])
                found = walking & (depth < count) & child.any(1)
                if not found.any():
                    break
                node = np.where(found, child.argmax(1), node)
                reached += found
                walking = found
            reach[source] = reached
            picked = judged & (pick >= 0)
            if not self.required[source]:
                # An optional source is judged on the first picks only it proposed: where another
                # source picked the same token its score adds nothing, and counting those hits
                # would scale up its scores where it stands alone (best-of-8 code edit: a suffix
                # cache scaled x1.35 so, its siblings' samples outranked the head's tokens).
                for other, theirs in enumerate(drafts):
                    if other != source and theirs is not None:
                        picked &= pick != theirs[2]
            self.first_hits[source] = self.first_hits[source] * self.decay + float((picked & (pick == emitted[:, 0])).sum())
            self.first_scores[source] = self.first_scores[source] * self.decay + float(pick_score[picked].sum())
        rows = float(judged.sum())
        for source, reached in reach.items():
            others = [r for s, r in reach.items() if s != source]
            best_other = np.maximum.reduce(others) if others else np.zeros_like(reached)
            self.added[source] = self.added[source] * self.decay + float(np.maximum(reached - best_other, 0).sum())
            self.judged[source] = self.judged[source] * self.decay + rows
            self.seen[source] += int(rows)


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
        self.needs_hidden_states = any(d.needs_hidden_states for d in self.drafters)
        layers = {d.hidden_layers for d in self.drafters if d.needs_hidden_states}
        if len(layers) > 1:
            raise ValueError(f"MergedDrafter: its drafters read different hidden layers of the target: {sorted(map(str, layers))}")
        self.hidden_layers = layers.pop() if layers else None
        self.learning = any(getattr(d, "learning", False) for d in self.drafters)

    judge: Optional[SourceJudge] = None  # set by merged drafters that judge their sources

    def start(self, history, lengths, capacity):
        for d in self.drafters:
            d.start(history, lengths, capacity)
        if self.judge is not None:
            self.judge.start()

    def keep_rows(self, rows):
        for d in self.drafters:
            d.keep_rows(rows)
        if self.judge is not None:
            self.judge.keep_rows(rows)

    def finish(self):
        for d in self.drafters:
            d.finish()

    def upkeep_seconds(self):
        return sum(upkeep_seconds(d) for d in self.drafters)

    def cost_identity(self):
        return {"drafter": type(self).__name__, "parts": [cost_identity(d) for d in self.drafters]}

    def cost_twin(self):
        twin = copy.copy(self)
        twin.drafters = [cost_twin(d) for d in self.drafters]
        if self.judge is not None:
            twin.judge = self.judge.cost_twin()
        return twin

    def observe(self, hidden_states, accepted_nodes=None, num_accepted=None):
        for d in self.drafters:
            if d.needs_hidden_states:
                d.observe(hidden_states, accepted_nodes, num_accepted)

    def split_budget(self, budget: torch.Tensor) -> list:
        """Each drafter's share of the per-row `budget` [B], in proportion to its size (the
        rounding remainder to the first drafters; no share above a drafter's size)."""
        budget = budget.long().clamp(max=self.max_nodes)
        sizes = torch.tensor([d.max_nodes for d in self.drafters], device=budget.device)
        shares = budget[None, :] * sizes[:, None] // max(self.max_nodes, 1)  # [D, B]
        left = budget - shares.sum(0)
        for i in range(len(self.drafters)):  # a handful of drafters, vectorised over rows
            extra = torch.minimum(left, sizes[i] - shares[i])
            shares[i] += extra
            left = left - extra
        return list(shares)

    def propose(self, history, lengths, sampling=None, budget=None) -> Draft:
        """Merge the drafters' deterministic proposals (`sampling` is not used); with a
        `budget`, each drafter gets its share (`split_budget`) and each row keeps its first
        budget[b] merged nodes (in the drafters' priority order). No scores: the drafters'
        confidences are not comparable with each other."""
        shares = [None] * len(self.drafters) if budget is None else self.split_budget(budget)
        trees = [d.propose(history, lengths, None, share).tree for d, share in zip(self.drafters, shares)]
        batch = history.shape[0]
        sequences = [[] for _ in range(batch)]
        for tree in trees:
            parents = tree.parents.tolist()
            for b in range(batch):
                real = [i for i, p in enumerate(parents[b]) if i == 0 or p >= 0]
                has_child = {p for p in parents[b] if p >= 0}
                sequences[b] += [tree.path_tokens(b, i)[1:] for i in real if i > 0 and i not in has_child]
        roots = root_tokens(history, lengths).tolist()
        merged = Draft(TokenTree.from_sequences(roots, sequences, self.max_nodes).to(history.device))
        return first_nodes(merged, budget) if budget is not None else Draft(trimmed(merged.tree))


class SuffixDrafter(Drafter):
    """Drafts from a suffix cache of every token sequence it has seen (`SuffixIndex`).

    What it sees: each `generate` call's prompts and every token its rows emit, as soon as
    they are emitted, so the rows of one batch draft from each other (best-of-n samples of
    one prompt: what one sibling wrote is a likely draft for the others); what earlier calls
    with this same object saw (the cache persists in the object, up to `max_tokens`, oldest
    evicted first); and what `add(token_lists)` gives it (a code base, documents, earlier
    transcripts). Each step, per row: the longest suffix of the row's tokens (up to
    `max_depth`) found in the cache, and the trie of the continuations that followed its
    newest `max_candidates` occurrences (up to `num_tokens` deep, the `max_nodes` most
    frequent nodes). Rows with the same prompt share its cached copy (`SuffixIndex.fork`), so
    n samples do not count the prompt n times.

    Drafts are deterministic (verified with draft_probs None: sampled rows stay exact). Each
    node's score is its empirical path probability, shrunk for few occurrences and weighted
    by how long the matched suffix was: count / (occurrences + 0.5) * first(n) * next(n) **
    (depth - 1), with first/next the n-gram match curves of `match_scores`; the adaptive
    planner keeps what pays. The cost per step (append + draft) does not grow with the cache.

    A seed reproduces a sampled output only with the same cache contents (the tree verified
    depends on them; its distribution does not). The tokens of each row's last step are not
    cached (a drafter sees tokens when asked for the next draft).

    Args:
        max_tokens: cache budget in tokens (92 bytes each, fixed at creation).
        num_tokens: deepest continuation drafted.
        max_nodes: most drafted nodes per row and step.
        max_depth: longest suffix matched (<= 32).
        max_candidates: occurrences whose continuations form the tree.
    """

    drafts_for_free = True

    def __init__(self, max_tokens: int = 1 << 20, num_tokens: int = 16, max_nodes: int = 32, max_depth: int = 32,
                 max_candidates: int = 8):
        if num_tokens < 1 or max_nodes < 1:
            raise ValueError(f"num_tokens and max_nodes must be >= 1, got {num_tokens} and {max_nodes}")
        self.num_tokens, self.max_nodes = num_tokens, max_nodes
        self.max_depth, self.max_candidates = max_depth, max_candidates
        self.index = SuffixIndex(1, max_tokens=max_tokens, max_depth=max_depth, max_candidates=max_candidates)
        self.slots = None

    def cost_identity(self):
        return {**super().cost_identity(), "num_tokens": self.num_tokens, "max_depth": self.max_depth,
                "max_candidates": self.max_candidates}

    def cost_twin(self):
        """An empty cache with the same settings: a step's cost does not grow with the cache
        (so a small one, which allocates less, costs the same)."""
        return SuffixDrafter(1 << 16, self.num_tokens, self.max_nodes, self.max_depth, self.max_candidates)

    def add(self, token_lists) -> None:
        """Cache finished token sequences (lists or 1-D int tensors of token ids)."""
        self.index.add(token_lists)

    def clear(self) -> None:
        """Forget everything cached."""
        self.index.clear()

    @property
    def cached_tokens(self) -> int:
        """Tokens the cache holds."""
        return self.index.cached_tokens

    def start(self, history, lengths, capacity):
        """Each row starts a live sequence in slot b; a prompt equal to an earlier row's is
        forked from it (cached once)."""
        batch = history.shape[0]
        self.index.reserve_slots(batch)
        host = history.cpu()
        seen = {}
        for b, n in enumerate(lengths.tolist()):
            prompt = host[b, :n]
            key = tuple(prompt.tolist())
            if key in seen:
                self.index.fork(b, seen[key])
            else:
                self.index.start(b, prompt)
                seen[key] = b
        self.slots = torch.arange(batch)
        self.indexed = lengths.long().cpu().clone()  # tokens of each row the index holds

    def keep_rows(self, rows):
        rows = rows.cpu()
        self.slots, self.indexed = self.slots[rows], self.indexed[rows]

    def finish(self):
        self.slots = None

    def propose(self, history, lengths, sampling=None, budget=None) -> Draft:
        """Append what each row emitted since the last step (every row first: siblings see
        each other's tokens), then draft every row (see the class docstring). `sampling` is
        not used; a `budget` keeps each row's best budget[b] nodes."""
        host_lengths = lengths.long().cpu()
        new = host_lengths - self.indexed
        j = torch.arange(max(int(new.max()), 1))
        gather_at = (self.indexed[:, None] + j).clamp(max=history.shape[1] - 1)
        appended = history.gather(1, gather_at.to(history.device)).cpu()
        out = self.index.append_and_draft(self.slots, appended, new, num_tokens=self.num_tokens,
                                          max_nodes=self.max_nodes)
        self.indexed = host_lengths
        tree = trimmed(TokenTree._from_op(out.tokens, out.parents))
        width = tree.tokens.shape[1]
        depths = tree.depths
        curve = match_scores(out.match_lengths.long(), self.num_tokens)  # [B, 1 + num_tokens]
        counts = out.counts[:, :width].double()
        share = counts / (counts[:, :1] + 0.5)
        scores = torch.where(tree.parents >= 0, share * curve.gather(1, depths.clamp(min=0)).double(), 0.0)
        scores[:, 0] = 1.0
        draft = Draft(tree, None, scores.float())
        if budget is not None:
            _, position = rank_nodes(draft.scores, tree.parents >= 0)
            keep = (position <= budget.cpu()[:, None]) & ((tree.parents >= 0) | (position == 0))
            draft = keep_nodes(draft, keep)[0]
        device = history.device
        return Draft(TokenTree._from_op(draft.tree.tokens.to(device), draft.tree.parents.to(device)), None,
                     draft.scores.to(device))


class ScoredMergedDrafter(MergedDrafter):
    """Several drafters' deterministic proposals merged into one tree per row, each node
    scored by the best of its sources' scores (an unscored proposal counts each node as
    0.5 ** depth), each source's scaled by how often its first picks were right
    (`SourceJudge`), so the adaptive planner keeps the nodes most likely accepted from any
    source. The first drafter is merged at every step, the others while they add accepted
    tokens the rest do not (`SourceJudge`). Used by `default_drafter` to put a row's own
    n-gram drafts and the suffix cache into one tree.

    Args:
        drafters: the drafters to merge, in priority order (earlier ones get lower node ids).
    """

    def __init__(self, drafters: Sequence[Drafter]):
        super().__init__(drafters)
        self.drafts_for_free = all(d.drafts_for_free for d in self.drafters)
        self.judge = SourceJudge([i == 0 for i in range(len(self.drafters))])

    def propose(self, history, lengths, sampling=None, budget=None) -> Draft:
        """Merge the drafters' proposals with scores, as the judge plans (`sampling` is not
        used); with a `budget`, each drafter gets its share (`MergedDrafter.split_budget`)."""
        shares = [None] * len(self.drafters) if budget is None else self.split_budget(budget)
        plan = self.judge.plan()
        drafts = [None if what == SKIP else d.propose(history, lengths, None, share)
                  for d, share, what in zip(self.drafters, shares, plan)]
        draft = merge_judged(self.judge, plan, drafts, history, lengths, self.max_nodes)
        if budget is not None:
            draft = first_nodes(draft, budget.to(draft.tree.tokens.device))
        return draft


def merge_judged(judge: SourceJudge, plan: Sequence[str], drafts: Sequence[Optional[Draft]], history: torch.Tensor,
                 lengths: torch.Tensor, max_nodes: int) -> Draft:
    """The drafts `plan` merges, in one trie per row (`merge_scored_trees`, at most `max_nodes`
    drafted nodes), each node scored by the best of its drafts' scores as `judge` scales them,
    trimmed, on history's device; the judge sees every asked draft (merged or probed) first."""
    merged = [(source, d) for source, (d, what) in enumerate(zip(drafts, plan)) if what == MERGE]
    scores = [judge.scaled(source, d) for source, d in merged]  # (on the host)
    judge.observe(drafts, history, lengths)
    tokens, parents, best = merge_scored_trees(root_tokens(history, lengths).tolist(),
                                               [(d.tree.tokens.cpu(), d.tree.parents.cpu()) for _, d in merged],
                                               scores, max_nodes)
    tree = trimmed(TokenTree._from_op(tokens, parents))
    device = history.device
    return Draft(TokenTree._from_op(tree.tokens.to(device), tree.parents.to(device)), None,
                 best[:, : tree.tokens.shape[1]].to(device))
