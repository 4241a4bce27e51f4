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

from . import config
from .drafters import Drafter, Sampling
from .philox import seeds_from_int
from .verify import verify

_GOLDEN = 0x9E3779B97F4A7C15  # step -> seed offset (odd 64-bit constant)


@dataclass
class GenerateStats:
    """What a `generate` call did.

    steps: target forwards after the prefill (one per draft-verify-accept step).
    new_tokens: tokens generated per row.
    tokens_per_step: tokens emitted per (step, unfinished row), the mean speculation gain.
    acceptance_per_depth: [d] = fraction of (step, unfinished row) pairs whose accepted path
        reached depth d + 1 (d + 1 drafted tokens accepted).
    time_prefill / time_draft / time_verify / time_accept / time_total: seconds; verify
        includes the target's tree forward, accept the cache compaction and bookkeeping.
    """

    steps: int = 0
    new_tokens: List[int] = field(default_factory=list)
    tokens_per_step: float = 0.0
    acceptance_per_depth: List[float] = field(default_factory=list)
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_accept: float = 0.0
    time_total: float = 0.0

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


def _eos_ids(target, eos_token_id) -> Optional[torch.Tensor]:
    """eos ids as a 1D tensor, or None. None: the target's generation_config.eos_token_id
    (as HF generate); pass [] to disable."""
    if eos_token_id is None:
        eos_token_id = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.int64) if ids else None


def _pad_id(target, eos) -> int:
    gen_cfg = getattr(target, "generation_config", None)
    for pad in (getattr(gen_cfg, "pad_token_id", None), getattr(target.config, "pad_token_id", None)):
        if pad is not None:
            return int(pad)
    return int(eos[0]) if eos is not None else 0


def _row_seeds(seed, batch: int, device) -> torch.Tensor:
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()))
    if isinstance(seed, torch.Tensor):
        if seed.shape != (batch,) or seed.dtype != torch.int64:
            raise ValueError(f"seed: expected an int or an int64 tensor of shape [{batch}], got {seed.dtype} {tuple(seed.shape)}")
        return seed.to(device)
    return seeds_from_int(int(seed), batch, device)


def _step_seeds(row_seeds: torch.Tensor, step: int) -> torch.Tensor:
    """Per-row seeds for one step: row seed XOR a step-dependent 64-bit constant."""
    offset = (step * _GOLDEN) & 0xFFFFFFFFFFFFFFFF
    return row_seeds ^ (offset - (1 << 64) if offset >= 1 << 63 else offset)


def _left_align(input_ids: torch.Tensor, lengths: torch.Tensor, capacity: int) -> torch.Tensor:
    """[B, capacity] int64: row b's last lengths[b] prompt tokens moved to the front, zeros after."""
    batch, prompt_len = input_ids.shape
    j = torch.arange(capacity, device=input_ids.device)
    src = (prompt_len - lengths)[:, None] + j
    tokens = input_ids.long().gather(1, src.clamp(max=prompt_len - 1))
    return torch.where(j[None, :] < lengths[:, None], tokens, 0)


def _emitted_counts(out, eos, budget, done):
    """Tokens each row keeps of `out.output_tokens` (num_accepted + 1, cut after the first eos
    and at the row's remaining budget; 0 for finished rows), and whether it emitted an eos."""
    emitted = out.output_tokens.long()
    j = torch.arange(emitted.shape[1], device=emitted.device)
    count = out.num_accepted.long() + 1
    if eos is None:
        return torch.minimum(count, budget).masked_fill(done, 0), torch.zeros_like(done)
    is_eos = torch.isin(emitted, eos) & (j[None, :] < count[:, None])
    count = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, count)
    count = torch.minimum(count, budget).masked_fill(done, 0)
    return count, (is_eos & (j[None, :] < count[:, None])).any(1)


def _append(history, lengths, tokens, count) -> None:
    """history[b, lengths[b] + j] = tokens[b, j] for j < count[b], in place."""
    j = torch.arange(tokens.shape[1], device=tokens.device)
    keep = j[None, :] < count[:, None]
    rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None].expand_as(keep)
    history[rows[keep], (lengths[:, None] + j)[keep]] = tokens.long()[keep]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.inference_mode()
def generate(
    target,
    input_ids: torch.Tensor,
    *,
    drafter: Optional[Drafter] = None,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    seed: Union[None, int, torch.Tensor] = None,
    eos_token_id: Union[None, int, Sequence[int]] = None,
    attention_mask: Optional[torch.Tensor] = None,
    streamer=None,
) -> GenerateOutput:
    """Speculative decoding with `target` (a transformers causal LM), lossless.

    Args:
        target: a transformers (>= 5) causal LM with standard full attention (Llama, Qwen2,
            Mistral-like); it runs with `specdec_tree` attention inside this call only.
        input_ids: int [B, L] prompts, left-padded where `attention_mask` is 0.
        drafter: None (plain decoding), `NgramDrafter`, `DraftModelDrafter`, `MergedDrafter`.
        max_new_tokens: most tokens generated per row.
        temperature: 0 for greedy (the target's argmax chain, lowest id on ties), else
            sampling from softmax(logits / temperature) after top_k and top_p.
        seed: None, int (each row its own stream) or int64 [B]; every step uses fresh
            per-row seeds derived from it.
        eos_token_id: int or list; a row stops after emitting one. None: the target's
            generation_config.eos_token_id (as HF generate); [] disables.
        attention_mask: [B, L], 1 for prompt tokens, 0 for left padding (default all ones).
        streamer: optional, HF streamer protocol (batch size 1): `put(prompt ids)`, then
            `put(new ids)` after every step, then `end()`.

    Returns:
        GenerateOutput(sequences [B, L + new], stats): the prompts as given, then the
        generated tokens, rows that stopped early padded with the pad token, as HF `generate`.
    """
    from . import hf  # transformers is an optional dependency

    t_start = time.perf_counter()
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids: expected int [B, L] with L >= 1, got shape {tuple(input_ids.shape)}")
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("streamer: streaming needs a batch of one prompt")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature: expected >= 0 (0 = greedy), got {temperature}")
    device = input_ids.device
    batch, prompt_len = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask: expected shape {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}")
    lengths = attention_mask.long().sum(1)
    left_padded = torch.arange(prompt_len, device=device)[None, :] >= (prompt_len - lengths)[:, None]
    if not torch.equal(left_padded, attention_mask.bool()) or (lengths == 0).any():
        raise ValueError("attention_mask: expected left padding (0s then 1s) and at least one prompt token per row")
    eos = _eos_ids(target, eos_token_id)
    eos = None if eos is None else eos.to(device)
    pad_id = _pad_id(target, eos)
    drafter = drafter if drafter is not None else Drafter()
    greedy = temperature == 0
    row_seeds = _row_seeds(seed, batch, device)
    sampling = None
    if not greedy:
        generator = torch.Generator(device).manual_seed(int(row_seeds.sum()) & (2**63 - 1))
        sampling = Sampling(float(temperature), top_k, top_p, generator)

    stats = GenerateStats()
    capacity = prompt_len + max_new_tokens + 1 + drafter.max_nodes
    history = _left_align(input_ids, lengths, capacity)  # every row's tokens, left-aligned
    generated = torch.zeros(batch, dtype=torch.int64, device=device)
    done = generated >= max_new_tokens
    # Rows still running are history[i] etc. for original row row_ids[i]; finished rows are
    # moved into the out_* tensors and dropped from the batch.
    row_ids = torch.arange(batch, device=device)
    out_history, out_lengths, out_generated = history.clone(), lengths.clone(), generated.clone()
    accepted_hist = torch.zeros(1 + drafter.max_nodes, dtype=torch.int64)
    max_depth = 0
    # The loop builds every op input itself: re-reading them would cost a host sync per op call
    # on GPU (one per layer per step) and about 0.2 ms per tree-attention call on CPU.
    with hf.use_tree_attention(target, *drafter.models), config.value_checks(False):
        cache = hf.TreeKVCache.for_model(target, batch, capacity)
        wants_hidden = bool(getattr(drafter, "needs_hidden_states", False))
        prefill_hidden = hf.prefill(target, cache, history, lengths, return_hidden=wants_hidden)
        drafter.start(history, lengths, capacity)
        if wants_hidden:
            drafter.observe(prefill_hidden)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        t0 = _sync(device)
        stats.time_prefill = t0 - t_start
        try:
            while not bool(done.all()):
                # Draft: a token tree per row, rooted at the row's last token.
                draft = drafter.propose(history, lengths, sampling)
                tree, depths = draft.tree, draft.tree.depths
                max_depth = max(max_depth, int(depths.max()))
                t1 = _sync(device)
                # Verify: one target forward over every tree node, then lossless acceptance.
                positions = cache.seqlens.long()[:, None] + depths.clamp(min=0)  # prefix length + depth
                logits = hf.forward(target, cache, tree.tokens, positions, tree.mask(), return_hidden=wants_hidden)
                if wants_hidden:
                    logits, hidden = logits
                out = verify(logits, tree.tokens, tree.parents, draft_probs=draft.draft_probs, temperature=temperature,
                             top_k=top_k, top_p=top_p, seed=_step_seeds(row_seeds, stats.steps))
                if wants_hidden:
                    drafter.observe(hidden, out.accepted_nodes, out.num_accepted)
                t2 = _sync(device)
                # Accept: keep the accepted path in the cache, append the emitted tokens.
                cache.compact_(out.accepted_nodes, out.num_accepted)
                count, hit_eos = _emitted_counts(out, eos, max_new_tokens - generated, done)
                _append(history, lengths, out.output_tokens, count)
                if streamer is not None and int(count[0]) > 0:
                    streamer.put(out.output_tokens[0, : int(count[0])].cpu())
                accepted_hist += torch.bincount(out.num_accepted.long()[~done], minlength=accepted_hist.numel()).cpu()
                lengths, generated = lengths + count, generated + count
                done = done | hit_eos | (generated >= max_new_tokens)
                cache.set_lengths(lengths - 1)  # (rows that just finished drop what they accepted past their end)
                stats.steps += 1
                if bool(done.any()) and not bool(done.all()):
                    # Finished rows leave the batch (one copy of the caches), so later steps
                    # do not spend target and draft compute on them.
                    finished, keep = done.nonzero()[:, 0], (~done).nonzero()[:, 0]
                    out_history[row_ids[finished]] = history[finished]
                    out_lengths[row_ids[finished]], out_generated[row_ids[finished]] = lengths[finished], generated[finished]
                    history, lengths, generated, done = history[keep], lengths[keep], generated[keep], done[keep]
                    row_ids, row_seeds = row_ids[keep], row_seeds[keep]
                    cache.keep_rows(keep)
                    drafter.keep_rows(keep)
                t3 = _sync(device)
                stats.time_draft, stats.time_verify, stats.time_accept = (
                    stats.time_draft + t1 - t0, stats.time_verify + t2 - t1, stats.time_accept + t3 - t2)
                t0 = t3
        finally:
            drafter.finish()
    if streamer is not None:
        streamer.end()

    out_history[row_ids], out_lengths[row_ids], out_generated[row_ids] = history, lengths, generated
    history, lengths, generated = out_history, out_lengths, out_generated
    new = int(generated.max()) if batch else 0
    j = torch.arange(new, device=device)
    gen_tokens = history.gather(1, (lengths - generated)[:, None] + j)
    gen_tokens = torch.where(j[None, :] < generated[:, None], gen_tokens, pad_id)
    sequences = torch.cat([input_ids, gen_tokens.to(input_ids.dtype)], dim=1)

    pairs = int(accepted_hist.sum())
    stats.new_tokens = generated.tolist()
    stats.tokens_per_step = (sum(stats.new_tokens) / pairs) if pairs else 0.0
    reached = accepted_hist.flip(0).cumsum(0).flip(0)[1:]  # [d]: pairs with >= d + 1 accepted
    stats.acceptance_per_depth = [int(r) / pairs for r in reached[:max_depth]] if pairs else []
    stats.time_total = time.perf_counter() - t_start
    return GenerateOutput(sequences, stats)
