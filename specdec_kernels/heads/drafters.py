"""Drafters built on learned heads: `EagleDrafter`, `MedusaDrafter` (`default_drafter`, in
`heads.default`, merges them with n-gram and suffix-cache drafts).

Both read the target's features (its LM head's input) that `generate` hands to `observe`
after the prefill and after every verify forward: no extra target pass. Both keep a feature
buffer per row: `features[b, i]` is the target's feature at position i (the one whose
logits predicted token i + 1), known for i < lengths[b] - 1 (the root's own feature is not
computed until the root is verified). An EAGLE head with `feature_layers` (EAGLE-3) asks
`generate` for those hidden states instead (`hidden_layers`) and buffers their fusion, its
input feature.

Trees are built best-first, EAGLE-2 style: every drafted node has a score, the product of
the draft probabilities along its path (the estimated chance that the target accepts the
whole path); each depth expands the `top_k` highest-scoring nodes of the previous depth,
and (greedy) the final tree keeps the `budget` highest-scoring candidates, which always
include their ancestors. Greedy trees are deterministic with distinct siblings
(draft_probs None). With sampling, each expanded node's children are drawn i.i.d. from the
head's (temperature / top-k / top-p warped) distribution and returned in `draft_probs`; no
child is ever dropped because of its own value (that would bias the sample): the kept nodes
are a prefix of the creation order, chosen by the budget alone.

`online=` (both drafters, and `default_drafter`): the head keeps learning from the target's
verified features while it serves (`heads.online.OnlineLearner`, hooked into `start`,
`propose`, `keep_rows` and `finish`); drafts stay proposals, so outputs stay exact.
"""

import copy
import functools
import itertools
import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from .. import config
from ..loop.cost_model import shapes_digest
from ..loop.drafters import (SKIP, Draft, Drafter, MergedDrafter, ScoredMergedDrafter, SourceJudge, merge_judged,
                             root_tokens)
from ..ops import decoder_layer as fused_op
from ..ops import rms_norm as norm_op
from ..ops.small_linear import choose_small_linear_rows, linear_weights, routed_linear, small_linears
from ..ops.sampling import target_probs
from ..ops.tree import TokenTree
from .common import check_target, input_embedding, lm_head_weight, read_head, text_config
from .modules import EagleHead, MedusaHeads, rope
from .online import OnlineLearner, OnlineOptions, native_bf16_cpu, training_copy

_TIE = 1e-6  # per-depth penalty on log scores: a parent always outranks its children
_LAYOUTS = {}  # (head shapes, CPU threads) -> small_linear_rows, measured once per process
# Entries per call of a long catch-up of the fused (CPU) head path (the prompt, after the
# prefill). Its mask is a causal chain, whose triangle tree attention computes directly (the
# twenty-third session; before, a 64-entry cap kept its T x T mask walk short); the cap now
# bounds a call's mask and activations. A 692-token prompt's first draft, 2-core AMD EPYC,
# interleaved, four rounds: chunks of 64 39-48 ms (bf16) / 37-57 (fp32), of 512 31-41 / 32-40,
# one call 30-36 / 31-41.
CATCH_UP_CHUNK = 512
# A batch's catch-up feeds each row alone when feeding them together would pad in more than
# this many entries per extra call (estimates for the 2-core AMD EPYC: a call ~0.2 ms of Python
# and a weight read from L3, an entry ~0.07 ms of a bf16 head layer's products).
PER_ROW_PADDING = 4


def _load(module_cls, target, head, kind):
    """Build a head module for `target` from a head directory (or return a module as is)."""
    if isinstance(head, module_cls):
        return head
    if not isinstance(head, (str, Path)):
        raise ValueError(f"head: expected a head directory (str or Path), got {type(head).__name__}")
    config, tensors = read_head(head, kind)
    check_target(config["target"], target, str(head))
    module = module_cls(config["head"])
    param = lm_head_weight(target)
    module.load_state_dict({k: (v.to(torch.float32) if v.is_floating_point() else v) for k, v in tensors.items()})
    return module.to(device=param.device).eval()


def _source(head):
    """The head directory a drafter was loaded from (None for a module passed as is)."""
    return Path(head) if isinstance(head, (str, Path)) else None


def _small_linear_rows(module, w_draft):
    """The row counts (lo, hi) at which an fp32 or bf16 head's products run our CPU kernel
    (`small_linear`): measured on its own weights and draft-vocabulary LM head once per process
    ((0, 0) for other dtypes and devices). The shipped head drafts in bf16, where torch's
    few-row `F.linear` is slow on CPUs with AMX (its 8 products at 1 row: 653 us against 265
    for ours, Xeon, 2 threads). Counts up to 32: a batch of 8 rows drafts 16-32 frontier nodes a depth."""
    if w_draft.device.type != "cpu" or w_draft.dtype not in (torch.float32, torch.bfloat16):
        return (0, 0)
    weights = linear_weights(module) + [w_draft]
    key = (tuple(tuple(w.shape) for w in weights), torch.get_num_threads())
    if key not in _LAYOUTS:
        _LAYOUTS[key] = choose_small_linear_rows(weights, counts=(1, 2, 4, 8, 16, 32), repeats=3)
    return _LAYOUTS[key]


def head_dtype(device) -> torch.dtype:
    """The heads' default compute dtype on `device`: bfloat16 on a GPU and on a CPU with bf16
    arithmetic (AVX512-BF16 or AMX: `online.native_bf16_cpu`), float32 on other CPUs (there
    torch and our kernels convert every bf16 product to fp32 first, and bf16 runs slower)."""
    device = torch.device(device)
    return torch.bfloat16 if device.type != "cpu" or native_bf16_cpu() else torch.float32


def _no_draft(history, lengths) -> Draft:
    """Each row's root alone (score 1): a step that drafts nothing."""
    root = root_tokens(history, lengths)
    return Draft(TokenTree.chain(root, history.new_zeros(history.shape[0], 0)), None,
                 torch.ones(history.shape[0], 1, device=history.device))


@functools.lru_cache(maxsize=None)
def _causal_mask(n: int) -> torch.Tensor:
    """bool [n, n], lower triangular (read only: shared between calls)."""
    return torch.ones(n, n, dtype=torch.bool).tril()


@functools.lru_cache(maxsize=None)
def _eye_mask(n: int) -> torch.Tensor:
    """bool [1, n, n] identity (read only: shared between calls)."""
    return torch.eye(n, dtype=torch.bool)[None]


def fuses_block(dtype, device) -> bool:
    """Whether a head's decoder block in `dtype` on `device` can run as one `decoder_layer` op,
    its norms as `rms_norm` ops (the compiled CPU kernels, fp32 or bf16, `config.fused_layers` on)."""
    return (config.fused_layers and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and fused_op.has_kernel() and norm_op.has_kernel())


class _HeadDrafter(Drafter):
    """What EAGLE and Medusa drafters share: the feature buffer, the draft vocabulary's LM
    head rows, and the best-first tree construction (`_build`)."""

    needs_hidden_states = True

    def __init__(self, target, module, max_nodes: int, depth: int, top_k: int, dtype, online=None, source=None):
        for name, value in (("max_nodes", max_nodes), ("depth", depth), ("top_k", top_k)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if dtype is None:
            dtype = head_dtype(lm_head_weight(target).device)
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be None, torch.float32, bfloat16 or float16, got {dtype}")
        self.dtype = dtype
        self.min_score = 0.0
        options = OnlineOptions.coerce(online)
        master = training_copy(module) if options is not None else None  # fp32, before the cast below
        self.target, self.head = target, module.to(dtype)
        self.max_nodes, self.depth, self.top_k = int(max_nodes), int(depth), int(top_k)
        self.vocab = module.draft_vocab.to(lm_head_weight(target).device)
        self.vocab_size = lm_head_weight(target).shape[0]
        if int(self.vocab.max()) >= self.vocab_size:
            raise ValueError("head: its draft vocabulary has token ids outside the target's vocabulary")
        self.w_draft = lm_head_weight(target).detach()[self.vocab].to(dtype)  # [N, H]
        # A step's head forwards see a few rows (the frontier, the tokens accepted since the
        # last step): on some CPUs our kernel runs those faster (specdec_kernels/small_linear.py); measured here.
        self.small_linear_rows = _small_linear_rows(self.head, self.w_draft)
        # EAGLE-3 heads read several of the target's layers; online learning also needs the
        # LM head's input (its labels), appended last.
        self.feature_layers = tuple(getattr(module, "feature_layers", ()))
        self.with_labels = bool(self.feature_layers) and options is not None
        final = int(text_config(target).num_hidden_layers)
        layers = self.feature_layers + ((final,) if self.with_labels else ())
        self.hidden_layers = layers or None
        self.features = self.labels = None
        self.source = source
        # Online adaptation (heads.online): the head keeps learning from what the target verifies.
        self.online = OnlineLearner(self, master, options, source) if options is not None else None

    def save(self, out_dir) -> Path:
        """Write the head (adapted, when online) as a head directory that `EagleDrafter` /
        `MedusaDrafter` load: fp16 weights, config naming the target. Online: the learner's
        fp32 weights; frozen: the serving head's (in the drafter's dtype)."""
        if self.online is not None:
            return self.online.save(out_dir)
        from .common import target_identity, write_head

        kind = "eagle" if isinstance(self.head, EagleHead) else "medusa"
        training = read_head(self.source)[0].get("training", {}) if self.source is not None else {}
        return write_head(out_dir, {"kind": kind, "head": dict(self.head.config), "target": target_identity(self.target),
                                    "training": training}, self.head.state_dict())

    # -- state -------------------------------------------------------------------------
    def start(self, history, lengths, capacity):
        self._rotary_table = None
        hidden = self.w_draft.shape[1]
        self.features = torch.zeros(history.shape[0], capacity, hidden, device=history.device, dtype=self.dtype)
        self.labels = torch.zeros_like(self.features) if self.with_labels else None
        self.known = lengths.long() - 1  # features known per row once observe has run
        if self.online is not None:
            self.online.started(history, lengths, capacity)

    def observe(self, hidden_states, accepted_nodes=None, num_accepted=None):
        if accepted_nodes is not None and not self.feature_layers and hidden_states.device.type == "cpu":
            # On a CPU the accepted path's few indices are Python ints: one gather and one
            # write, where the tensor path below takes ~10 tiny ops (5-10 us each in the loop).
            counts = [n + 1 for n in num_accepted.tolist()]
            nodes, known, last = accepted_nodes.tolist(), self.known.tolist(), self.features.shape[1] - 1
            rows = [b for b, n in enumerate(counts) for _ in range(n)]
            src = [max(nodes[b][j], 0) for b, n in enumerate(counts) for j in range(n)]
            slots = [min(known[b] + j, last) for b, n in enumerate(counts) for j in range(n)]
            self.features[rows, slots] = hidden_states[rows, src].to(self.dtype)
            self.known = self.known + torch.tensor(counts, dtype=self.known.dtype)
            return
        h = hidden_states.to(self.dtype)
        if accepted_nodes is not None:  # only the accepted path's nodes are kept (and fused)
            width = int(num_accepted.max()) + 1
            index = accepted_nodes[:, :width].long().clamp(min=0)
            h = h.gather(1, index.view(*index.shape, *[1] * (h.dim() - 2)).expand(*index.shape, *h.shape[2:]))
        labels = None
        if self.feature_layers:  # [B, T, layers (+ the LM head input), H]: fuse, keep the labels
            k = len(self.feature_layers)
            labels = h[:, :, k] if self.with_labels else None
            with torch.no_grad():
                h = self.head.input_features(h[:, :, :k])
        if accepted_nodes is None:
            self.features[:, : h.shape[1]] = h
            if labels is not None:
                self.labels[:, : h.shape[1]] = labels
            return
        j = torch.arange(h.shape[1], device=h.device)
        keep = j[None, :] <= num_accepted.long()[:, None]
        slots = (self.known[:, None] + j).clamp(max=self.features.shape[1] - 1)
        rows = torch.arange(h.shape[0], device=h.device)[:, None].expand_as(slots)
        self.features[rows[keep], slots[keep]] = h[keep]
        if labels is not None:
            self.labels[rows[keep], slots[keep]] = labels[keep]
        self.known = self.known + num_accepted.long() + 1

    def keep_rows(self, rows):
        if self.online is not None:
            self.online.keeping(rows)  # (reads the leaving rows' features first)
        self.features, self.known = self.features[rows], self.known[rows]
        if self.labels is not None:
            self.labels = self.labels[rows]

    def finish(self):
        if self.online is not None:
            self.online.finishing()
        self.features = self.labels = None

    @property
    def learning(self) -> bool:
        """True when the head adapts online (see `Drafter.learning`)."""
        return self.online is not None

    def upkeep_seconds(self) -> float:
        """The online head's update seconds so far (0 for a frozen head)."""
        return 0.0 if self.online is None else float(self.online.stats.update_seconds)

    def cost_identity(self) -> dict:
        """The head's kind and shapes, its draft vocabulary's size, dtype and tree settings (the
        target, whose LM head rows it reads, is in the cost's key beside it)."""
        return {"drafter": type(self).__name__, "max_nodes": self.max_nodes, "depth": self.depth, "top_k": self.top_k,
                "head": shapes_digest(self.head), "vocab": int(self.vocab.numel()), "dtype": str(self.dtype),
                "feature_layers": list(self.feature_layers)}

    def cost_twin(self):
        """A frozen twin: an online head's updates are upkeep, not drafting (the planner
        leaves them out of the step times it learns from too)."""
        twin = copy.copy(self)
        twin.online = None
        return twin

    def propose(self, history, lengths, sampling=None, budget=None) -> Draft:
        """Draft a tree per row (`_propose`, see the class docstring); online, the learner
        first labels the last step's outcome and, every `interval` steps, updates the head."""
        if self.online is not None:
            self.online.before_propose(history, lengths)
        if budget is not None and not bool((budget > 0).any()):
            # Nothing to draft this step: no head forward (EAGLE catches up on the skipped
            # tokens at its next draft, in one batched pass).
            draft = _no_draft(history, lengths)
        elif self.fuses_now():
            draft = self._propose(history, lengths, sampling, budget)  # (routes its products itself)
        else:
            with small_linears(self.head, self.small_linear_rows):  # (patching the modules: ~0.1 ms a call)
                draft = self._propose(history, lengths, sampling, budget)
        if self.online is not None:
            self.online.proposed(draft, lengths)
        return draft

    def fuses_now(self) -> bool:
        """Whether this step drafts through the fused block (the condition `fused_block()`
        checks, without gathering the weights). Medusa heads have no block."""
        return False

    def _logits(self, g):
        """Draft-vocabulary logits of head outputs g [..., H] (our kernel where measured faster)."""
        return routed_linear(g, self.w_draft, None, self.small_linear_rows)

    # -- the fused block (CPU) -----------------------------------------------------------
    # A drafter whose head is one Llama-family decoder block between an input projection and
    # a final norm (EAGLE, a one-layer MTP head) drafts with the block as one `decoder_layer`
    # op per forward on a CPU: no Python or torch dispatch inside the block (the torch-module
    # path spent most of a 1-2 row forward there). The op attends each row's cache prefix in
    # full and its new entries under a tree mask, so a tree depth re-feeds every node fed so
    # far with the new frontier (a few rows, which cost little more than one on a CPU: the
    # weights are read once) and each node sees its own ancestors only. Subclasses provide
    # `fused_block()` (weights, eps, scale or None), `_block_inputs`, `_block_outputs`,
    # `_rotary` (the block's cos / sin at positions [1, S]) and the block's caches.

    def _fused_tree(self, history, lengths, sampling, budget, block, cached, k_cache, v_cache):
        """Catch up the block's cache, then draft a best-first tree with the fused block. The
        cache holds entry i (feature i, token i + 1) at slot i for i < cached[b]. Tree node n
        (creation order) goes to slot prefix + n, at position prefix - 1 + its depth.

        Returns (the Draft, the new `cached`: lengths - 1, at least 0).

        The fused path runs on the CPU only, so the catch-up's index math is done on Python
        ints (a few per row): inside the loop every tiny tensor op costs 5-10 us (the target's
        forward has just evicted the dispatcher from the caches), and a one-depth draft is
        otherwise mostly such ops."""
        weights, eps, scale = block
        batch, width = history.shape
        hidden = self.features.shape[-1]
        prefix = [n - 1 for n in lengths.tolist()]  # entries 0 .. L-2 exist once caught up
        now_cached = torch.tensor([max(p, 0) for p in prefix])
        can_draft = [p > 0 for p in prefix]
        if not any(can_draft):
            return _no_draft(history, lengths), now_cached
        size = k_cache.shape[1]
        table = self._rotary_table  # (reset by start)
        if table is None or table[0].shape[0] < size:  # cos / sin of every cache slot, once per generate call
            cos, sin = self._rotary(torch.arange(size)[None])
            table = self._rotary_table = (cos[0].contiguous(), sin[0].contiguous())

        def run(x, positions, mask, seqlens, rows=slice(None)):
            # (rows: a slice of the batch, so the caches stay views the op writes through)
            out = torch.ops.specdec.decoder_layer(x.contiguous(), F.embedding(positions, table[0]),
                                                  F.embedding(positions, table[1]), weights, k_cache[rows],
                                                  v_cache[rows], mask.contiguous(), seqlens, scale, eps,
                                                  self.small_linear_rows[1] + 1)  # (BLAS where measured faster)
            return self._block_outputs(out)

        # Feed the entries since the last step, and at least the last one (its output drafts
        # the root's children): re-fed entries write the same keys and values again.
        last = [max(p - 1, 0) for p in prefix]
        base = [min(c, n) for c, n in zip(cached.tolist(), last)]
        counts = [max(p - b, 1) for p, b in zip(prefix, base)]
        capacity = self.features.shape[1]

        def catch_up(first, stop):
            """Feed rows [first, stop) their entries; returns (fed deeper, logits' input) of
            each row's last entry, [stop - first, ...] each. Rows with fewer entries than the
            longest pad theirs with scratch past their prefix (overwritten later); a row whose
            window would pass the cache's end starts earlier instead."""
            rows, count = stop - first, max(counts[first:stop])
            start = [max(min(b, size - count), 0) for b in base[first:stop]]
            ends = last[first:stop]
            positions = torch.tensor([[s + j for j in range(count)] for s in start])
            # Row b's entries idx = min(position, last) as flat indices into the feature
            # buffer and (idx + 1) into the history.
            idx = [[min(s + j, n) for j in range(count)] for s, n in zip(start, ends)]
            feats = self.features.view(-1, hidden)[torch.tensor([b * capacity + i for b, row in enumerate(idx, first)
                                                                 for i in row])]
            tokens = torch.take(history, torch.tensor([[b * width + i + 1 for i in row] for b, row in enumerate(idx, first)]))
            x = self._block_inputs(feats.view(rows, count, hidden), tokens, positions if min(start) == 0 else None)
            if count <= CATCH_UP_CHUNK:
                feed, g = run(x, positions, _causal_mask(count), torch.tensor(start, dtype=torch.int32),
                              slice(first, stop))
            else:
                # A long catch-up (the prompt, after the prefill) in chunks of CATCH_UP_CHUNK:
                # each chunk reads the entries before it as its prefix.
                parts = [run(x[:, c: c + CATCH_UP_CHUNK], positions[:, c: c + CATCH_UP_CHUNK],
                             _causal_mask(min(CATCH_UP_CHUNK, count - c)),
                             torch.tensor([s + c for s in start], dtype=torch.int32), slice(first, stop))
                         for c in range(0, count, CATCH_UP_CHUNK)]
                g = torch.cat([part[1] for part in parts], 1)
                feed = g if parts[0][0] is parts[0][1] else torch.cat([part[0] for part in parts], 1)
            at = torch.tensor([r * count + min(n - s, count - 1) for r, (s, n) in enumerate(zip(start, ends))])
            g_last = g.reshape(rows * count, -1)[at]
            return (g_last if feed is g else feed.reshape(rows * count, -1)[at]), g_last

        # The rows are fed together, each padded to the longest row's entries, unless that
        # pads more than PER_ROW_PADDING entries per extra call that feeding each row alone
        # would make (one row accepted a long copy): then each row alone.
        if batch > 1 and batch * max(counts) - sum(counts) > PER_ROW_PADDING * (batch - 1):
            parts = [catch_up(b, b + 1) for b in range(batch)]
            feed_root, g_root = torch.cat([part[0] for part in parts]), torch.cat([part[1] for part in parts])
        else:
            feed_root, g_root = catch_up(0, batch)
        # The root's children come from the output at the last entry.
        state = {"x": None, "feed": feed_root[:, None]}

        def expand(level, parent_pos, tokens):
            n_new = tokens.shape[1]
            feed_parent = state["feed"].gather(1, parent_pos[:, :, None].expand(-1, -1, state["feed"].shape[-1]))
            pos_new = torch.tensor([p - 1 + level for p in prefix])[:, None].expand(-1, n_new)
            x_new = self._block_inputs(feed_parent, tokens, pos_new if min(prefix) - 1 + level <= 0 else None)
            own = _eye_mask(n_new).expand(batch, -1, -1)
            if state["x"] is None:  # the first depth: the new nodes see themselves only
                xs, pos, anc, front = x_new, pos_new, own, own
            else:
                # Ancestors among the fed nodes: the parent's (the parent included), then itself.
                fed = state["x"].shape[1]
                front = state["front_anc"].gather(1, parent_pos[:, :, None].expand(-1, -1, fed))
                front = torch.cat([front, own], dim=2)  # [B, n_new, fed + n_new]
                old = torch.cat([state["anc"], front.new_zeros(batch, fed, n_new)], dim=2)
                anc = torch.cat([old, front], dim=1)
                xs, pos = torch.cat([state["x"], x_new], 1), torch.cat([state["pos"], pos_new], 1)
            feed, g = run(xs, pos, anc, now_cached.to(torch.int32))
            fed = xs.shape[1] - n_new
            state.update(x=xs, pos=pos, anc=anc, front_anc=front, feed=feed[:, fed:])
            return self._logits(g[:, fed:])

        can_draft = torch.tensor(can_draft)
        return self._build(history, lengths, self._logits(g_root), expand, sampling, budget, can_draft), now_cached

    # -- trees -------------------------------------------------------------------------
    @staticmethod
    def _chains_greedily(sampling, width: int) -> bool:
        """Whether `_build` takes `_greedy_chain` (greedy, one candidate a depth)."""
        return sampling is None and width == 1

    def _greedy_chain(self, root, logits, expand, depth, limit, budget) -> Draft:
        """`_build` when every depth has one candidate (top_k 1, greedy): the chain of the
        argmaxes, node d scored by its path probability, cut to the row's limit[b] (a list)
        and, without a budget, to the nodes scored at least min_score (scores fall along the
        chain, so both cuts keep a prefix). The general selection keeps the same nodes; this
        takes two ops a depth and lays the chain's few numbers out on the host (small ops are
        most of a one-layer MTP chain's ~2 ms of drafting on a CPU)."""
        picks, logq = [], []
        for level in range(1, depth + 1):
            lq, idx = torch.log_softmax(logits, -1, dtype=torch.float32).topk(1, dim=-1)  # [B, 1] each
            picks.append(idx)
            logq.append(lq)
            if level == depth:
                break
            logits = expand(level, torch.zeros_like(idx), self.vocab[idx])[:, 0]
        tokens = self.vocab[torch.cat(picks, 1) if depth > 1 else idx].tolist()
        logq = (torch.cat(logq, 1) if depth > 1 else lq).tolist()
        # The cut compares the scores as the Draft holds them (float32), so a node kept or cut
        # agrees with its returned score (in float64 a score at the threshold could fall below it).
        cut = np.float32(self.min_score if budget is None else 0.0)
        node_tokens, node_parents, node_scores = [], [], []
        for r, t, lq, n in zip(root.tolist(), tokens, logq, limit):
            scores = [np.float32(math.exp(s)) for s in itertools.accumulate(lq[: min(n, depth)])]
            kept = next((d for d, p in enumerate(scores) if p < cut), len(scores))
            node_tokens.append([r] + t[:kept])
            node_parents.append(list(range(-1, kept)))
            node_scores.append([1.0] + scores[:kept])
        num = max(len(t) for t in node_tokens)
        pad = lambda rows, value: [row + [value] * (num - len(row)) for row in rows]  # noqa: E731
        device = root.device
        tree = TokenTree._from_op(torch.tensor(pad(node_tokens, -1), device=device),
                                  torch.tensor(pad(node_parents, -1), device=device))
        return Draft(tree, None, torch.tensor(pad(node_scores, 0.0), device=device))

    def _warped(self, logits, sampling):
        """Draft distribution [n, N] the children are drawn from (the target's warping)."""
        n = logits.shape[0]
        full = lambda v, dtype: torch.full((n,), v, dtype=dtype, device=logits.device)  # noqa: E731
        return target_probs(logits, full(sampling.temperature, torch.float32), full(sampling.top_k or 0, torch.int64),
                            full(1.0 if sampling.top_p is None else sampling.top_p, torch.float32))

    def _build(self, history, lengths, first_logits, expand, sampling, budget, can_draft):
        """Best-first tree from `first_logits [B, N]` (the root's children) and `expand`,
        a callable (level, parents [B, F] frontier positions in the previous frontier,
        tokens [B, F] target ids) -> logits [B, F, N] of the new frontier's children.

        Returns a Draft whose rows hold at most budget[b] drafted nodes."""
        device = history.device
        batch = history.shape[0]
        # Each row's node limit, on the host (one sync; the sizes below need it anyway).
        limits = [self.max_nodes] * batch if budget is None else \
            [min(self.max_nodes, max(int(b), 0)) for b in budget.tolist()]
        limits = [n if ok else 0 for n, ok in zip(limits, can_draft.tolist())]
        max_budget = max(limits, default=0)
        if max_budget == 0:
            return _no_draft(history, lengths)
        root = root_tokens(history, lengths)
        width = min(self.top_k, self.vocab.numel())
        depth = min(self.depth, max_budget)
        if self._chains_greedily(sampling, width):
            return self._greedy_chain(root, first_logits, expand, depth, limits, budget)
        # The candidates' bookkeeping runs in numpy on the host: a best-first tree is a few
        # dozen numbers per row, and a numpy op on them costs ~1 us where a torch op costs
        # 5-10 us inside the decode loop on a CPU (on a GPU: one small copy per depth).
        limit = np.array(limits)
        rows = np.arange(batch)[:, None]
        # Candidates (root = 0): token (draft-vocab index), parent candidate, log score (fp32), depth.
        cand_tok = [np.zeros((batch, 1), dtype=np.int64)]
        cand_par = [np.full((batch, 1), -1, dtype=np.int64)]
        cand_score = [np.zeros((batch, 1), dtype=np.float32)]
        cand_depth = [0]
        probs_of = []  # (candidate ids [B, F], probs [B, F, N] tensor) for expanded nodes
        frontier = np.zeros((batch, 1), dtype=np.int64)  # candidate ids
        frontier_score = np.zeros((batch, 1), dtype=np.float32)
        logits = first_logits[:, None, :]
        count = 1
        for level in range(1, depth + 1):
            fcount = frontier.shape[1]
            flat = logits.reshape(batch * fcount, -1)
            if sampling is None:
                lq, idx = torch.log_softmax(flat, -1, dtype=torch.float32).topk(width, dim=-1)
            else:
                probs = self._warped(flat.float(), sampling)
                idx = torch.multinomial(probs, width, replacement=True, generator=sampling.generator)
                lq = probs.gather(1, idx).clamp(min=1e-30).log()
                probs_of.append((frontier, probs.reshape(batch, fcount, -1)))
            idx = idx.reshape(batch, fcount * width).cpu().numpy()
            scores = np.repeat(frontier_score, width, axis=1) + lq.reshape(batch, fcount * width).cpu().numpy()
            cand_tok.append(idx)
            cand_par.append(np.repeat(frontier, width, axis=1))
            cand_score.append(scores)
            cand_depth += [level] * idx.shape[1]
            first_new = count
            count += idx.shape[1]
            if level == depth or (sampling is not None and count - 1 >= max_budget):
                break
            # Next frontier: the top_k best new candidates (their children come next), in
            # creation order (ties: the earlier candidate).
            keep = min(width, idx.shape[1])
            top = np.sort(np.argsort(-scores, axis=1, kind="stable")[:, :keep], axis=1)
            frontier = first_new + top
            frontier_score = scores[rows, top]
            logits = expand(level, torch.from_numpy(top // width).to(device),
                            self.vocab[torch.from_numpy(idx[rows, top]).to(device)])
        tokens = np.concatenate(cand_tok, 1)
        scores = np.concatenate(cand_score, 1)
        parents = np.concatenate(cand_par, 1)
        total = tokens.shape[1]
        n_keep = int(min(max_budget, total - 1)) + 1
        if sampling is None:
            # Greedy: the limit[b] best candidates (ties: shallower, then earlier, first), in
            # creation order.
            key = scores - np.float32(_TIE) * np.array(cand_depth, dtype=np.float32)[None, :]
            key[:, 0] = np.inf
            ranked = np.argsort(-key, axis=1, kind="stable")[:, :n_keep]
            chosen = np.sort(ranked, axis=1)
            # Rows with a smaller limit drop their lowest-ranked picks (never an ancestor of a kept one).
            order_rank = np.argsort(np.argsort(-key[rows, chosen], axis=1, kind="stable"), axis=1, kind="stable")
            real = order_rank <= limit[:, None]
            if self.min_score > 0 and budget is None:
                # Confidence cut: nodes the head itself rates unlikely to be accepted cost a
                # target forward slot for little gain (scores fall along paths: closure kept).
                real &= (np.exp(scores[rows, chosen]) >= self.min_score) | (chosen == 0)
        else:
            # Sampling: a prefix of the creation order, as long as the row's limit.
            chosen = np.broadcast_to(np.arange(n_keep), (batch, n_keep))
            real = chosen <= limit[:, None]
        # Re-index: the kept candidates become nodes 0 .. kept - 1 in creation order (parents
        # first), padding after them (a spare column, cut below).
        new_id = np.where(real, np.cumsum(real, axis=1) - 1, -1)
        node_of = np.full((batch, total), -1, dtype=np.int64)
        node_of[rows, chosen] = new_id
        slot = np.where(real, new_id, n_keep)
        node_tokens = np.full((batch, n_keep + 1), -1, dtype=np.int64)
        node_parent = np.full((batch, n_keep + 1), -1, dtype=np.int64)
        node_scores = np.zeros((batch, n_keep + 1), dtype=np.float32)
        node_tokens[rows, slot] = self._vocab_host()[tokens[rows, chosen]]
        node_parent[rows, slot] = node_of[rows, np.maximum(parents[rows, chosen], 0)]
        node_scores[rows, slot] = np.exp(scores[rows, chosen])
        node_tokens[:, 0], node_parent[:, 0], node_scores[:, 0] = root.cpu().numpy(), -1, 1.0
        num = int(real.sum(1).max())
        draft_probs = None
        if sampling is not None:
            small = torch.zeros(batch, n_keep + 1, self.vocab.numel(), device=device)
            for cand_ids, probs in probs_of:
                nodes = node_of[rows, cand_ids]
                r, c = np.nonzero(nodes >= 0)
                small[torch.from_numpy(r).to(device), torch.from_numpy(nodes[r, c]).to(device)] = \
                    probs[torch.from_numpy(r).to(device), torch.from_numpy(c).to(device)]
            draft_probs = torch.zeros(batch, num, self.vocab_size, device=device)
            draft_probs.index_copy_(2, self.vocab, small[:, :num])
        host = lambda a: torch.from_numpy(np.ascontiguousarray(a[:, :num])).to(device)  # noqa: E731
        return Draft(TokenTree._from_op(host(node_tokens), host(node_parent)), draft_probs, host(node_scores))

    def _vocab_host(self) -> np.ndarray:
        """The draft vocabulary's target ids, as a numpy array (the tree bookkeeping's)."""
        cached = getattr(self, "_vocab_np", None)
        if cached is None or cached[0] is not self.vocab:
            cached = self._vocab_np = (self.vocab, self.vocab.cpu().numpy())
        return cached[1]


class EagleDrafter(_HeadDrafter):
    """EAGLE drafting with a trained head (`train_draft_head(kind="eagle")`).

    The head keeps its own one-layer KV cache: entry i is the head's input at position i,
    (target feature f_i, embedding of token i + 1), for i < lengths[b] - 1. Each step it
    appends the entries of the tokens accepted since the last step (with the target's true
    features, which `observe` recorded), whose last output g predicts the root's feature;
    then it grows the tree one depth per head forward, feeding each expanded node as
    (its parent's output g, its token) under a tree mask, and drops the tree entries again.

    Args:
        target: the transformers causal LM the head was trained for (checked).
        head: a head directory written by `train_draft_head` / `specdec train-draft`.
        max_nodes: most drafted nodes per row (the default size; `budget` can lower it).
        depth: most tree depth; top_k: nodes expanded per depth and children per node.
            Defaults: 4 nodes, depth 3, top_k 2 for a CPU target; 24, 6, 6 on a GPU.
        min_score: without the adaptive planner (generate(adaptive=False): no `budget`),
            greedy trees drop nodes whose score (the head's estimate that the path is
            accepted) is below it, so unsure steps verify fewer nodes; default 0.25 on a CPU
            (every node costs target compute there), 0 on a GPU. With the planner, it prunes
            by the scores instead, calibrated by what each row accepted. Sampled trees keep
            every node (dropping a sampled child by its own probability would bias the sample).
        dtype: the head's compute dtype; None (default): `head_dtype` (bfloat16 on a GPU and
            on a CPU with bf16 arithmetic, float32 on other CPUs). bfloat16 halves the weight
            traffic (one depth reads ~36 MB in fp32: the layer and 8192 LM-head rows, ~7% of a
            target forward). With the layer as one `decoder_layer` op on a CPU (fp32 or bf16)
            bf16 drafted faster on the Intel Xeon (AVX512-BF16; a 3-node tree 4.0 against 5.6
            ms, best of 40); on an AMD EPYC without bf16 arithmetic every bf16 product is
            converted first and bf16 drafting was the slower (the head's catch-up over a
            691-token prompt 262 ms). Drafts are proposals only, so outputs stay exact in any dtype.
        online: False (a frozen head), True, a dict of `heads.online.OnlineOptions` settings,
            or an `OnlineOptions`: the head keeps learning from the target's verified
            features while it serves (`self.online`, an `OnlineLearner`: stats, `update`;
            `save(dir)` writes the adapted head). Outputs stay exact either way.
    """

    def __init__(self, target, head, *, max_nodes: Optional[int] = None, depth: Optional[int] = None,
                 top_k: Optional[int] = None, min_score: Optional[float] = None, dtype=None, online=False):
        module = _load(EagleHead, target, head, "eagle")
        small = lm_head_weight(target).device.type == "cpu"
        # On a CPU every verified node costs target compute (a bf16 5-node tree 1.1-1.2x one
        # token on the 2-core machine, fp32 ~1.3x), so the default tree is small (6 / 3 / 2 and
        # 8-node trees measured within noise of it: docs/loop.md); a GPU verifies wide trees
        # for nearly free (EAGLE-2's shapes).
        max_nodes = max_nodes if max_nodes is not None else (4 if small else 24)
        depth = depth if depth is not None else (3 if small else 6)
        top_k = top_k if top_k is not None else (2 if small else 6)
        super().__init__(target, module, max_nodes, depth, top_k, dtype, online, _source(head))
        self.min_score = float(min_score) if min_score is not None else (0.25 if small else 0.0)
        if not 0.0 <= self.min_score <= 1.0:
            raise ValueError(f"min_score must be in [0, 1], got {min_score}")
        self.embed = input_embedding(target)
        self.k_cache = self.v_cache = None

    def start(self, history, lengths, capacity):
        super().start(history, lengths, capacity)
        h = self.head
        size = capacity + max(self.depth * self.top_k, self.max_nodes) + 2  # tree nodes and catch-up scratch past the prefix
        shape = (history.shape[0], size, h.num_kv_heads, h.head_dim)
        self.k_cache = torch.zeros(shape, device=history.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=history.device, dtype=self.dtype)
        self.cached = torch.zeros(history.shape[0], dtype=torch.int64, device=history.device)

    def keep_rows(self, rows):
        super().keep_rows(rows)
        self.k_cache, self.v_cache, self.cached = self.k_cache[rows], self.v_cache[rows], self.cached[rows]

    def finish(self):
        super().finish()
        self.k_cache = self.v_cache = None

    def _attend(self, slots, mask):
        """An `attend` for EagleHead: write the new k/v at `slots [B, T]`, then attend over
        cache slots [0, S) where `mask [B, T, S]` allows."""
        def attend(q, k, v):
            rows = torch.arange(q.shape[0], device=q.device)[:, None].expand_as(slots)
            self.k_cache[rows, slots] = k.to(self.dtype)
            self.v_cache[rows, slots] = v.to(self.dtype)
            span = mask.shape[-1]
            keys, values = self.k_cache[:, :span], self.v_cache[:, :span]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                                 attn_mask=mask[:, None], enable_gqa=q.shape[2] != keys.shape[2])
            return out.transpose(1, 2)
        return attend

    def fused_block(self):
        """(weights in `decoder_layer.WEIGHT_NAMES` order, eps, scale) to run the head's layer as
        one `decoder_layer` op, or None where it cannot (another device or dtype, no kernel).
        Read at every step: an online head's parameters change."""
        h = self.head
        if not self.fuses_now():
            return None
        weights = [h.input_norm.weight, h.q_proj.weight, None, h.k_proj.weight, None, h.v_proj.weight, None, None, None,
                   h.o_proj.weight, None, h.post_norm.weight, h.gate_proj.weight, h.up_proj.weight, h.down_proj.weight]
        return [w if w is None else w.detach() for w in weights], float(h.input_norm.eps), h.head_dim ** -0.5

    def fuses_now(self) -> bool:
        return self.k_cache is not None and fuses_block(self.dtype, self.k_cache.device)

    def _block_inputs(self, features, tokens, positions):
        """fc(concat(feature, embedding of the token)): the decoder layer's input (positions:
        unused)."""
        fc = self.head.fc
        return routed_linear(torch.cat([features.to(self.dtype), self.embed(tokens).to(self.dtype)], dim=-1),
                             fc.weight, fc.bias, self.small_linear_rows)

    def _block_outputs(self, out):
        """(fed deeper, logits' input): both g, the final norm of the layer's output."""
        norm = self.head.norm
        g = norm_op.rms_norm(out, norm.weight.detach(), norm.eps)
        return g, g

    def _rotary(self, positions):
        return rope(positions, self.head.head_dim, self.head.theta, self.dtype)

    @torch.inference_mode()
    def _propose(self, history, lengths, sampling=None, budget=None) -> Draft:
        """Catch up the head's cache, then draft a best-first tree (see the class docstring)."""
        block = self.fused_block()
        if block is not None:
            draft, self.cached = self._fused_tree(history, lengths, sampling, budget, block, self.cached, self.k_cache,
                                                  self.v_cache)
            return draft
        device = history.device
        batch = history.shape[0]
        lengths = lengths.long()
        prefix = lengths - 1  # entries 0 .. L-2 exist once caught up
        can_draft = prefix > 0
        start = torch.minimum(self.cached, prefix)
        pending = prefix - start
        g_root = torch.zeros(batch, self.w_draft.shape[1], device=device, dtype=self.dtype)
        if int(pending.max()) > 0:
            j = torch.arange(int(pending.max()), device=device)
            pos = (start[:, None] + j).clamp(max=history.shape[1] - 2)
            feats = self.features.gather(1, pos[:, :, None].expand(-1, -1, self.features.shape[-1]))
            tokens = history.gather(1, pos + 1)
            slots = start[:, None] + j
            span = int(slots.max()) + 1
            mask = torch.arange(span, device=device)[None, None, :] <= slots[:, :, None]
            out = self.head(feats.to(self.dtype), self.embed(tokens).to(self.dtype), slots, self._attend(slots, mask))
            last = (pending - 1).clamp(min=0)
            g_root = out.gather(1, last[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]
        self.cached = prefix.clone()
        # Rows that fed nothing this step still need their last entry's output: recompute it.
        stale = can_draft & (pending == 0)
        if bool(stale.any()):
            g_root = torch.where(stale[:, None], self._rerun_last(history, prefix), g_root)
        # Tree nodes: fed node n sits at cache slot prefix + n, position prefix - 1 + depth.
        state = {"g": g_root[:, None, :], "anc": torch.zeros(batch, 1, 0, dtype=torch.bool, device=device), "fed": 0}

        def expand(level, parent_pos, tokens):
            g_parent = state["g"].gather(1, parent_pos[:, :, None].expand(-1, -1, state["g"].shape[-1]))
            n_new = tokens.shape[1]
            fed = state["fed"]
            anc_parent = state["anc"].gather(1, parent_pos[:, :, None].expand(-1, -1, state["anc"].shape[-1]))
            own = torch.eye(n_new, dtype=torch.bool, device=device)[None].expand(batch, -1, -1)
            anc = torch.cat([anc_parent, own], dim=-1)  # [B, n_new, fed + n_new] over fed slots
            slots = prefix[:, None] + fed + torch.arange(n_new, device=device)
            span = int(prefix.max()) + fed + n_new
            s = torch.arange(span, device=device)
            mask = (s[None, None, :] < prefix[:, None, None]).expand(-1, n_new, -1).clone()
            rel = s[None, None, :] - prefix[:, None, None]  # fed index of each slot (per row)
            in_tree = (rel >= 0) & (rel < fed + n_new)
            mask |= in_tree & anc.gather(2, rel.clamp(0, fed + n_new - 1).expand(-1, n_new, -1))
            positions = (prefix - 1 + level)[:, None].expand(-1, n_new)
            g = self.head(g_parent, self.embed(tokens).to(self.dtype), positions, self._attend(slots, mask))
            state["g"], state["anc"], state["fed"] = g, anc, fed + n_new
            return self._logits(g)

        first = self._logits(g_root)
        return self._build(history, lengths, first, expand, sampling, budget, can_draft)

    def _rerun_last(self, history, prefix):
        """The head's output at entry prefix - 1 (already cached): rerun that one entry."""
        device = history.device
        pos = (prefix - 1).clamp(min=0)
        feats = self.features.gather(1, pos[:, None, None].expand(-1, 1, self.features.shape[-1]))
        tokens = history.gather(1, (pos + 1)[:, None])
        slots = pos[:, None]
        mask = torch.arange(int(slots.max()) + 1, device=device)[None, None, :] <= slots[:, :, None]
        return self.head(feats.to(self.dtype), self.embed(tokens).to(self.dtype), slots, self._attend(slots, mask))[:, 0]


class MedusaDrafter(_HeadDrafter):
    """Medusa drafting with trained heads (`train_draft_head(kind="medusa")`).

    Head k applied to the feature of the last verified position predicts the token at depth
    k of the tree. The tree is best-first over the heads' top candidates: a node at depth d
    gets the top_k tokens of head d + 1 as children (greedy; sampled i.i.d. from head d + 1
    when sampling), and nodes are kept by the product of their path's head probabilities.

    Args:
        target: the transformers causal LM the heads were trained for (checked).
        heads: a head directory written by `train_draft_head(kind="medusa")`.
        max_nodes, top_k, dtype, online: as in `EagleDrafter` (same defaults); depth is the
            number of heads.
    """

    def __init__(self, target, heads, *, max_nodes: Optional[int] = None, top_k: Optional[int] = None,
                 dtype=None, online=False):
        module = _load(MedusaHeads, target, heads, "medusa")
        small = lm_head_weight(target).device.type == "cpu"
        max_nodes = max_nodes if max_nodes is not None else (4 if small else 24)
        top_k = top_k if top_k is not None else (2 if small else 6)
        super().__init__(target, module, max_nodes, module.weight.shape[0], top_k, dtype, online, _source(heads))

    @torch.inference_mode()
    def _propose(self, history, lengths, sampling=None, budget=None) -> Draft:
        """Draft a best-first tree from the heads (see the class docstring)."""
        lengths = lengths.long()
        can_draft = lengths >= 2
        pos = (lengths - 2).clamp(min=0)
        feat = self.features.gather(1, pos[:, None, None].expand(-1, 1, self.features.shape[-1]))[:, 0]
        per_head = self._logits(self.head(feat.to(self.dtype)))  # [B, K, N]

        def expand(level, parent_pos, tokens):
            return per_head[:, level : level + 1].expand(-1, tokens.shape[1], -1)

        return self._build(history, lengths, per_head[:, 0], expand, sampling, budget, can_draft)


class HeadNgramDrafter(MergedDrafter):
    """A head drafter's tree merged with an n-gram drafter's continuations (one trie, shared
    prefixes once, distinct siblings), and the target's features passed on to the head. Like
    every merged proposal it is deterministic (verified with draft_probs None, exact when
    sampling too); the head proposes its greedy best-first tree.

    Each merged node carries a score, the higher of its sources' (the head's path
    probability, the n-gram's match odds: both estimate the chance the path is accepted, each
    scaled by how often its source's first picks were right, `SourceJudge`), so the adaptive
    planner keeps the nodes most likely accepted from either source. With a budget the head
    drafts at most that many nodes (a head forward costs compute; none at all when no row may
    draft) while the n-gram continuation, free to find, is always proposed whole and left to
    the planner. When `ngram` is a `ScoredMergedDrafter` (the n-gram drafter and a suffix
    cache, as `default_drafter` builds it), its drafters join this one merge directly (one
    trie instead of two), its first one merged at every step and the others while they add
    accepted tokens the head and the rest do not (`SourceJudge`).

    Args:
        head_drafter: an `EagleDrafter`, `MedusaDrafter` or `MtpDrafter`.
        ngram: the n-gram drafter whose continuations are added (code edits keep their gain),
            or a `ScoredMergedDrafter` of it and more deterministic drafters; an unscored
            proposal (an n-gram tree) counts each node as 0.5 ** depth.
        confident: with a budget, rows whose n-gram continuation's first node scores at least
            this (a long match: a copy in progress) get no head drafts; the head's siblings
            would only pay when a near-certain token is wrong, and its forwards cost ~7% of
            a target forward per depth on a CPU. None: the head always drafts.
    """

    needs_hidden_states = True

    def __init__(self, head_drafter: _HeadDrafter, ngram: Drafter, confident: Optional[float] = 0.8):
        if confident is not None and not 0.0 < confident <= 1.0:
            raise ValueError(f"confident must be in (0, 1] or None, got {confident}")
        super().__init__([head_drafter, ngram])
        self.head_drafter, self.ngram, self.confident = head_drafter, ngram, confident
        self.context = list(ngram.drafters) if isinstance(ngram, ScoredMergedDrafter) else [ngram]
        self.judge = SourceJudge([True, True] + [False] * (len(self.context) - 1))  # the head, the first context drafter

    def observe(self, hidden_states, accepted_nodes=None, num_accepted=None):
        self.head_drafter.observe(hidden_states, accepted_nodes, num_accepted)

    def cost_identity(self):
        return {**super().cost_identity(), "confident": self.confident}

    def cost_twin(self):
        twin = super().cost_twin()
        twin.head_drafter, twin.ngram = twin.drafters
        twin.context = list(twin.ngram.drafters) if isinstance(twin.ngram, ScoredMergedDrafter) else [twin.ngram]
        return twin

    @property
    def online(self):
        """The head's `OnlineLearner`, or None for a frozen head."""
        return self.head_drafter.online

    def save(self, out_dir) -> Path:
        """The head drafter's `save` (the adapted head when online)."""
        return self.head_drafter.save(out_dir)

    def propose(self, history, lengths, sampling=None, budget=None) -> Draft:
        """The head's tree (within `budget`) merged with the asked context drafters'
        proposals, with scores."""
        plan = self.judge.plan()
        context = [None if what == SKIP else d.propose(history, lengths, None) for d, what in zip(self.context, plan[1:])]
        ngram = context[0]
        if budget is not None and self.confident is not None and ngram.scores is not None \
                and ngram.scores.shape[1] > 1:
            sure = ngram.scores[:, 1].to(budget.device) >= self.confident
            budget = torch.where(sure, 0, budget)
        drafts = [self.head_drafter.propose(history, lengths, None, budget)] + context
        return merge_judged(self.judge, plan, drafts, history, lengths, self.max_nodes)


def _head_dirs():
    """Folders searched for trained heads: the package's own, then the user's
    (`<cache_dir>/heads`, where `specdec train-draft --out` may point)."""
    from ..models import cache_dir

    roots = [Path(__file__).resolve().parent / "trained", cache_dir() / "heads"]
    found = []
    for root in roots:
        if root.is_dir():
            found += sorted(p for p in root.iterdir() if (p / "config.json").is_file())
    return found


def find_head(target, kind: Optional[str] = None) -> Optional[Path]:
    """The first head directory (shipped, then user's; EAGLE before Medusa) trained for
    `target` (same identity), or None."""
    import json

    identity = None
    candidates = []
    for folder in _head_dirs():
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            continue
        if kind is not None and config.get("kind") != kind:
            continue
        if kind is None and config.get("kind") not in ("eagle", "medusa"):  # (trained MTP heads: MtpDrafter(target, dir))
            continue
        candidates.append((0 if config.get("kind") == "eagle" else 1, folder, config))
    for _, folder, config in sorted(candidates, key=lambda c: c[0]):
        if identity is None:
            from .common import target_identity

            identity = target_identity(target)
        if config.get("target") == identity:
            return folder
    return None


def head_drafter(target, head=None, *, online=False) -> Drafter:
    """The `EagleDrafter` or `MedusaDrafter` (by the head's config) of `head`, a head
    directory, or of the target's own head (`find_head`), with `online` as those drafters
    take it; ValueError if there is none or `head` is no head directory."""
    folder = find_head(target) if head is None else Path(head)
    if folder is None:
        raise ValueError("model: no trained head for this target (train one: specdec train-draft)")
    if not (folder / "config.json").is_file():
        raise ValueError(f"head: {folder} is not a head directory (no config.json)")
    import json

    kind = json.loads((folder / "config.json").read_text())["kind"]
    return (EagleDrafter if kind == "eagle" else MedusaDrafter)(target, folder, online=online)
