"""`generate`: the draft -> tree-verify -> accept loop on any transformers causal LM.

Every step: the drafter proposes a token tree per row (root = the row's last token), the
target runs one forward over the whole tree (tree attention over its KV cache), `verify`
picks the accepted path and the next token, `compact_kv_cache_` keeps the accepted path in
the cache. Plain decoding (drafter=None) is the same loop with a root-only tree.

Caches (target and draft models) are left-aligned per row and always hold every token of
the row but the last one, which is the next tree's root; see `specdec_kernels.hf`.
"""

import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import torch

from .. import config
from .drafters import Drafter, Sampling, no_draft, upkeep_seconds
from .logits_processing import TreeLogitsProcessor, sampling_settings
from .memory import weights_in_huge_pages
from ..ops.philox import row_seeds
from ..ops.small_linear import small_linears
from .planner import Planner
from .cost_model import device_clock
from ..ops.verify import verify, verify_greedy

_GOLDEN = 0x9E3779B97F4A7C15  # step -> seed offset (odd 64-bit constant)


@dataclass
class GenerateStats:
    """What a `generate` call did.

    steps: target forwards after the prefill (one per draft-verify-accept step).
    new_tokens: tokens generated per row.
    tokens_per_step: tokens emitted per (step, unfinished row), the mean speculation gain.
    acceptance_per_depth: [d] = fraction of (step, unfinished row) pairs whose accepted path
        reached depth d + 1 (d + 1 drafted tokens accepted).
    nodes_per_step: mean verified draft nodes per (step, unfinished row).
    trace: one dict per step: rows (in the batch), width (tree nodes per row, root included,
        padding too), nodes_per_row and accepted_per_row (means over the rows), seconds (the
        step's wall time, drafting to bookkeeping), compiled_graph (its forward compiled a new
        graph: its seconds are mostly compiling, and the planner did not learn from them).
        Plot width or nodes_per_row against accepted_per_row to see what the planner chose
        against what was accepted.
    time_plan: host seconds the adaptive planner spent (inside time_draft when timing).
    time_prefill / time_total: seconds. time_draft / time_verify / time_accept: the split of
        the steps' time (only with generate(..., timing=True), else 0); verify includes the
        target's tree forward, accept the cache compaction and bookkeeping.
    compiled: whether the tree forwards ran compiled (`generate(..., compile=...)`; a drafter
        reading hidden states of chosen layers keeps them eager, see `compiled.StaticForward`).
    time_compile: seconds of the steps whose forward compiled a new graph (inside time_total
        and, when timing, time_verify; 0 when every graph was compiled by an earlier call).
        Those steps are not shown to the adaptive planner's cost model.
    """

    steps: int = 0
    new_tokens: List[int] = field(default_factory=list)
    tokens_per_step: float = 0.0
    acceptance_per_depth: List[float] = field(default_factory=list)
    nodes_per_step: float = 0.0
    trace: List[dict] = field(default_factory=list)
    time_plan: float = 0.0
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_accept: float = 0.0
    time_total: float = 0.0
    compiled: bool = False
    time_compile: float = 0.0

    def as_dict(self) -> dict:
        """The fields as a plain dict (also readable as stats["steps"])."""
        return dict(self.__dict__)

    def __getitem__(self, name: str):
        return getattr(self, name)


@dataclass
class GenerateOutput:
    """`sequences [B, L + new]`: the prompts as given (left padding kept), then the generated
    tokens, rows that stopped early padded with the pad token (as HF `generate`); `stats`."""

    sequences: torch.Tensor
    stats: GenerateStats


def eos_ids(target, eos_token_id=None) -> Optional[torch.Tensor]:
    """The ids a row stops at, as an int64 1D tensor, or None for none.

    eos_token_id None: the target's generation_config.eos_token_id (as HF generate); an int or
    a list of ints: those; [] disables stopping. (The CLI and the benchmarks use this too, so
    every path stops at the same tokens.)
    """
    if eos_token_id is None:
        eos_token_id = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.int64) if ids else None


def pad_id(target, eos: Optional[torch.Tensor] = None) -> int:
    """The token rows that stopped early are padded with: the target's generation_config
    pad_token_id, else its config's, else the first eos id (`eos`, as `eos_ids` returns), else 0."""
    gen_cfg = getattr(target, "generation_config", None)
    for pad in (getattr(gen_cfg, "pad_token_id", None), getattr(target.config, "pad_token_id", None)):
        if pad is not None:
            return int(pad)
    return int(eos[0]) if eos is not None else 0


def _step_seeds(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """Per-row seeds for one step: row seed XOR a step-dependent 64-bit constant."""
    offset = (step * _GOLDEN) & 0xFFFFFFFFFFFFFFFF
    return seeds ^ (offset - (1 << 64) if offset >= 1 << 63 else offset)


def _left_align(input_ids: torch.Tensor, lengths: torch.Tensor, capacity: int) -> torch.Tensor:
    """[B, capacity] int64: row b's last lengths[b] prompt tokens moved to the front, zeros after."""
    batch, prompt_len = input_ids.shape
    j = torch.arange(capacity, device=input_ids.device)
    src = (prompt_len - lengths)[:, None] + j
    tokens = input_ids.long().gather(1, src.clamp(max=prompt_len - 1))
    return torch.where(j[None, :] < lengths[:, None], tokens, 0)


class _Rows:
    """The per-row state of a `generate` call, kept in step as rows finish.

    Running rows: `history [R, S]` (every token of the row, left-aligned), `lengths [R]`,
    `generated [R]`, `done [R]`, `ids [R]` (each running row's index in the caller's batch)
    and `seeds [R]`. `keep(rows)` moves the finished rows into the full-batch output tensors
    and keeps `rows`; `sequences(...)` scatters everything back in the caller's order.
    """

    def __init__(self, history: torch.Tensor, lengths: torch.Tensor, seeds: torch.Tensor, max_new_tokens: int):
        self.history, self.lengths, self.seeds = history, lengths, seeds
        self.generated = torch.zeros_like(lengths)
        self.done = self.generated >= max_new_tokens
        self.ids = torch.arange(lengths.shape[0], device=lengths.device)
        self.max_new_tokens = max_new_tokens
        self._out_history, self._out_lengths, self._out_generated = history.clone(), lengths.clone(), self.generated.clone()

    def emitted_counts(self, out, eos: Optional[torch.Tensor]):
        """Tokens each row keeps of `out.output_tokens` (num_accepted + 1, cut after the first
        eos and at the row's remaining budget; 0 for finished rows), and whether it hit an eos."""
        emitted = out.output_tokens.long()
        count = out.num_accepted.long() + 1
        budget = self.max_new_tokens - self.generated
        if eos is None:
            return torch.minimum(count, budget).masked_fill(self.done, 0), torch.zeros_like(self.done)
        j = torch.arange(emitted.shape[1], device=emitted.device)
        is_eos = torch.isin(emitted, eos) & (j[None, :] < count[:, None])
        count = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, count)
        count = torch.minimum(count, budget).masked_fill(self.done, 0)
        return count, (is_eos & (j[None, :] < count[:, None])).any(1)

    def append(self, tokens: torch.Tensor, count: torch.Tensor, hit_eos: torch.Tensor) -> None:
        """history[b, lengths[b] + j] = tokens[b, j] for j < count[b]; rows that hit an eos or
        their token budget are done."""
        # One scatter that writes each slot's old value back where j >= count (no boolean
        # indexing: that costs a host sync and ~20 small ops a step). The slots stay inside the
        # row: lengths + j < prompt + max_new_tokens + 1 + max_nodes, the history's capacity.
        j = torch.arange(tokens.shape[1], device=tokens.device)
        slots = self.lengths[:, None] + j
        new = torch.where(j < count[:, None], tokens.long(), self.history.gather(1, slots))
        self.history.scatter_(1, slots, new)
        self.lengths, self.generated = self.lengths + count, self.generated + count
        self.done = self.done | hit_eos | (self.generated >= self.max_new_tokens)

    def keep(self, rows: torch.Tensor) -> None:
        """Store the rows not in `rows` in the output, keep `rows` (int64 indices, in order)."""
        gone = torch.ones_like(self.done)
        gone[rows] = False
        self._store(gone)
        self.history, self.lengths, self.generated = self.history[rows], self.lengths[rows], self.generated[rows]
        self.done, self.ids, self.seeds = self.done[rows], self.ids[rows], self.seeds[rows]

    def _store(self, which: torch.Tensor) -> None:
        ids = self.ids[which]
        self._out_history[ids], self._out_lengths[ids] = self.history[which], self.lengths[which]
        self._out_generated[ids] = self.generated[which]

    def sequences(self, input_ids: torch.Tensor, pad: int) -> torch.Tensor:
        """[B, L + new]: the prompts as given, then each row's generated tokens, pad after a row
        stopped (HF generate's layout); new = the most tokens any row generated."""
        self._store(torch.ones_like(self.done))
        history, lengths, generated = self._out_history, self._out_lengths, self._out_generated
        new = int(generated.max()) if generated.numel() else 0
        j = torch.arange(new, device=history.device)
        tokens = history.gather(1, (lengths - generated)[:, None] + j)
        tokens = torch.where(j[None, :] < generated[:, None], tokens, pad)
        return torch.cat([input_ids, tokens.to(input_ids.dtype)], dim=1)

    @property
    def new_tokens(self) -> List[int]:
        """Tokens generated per row of the caller's batch (after `sequences`)."""
        return self._out_generated.tolist()


def _draft(drafter: Drafter, planner: Optional[Planner], rows: _Rows, sampling, stats: GenerateStats):
    """The step's draft: with a planner, at most the nodes it budgets from the rows' history
    (all a drafter that `drafts_for_free` has; none, and the drafter is not asked, where no
    row's nodes repay drafting), then cut to the nodes worth verifying (its host time goes to
    stats.time_plan). Drafters catch up on the tokens of skipped steps at their next draft."""
    if planner is None:
        return drafter.propose(rows.history, rows.lengths, sampling)
    start, prefix = time.perf_counter(), float(rows.lengths.double().mean())
    remaining = rows.max_new_tokens - rows.generated
    budget = planner.budget(prefix, remaining)
    middle, upkeep = time.perf_counter(), upkeep_seconds(drafter)
    if planner.drafting:
        draft = drafter.propose(rows.history, rows.lengths, sampling, None if drafter.drafts_for_free else budget)
    else:
        draft = no_draft(rows.history, rows.lengths)
    end = time.perf_counter()
    # The drafting's own seconds (an online head's upkeep is no cost of this tree), which the
    # cost model corrects apart from the rest of the step.
    draft = planner.select(draft, prefix, remaining, drafting=(end - middle) - (upkeep_seconds(drafter) - upkeep))
    stats.time_plan += (middle - start) + (time.perf_counter() - end)
    return draft


class _Trace:
    """Per-step records for stats.trace; each step's wall time (but the first's, which also
    holds the drafter's catch-up over the prompt, and any step that compiled a graph)
    refreshes the planner's cost model, less the drafter's upkeep in that step
    (`Drafter.upkeep_seconds`: an online head's updates are no cost of the tree the step
    verified). Counts stay tensors until the end (no host sync per step)."""

    def __init__(self, planner: Optional[Planner], drafter: Drafter, static=None):
        self.planner, self.drafter, self.records, self.static = planner, drafter, [], static
        self.start, self.upkeep, self.compiles = time.perf_counter(), upkeep_seconds(drafter), self._compiles()

    def _compiles(self) -> int:
        return self.static.compiles if self.static is not None else 0

    def next_step(self) -> None:
        """A step ends (and the next begins): time the one before."""
        now, upkeep, compiles = time.perf_counter(), upkeep_seconds(self.drafter), self._compiles()
        if self.records and "seconds" not in self.records[-1]:
            self.records[-1]["seconds"] = now - self.start
            self.records[-1]["compiled"] = compiles != self.compiles
            if self.planner is not None and len(self.records) > 1 and compiles == self.compiles:
                self.planner.observe_time(now - self.start - (upkeep - self.upkeep))
        self.start, self.upkeep, self.compiles = now, upkeep, compiles

    def record(self, tree, out, active: torch.Tensor) -> None:
        """The verified tree and its outcome; the planner learns the rows' acceptance."""
        width = int(tree.tokens.shape[1])
        # The counts are reduced at the end (`steps`, `accepted_counts`): each small op here
        # is host time in every step, the share of a GPU step that matters most.
        # (A root-only tree, a plain step, has no draft nodes.)
        self.records.append({"rows": int(active.shape[0]), "width": width,
                             "nodes": ((tree.parents >= 0) & active[:, None]).sum() if width > 1 else 0,
                             "num_accepted": out.num_accepted, "active": active})
        if self.planner is not None:
            self.planner.observe(out, active)

    def accepted_counts(self, size: int) -> torch.Tensor:
        """int64 [size] on the host: [d] = (step, running row) pairs that accepted d draft nodes."""
        if not self.records:
            return torch.zeros(size, dtype=torch.int64)
        # Rows that were not running count in bin `size`, dropped (no boolean indexing: one
        # host sync per step on a GPU; here one copy at the end).
        accepted = torch.cat([torch.where(r["active"], r["num_accepted"].long(), size) for r in self.records])
        return torch.bincount(accepted, minlength=size + 1)[:size].cpu()

    def steps(self) -> List[dict]:
        if not self.records:
            return []
        zero = self.records[0]["num_accepted"].new_zeros((), dtype=torch.int64)
        sums = torch.stack([torch.stack([(r["num_accepted"].long() * r["active"]).sum(),
                                         r["nodes"] if isinstance(r["nodes"], torch.Tensor) else zero])
                            for r in self.records]).tolist()  # one copy to the host for all steps
        return [dict(rows=r["rows"], width=r["width"], nodes_per_row=nodes / r["rows"], accepted_per_row=accepted / r["rows"],
                     seconds=r.get("seconds", 0.0), compiled_graph=r.get("compiled", False))
                for r, (accepted, nodes) in zip(self.records, sums)]


@torch.inference_mode()
def generate(
    target,
    input_ids: torch.Tensor,
    *,
    drafter: Optional[Drafter] = None,
    max_new_tokens: int,
    temperature: Optional[float] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    seed: Union[None, int, torch.Tensor] = None,
    eos_token_id: Union[None, int, Sequence[int]] = None,
    attention_mask: Optional[torch.Tensor] = None,
    streamer=None,
    adaptive: Union[bool, Planner] = True,
    timing: bool = False,
    kv_page_size: Optional[int] = None,
    num_return_sequences: Optional[int] = None,
    generation_config=None,
    compile: Union[bool, str] = "auto",
    **generation_kwargs,
) -> GenerateOutput:
    """Speculative decoding with `target` (a transformers causal LM), lossless.

    Args:
        target: a transformers (>= 5) causal LM with standard full attention (Llama, Qwen2,
            Mistral-like); it runs with `specdec_tree` attention inside this call only. On a
            CPU its large weights (and a draft model's) are moved into 2 MB pages on the first
            call, values unchanged (`loop.memory`; `config.huge_pages` turns that off).
        input_ids: int [B, L] prompts (ids in [0, vocab)), left-padded where `attention_mask` is 0.
        drafter: None (plain decoding), `NgramDrafter`, `DraftModelDrafter`, `MergedDrafter`.
        max_new_tokens: most tokens generated per row.
        temperature: 0 for greedy (the target's argmax chain, lowest id on ties), else
            sampling from softmax(logits / temperature) after top_k and top_p. None (the
            default): as HF `generate`, greedy unless the generation config says do_sample,
            then its temperature / top_k / top_p (HF's defaults where it sets none).
        seed: None, int (each row its own stream) or int64 [B * num_return_sequences] (one
            per output row); every step uses fresh per-row seeds derived from it.
        eos_token_id: int or list; a row stops after emitting one. None: the target's
            generation_config.eos_token_id (as HF generate); [] disables.
        attention_mask: [B, L], 1 for prompt tokens, 0 for left padding (default all ones).
        streamer: optional, HF streamer protocol (batch size 1): `put(prompt ids)`, then
            `put(new ids)` after every step, then `end()`.
        adaptive: True: each step a `Planner` picks how many draft nodes each row verifies
            (0: plain decoding for that row) for the most expected tokens per second, from a
            cost model of the target forward measured on this device (once per model,
            device and dtype; cached on disk) and each row's acceptance (new rows start from
            what earlier calls with this target and kind of drafter accepted); drafters are
            asked for no more. When sampling, plans use only the calibration and this
            call's rows (never measured times), so a seed still reproduces the output. False: the drafter's fixed size. A `Planner` instance: that planner
            (its settings, or a given cost model). No effect without a drafter.
        num_return_sequences: n >= 1 (None: the generation config's, else 1): each prompt is
            repeated n times, as in HF `generate`: the rows are independent (each its own
            seed stream when sampling; greedy rows are n equal copies), and the output has
            B * n rows, prompt 0's n rows first. One call is then best-of-n, and a drafter
            that sees the whole batch (`SuffixDrafter`) drafts each row from its siblings.
        generation_config: a transformers GenerationConfig (default: target.generation_config);
            `generation_kwargs` (e.g. repetition_penalty=1.2, do_sample=True) update a copy of
            it, as in HF `generate`. Its logits processing (repetition penalty, no-repeat
            n-grams, bad words, min length / new tokens, suppressed tokens) is applied to every
            tree node with the node's own path as context, so greedy output stays identical to
            HF `generate` with the same settings; settings that cannot be applied exactly raise
            ValueError naming them (`specdec_kernels.loop.logits_processing`).
        timing: split stats.time_total into draft / verify / accept. On a GPU that costs a
            device synchronisation per phase and step, so it is off unless asked for.
        kv_page_size: None (default): the target's KV cache is dense, [B, S, Hkv, D] per layer.
            N >= 1: it is paged, pools of N-slot pages addressed by a block table (the layout
            serving engines use; `hf.TreeKVCache(page_size=N)`), with the paged tree attention
            and compaction kernels. Same output either way. (A draft model's cache stays dense.)
        compile: run the target's tree forward through `torch.compile` with static shapes
            (`specdec_kernels.loop.compiled`: trees and rows padded to buckets, a static cache
            capacity, our ops traced through their fake implementations, no graph break).
            False: eager. True: inductor's default mode. "reduce-overhead" (CUDA graphs, CUDA
            only; on an H200 a plain step of the default model's shapes 7.7x faster than
            eager, ~28 s to compile a graph) or another mode name in `compiled.MODES`. "auto" (the default):
            eager, the measured choice for now (docs/loop.md). The first step at each new
            shape bucket compiles (seconds for a tiny model, over a minute per graph for
            SmolLM2-135M on a 2-core CPU); graphs are kept for later calls with the same
            model, and `stats.time_compile` says what this call spent compiling. Same output
            as eager. Not with `kv_page_size`.

    Returns:
        GenerateOutput(sequences [B, L + new], stats): the prompts as given, then the
        generated tokens, rows that stopped early padded with the pad token, as HF `generate`.
    """
    from . import hf  # transformers is an optional dependency
    from . import compiled

    hf.cache.check_page_size(kv_page_size, "kv_page_size")
    t_start = time.perf_counter()
    gen_config = _generation_config(target, generation_config, generation_kwargs)
    temperature, top_k, top_p = sampling_settings(gen_config, temperature, top_k, top_p)
    lengths = _check_inputs(target, input_ids, attention_mask, max_new_tokens, temperature, streamer)
    input_ids, attention_mask, lengths = _repeat_rows(input_ids, attention_mask, lengths, gen_config,
                                                      num_return_sequences, streamer)
    device = input_ids.device
    batch, prompt_len = input_ids.shape
    eos = eos_ids(target, eos_token_id if eos_token_id is not None else gen_config.eos_token_id)
    eos = None if eos is None else eos.to(device)
    processor = TreeLogitsProcessor.from_generation_config(
        gen_config, input_ids, attention_mask if attention_mask is not None else torch.ones_like(input_ids),
        [] if eos is None else eos.tolist(), _vocab_size(target) or 0)
    drafter = drafter if drafter is not None else Drafter()
    sampling = None
    seeds = row_seeds(seed.to(device) if isinstance(seed, torch.Tensor) else seed, batch, device)
    if temperature > 0:
        generator = torch.Generator(device).manual_seed(int(seeds.sum()) & (2**63 - 1))
        sampling = Sampling(float(temperature), top_k, top_p, generator)

    planner = None
    if not isinstance(adaptive, (bool, Planner)):
        raise ValueError(f"adaptive: expected True, False or a Planner, got {type(adaptive).__name__}")
    if adaptive is not False and drafter.max_nodes > 0:
        planner = adaptive if isinstance(adaptive, Planner) else Planner()
    # What observe gets: the LM head's input (True), or the layers the drafter names.
    with_hidden = (tuple(drafter.hidden_layers) if drafter.hidden_layers else True) if drafter.needs_hidden_states else False

    stats = GenerateStats()
    capacity = prompt_len + max_new_tokens + 1 + drafter.max_nodes
    rows = _Rows(_left_align(input_ids, lengths, capacity), lengths, seeds, max_new_tokens)
    max_depth = 0
    clock = device_clock if timing else (lambda device: time.perf_counter())
    if device.type == "cpu" and config.huge_pages:
        weights_in_huge_pages(target, *drafter.models)  # (once per model: later calls find them moved)
    # The loop builds every op input itself: re-reading them would cost a host sync per op call
    # on GPU (one per layer per step) and about 0.2 ms per tree-attention call on CPU.
    # Few-row linears by our CPU kernel where the cost model found it faster (specdec_kernels/small_linear.py).
    linear_rows = _small_linear_rows(target, planner)
    static = compiled.static_forward(target, compile, device, kv_page_size is not None)
    # Tree steps and the prefill of Llama-family models on a CPU: the same math with fewer ops (loop/hf/lean.py).
    tree_forward, prefill, lean = (static.forward, hf.prefill, None) if static is not None else \
        hf.step_functions(target, linear_rows)
    # Greedy steps without logits processing read only each node's argmax: the lean forward
    # computes it from half the LM head's bytes (`LeanForward.greedy_rows`), the same tokens.
    greedy_head = lean if sampling is None and processor is None else None
    if greedy_head is not None:
        greedy_head.prepare_greedy()  # (before the steps: the planner learns their times)
    with hf.use_tree_attention(target, *drafter.models), config.value_checks(False), \
            small_linears(target, linear_rows):
        cache = hf.TreeKVCache.for_model(target, batch, capacity, page_size=kv_page_size) if static is None else \
            static.cache(target, batch, capacity)
        hidden = prefill(target, cache, rows.history, rows.lengths, return_hidden=with_hidden)
        drafter.start(rows.history, rows.lengths, capacity)
        if with_hidden:
            drafter.observe(hidden)
        if planner is not None:
            # Sampling: plans that the seed alone determines (see Planner.start).
            planner.start(target, batch, drafter.max_nodes, device, drafter, reproducible=sampling is not None)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        t0 = clock(device)
        stats.time_prefill = t0 - t_start
        trace = _Trace(planner, drafter, static)
        check_every = stop_check_every(device, drafter, streamer)
        try:
            running = not bool(rows.done.all())
            while running:
                trace.next_step()  # (a stop check waited for the step before: its time is real)
                # Draft: a token tree per row, rooted at the row's last token, of the size the
                # planner chose (the drafter's fixed size without one).
                draft = _draft(drafter, planner, rows, sampling, stats)
                tree, depths = draft.tree, draft.tree.depths
                width = tree.tokens.shape[1]
                if width > 1:  # (a root-only tree has depth 0: no host read)
                    max_depth = max(max_depth, int(depths.max()))
                t1 = clock(device)
                # Verify: one target forward over every tree node (position = prefix length +
                # depth), then lossless acceptance.
                positions = cache.seqlens.long()[:, None] + depths.clamp(min=0)
                if greedy_head is not None and greedy_head.greedy_rows(tree.tokens.numel()):
                    target_tokens = tree_forward(target, cache, tree.tokens, positions, tree.mask(),
                                                 return_hidden=with_hidden, greedy=True)
                    if with_hidden:
                        target_tokens, hidden = target_tokens
                    out = verify_greedy(target_tokens, tree.tokens, tree.parents)
                else:
                    logits = tree_forward(target, cache, tree.tokens, positions, tree.mask(), return_hidden=with_hidden)
                    if with_hidden:
                        logits, hidden = logits
                    if processor is not None:  # HF's logits processing, each node with its own path
                        logits = processor(logits, tree.tokens, tree.parents, depths, rows.history, rows.lengths,
                                           rows.generated, rows.ids)
                    out = verify(logits, tree.tokens, tree.parents, draft_probs=draft.draft_probs,
                                 temperature=temperature, top_k=top_k, top_p=top_p,
                                 seed=_step_seeds(rows.seeds, stats.steps))
                if with_hidden:
                    drafter.observe(hidden, out.accepted_nodes, out.num_accepted)
                t2 = clock(device)
                # Accept: the rows keep what they emitted, the cache everything but the last token.
                stats.steps += 1
                # The stop check reads the device (a host sync); between checks nothing is read
                # back (`stop_check_every`), and in plain decoding every running row gains one
                # token a step, so all are done after max_new_tokens steps.
                check = stats.steps % check_every == 0 or stats.steps >= max_new_tokens
                count, hit_eos = rows.emitted_counts(out, eos)
                cache.accept(out.accepted_nodes, out.num_accepted, count, max_count=None if check else width)
                active = ~rows.done
                trace.record(tree, out, active)
                rows.append(out.output_tokens, count, hit_eos)
                if streamer is not None and int(count[0]) > 0:
                    streamer.put(out.output_tokens[0, : int(count[0])].cpu())
                finished = int(rows.done.sum()) if check else 0  # (one host sync decides both)
                running = finished < rows.done.shape[0]
                if finished and running:
                    # Finished rows leave the batch (one copy of the caches), so later steps
                    # do not spend target and draft compute on them.
                    keep = (~rows.done).nonzero()[:, 0]
                    rows.keep(keep)
                    cache.keep_rows(keep)
                    drafter.keep_rows(keep)
                    if planner is not None:
                        planner.keep_rows(keep)
                t3 = clock(device)
                if timing:
                    stats.time_draft += t1 - t0
                    stats.time_verify += t2 - t1
                    stats.time_accept += t3 - t2
                t0 = t3
            trace.next_step()
            if planner is not None:
                planner.finish()
        finally:
            drafter.finish()
    if streamer is not None:
        streamer.end()

    sequences = rows.sequences(input_ids, pad_id(target, eos))
    num_accepted_counts = trace.accepted_counts(1 + drafter.max_nodes)  # [n]: (step, row) pairs accepting n drafts
    pairs = int(num_accepted_counts.sum())
    stats.new_tokens = rows.new_tokens
    stats.tokens_per_step = (sum(stats.new_tokens) / pairs) if pairs else 0.0
    reached = num_accepted_counts.flip(0).cumsum(0).flip(0)[1:]  # [d]: pairs with >= d + 1 accepted
    stats.acceptance_per_depth = [int(r) / pairs for r in reached[:max_depth]] if pairs else []
    stats.trace = trace.steps()
    stats.nodes_per_step = sum(t["nodes_per_row"] * t["rows"] for t in stats.trace) / pairs if pairs else 0.0
    stats.compiled = static is not None and static.compiled_steps > 0
    stats.time_compile = static.compile_seconds if static is not None else 0.0
    stats.time_total = time.perf_counter() - t_start
    return GenerateOutput(sequences, stats)


# Steps between stop checks in plain decoding, per device type (default 8): a check reads
# whether every row is done, a host sync; between checks the host queues the next step while
# the device runs this one, and rows that finished run on as no-ops (they keep nothing) until
# the next check. On a CPU a read costs nothing and a no-op step costs a whole forward: 1.
STOP_CHECK_EVERY = {"cpu": 1}


def stop_check_every(device: torch.device, drafter: Drafter, streamer) -> int:
    """Steps between `generate`'s stop checks: `STOP_CHECK_EVERY` for the device in plain
    decoding; 1 with a drafter (drafting reads the rows' tokens on the host every step anyway,
    and a finished row would still be drafted for) or a streamer (it gets every step's tokens)."""
    if drafter.max_nodes > 0 or streamer is not None:
        return 1
    return max(1, int(STOP_CHECK_EVERY.get(device.type, 8)))


def _small_linear_rows(target, planner: Optional[Planner]):
    """The row counts (lo, hi) at which the target's linears run our kernel (`small_linear.small_linears`):
    on a CPU, what its cost model chose at calibration (the planner's, else the target's,
    measured once per model, device and dtype and cached); elsewhere, and under tensor
    parallelism, (0, 0)."""
    from .cost_model import CostModel, tensor_parallel

    if next(target.parameters()).device.type != "cpu" or tensor_parallel(target):
        return (0, 0)
    if planner is not None and planner.cost_model is not None:
        return planner.cost_model.small_linear_rows
    return CostModel.for_model(target, verbose=planner.verbose if planner is not None else True).small_linear_rows


def _repeat_rows(input_ids, attention_mask, lengths, gen_config, num_return_sequences, streamer):
    """(input_ids, attention_mask, lengths) with each row repeated n times in place (HF's
    order: row b's copies at b * n .. b * n + n - 1), n = num_return_sequences, else the
    config's (which is then cleared: the repetition is done here). n = 1: unchanged."""
    n = num_return_sequences if num_return_sequences is not None else getattr(gen_config, "num_return_sequences", None)
    n = 1 if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_return_sequences: expected an int >= 1, got {n!r}")
    if hasattr(gen_config, "num_return_sequences"):
        gen_config.num_return_sequences = None
    if n == 1:
        return input_ids, attention_mask, lengths
    if streamer is not None:
        raise ValueError("streamer: streaming needs a batch of one prompt and num_return_sequences=1")
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    return input_ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0), lengths.repeat_interleave(n, 0)


def _generation_config(target, generation_config, generation_kwargs):
    """A copy of `generation_config` (default: the target's) updated with the call's keywords;
    a keyword that is not a generation setting raises ValueError naming it."""
    import copy

    from transformers import GenerationConfig

    base = generation_config if generation_config is not None else getattr(target, "generation_config", None)
    config = copy.deepcopy(base) if base is not None else GenerationConfig()
    unused = config.update(**generation_kwargs)
    if unused:
        raise ValueError(f"{', '.join(sorted(unused))}: not an argument of generate nor a generation setting")
    return config


def _check_inputs(target, input_ids, attention_mask, max_new_tokens, temperature, streamer) -> torch.Tensor:
    """Validate generate's arguments; returns the prompt lengths (int64 [B])."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids: expected int [B, L] with L >= 1, got {shape}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids: expected an integer dtype (token ids), got {input_ids.dtype}")
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("streamer: streaming needs a batch of one prompt")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature: expected >= 0 (0 = greedy), got {temperature}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask: expected shape {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}")
    lengths = attention_mask.long().sum(1)
    prompt_len = input_ids.shape[1]
    left_padded = torch.arange(prompt_len, device=input_ids.device)[None, :] >= (prompt_len - lengths)[:, None]
    if not torch.equal(left_padded, attention_mask.bool()) or (lengths == 0).any():
        raise ValueError("attention_mask: expected left padding (0s then 1s) and at least one prompt token per row")
    vocab = _vocab_size(target)
    real = input_ids[attention_mask.bool()]  # padding positions may hold anything
    if real.numel() and (int(real.min()) < 0 or (vocab is not None and int(real.max()) >= vocab)):
        raise ValueError(f"input_ids: token ids must lie in [0, {vocab}) (the target's vocabulary), "
                         f"got values in [{int(real.min())}, {int(real.max())}]")
    return lengths


def _vocab_size(target) -> Optional[int]:
    """Rows of the target's input embedding (the ids it can read), else config.vocab_size."""
    get = getattr(target, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    weight = getattr(emb, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return weight.shape[0]
    cfg = getattr(target, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return getattr(cfg, "vocab_size", None)
