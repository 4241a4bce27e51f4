"""Adaptive speculation: how many draft nodes each row verifies, step by step.

Speculation pays only when the tokens a step adds outweigh what drafting them and verifying
them costs. Each step the planner maximises the batch's expected emitted tokens per second
(goodput):

    goodput = (R + sum over verified nodes of P(node accepted)) / step_seconds(R, width)

R rows each emit one token plus their accepted drafts; a step's cost is the target's forward
(`CostModel`: it depends on the rows and the tree width, every row's tree padded to the
widest) plus, when the step drafts, the drafter's (`DraftCost`: by rows and drafted nodes;
plain decoding drafts nothing), so the planner picks
one width level n and gives each row its best min(n, useful) nodes: nodes below the widest
row's cost nothing more, and rows whose nodes are not worth min_gain draft nothing (plain
decoding). Under a batch node budget (`max_batch_nodes`), the nodes go to the rows with the
largest expected gains first.

Two decisions per step:
1. `budget()` before drafting, from each row's history: P(the rank-r node is accepted), the
   product of decayed rates per rank of acceptance given the parent's (rank = the node's place
   in the row's priority order; for a chain, its depth). Drafters draft at most that many
   nodes (a draft model skips the depths no row needs). Drafting n nodes costs what the
   drafter measured for n; when no row's nodes repay it, the step does not draft at all
   (`drafting` False: plain decoding), except that after `PROBE_AFTER` such steps in a row
   it drafts and verifies one node per row (a probe: rows that never draft never learn that
   drafting would pay again). A drafter that `drafts_for_free` is asked for its
   full draft every step instead (its cost, measured too, is then paid whatever the plan).
2. `select(draft)` after drafting: each node's estimate multiplies, along its path, the
   drafter's own conditional scores (from path probabilities, n-gram match lengths) scaled
   by how well the row's scores predicted its acceptance so far, or the rank rates where the
   drafter has no scores; the best nodes are kept (ancestor-closed: a node's estimate never
   exceeds its parent's, and ties keep the parent, which comes first). The drafting is paid
   by then: it counts in every choice's step time alike.
Drafts deeper than a row's remaining tokens (max_new_tokens) could not be emitted: never
verified.

Exactness. Verification is exact for any tree chosen from the past (earlier steps' outcomes,
timings, scores of deterministic proposals), so greedy output and sampled distributions do
not depend on the plan. One case needs care: children *sampled* from draft_probs. Keeping a
sampled child because of its own score would select on the sampled value (a child with high
q(x) is kept more often), and the kept children would no longer be i.i.d. draws from q, so
the SpecInfer acceptance test would be biased. Sampled trees are therefore never pruned by
score: their budget is fixed before drafting (from history only), and the drafter keeps the
first nodes of its fixed structure (a depth/width choice that does not look at the samples).
"""

import json
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np
import torch

from .cost_model import CostModel, DraftCost, draft_identity, host_array, identity, tensor_parallel
from .drafters import Draft, keep_nodes, rank_order


# What rows of earlier calls accepted, per (cost model key, drafter kind): the prior of new
# rows, so a call does not spend its first steps relearning what the last one knew.
_LEARNED: Dict[str, float] = {}


def choose_counts(gains: torch.Tensor, step_seconds: torch.Tensor, *, max_batch_nodes: Optional[int] = None,
                  min_gain: float = 0.0) -> torch.Tensor:
    """How many nodes each row verifies, for the best expected tokens per second.

    Args:
        gains: float [R, N], each row's candidate nodes' acceptance probabilities, sorted
            descending per row (absent nodes 0).
        step_seconds: float [N + 1] (a tensor or numpy array), predicted seconds of a step
            whose widest tree has 1 + n nodes (n = 0 .. N).
        max_batch_nodes: most drafted nodes over all rows (None: no limit).
        min_gain: nodes with a gain <= min_gain are never verified.

    Returns:
        int64 [R] on gains' device: row r verifies its first counts[r] nodes.
    """
    rows, num = gains.shape
    if tuple(step_seconds.shape) != (num + 1,):
        raise ValueError(f"step_seconds: expected shape ({num + 1},), got {tuple(step_seconds.shape)}")
    if max_batch_nodes is not None and max_batch_nodes < 0:
        raise ValueError(f"max_batch_nodes: expected >= 0 or None, got {max_batch_nodes}")
    # On the host in numpy: a handful of numbers, asked every step (a numpy op ~1 us, a torch
    # op 5-10 us inside the decode loop and ~20 us on a GPU's host).
    counts = _choose_counts(host_array(gains), host_array(step_seconds), max_batch_nodes, min_gain)
    return torch.from_numpy(counts).to(gains.device)


def _choose_counts(gains: np.ndarray, step_seconds: np.ndarray, max_batch_nodes: Optional[int],
                   min_gain: float) -> np.ndarray:
    """`choose_counts` on float64 numpy arrays."""
    rows, num = gains.shape
    if rows == 0 or num == 0:
        return np.zeros(rows, dtype=np.int64)
    useful = gains > min_gain
    gains = gains * useful
    available = useful.sum(1)  # [R]: a row's useful nodes (a prefix, since sorted)
    levels = np.arange(num + 1)
    counts = np.minimum(levels[:, None], available[None, :])  # [N + 1, R]: each row's nodes at level n
    cumulative = np.concatenate([np.zeros((rows, 1)), gains.cumsum(1)], 1)  # [R, N + 1]
    expected = rows + cumulative.sum(0)  # [N + 1]: expected tokens at level n
    if max_batch_nodes is not None:
        over = counts.sum(1) > max_batch_nodes
        if over.any():
            # Levels over the budget keep the budget's best nodes among their ranks < n (ties:
            # the earlier row, then the earlier rank).
            ranks = np.arange(num)
            masked = np.where(ranks[None, None, :] < levels[over][:, None, None], gains[None], 0.0).reshape(-1, rows * num)
            top = np.argsort(-masked, axis=1, kind="stable")[:, : min(max_batch_nodes, rows * num)]
            values = np.take_along_axis(masked, top, 1)
            chosen = np.zeros_like(masked)
            np.put_along_axis(chosen, top, (values > 0).astype(np.float64), 1)
            counts[over] = chosen.reshape(-1, rows, num).sum(2).astype(np.int64)
            expected[over] = rows + values.sum(1)
    width = counts.max(1)  # the widest row sets the step's cost
    goodput = expected / step_seconds[width]
    # The cheapest level within rounding of the best (a tie buys nothing for the extra compute).
    best = int(np.flatnonzero(goodput >= goodput.max() * (1 - 1e-9))[0])
    return counts[best].astype(np.int64)


class AcceptanceModel:
    """Per row: a decayed acceptance rate per rank, conditional on the node's parent being
    accepted, and the drafter's typical conditional score per rank.

    A node can only be accepted if its parent was, so the model learns P(rank-k node accepted
    | its parent accepted): hit[r, k] / tried[r, k], decayed counts of steps where row r's
    rank-k node (its k-th best drafted node; for a chain, depth k + 1) was verified with its
    parent on the accepted path, and was accepted. A chain rejected at depth 2 so tells
    nothing about depths 3 and beyond (counting them as misses would make one rejected copy,
    e.g. at a renamed identifier in a code edit, shrink the next drafts for many steps). The
    rate is (hit + alpha * w) / (tried + w), w = rank_weight: measured where the row has
    reached rank k often, else near the row's per-token acceptance alpha (one rejection at a
    rank does not undo what the row's other drafts showed), alpha = accepted / (accepted +
    rejected) drafts (a rejection: the accepted path stopped where a verified child existed;
    prior `prior`, weight prior_weight).
    A node's estimate is the product of the conditional rates along its path, so unmeasured
    deep ranks follow alpha: a row that verifies one node and always accepts it looks worth
    drafting deeper, and gets measured. All counts decay every step, so a row that stopped
    verifying drifts back to the prior and tries again.

    Scores: drafters give path scores (acceptance estimates: path probabilities, n-gram match
    odds); a node's conditional score is its score over its parent's. score_sum[r, k] is the
    decayed sum of the verified (parent accepted) rank-k nodes' conditional scores; a node's
    conditional estimate is its conditional score times hit / score_sum of its rank (both
    starting from alpha * w): without history a score counts at face value, and as the row
    verifies nodes of a rank, its scores are judged against what they turned out to be worth.
    """

    def __init__(self, rows: int, max_nodes: int, device=None, *, decay: float = 0.8, prior: float = 0.6,
                 prior_weight: float = 1.0, rank_weight: float = 3.0):
        # The state lives on the host whatever the rows' device (`device` is accepted and
        # ignored): a few numbers per row, read and updated every step in numpy through
        # `.numpy()` views of these CPU tensors (a numpy op on them ~1 us; a torch op 5-10 us
        # inside the decode loop, and a GPU kernel plus a sync on a GPU).
        self.decay, self.prior_weight, self.rank_weight = decay, prior_weight, rank_weight
        self.hit = torch.zeros(rows, max_nodes + 1, dtype=torch.float64)  # last column: padding sink
        self.tried = torch.zeros_like(self.hit)
        self.score_sum = torch.zeros_like(self.hit)
        self.prior = prior
        self.accepted = torch.zeros(rows, dtype=torch.float64)
        self.rejected = torch.zeros_like(self.accepted)

    def alpha(self) -> torch.Tensor:
        """float64 [R]: each row's per-token acceptance (decayed, with the prior)."""
        return torch.from_numpy(self.alpha_np())

    def alpha_np(self) -> np.ndarray:
        """`alpha` as a numpy array."""
        w, accepted = self.prior_weight, self.accepted.numpy()
        return (accepted + self.prior * w) / (accepted + self.rejected.numpy() + w)

    def conditional_rates(self) -> torch.Tensor:
        """float64 [R, N]: P(the rank-k node is accepted | its parent is)."""
        return torch.from_numpy(self.conditional_rates_np())

    def conditional_rates_np(self) -> np.ndarray:
        """`conditional_rates` as a numpy array."""
        w = self.rank_weight
        return ((self.hit.numpy() + self.alpha_np()[:, None] * w) / (self.tried.numpy() + w))[:, :-1]

    def rank_rates(self) -> torch.Tensor:
        """float64 [R, N]: P(the rank-k node is accepted) for a chain (node k's parent is
        node k - 1): the product of the conditional rates, non-increasing in k."""
        return torch.from_numpy(self.rank_rates_np())

    def rank_rates_np(self) -> np.ndarray:
        """`rank_rates` as a numpy array."""
        return self.conditional_rates_np().cumprod(1)

    def estimates(self, scores: Optional[torch.Tensor], parent_ranks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """float64 [R, K] (on the host): acceptance estimates of each row's nodes in rank
        order, non-increasing in k.

        scores: [R, K] the nodes' path scores in rank order (None: the rates alone).
        parent_ranks: int [R, K], the rank of each node's parent (-1: the root); None: a chain
            (node k's parent is node k - 1). Parents rank before their children.
        (Tensors on any device, or numpy arrays.)
        """
        return torch.from_numpy(self.estimates_np(None if scores is None else host_array(scores),
                                                  None if parent_ranks is None else host_array(parent_ranks, torch.int64)))

    def estimates_np(self, scores: Optional[np.ndarray], parent_ranks: Optional[np.ndarray] = None) -> np.ndarray:
        """`estimates` on numpy arrays (float64 scores, int64 parent ranks)."""
        num = self.hit.shape[1] - 1
        k = scores.shape[1] if scores is not None else parent_ranks.shape[1] if parent_ranks is not None else num
        if k > num:
            raise ValueError(f"scores: {k} ranked nodes, but the model tracks {num}")
        rates = self.conditional_rates_np()[:, :k]
        if scores is not None:
            w = self.rank_weight
            alpha = self.alpha_np()[:, None]
            scores = np.maximum(scores, 0.0)
            parent_scores = np.ones_like(scores)
            if parent_ranks is None:
                parent_scores[:, 1:] = scores[:, :-1]
            else:
                parent_scores = np.where(parent_ranks >= 0,
                                         np.take_along_axis(scores, np.maximum(parent_ranks, 0), 1), 1.0)
            with np.errstate(divide="ignore", invalid="ignore"):
                conditional = np.minimum(np.where(parent_scores > 0, scores / parent_scores, 0.0), 1.0)
                typical = (self.score_sum.numpy()[:, :k] + alpha * w) / (self.tried.numpy()[:, :k] + w)
                ratio = np.minimum(np.where(typical > 0, conditional / typical, 1.0), 4.0)
            rates = np.minimum(rates * ratio, 1.0)
        if parent_ranks is None:
            path = rates.cumprod(1)
        else:  # parents rank first: one pass in rank order multiplies each path out
            path = rates.copy()
            rows = np.arange(path.shape[0])
            for j in range(1, k):
                parent = parent_ranks[:, j]
                path[:, j] = rates[:, j] * np.where(parent >= 0, path[rows, np.maximum(parent, 0)], 1.0)
        return np.minimum.accumulate(path, axis=1) if path.shape[1] else path

    def update(self, ranks: torch.Tensor, on_path: torch.Tensor, scores: Optional[torch.Tensor], active: torch.Tensor,
               rejected: Optional[torch.Tensor] = None, parents: Optional[torch.Tensor] = None) -> None:
        """One verified step: `ranks [R, T]` (rank of each tree node, -1 for the root and
        padding), `on_path [R, T]` (node accepted; the root is), `scores [R, T]` (path scores,
        the root's 1) or None, `active [R]` (rows still generating before this step),
        `rejected [R]` (the accepted path stopped where a verified child existed; None: where a
        node whose parent was accepted was not), `parents [R, T]` (node ids; None: a chain,
        node t's parent is node t - 1). Tensors on any device, or numpy arrays."""
        self.update_np(host_array(ranks, torch.int64), host_array(on_path, torch.bool),
                       None if scores is None else host_array(scores), host_array(active, torch.bool),
                       None if rejected is None else host_array(rejected, torch.bool),
                       None if parents is None else host_array(parents, torch.int64))

    def update_np(self, ranks: np.ndarray, on_path: np.ndarray, scores: Optional[np.ndarray], active: np.ndarray,
                  rejected: Optional[np.ndarray] = None, parents: Optional[np.ndarray] = None) -> None:
        """`update` on numpy arrays."""
        sink = self.hit.shape[1] - 1
        if parents is None:
            parents = np.broadcast_to(np.arange(ranks.shape[1]) - 1, ranks.shape)
        parents = np.maximum(parents, 0)
        verified = (ranks >= 0) & active[:, None]
        reached = verified & np.take_along_axis(on_path, parents, 1)  # verified with the parent accepted
        index = np.where(reached, ranks, sink)
        self.decay_np()
        hit, tried, score_sum = self.hit.numpy(), self.tried.numpy(), self.score_sum.numpy()
        accepted, rejected_counts = self.accepted.numpy(), self.rejected.numpy()
        hits = (reached & on_path).astype(np.float64)
        if rejected is None:
            rejected = (reached & ~on_path).any(1)
        accepted += hits.sum(1)
        rejected_counts += (rejected & active).astype(np.float64)
        rows = np.broadcast_to(np.arange(ranks.shape[0])[:, None], ranks.shape)
        np.add.at(tried, (rows, index), reached.astype(np.float64))
        np.add.at(hit, (rows, index), hits)
        if scores is not None:
            above = np.take_along_axis(scores, parents, 1)
            with np.errstate(divide="ignore", invalid="ignore"):
                conditional = np.clip(np.where(above > 0, scores / above, 0.0), 0.0, 1.0)
            np.add.at(score_sum, (rows, index), np.where(reached, conditional, 0.0))

    def decay_np(self) -> None:
        """Every count fades by `decay` (what each update does first; alone: a step that verified
        no drafted node, whose update adds nothing)."""
        for counts in (self.hit, self.tried, self.score_sum, self.accepted, self.rejected):
            counts.numpy()[...] *= self.decay

    def keep_rows(self, rows: torch.Tensor) -> None:
        rows = rows.cpu()
        self.hit, self.tried, self.score_sum = self.hit[rows], self.tried[rows], self.score_sum[rows]
        self.accepted, self.rejected = self.accepted[rows], self.rejected[rows]


@dataclass
class _Plan:
    """What the planner decided for the step in flight (for `observe`)."""

    ranks: np.ndarray  # [R, T] rank of each verified node, -1 root / padding
    parents: np.ndarray  # [R, T] of the verified tree
    scores: Optional[np.ndarray]
    rows: int
    width: int
    prefix: float
    draft_seconds: float  # what the drafting cost model predicts for the step's drafting (0: none)
    drafted: int = 0  # the drafting's budget (the widest row's nodes; 0: the step did not draft)
    drafting: Optional[float] = None  # the drafting's measured seconds (None: not measured)


PROBE_AFTER = 8  # steps without drafting before the planner drafts one node per row anyway (`budget`)


class Planner:
    """Chooses each row's verified draft nodes every step (see the module docstring).

    Args:
        cost_model: a `CostModel`; None: `CostModel.for_model(target)` at `start` (measured on
            first use, then cached).
        draft_cost: a `DraftCost` for the drafter of every call; None: `DraftCost.for_drafter(target,
            drafter)` at each `start` (measured on first use per target and drafter identity,
            then cached).
        max_batch_nodes: most drafted nodes verified per step over the whole batch (None: no
            limit beyond each drafter's size).
        min_gain: a node whose estimated acceptance is at most this is never verified.
        decay, prior: of the acceptance model (`AcceptanceModel`).
        verbose: print the calibration's progress line.
    """

    def __init__(self, cost_model: Optional[CostModel] = None, *, draft_cost: Optional[DraftCost] = None,
                 max_batch_nodes: Optional[int] = None, min_gain: float = 0.01, decay: float = 0.8, prior: float = 0.6,
                 verbose: bool = True):
        if max_batch_nodes is not None and (not isinstance(max_batch_nodes, int) or max_batch_nodes < 0):
            raise ValueError(f"max_batch_nodes: expected an int >= 0 or None, got {max_batch_nodes!r}")
        if not 0.0 <= min_gain < 1.0:
            raise ValueError(f"min_gain: expected a value in [0, 1), got {min_gain}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay: expected a value in [0, 1), got {decay}")
        if not 0.0 < prior < 1.0:
            raise ValueError(f"prior: expected a value in (0, 1), got {prior}")
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise ValueError(f"cost_model: expected a CostModel or None, got {type(cost_model).__name__}")
        if draft_cost is not None and not isinstance(draft_cost, DraftCost):
            raise ValueError(f"draft_cost: expected a DraftCost or None, got {type(draft_cost).__name__}")
        self.cost_model, self.max_batch_nodes, self.min_gain = cost_model, max_batch_nodes, min_gain
        self._measure = cost_model is None  # ours to (re)load when the target changes
        self.draft_cost, self._measure_drafts = draft_cost, draft_cost is None
        self.decay, self.prior, self.verbose = decay, prior, verbose
        self.acceptance: Optional[AcceptanceModel] = None
        self._plan: Optional[_Plan] = None
        self._reproducible = False
        self._free = False  # the call's drafter drafts_for_free
        self._drafted = 0  # the step's drafting: the widest row's budget (free drafters: their size), 0 none
        self._idle, self._probing = 0, False

    def start(self, target, rows: int, max_nodes: int, device, drafter=None, reproducible: bool = False) -> None:
        """Per generate call: the cost model (measured or loaded once) and fresh row histories,
        whose prior per-token acceptance is what earlier calls with the same target and kind
        of drafter measured (else `prior`).

        reproducible: plan from the calibrated cost models (the target's and the drafter's,
        both read from disk once measured) and this call's rows only (no
        measured step times, nothing learned in earlier calls), so the plan, and with it a
        sampled output, is the same for the same seed every time. Greedy output never
        depends on the plan; sampled output does (a different tree draws other numbers).
        A tensor-parallel target always plans this way: every rank must choose the same
        trees (the same forward shapes), so no rank may plan from its own step timings.
        """
        reproducible = reproducible or tensor_parallel(target)
        key = identity(target)
        if self._measure or self.cost_model is None:
            if self.cost_model is None or self.cost_model.key != key:
                self.cost_model = CostModel.for_model(target, verbose=self.verbose)
        elif self.cost_model.key != key:
            raise ValueError(f"cost_model: measured for {self.cost_model.key}, but the target is {key}; "
                             "pass cost_model=None to measure this target")
        if drafter is not None and self._measure_drafts:
            self.draft_cost = DraftCost.for_drafter(target, drafter, verbose=self.verbose)
        elif drafter is not None and self.draft_cost.key != draft_identity(target, drafter):
            raise ValueError(f"draft_cost: measured for {self.draft_cost.key}, but the call's is "
                             f"{draft_identity(target, drafter)}; pass draft_cost=None to measure this drafter")
        self._free = bool(getattr(drafter, "drafts_for_free", False))
        self.max_nodes = max_nodes
        # The drafter's kind: its class, size and the model objects it runs (another draft
        # model is another drafter, even with the same shapes).
        # An online head (`learning`) is not the drafter it was in an earlier call, nor like a
        # frozen copy of its kind: no key, so each call starts it from the neutral prior and
        # rows try it again (a remembered low acceptance kept a learning head from ever
        # drafting, and so from showing what it learnt), and its calls set no one's prior.
        kind = [type(drafter).__name__, max_nodes, [id(m) for m in getattr(drafter, "models", ())]]
        learning = getattr(drafter, "learning", False)
        self._learned_key = None if learning else json.dumps([self.cost_model.key, kind], sort_keys=True, default=str)
        self._reproducible = reproducible
        use_learned = not reproducible and self._learned_key is not None
        prior = _LEARNED.get(self._learned_key, self.prior) if use_learned else self.prior
        self.acceptance = AcceptanceModel(rows, max_nodes, decay=self.decay, prior=prior)
        self.device = torch.device(device)  # the rows': where budgets go back to
        self._alpha_sum, self._alpha_rows = 0.0, 0
        self._plan, self._drafted = None, 0
        self._idle, self._probing = 0, False  # steps in a row without drafting; this step probes

    def _draft_seconds(self, rows: int, nodes: np.ndarray) -> np.ndarray:
        """float64 predicted seconds of drafting up to `nodes` nodes per row (0 for 0)."""
        if self.draft_cost is None:
            return np.zeros(np.shape(nodes))
        return self.draft_cost.seconds_np(rows, nodes, corrected=not self._reproducible)

    def _step_seconds(self, rows: int, prefix: float, num_nodes: int, drafted: Optional[int] = None) -> np.ndarray:
        """[num_nodes + 1]: predicted seconds of a step with trees 1 .. num_nodes + 1 wide.
        drafted None: drafting is still to be chosen, and a tree of n drafted nodes pays for
        drafting n (plain decoding for nothing); else the step drafted up to `drafted` nodes
        per row (0: nothing), paid whatever it verifies."""
        widths = np.arange(1, num_nodes + 2, dtype=np.float64)
        nodes = widths - 1 if drafted is None else np.full_like(widths, drafted)
        return self.cost_model.step_seconds_np(rows, widths, prefix, self._draft_seconds(rows, nodes),
                                               corrected=not self._reproducible)

    @property
    def drafting(self) -> bool:
        """Whether the step `budget` planned drafts (False: every row decodes plainly, and
        the drafter is not asked)."""
        return self._drafted > 0

    def budget(self, prefix: float, remaining: Optional[torch.Tensor] = None) -> torch.Tensor:
        """int64 [R]: the most nodes each row should draft this step (from its history).
        remaining: [R] tokens each row may still emit (None: no limit); a step emits the
        accepted drafts plus one token, so drafts deeper than remaining - 1 are worth nothing."""
        # (In numpy on the host, as the whole plan: see AcceptanceModel.)
        rates = self.acceptance.rank_rates_np()
        if remaining is not None:  # a chain's rank k sits at depth k + 1
            rank = np.arange(rates.shape[1])
            rates = np.where(rank[None, :] + 1 < host_array(remaining, torch.int64)[:, None], rates, 0.0)
        # A free drafter drafts its full size every step: paid at every level alike.
        seconds = self._step_seconds(rates.shape[0], prefix, rates.shape[1], self.max_nodes if self._free else None)
        counts = _choose_counts(rates, seconds, self.max_batch_nodes, self.min_gain)
        # A probe: after PROBE_AFTER steps without drafting, one node per row that may still
        # use it. Rows that stop drafting learn nothing more, and their rates only drift back
        # to the call's prior, which a short or unlucky earlier call may have left too low to
        # ever draft again (a benchmark's 4-token warm-up call once stopped every later call
        # from drafting on code edit, 40 tok/s where 110 was there to take). Deterministic:
        # the plan of a sampled call still depends on its own rows only.
        self._probing = False
        most = int(counts.max()) if counts.size else 0
        if not self._free and counts.size and most == 0:
            self._idle += 1
            if self._idle >= PROBE_AFTER:
                counts = (rates[:, 0] > 0).astype(np.int64) if rates.shape[1] else counts
                if self.max_batch_nodes is not None:  # the batch's node budget holds for probes too
                    counts = np.where(counts.cumsum(0) <= self.max_batch_nodes, counts, 0)
                self._probing = bool(counts.any())
                most = int(self._probing)
        if most > 0:
            self._idle = 0
        self._drafted = self.max_nodes if self._free else most
        return torch.from_numpy(counts).to(self.device)

    def select(self, draft: Draft, prefix: float, remaining: Optional[torch.Tensor] = None,
               drafting: Optional[float] = None) -> Draft:
        """The drafted tree cut to the nodes worth verifying (sampled trees: as drafted);
        remaining as in `budget` (nodes deeper than remaining - 1 are never verified).
        drafting: the seconds the drafter's `propose` took for `draft` (0 when the step did
        not draft; None: not measured), from which `observe_time` corrects the drafting's
        cost (`DraftCost.observe`) apart from the forward's (`CostModel.observe`)."""
        tree = draft.tree
        rows, width = tree.tokens.shape
        # The plan is made on the host: one copy of the tree's parents and scores there.
        parents = host_array(tree.parents, torch.int64)
        scores = None if draft.scores is None else host_array(draft.scores)
        real = parents >= 0  # drafted nodes (the root has parent -1)
        node = np.arange(width)
        paid = float(self._draft_seconds(rows, np.array([float(self._drafted)]))[0])
        if width == 1:  # a root-only tree (the step did not draft): no node to rank or cut
            self._plan = _Plan(np.full((rows, 1), -1, dtype=np.int64), parents, scores, rows, width, prefix, paid,
                               self._drafted, drafting)
            return draft
        if draft.draft_probs is not None:  # sampled children: never pruned by value (module docstring)
            self._plan = _Plan(np.where(real, node - 1, -1), parents, scores, rows, width, prefix, paid,
                               self._drafted, drafting)
            return draft
        # Rank the nodes by the drafter's scores, else in its node order (its priority).
        # (a writable array: torch warns on a read-only one, such as a broadcast of one row)
        key = scores if scores is not None else np.repeat((1.0 - node / width)[None, :], rows, 0)
        order, position = rank_order(key, real)
        ranked_scores = None if scores is None else np.take_along_axis(scores, order, 1)[:, 1:]
        parent_ranks = np.take_along_axis(position, np.maximum(np.take_along_axis(parents, order[:, 1:], 1), 0), 1) - 1
        num_real = real.sum(1)
        gains = self.acceptance.estimates_np(ranked_scores, parent_ranks)
        if remaining is not None:
            remaining = host_array(remaining, torch.int64)
            if (remaining <= num_real).any():
                depths = np.take_along_axis(host_array(tree.depths, torch.int64), order[:, 1:], 1)
                gains = np.minimum.accumulate(np.where(depths < remaining[:, None], gains, 0.0), axis=1)
        gains = np.where(node[None, : width - 1] < num_real[:, None], gains, 0.0)
        seconds = self._step_seconds(rows, prefix, width - 1, self._drafted)
        counts = _choose_counts(gains, seconds, self.max_batch_nodes, self.min_gain)
        if self._probing:  # a probe's node is verified whatever its estimate (see budget)
            counts = np.maximum(counts, (num_real > 0).astype(np.int64))
        if (counts >= num_real).all():  # nothing pruned: the draft as it is
            self._plan = _Plan(np.where(real, position - 1, -1), parents, scores, rows, width, prefix, paid,
                               self._drafted, drafting)
            return draft
        keep = (position <= counts[:, None]) & (real | (node == 0))
        draft, _ = keep_nodes(draft, torch.from_numpy(keep))
        # The kept nodes' ranks at their new places (keep_nodes renumbers them in order).
        new_index = keep.cumsum(1) - 1
        kept_parents = host_array(draft.tree.parents, torch.int64)
        kept_scores = None if draft.scores is None else host_array(draft.scores)
        ranks = np.full(kept_parents.shape, -1, dtype=np.int64)
        ranks[np.nonzero(keep)[0], new_index[keep]] = np.where(real, position - 1, -1)[keep]
        ranks[:, 0] = -1
        self._plan = _Plan(ranks, kept_parents, kept_scores, rows, kept_parents.shape[1], prefix, paid,
                           self._drafted, drafting)
        return draft

    def observe(self, out, active: torch.Tensor) -> None:
        """After verification: update the rows' acceptance from `out` (a VerifyOutput)."""
        plan = self._plan
        if plan.width == 1:
            # A root-only tree verified no drafted node: the update would only fade the counts
            # (a third of a millisecond of host ops, on every step that did not draft).
            self.acceptance.decay_np()
            return
        path = host_array(out.accepted_nodes, torch.int64)
        num_accepted = host_array(out.num_accepted, torch.int64)
        # on_path: the accepted path's nodes, the root included (indexed by a mask: a scatter
        # that sent the path's padding entries to node 0 could overwrite the root's mark)
        valid = (np.arange(path.shape[1])[None, :] <= num_accepted[:, None]) & (path >= 0)
        on_path = np.zeros(plan.ranks.shape, dtype=bool)
        on_path[np.nonzero(valid)[0], path[valid]] = True
        # Rejected: the last accepted node has a verified child (the path could have gone on).
        last = np.take_along_axis(path, num_accepted[:, None], 1)
        rejected = ((plan.parents == last) & (plan.ranks >= 0)).any(1)
        self.acceptance.update_np(plan.ranks, on_path, plan.scores, host_array(active, torch.bool), rejected, plan.parents)

    def observe_time(self, seconds: float) -> None:
        """The measured seconds of the step last planned (drafting to bookkeeping), against
        its prediction with the drafting it did."""
        if self._plan is not None and not self._reproducible:
            plan = self._plan
            drafting = plan.draft_seconds if plan.drafting is None else plan.drafting
            if plan.drafting is not None and plan.drafted > 0 and self.draft_cost is not None:
                self.draft_cost.observe(plan.rows, plan.drafted, plan.drafting)
            self.cost_model.observe(plan.rows, plan.width, plan.prefix, seconds, drafting)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Rows finished: the batch keeps `rows`; the leaving rows' acceptance is remembered."""
        leaving = torch.ones(self.acceptance.accepted.shape[0], dtype=torch.bool)
        leaving[rows.cpu()] = False
        self._remember(leaving)
        self.acceptance.keep_rows(rows)

    def finish(self) -> None:
        """The call ended: its rows' mean per-token acceptance becomes the next call's prior
        (kept inside [0.05, 0.95], so a later call still explores)."""
        self._remember(torch.ones_like(self.acceptance.accepted, dtype=torch.bool))
        if self._alpha_rows and self._learned_key is not None:
            _LEARNED[self._learned_key] = min(max(self._alpha_sum / self._alpha_rows, 0.05), 0.95)

    def _remember(self, which: torch.Tensor) -> None:
        self._alpha_sum += float(self.acceptance.alpha()[which].sum())
        self._alpha_rows += int(which.sum())
