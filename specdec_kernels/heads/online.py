"""Online adaptation of a draft head while it serves (online speculative decoding).

Every verify forward hands the head drafter the target's features (the LM head's input) of
the accepted path (`observe`), and the target's distribution at any position is its frozen
LM head applied to that feature. So the drafter has, for free, exactly what offline
self-distillation trains on: `OnlineLearner` keeps those positions in a bounded buffer and
every `interval` decoding steps takes `steps_per_update` optimiser steps on the head,
distilling it towards the target on the traffic it actually sees. The same drafter object
reused across `generate` calls keeps learning.

What is stored, and why features rather than distributions: per verified position the
target's feature f_p (bf16, H values) and the token that followed (x_{p+1}). f_p is the
EAGLE head's input at p and, through the frozen LM head, the training target at p - 1
(softmax(W f_p), exact up to the bf16 rounding the drafter serves with anyway), so one H-vector per
position replaces both an input and a distribution: 1152 bytes per position for the default
model (H = 576) against 16 KB for its distribution over the 8192-token draft vocabulary, or
~200 bytes for a lossy top-32 that would still need the feature as input. The default
capacity, 8192 positions, is ~9.5 MB. The distributions are recomputed only for the positions
an update trains on (W f over the draft vocabulary, renormalised there: the head can
only propose draft-vocabulary tokens).

Weighting: positions where the head's own tree was rejected (the target's next token was
not among the drafted children of the last accepted head node) weigh `rejected_weight`,
prompt positions `prompt_weight`, other generated positions 1. Windows (EAGLE) or positions
(Medusa) are drawn in proportion to those weights and the loss is weighted by them too.

Safety: drafts are proposals only, so whatever the head's weights, `verify` keeps the output
exactly the target's (greedy: its argmax chain; sampling: its distribution, because the
draft probabilities passed to verify are those the drafted tokens were sampled from). An
update whose loss is not finite, or explodes against its running average while the last good
weights do much better on the same batch, restores the last good weights and optimiser state
(`stats.rollbacks`); a step that leaves a weight non-finite is undone the same way. The
learner trains an fp32 master copy (bf16 autocast when `mixed_precision`: by default only
where the CPU has native bf16 matrix instructions, see `OnlineOptions`) and copies it into the serving head (the drafter's dtype) after each good
step. It has its own random generator: generation's sampling stream is never touched.

The updates run in the decoding loop, at the start of a step's `propose`, and their time is
counted in `stats.update_seconds`. No background thread: an update of 128 positions takes
~28 ms for the default model on the 2-core AVX512-BF16 development machine (about one decoding
step; every 10 steps, 6-7 % of the decoding time in `specdec bench online`), and on a 2-core
CPU a thread would take the cores the target forward runs on: the default model decodes at
0.6x its 2-thread speed on one thread (plain 21.5 against 35.5 tokens/s, `default_drafter`
26.0 against ~41 on a summarisation request, same machine), so a learner with a core of its
own would cost ~40% of the decoding speed, against 1-8% in the loop. (Measured; no threaded
learner was built.) On a GPU the updates could overlap the target's forwards on a side
stream; nothing here has run on one.
"""

import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import List, Optional

import torch
import torch.nn.functional as F

from .common import lm_head_weight, read_head, target_identity, write_head
from .modules import EagleHead, MedusaHeads
from .train import eagle_passes

LOSSES = ("kl", "reverse_kl", "jsd")


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX tiles); without
    them torch emulates bf16 and a bf16 update is several times slower than fp32."""
    is_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    return bool(is_bf16() or is_amx())


@dataclass
class OnlineOptions:
    """Settings of online adaptation (`online=` of the head drafters: True for these
    defaults, a dict of some of them, or an instance).

    interval: decoding steps between updates (counted across `generate` calls).
    steps_per_update: optimiser steps per update (each on a fresh batch).
    lr: AdamW learning rate (betas 0.9 / 0.95, no weight decay, gradients clipped to norm `grad_clip`).
    loss: "kl" (forward KL(target || head), the default), "reverse_kl" (KL(head || target)) or
        "jsd" (Jensen-Shannon), over the draft vocabulary.
    capacity: most buffered positions (finished rows; the oldest are dropped first). The rows
        of the running call are read in place from the drafter's own feature buffer.
    batch: positions per optimiser step (EAGLE: batch // window windows of `window`
        consecutive positions, so the head's attention has context; Medusa: batch // heads positions).
    window: EAGLE training window (positions, the last one drawn by weight).
    rejected_weight, prompt_weight: weights of positions where the head was rejected and of
        prompt positions (other generated positions: 1).
    reg_weight: EAGLE's feature regression (smooth L1 of the predicted feature), as offline.
    noise: uniform noise on EAGLE's input features, relative to their RMS, as offline.
    min_positions: no update before the buffer holds this many trainable positions.
    explode_factor: a loss above explode_factor x its running average is checked against the
        last good weights on the same batch (rolled back if they do explode_factor / 2 better).
    refresh_cache: after an update, recompute the EAGLE head's KV cache of the running rows
        with the new weights (else old entries stay, computed with the weights before).
    mixed_precision: bf16 autocast for the head's forward/backward. None (default): on where it
        is fast, a GPU or a CPU with native bf16 matrix instructions (AVX512-BF16 or AMX);
        elsewhere bf16 is emulated: on an AVX2 AMD EPYC updates took 57-61% of generation
        time with it and 7-10% without (8.8% over prompts 3-9; summarisation stream, 128 tokens
        per prompt).
    prompt_steps: optimiser steps on each call's prompts before its first draft, on batches
        drawn from the prompt positions alone (test-time training on the context: prefill
        already gave the target's features there). 0 (default): off. Counted in
        `stats.update_seconds`; each costs about one update (~27 ms on the development CPU).
        Measured (README): a head trained on code only, replaying summarisation dev requests,
        agreed with the target 0.066 -> 0.19 with 10 steps at lr 1e-3; end to end no gain
        yet (the planner seldom lets a weak head draft), so off.
    prompt_lr: the learning rate of those steps (None: `lr`).
    unroll: EAGLE: drafted depths also trained on the head's own predicted features
        (training-time test, as `train_draft_head(unroll=)`). Each adds about one update's
        compute; 0 (default) keeps the update cost of depth 1 alone.
    backoff: while updates do not pay, the learner spaces them out, doubling its interval up
        to backoff x `interval` decoding steps, and halves it back towards `interval` when
        they pay again; 1: a fixed interval. Whether they pay: `stats.gain`, the relative
        reduction of the divergence against the head the drafter started with, on the
        samples generated since the last update (no update has trained on them yet), taken
        before each update: both weights' forwards over those samples and 16 before them,
        no backward (~5 ms against ~24 ms for an update step, default model, 2-core CPU),
        averaged over updates (0.8 / 0.2). Below `min_gain` after 4 probes the interval
        doubles; at 2 x `min_gain` or more it halves.
        Measured (`specdec bench online`, README): the shipped head on its held-out streams,
        where it has nothing left to learn, measured gains of ~0 and backed off to 80 steps:
        update share 1.3% instead of 5.9-7.2%, tokens/s online / frozen 0.98-0.99x instead
        of 0.92-0.93x. A head trained on code only, on the summarisation stream, measured
        ~0.35 and kept the base interval (update share 7.9% with the probes, 6.3% without).
    min_gain: see backoff.
    seed: the learner's own random generator (batch draws, noise).
    """

    # Defaults measured on summarisation dev requests 34..37 (not the benchmark's held-out
    # 0..9, not the shipped head's training requests 10..33), SmolLM2-135M, one thread: one
    # update of 128 positions costs ~0.15-0.2 s, a step ~0.3 s, so every 8 steps took 8-11 %
    # of generation time and every 10 steps keeps it under 10 %; lr 1e-3 lowered tokens per
    # step (0.87-0.93x frozen), 1e-4 and 3e-5 left it at ~0.98-1.0x over four prompts.
    interval: int = 10
    steps_per_update: int = 1
    lr: float = 1e-4
    loss: str = "kl"
    capacity: int = 8192
    batch: int = 128
    window: int = 64
    rejected_weight: float = 4.0
    prompt_weight: float = 0.1
    reg_weight: float = 1.0
    noise: float = 0.05
    min_positions: int = 32
    explode_factor: float = 4.0
    grad_clip: float = 1.0
    refresh_cache: bool = False
    mixed_precision: Optional[bool] = None
    prompt_steps: int = 0
    prompt_lr: Optional[float] = None
    unroll: int = 0
    backoff: int = 8
    min_gain: float = 0.02
    seed: int = 0

    def __post_init__(self):
        for name in ("interval", "steps_per_update", "capacity", "batch", "window", "min_positions", "backoff"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"online: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("lr", "grad_clip"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"online: {name} must be > 0, got {getattr(self, name)}")
        for name in ("rejected_weight", "prompt_weight", "reg_weight", "noise"):
            if not float(getattr(self, name)) >= 0:
                raise ValueError(f"online: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("unroll", "prompt_steps"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"online: {name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= float(self.min_gain) < 1.0:
            raise ValueError(f"online: min_gain must be in [0, 1), got {self.min_gain}")
        if self.prompt_lr is not None and not float(self.prompt_lr) > 0:
            raise ValueError(f"online: prompt_lr must be > 0, got {self.prompt_lr}")
        if not float(self.explode_factor) > 2:
            raise ValueError(f"online: explode_factor must be > 2, got {self.explode_factor}")
        if self.loss not in LOSSES:
            raise ValueError(f"online: loss must be one of {LOSSES}, got {self.loss!r}")

    @classmethod
    def coerce(cls, online) -> Optional["OnlineOptions"]:
        """None for False/None; the defaults for True; a dict updates the defaults; an instance as is."""
        if online is None or online is False:
            return None
        if online is True:
            return cls()
        if isinstance(online, cls):
            return online
        if isinstance(online, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(online) - known)
            if unknown:
                raise ValueError(f"online: unknown settings {unknown} (known: {sorted(known)})")
            return cls(**online)
        raise ValueError(f"online: expected a bool, a dict of settings or OnlineOptions, got {type(online).__name__}")


@dataclass
class OnlineStats:
    """What the learner did (cumulative over the drafter's life).

    steps: decoding steps seen; updates: optimiser steps taken; rollbacks: updates undone
    (divergence); skipped: updates without enough data; update_seconds: wall time spent in
    updates (in the decoding loop); last_loss / loss_avg: the latest and the running average
    training loss (the divergence plus reg_weight x feature regression, weighted);
    buffered: positions in the buffer (finished rows); head_steps: (step, row) pairs where the
    head drafted at least one node; head_accepted: the head's drafted tokens that were
    accepted there; head_rejected: those pairs where the target rejected the head's drafts;
    interval: the decoding steps between updates now (`OnlineOptions.backoff`: longer while
    updates do not pay); gain: the averaged relative divergence reduction against the
    starting head that decides it (nan before the first probe, or without back-off).
    """

    steps: int = 0
    updates: int = 0
    rollbacks: int = 0
    skipped: int = 0
    update_seconds: float = 0.0
    last_loss: float = float("nan")
    loss_avg: float = float("nan")
    buffered: int = 0
    head_steps: int = 0
    head_accepted: int = 0
    head_rejected: int = 0
    interval: int = 0
    gain: float = float("nan")

    def as_dict(self) -> dict:
        """The fields as a plain dict."""
        return asdict(self)


@dataclass
class _Segment:
    """Consecutive positions base .. base + m - 1 of one row: features [m, H] (the head's
    input), the tokens that followed them [m], each position's sample weight [m] (sample j
    trains the prediction of the target's distribution at position j + 1), and the LM head's
    inputs [m, H] there (the labels: the features themselves unless the head fuses several
    layers, EAGLE-3)."""

    feats: torch.Tensor
    next_tokens: torch.Tensor
    weights: torch.Tensor
    base: int
    labels: torch.Tensor

    def tail(self, start: int) -> "_Segment":
        """Positions start .. m - 1 of this segment."""
        labels = self.feats[start:] if self.labels is self.feats else self.labels[start:]
        return _Segment(self.feats[start:], self.next_tokens[start:], self.weights[start:], self.base + start, labels)

    def clone(self) -> "_Segment":
        feats = self.feats.clone()
        labels = feats if self.labels is self.feats else self.labels.clone()
        return _Segment(feats, self.next_tokens.clone(), self.weights.clone(), self.base, labels)

    @property
    def size(self) -> int:
        return self.feats.shape[0]


def training_copy(module: torch.nn.Module) -> torch.nn.Module:
    """An fp32 copy of a head module (its own ordinary tensors, even when `module` was made
    under inference mode), in training mode."""
    with torch.inference_mode(False):
        master = type(module)(module.config)
        master.load_state_dict({k: v.clone() for k, v in module.state_dict().items()})
        master.float()
    return master.train()


class OnlineLearner:
    """The online adaptation of one head drafter (see the module docstring).

    Created by the drafters (`EagleDrafter(..., online=True)`), which call its hooks:
    `started` (their `start`), `before_propose` / `proposed` (around each `propose`),
    `keeping` (their `keep_rows`) and `finishing` (their `finish`).

    Args:
        drafter: the `EagleDrafter` or `MedusaDrafter` whose head is adapted.
        master: an fp32 trainable copy of its head (`training_copy`, taken before the drafter
            cast its head to its dtype, so no precision is lost).
        options: `OnlineOptions`.
        source: the head directory the drafter was loaded from (its training facts are kept
            in `save`), or None.
    """

    def __init__(self, drafter, master: torch.nn.Module, options: OnlineOptions, source=None):
        self.drafter, self.master, self.options = drafter, master, options
        self.kind = "eagle" if isinstance(master, EagleHead) else "medusa"
        if not isinstance(master, (EagleHead, MedusaHeads)):
            raise ValueError(f"online: expected an EagleHead or MedusaHeads, got {type(master).__name__}")
        self.source = source
        self.unroll = int(options.unroll) if self.kind == "eagle" else 0
        self.stats = OnlineStats(interval=int(options.interval))
        self.backoff = int(options.backoff) > 1
        self._probes = 0
        self.segments: List[_Segment] = []
        with torch.inference_mode(False):
            self.generator = torch.Generator().manual_seed(int(options.seed))
            vocab = master.draft_vocab.to(lm_head_weight(drafter.target).device)
            self.w_label = lm_head_weight(drafter.target).detach()[vocab].float()  # [N, H] fp32
            mixed = options.mixed_precision
            self.mixed = (self.w_label.device.type != "cpu" or native_bf16_cpu()) if mixed is None else bool(mixed)
            # The labels' logits in bf16 where the update runs in bf16: the fp32 product was a
            # quarter of an update's time on the CPU, and the drafter serves in bf16 anyway.
            self.w_label_low = self.w_label.bfloat16() if self.mixed else self.w_label
            self.params = [p for p in master.parameters()]
            # fused: one kernel over all parameters (~7x faster than the per-tensor loop on the CPU)
            self.optim = torch.optim.AdamW(self.params, lr=options.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
            self._init_optimizer_state()
            self.good = [p.detach().clone() for p in self.params]  # the last good weights
            self.good_state = self._state_tensors(clone=True)
            # The weights the drafter started with: back-off measures the updates against them.
            self.initial = [p.detach().clone() for p in self.params] if self.backoff else None
        self.good_steps = 0
        self._since = 0
        self._history = None
        self._lengths = None
        self._trees = None
        self.row_weights = None
        self._prompt_lengths = None
        self._fresh_from = None
        self._prompt_pending = False

    # -- hooks (called by the drafter) ---------------------------------------------------
    def started(self, history, lengths, capacity):
        """A generate call starts: per-row sample weights (prompt positions lighter)."""
        lengths = lengths.long()
        j = torch.arange(capacity, device=history.device)
        # Sample j predicts the target's distribution at j + 1, i.e. token j + 2: generated
        # from j = L0 - 2 on.
        prompt = j[None, :] < (lengths - 2)[:, None]
        self.row_weights = torch.where(prompt, float(self.options.prompt_weight), 1.0)
        self._prompt_lengths = lengths.clone()  # (prompt_steps train on positions j < L0 - 2)
        self._fresh_from = lengths - 2  # back-off probes: samples no update has seen yet start here
        self._history, self._lengths, self._trees = history, lengths.clone(), None
        self._prompt_pending = int(self.options.prompt_steps) > 0

    def before_propose(self, history, lengths):
        """Each step, before drafting: label the last step's outcome, then maybe update."""
        lengths = lengths.long()
        if self._trees is not None:
            self._label(history, lengths)
        self._history, self._lengths = history, lengths.clone()
        if self._prompt_pending:  # the first step of a call: the features of its prompts are in
            self._prompt_pending = False
            self.adapt_to_prompts()
        self.stats.steps += 1
        self._since += 1
        base = int(self.options.interval)  # (options may change between calls: kept within them)
        self.stats.interval = min(max(self.stats.interval, base), base * int(self.options.backoff))
        if self._since >= self.stats.interval:
            self._since = 0
            self.update()

    def proposed(self, draft, lengths):
        """Remember the head's own tree per row (to see next step where it was rejected)."""
        tree = draft.tree
        self._trees = (tree.tokens.tolist(), tree.parents.tolist(), lengths.long().tolist())

    def keeping(self, rows):
        """Rows leave the batch: buffer the others' data, follow the kept rows."""
        if self._lengths is None:
            return
        gone = torch.ones(self._lengths.shape[0], dtype=torch.bool)
        gone[rows.cpu()] = False
        for b in gone.nonzero()[:, 0].tolist():
            self._archive(b)
        rows_dev = rows.to(self._lengths.device)
        self._history, self._lengths = self._history[rows_dev], self._lengths[rows_dev]
        self.row_weights = self.row_weights[rows_dev]
        self._prompt_lengths = self._prompt_lengths[rows_dev]
        self._fresh_from = self._fresh_from[rows_dev]
        if self._trees is not None:
            keep = rows.tolist()
            self._trees = tuple([part[i] for i in keep] for part in self._trees)

    def finishing(self):
        """The call ends: buffer every remaining row."""
        if self._lengths is not None and self.drafter.features is not None:
            for b in range(self._lengths.shape[0]):
                self._archive(b)
        self._history = self._lengths = self._trees = self.row_weights = self._prompt_lengths = self._fresh_from = None

    # -- data ----------------------------------------------------------------------------
    def _label(self, history, lengths):
        """Walk each row's last head tree along the tokens emitted since: count the head's
        accepted tokens, and weight the position where its drafts were rejected."""
        tokens, parents, before = self._trees
        self._trees = None
        emitted_all = history.tolist() if history.shape[1] * history.shape[0] < 65536 else None
        for b in range(len(tokens)):
            start, end = before[b], int(lengths[b])
            if end <= start or start < 1:
                continue
            row_tokens, row_parents = tokens[b], parents[b]
            if not any(p >= 0 for p in row_parents[1:]):
                continue  # the head drafted nothing for this row
            emitted = emitted_all[b][start:end] if emitted_all is not None else history[b, start:end].tolist()
            node, accepted, rejected = 0, 0, False
            for tok in emitted:
                children = [i for i in range(1, len(row_parents)) if row_parents[i] == node]
                match = next((i for i in children if row_tokens[i] == tok), None)
                if match is None:
                    rejected = bool(children)
                    break
                node, accepted = match, accepted + 1
            self.stats.head_steps += 1
            self.stats.head_accepted += accepted
            if rejected:
                self.stats.head_rejected += 1
                # The target's distribution at position start - 1 + accepted (the last accepted
                # node) was missed: sample index start - 2 + accepted.
                i = start - 2 + accepted
                if 0 <= i < self.row_weights.shape[1]:
                    self.row_weights[b, i] = float(self.options.rejected_weight)

    def _live(self, b, prompt_only: bool = False, fresh_only: bool = False) -> Optional[_Segment]:
        """Row b of the running call as a segment (views; positions 0 .. L - 2 known), its
        samples weighted as for updates, or 1 on prompt positions (prompt_only) or on the
        generated ones no update has drawn yet (fresh_only) and 0 elsewhere."""
        m = int(self._lengths[b]) - 1
        if m < 2:
            return None
        feats = self.drafter.features[b, :m]
        labels = feats if self.drafter.labels is None else self.drafter.labels[b, :m]
        if prompt_only:  # the samples that predict prompt tokens, as `started` weights them
            weights = (torch.arange(m, device=feats.device) < self._prompt_lengths[b] - 2).float()
        elif fresh_only:
            weights = (torch.arange(m, device=feats.device) >= self._fresh_from[b]).float()
        else:
            weights = self.row_weights[b, :m]
        return _Segment(feats, self._history[b, 1 : m + 1], weights, 0, labels)

    def _archive(self, b):
        """Copy row b of the running call into the buffer (oldest positions dropped beyond capacity)."""
        seg = self._live(b)
        if seg is None:
            return
        with torch.inference_mode(False):
            seg = seg.clone()
        self.segments.append(seg)
        total = self.stats.buffered + seg.size
        cap = int(self.options.capacity)
        while total > cap and self.segments:
            oldest = self.segments[0]
            extra = total - cap
            if oldest.size - extra < 2:
                self.segments.pop(0)
                total -= oldest.size
            else:  # keep its last positions
                self.segments[0] = oldest.tail(extra)
                total -= extra
        self.stats.buffered = total

    def _running(self, **mode) -> List[_Segment]:
        """The running call's rows as segments (`_live` with `mode`); [] outside a call."""
        if self._lengths is None or self.drafter.features is None:
            return []
        return [s for s in (self._live(b, **mode) for b in range(self._lengths.shape[0])) if s is not None]

    def _sources(self) -> List[_Segment]:
        return self.segments + self._running()

    def trainable_positions(self) -> int:
        """Positions an update could train on now (buffer and running rows)."""
        return sum(max(s.size - 1, 0) for s in self._sources())

    def _draw(self, sources, count):
        """`count` (source index, sample index) pairs drawn with probability proportional to
        the sample weights (sample j needs j + 1 < size: its target feature)."""
        weights = torch.cat([s.weights[: max(s.size - 1, 0)].float().cpu() for s in sources])
        if weights.numel() == 0 or not float(weights.sum()) > 0:
            return []
        flat = torch.multinomial(weights, count, replacement=True, generator=self.generator)
        ends = torch.tensor([max(s.size - 1, 0) for s in sources]).cumsum(0)
        which = torch.searchsorted(ends, flat, right=True)  # the source whose range holds each draw
        starts = ends - torch.tensor([max(s.size - 1, 0) for s in sources])
        return list(zip(which.tolist(), (flat - starts[which]).tolist()))

    # -- losses --------------------------------------------------------------------------
    def _divergence(self, logits_q, logp):
        """Per-position divergence between the target (log-probs logp) and the head
        (logits_q), over the draft vocabulary: options.loss."""
        logq = torch.log_softmax(logits_q.float(), -1)
        loss = self.options.loss
        if loss == "kl":
            return (logp.exp() * (logp - logq)).sum(-1)
        if loss == "reverse_kl":
            return (logq.exp() * (logq - logp)).sum(-1)
        logm = torch.logaddexp(logp, logq) - math.log(2.0)
        return 0.5 * (logp.exp() * (logp - logm)).sum(-1) + 0.5 * (logq.exp() * (logq - logm)).sum(-1)

    def _autocast(self):
        device = self.w_label.device.type
        if self.mixed:
            return torch.autocast(device, dtype=torch.bfloat16)
        return torch.autocast(device, enabled=False)

    def _batch(self, sources=None):
        """The next training batch from `sources` (default: the buffer and the running rows), or None."""
        sources = self._sources() if sources is None else sources
        if sum(max(s.size - 1, 0) for s in sources) < self.options.min_positions:
            return None
        if self.kind == "eagle":
            picks = self._draw(sources, max(1, self.options.batch // int(self.options.window)))
        else:
            picks = self._draw(sources, max(1, self.options.batch // int(self.master.weight.shape[0])))
        return self._assemble(sources, picks, add_noise=True) if picks else None

    def _assemble(self, sources, picks, add_noise: bool, width: Optional[int] = None):
        """The batch of `picks` ((source index, sample index) pairs): EAGLE, the window of
        `width` (default `window`) samples ending at each; Medusa, each sample; `add_noise`:
        EAGLE's input noise."""
        device = self.w_label.device
        if self.kind == "eagle":
            width = int(width or self.options.window)
            spans = [(k, max(0, j - width + 1), j + 1) for k, j in picks]
            n = max(e - s for _, s, e in spans)
            hidden = self.w_label.shape[1]
            inp = torch.zeros(len(spans), n, hidden, device=device)
            tgt = torch.zeros(len(spans), n, hidden, device=device)
            tok = torch.zeros(len(spans), n, dtype=torch.int64, device=device)
            wts = torch.zeros(len(spans), n, device=device)
            pos = torch.zeros(len(spans), n, dtype=torch.int64, device=device)
            for r, (k, s, e) in enumerate(spans):
                src = sources[k]
                inp[r, : e - s] = src.feats[s:e].to(device).float()
                tgt[r, : e - s] = src.labels[s + 1 : e + 1].to(device).float()
                tok[r, : e - s] = src.next_tokens[s:e].to(device).long()
                wts[r, : e - s] = src.weights[s:e].to(device).float()
                pos[r] = src.base + s + torch.arange(n, device=device)
            if add_noise and self.options.noise > 0:  # as offline: robustness to the head's own (inexact) features
                scale = inp.pow(2).mean(-1, keepdim=True).sqrt()
                noise = (torch.rand(inp.shape, generator=self.generator) * 2 - 1).to(device)
                inp = inp + noise * float(self.options.noise) * scale
            return {"inp": inp, "tgt": tgt, "tok": tok, "w": wts, "pos": pos}
        heads = int(self.master.weight.shape[0])
        hidden = self.w_label.shape[1]
        inp = torch.zeros(len(picks), hidden, device=device)
        tgt = torch.zeros(len(picks), heads, hidden, device=device)
        wts = torch.zeros(len(picks), heads, device=device)
        for r, (k, t) in enumerate(picks):
            src = sources[k]
            inp[r] = src.feats[t].to(device).float()
            for h in range(1, heads + 1):
                if t + h < src.size:  # head h at t learns the target's distribution at t + h
                    tgt[r, h - 1] = src.feats[t + h].to(device).float()
                    wts[r, h - 1] = float(src.weights[t + h - 1]) * (0.8 ** (h - 1))
        return {"inp": inp, "tgt": tgt, "w": wts}

    def _loss(self, batch, params=None, regression: bool = True):
        """Weighted training loss of `batch` with the master weights (or `params`, a list in
        master.parameters() order, for the rollback check and the back-off); `regression`
        False: the divergence alone."""
        module = self.master
        if params is not None:
            names = [n for n, _ in self.master.named_parameters()]
            call = lambda *a: torch.func.functional_call(module, dict(zip(names, params)), a)  # noqa: E731
        else:
            call = module
        # Only the weighted samples need logits (the LM head is most of the cost): a probe
        # weighs just the fresh end of its windows. Their labels are kept with the batch for
        # a second call on it (the rollback check, the probe's starting weights).
        w = batch["w"]
        sel = w > 0
        if "logp" not in batch:
            with torch.no_grad():
                labels = batch["tgt"][sel].to(self.w_label_low.dtype) @ self.w_label_low.T
                batch["logp"] = torch.log_softmax(labels.float(), -1)
        logp, w_sel, tgt_sel = batch["logp"], w[sel], batch["tgt"][sel]
        if self.kind == "eagle":
            inp = batch["inp"]
            with torch.no_grad():
                emb = self.drafter.embed(batch["tok"]).float()
            depth_of = torch.arange(w.shape[1], device=w.device).expand_as(w)[sel]
            total = 0.0
            with self._autocast():
                outs = eagle_passes(call, inp, emb, batch["pos"], self.unroll)
                logits = [g[sel] @ self.w_label_low.T for g in outs]
            for d, g in enumerate(outs):  # pass d drafts depth d + 1 (positions i >= d only)
                pass_loss = self._divergence(logits[d], logp)
                if regression and self.options.reg_weight > 0:
                    reg = F.smooth_l1_loss(g[sel].float(), tgt_sel, reduction="none").mean(-1)
                    pass_loss = pass_loss + float(self.options.reg_weight) * reg
                total = total + (pass_loss * w_sel * (depth_of >= d)).sum()
        else:
            with self._autocast():
                outs = call(batch["inp"])  # [P, K, H]
                logits = outs[sel] @ self.w_label_low.T
            total = (self._divergence(logits, logp) * w_sel).sum()
        return total / w.sum().clamp(min=1e-6)

    # -- updates -------------------------------------------------------------------------
    def _init_optimizer_state(self):
        """Materialise AdamW's state (zeros) so that snapshots have fixed tensors to copy into."""
        for p in self.params:
            state = self.optim.state[p]
            # On the parameter's device: the fused AdamW kernel reads the step there (a host
            # scalar is what the unfused CPU path uses, a CUDA head's fused step would not find it).
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _state_tensors(self, clone=False):
        out = []
        for p in self.params:
            state = self.optim.state[p]
            for key in ("step", "exp_avg", "exp_avg_sq"):
                out.append(state[key].clone() if clone else state[key])
        return out

    def _snapshot(self):
        torch._foreach_copy_(self.good, [p.detach() for p in self.params])
        torch._foreach_copy_(self.good_state, self._state_tensors())

    def _rollback(self):
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in self.params], self.good)
            torch._foreach_copy_(self._state_tensors(), self.good_state)
        self.optim.zero_grad(set_to_none=True)
        self.stats.rollbacks += 1
        self._push()

    def _push(self):
        """Copy the master weights into the serving head (the drafter's dtype)."""
        with torch.no_grad():
            for serving, p in zip(self.drafter.head.parameters(), self.params):
                serving.copy_(p.detach())
        if self.options.refresh_cache and self.kind == "eagle" and getattr(self.drafter, "cached", None) is not None:
            # The next propose re-runs the head over each row's prefix (a new tensor: the
            # drafter's state may be an inference-mode tensor, not writable from here).
            self.drafter.cached = torch.zeros_like(self.drafter.cached)

    def update(self) -> bool:
        """Take `steps_per_update` optimiser steps now (the drafter calls this every
        `stats.interval` steps; with back-off, after probing the weights on the fresh samples);
        returns whether any step was taken."""
        return self._steps(int(self.options.steps_per_update), probe=self.backoff)

    def _probe(self) -> None:
        """Back-off: the divergence of the current weights and of the starting ones on the
        running rows' samples that no update has drawn yet (EAGLE: a window ending at each
        row's last sample; noise-free), folded into `stats.gain`; then `stats.interval` doubles
        (up to backoff x interval) or halves (down to interval)."""
        if self._lengths is None or self.drafter.features is None:
            return
        counted = [(s, int(s.weights[: s.size - 1].sum())) for s in self._running(fresh_only=True)]
        sources = [s for s, fresh in counted if fresh > 0]
        self._fresh_from = torch.maximum(self._fresh_from, self._lengths - 2)
        if not sources:
            return
        width = None
        if self.kind == "eagle":
            picks = [(k, s.size - 2) for k, s in enumerate(sources)]
            # The fresh samples and 16 before them as context (not a whole window: a probe
            # should cost a fraction of an update).
            width = min(int(self.options.window), max(fresh for _, fresh in counted) + 16)
        else:
            last = max(1, int(self.options.batch) // int(self.master.weight.shape[0]))  # as many as an update
            picks = [(k, j) for k, s in enumerate(sources) for j in range(max(0, s.size - 1 - last), s.size - 1)]
        batch = self._assemble(sources, picks, add_noise=False, width=width)
        with torch.no_grad():
            now = float(self._loss(batch, regression=False))
            start = float(self._loss(batch, self.initial, regression=False))
        if not (math.isfinite(now) and math.isfinite(start) and start > 0):
            return
        gain = 1.0 - now / start
        old = self.stats.gain
        self.stats.gain = gain if not math.isfinite(old) else 0.8 * old + 0.2 * gain
        self._probes += 1
        if self._probes < 4:
            return
        base = int(self.options.interval)
        most = base * int(self.options.backoff)
        if self.stats.gain < self.options.min_gain:
            self.stats.interval = min(2 * self.stats.interval, most)
        elif self.stats.gain >= 2 * self.options.min_gain:
            self.stats.interval = max(self.stats.interval // 2, base)

    def adapt_to_prompts(self) -> bool:
        """`prompt_steps` optimiser steps on the running rows' prompt positions (at
        `prompt_lr`); returns whether any step was taken."""
        if self._lengths is None or self.drafter.features is None:
            return False
        sources = self._running(prompt_only=True)
        lr = self.options.lr if self.options.prompt_lr is None else self.options.prompt_lr
        return self._steps(int(self.options.prompt_steps), sources, lr)

    def _steps(self, count: int, sources=None, lr: Optional[float] = None, probe: bool = False) -> bool:
        """`count` optimiser steps on batches from `sources` (default: the buffer and the
        running rows) at `lr` (default: the options' lr), after `_probe` when `probe`; timed
        into stats.update_seconds."""
        start = time.perf_counter()
        took = False
        try:
            with torch.inference_mode(False), torch.enable_grad():
                if lr is not None:
                    for group in self.optim.param_groups:
                        group["lr"] = float(lr)
                if probe:
                    self._probe()
                for _ in range(count):
                    took = self._step(sources) or took
        finally:
            for group in self.optim.param_groups:
                group["lr"] = float(self.options.lr)
            self.stats.update_seconds += time.perf_counter() - start
        return took

    def _step(self, sources=None) -> bool:
        batch = self._batch(sources)
        if batch is None:
            self.stats.skipped += 1
            return False
        self.master.train()
        loss = self._loss(batch)
        value = float(loss.detach())
        self.stats.last_loss = value
        if not math.isfinite(value):
            self._rollback()
            return False
        avg = self.stats.loss_avg
        if self.good_steps >= 3 and math.isfinite(avg) and value > self.options.explode_factor * avg:
            # Either these weights diverged or this batch is just hard (a new kind of prompt):
            # the last good weights on the same batch tell which.
            with torch.no_grad():
                good = float(self._loss(batch, self.good))
            if good * self.options.explode_factor / 2 < value:
                self._rollback()
                return False
        self._snapshot()  # these weights passed: the point to come back to
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(self.params, float(self.options.grad_clip))
        if not bool(torch.isfinite(norm)) or not grads:
            self.optim.zero_grad(set_to_none=True)
            self.stats.skipped += 1
            return False
        self.optim.step()
        # One reduction over all weights (a non-finite weight makes its norm non-finite);
        # checking tensor by tensor took ~10% of an update.
        if not bool(torch.stack(torch._foreach_norm(self.params)).isfinite().all()):
            self._rollback()
            return False
        self.good_steps += 1
        self.stats.updates += 1
        self.stats.loss_avg = value if not math.isfinite(avg) else 0.9 * avg + 0.1 * value
        self._push()
        return True

    # -- saving --------------------------------------------------------------------------
    def save(self, out_dir) -> Path:
        """Write the adapted head (the master weights, fp16) as a trained head directory:
        `EagleDrafter(target, out_dir)` / `MedusaDrafter(target, out_dir)` load it."""
        base = {}
        if self.source is not None:
            try:
                base = read_head(self.source)[0].get("training", {})
            except ValueError:
                base = {}
        training = {"base": base, "base_dir": None if self.source is None else str(self.source),
                    "online": {"options": asdict(self.options), **self.stats.as_dict()}}
        state = dict(self.master.state_dict())
        config = {"kind": self.kind, "head": dict(self.master.config), "target": target_identity(self.drafter.target),
                  "training": training}
        return write_head(out_dir, config, state)

