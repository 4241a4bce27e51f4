"""HF `generate`'s logits processing, applied to every node of a token tree.

A tree node's logits predict the token after that node, so HF would process them with the
context it would have had at that point of sequential decoding: the prompt exactly as given
(left padding included), the tokens generated so far, then the drafted tokens on the node's
own path (its ancestors below the root, and the node itself). `TreeLogitsProcessor` builds
that context for every node at once and applies, in HF's order:

| generation_config field  | HF processor                       | effect on node i                                    |
| ------------------------ | ---------------------------------- | --------------------------------------------------- |
| `repetition_penalty`     | RepetitionPenaltyLogitsProcessor   | logits of tokens in the context (padding ignored): / p if > 0, * p if < 0 |
| `no_repeat_ngram_size` n | NoRepeatNGramLogitsProcessor       | -inf for every token that would repeat an n-gram of the context (padding included, as HF) |
| `bad_words_ids`          | NoBadWordsLogitsProcessor          | -inf for a word's last token where the context ends with the rest (eos-only words dropped, as HF) |
| `min_length`             | MinLengthLogitsProcessor           | -inf for eos while padded prompt + generated + depth < min_length |
| `min_new_tokens`         | MinNewTokensLengthLogitsProcessor  | -inf for eos while generated + depth < min_new_tokens |
| `suppress_tokens`        | SuppressTokensLogitsProcessor      | -inf always                                         |
| `begin_suppress_tokens`  | SuppressTokensAtBeginLogitsProcessor | -inf at the first generated token (generated + depth == 0) |

Temperature, top-k and top-p (HF's warpers, applied after the processors) are applied by
`verify`. Settings we cannot apply exactly are refused (`UNSUPPORTED`), never ignored.
"""

from typing import List, Optional, Sequence

import torch

# generation_config fields whose processing we do not implement, with the value that means
# "off". A config with any other value is refused with a ValueError naming the field.
UNSUPPORTED = {
    "guidance_scale": (None, 1, 1.0),
    "sequence_bias": (None,),
    "encoder_repetition_penalty": (None, 1.0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "remove_invalid_values": (None, False),
    "exponential_decay_length_penalty": (None,),
    "min_p": (None,),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "top_h": (None,),
    "watermarking_config": (None,),
    "num_beams": (None, 1),
    "num_beam_groups": (None, 1),
    "num_return_sequences": (None, 1),
    "penalty_alpha": (None,),
    "diversity_penalty": (None, 0.0),
    "force_words_ids": (None,),
    "constraints": (None,),
}


def refused_settings(generation_config) -> List[str]:
    """Names (with values) of the generation_config settings `generate` cannot apply exactly."""
    refused = []
    for name, off in UNSUPPORTED.items():
        value = getattr(generation_config, name, None)
        if value is not None and value not in off:
            refused.append(f"{name}={value!r}")
    return refused


def sampling_settings(generation_config, temperature, top_k, top_p):
    """(temperature, top_k, top_p) for `verify` from the call's values and the config.

    Temperature unset (None): as HF `generate`, `do_sample` decides: greedy (0) unless it is
    True, then temperature, top_k and top_p come from the config, HF's global defaults
    (temperature 1, top_k 50, top_p 1) filling what it leaves unset, and the call's top_k /
    top_p win. An explicit temperature keeps our meaning (0 greedy, > 0 sampling); top_k /
    top_p the call leaves unset come from the config only where the config sets them (HF's
    global top_k=50 is not imposed on a caller who chose a temperature).
    """
    get = lambda name: getattr(generation_config, name, None)  # noqa: E731
    if temperature is None:
        defaults = getattr(generation_config, "_get_default_generation_params", dict)()
        pick = lambda name: get(name) if get(name) is not None else defaults.get(name)  # noqa: E731
        if not pick("do_sample"):
            return 0.0, top_k, top_p
        temperature = float(pick("temperature") if pick("temperature") is not None else 1.0)
    else:
        pick = get
    if temperature > 0:
        top_k = top_k if top_k is not None else (pick("top_k") or None)
        top_p = top_p if top_p is not None else (pick("top_p") if pick("top_p") is not None and pick("top_p") < 1.0 else None)
    return temperature, top_k, top_p


def _token_list(value) -> List[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


class TreeLogitsProcessor:
    """The logits processing of `generation_config` for the nodes of a token tree (see module
    docstring). Build it with `from_generation_config`, which returns None when the config
    asks for no processing (the loop then skips it at no cost).

    Args:
        prompt_ids: int [B0, P], the prompts as given to `generate` (left padding included).
        attention_mask: [B0, P], 0 on left padding.
        eos_ids: the eos token ids (min_length / min_new_tokens act on them).
        vocab_size: V of the target's logits.
        repetition_penalty, no_repeat_ngram_size, bad_words_ids, min_length, min_new_tokens,
        suppress_tokens, begin_suppress_tokens: as in transformers' GenerationConfig.
    """

    def __init__(self, prompt_ids, attention_mask, eos_ids: Sequence[int], vocab_size: int, *,
                 repetition_penalty: Optional[float] = None, no_repeat_ngram_size: Optional[int] = None,
                 bad_words_ids=None, min_length: Optional[int] = None, min_new_tokens: Optional[int] = None,
                 suppress_tokens=None, begin_suppress_tokens=None):
        self.prompt_ids = prompt_ids.long()
        self.pad_lengths = (attention_mask == 0).long().sum(1)
        self.vocab_size = int(vocab_size)
        device = prompt_ids.device
        self.eos = torch.tensor(_token_list(eos_ids), dtype=torch.int64, device=device)
        if repetition_penalty is not None and not repetition_penalty > 0:
            raise ValueError(f"repetition_penalty: expected a float > 0, got {repetition_penalty}")
        self.repetition_penalty = None if repetition_penalty in (None, 1.0) else float(repetition_penalty)
        if no_repeat_ngram_size is not None and no_repeat_ngram_size < 0:
            raise ValueError(f"no_repeat_ngram_size: expected >= 0, got {no_repeat_ngram_size}")
        self.ngram = int(no_repeat_ngram_size or 0)
        words = [list(map(int, w)) for w in (bad_words_ids or [])]
        if any(not w or min(w) < 0 or max(w) >= self.vocab_size for w in words):
            raise ValueError(f"bad_words_ids: expected non-empty lists of token ids in [0, {self.vocab_size}), got {bad_words_ids}")
        # HF drops the words that are exactly one eos token (they would stop generation from ending).
        words = [w for w in words if not (len(w) == 1 and w[0] in self.eos.tolist())]
        self.single_bad = torch.tensor([w[0] for w in words if len(w) == 1], dtype=torch.int64, device=device)
        self.multi_bad = [w for w in words if len(w) > 1]
        self.min_length = int(min_length or 0) if self.eos.numel() else 0
        self.min_new_tokens = int(min_new_tokens or 0) if self.eos.numel() else 0
        self.suppress = torch.tensor(_token_list(suppress_tokens), dtype=torch.int64, device=device)
        self.begin_suppress = torch.tensor(_token_list(begin_suppress_tokens), dtype=torch.int64, device=device)
        for name, ids in (("suppress_tokens", self.suppress), ("begin_suppress_tokens", self.begin_suppress)):
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
                raise ValueError(f"{name}: token ids must be in [0, {self.vocab_size}), got {ids.tolist()}")
        self.needs_context = self.repetition_penalty is not None or self.ngram > 0 or bool(self.multi_bad)

    @classmethod
    def from_generation_config(cls, generation_config, prompt_ids, attention_mask, eos_ids, vocab_size):
        """The processor `generation_config` asks for, or None when it asks for none.
        Raises ValueError naming every setting that cannot be applied exactly."""
        refused = refused_settings(generation_config)
        if refused:
            raise ValueError("generation_config: specdec_kernels.loop.generate cannot apply these settings exactly: "
                             + ", ".join(refused))
        get = lambda name: getattr(generation_config, name, None)  # noqa: E731
        processor = cls(prompt_ids, attention_mask, eos_ids, vocab_size,
                        repetition_penalty=get("repetition_penalty"), no_repeat_ngram_size=get("no_repeat_ngram_size"),
                        bad_words_ids=get("bad_words_ids"), min_length=get("min_length"),
                        min_new_tokens=get("min_new_tokens"), suppress_tokens=get("suppress_tokens"),
                        begin_suppress_tokens=get("begin_suppress_tokens"))
        return processor if processor.active() else None

    def active(self) -> bool:
        """Whether any rule is on."""
        return (self.needs_context or self.single_bad.numel() > 0 or self.min_length > 0 or self.min_new_tokens > 0
                or self.suppress.numel() > 0 or self.begin_suppress.numel() > 0)

    def node_contexts(self, tree_tokens, parents, depths, history, lengths, generated, rows):
        """(ctx [B, T, C], ctx_len [B, T]): node i's context, the padded prompt, the generated
        tokens, then the drafted tokens of its path (depth d adds d tokens). Past ctx_len: -1.
        The path starts right after each row's own generated tokens, so rows that generated
        fewer tokens have their path earlier: every context is contiguous."""
        batch, num_nodes = tree_tokens.shape
        device = tree_tokens.device
        prompts = self.prompt_ids[rows]  # [B, P]
        prompt_len = prompts.shape[1]
        generated = generated.long()
        max_gen = int(generated.max()) if batch else 0
        max_depth = int(depths.max()) if depths.numel() else 0
        width = prompt_len + max_gen + max_depth
        ctx = torch.full((batch, num_nodes, width), -1, dtype=torch.int64, device=device)
        ctx[:, :, :prompt_len] = prompts[:, None, :]
        if max_gen:
            j = torch.arange(max_gen, device=device)
            start = (lengths.long() - generated)[:, None]  # where the generated tokens start in history
            gen = history.gather(1, (start + j).clamp(max=history.shape[1] - 1))
            gen = torch.where(j[None, :] < generated[:, None], gen, -1)
            ctx[:, :, prompt_len : prompt_len + max_gen] = gen[:, None, :]
        base_len = prompt_len + generated  # [B]
        # Walk up from every node: a node at depth d >= 1 writes its token at base_len + d - 1.
        node = torch.arange(num_nodes, device=device).expand(batch, -1)
        safe_parents = parents.long().clamp(min=0)
        for _ in range(max_depth):
            d = depths.gather(1, node)
            token = tree_tokens.long().gather(1, node)
            writes = d >= 1
            slot = (base_len[:, None] + d - 1).clamp(min=0)
            current = ctx.gather(2, slot[:, :, None])[:, :, 0]
            ctx.scatter_(2, slot[:, :, None], torch.where(writes, token, current)[:, :, None])
            node = torch.where(writes, safe_parents.gather(1, node), node)
        ctx_len = base_len[:, None] + depths.clamp(min=0)
        return ctx, ctx_len

    def __call__(self, logits, tree_tokens, parents, depths, history, lengths, generated, rows):
        """Processed fp32 logits [B, T, V].

        logits [B, T, V] of the tree nodes; tree_tokens, parents, depths [B, T]; history
        [B, S] the rows' tokens, left-aligned (prompt without padding, then generated), lengths
        [B]; generated [B] tokens generated so far; rows [B] the rows' indices in the prompts.
        """
        scores = logits.float().clone()
        batch, num_nodes, vocab = scores.shape
        device = scores.device
        real = (parents >= 0) | (torch.arange(num_nodes, device=device) == 0)[None, :]
        depths = torch.where(real, depths, 0).long()
        new_tokens = generated.long()[:, None] + depths  # tokens generated before node i's prediction
        neg_inf = float("-inf")
        if self.needs_context:
            ctx, ctx_len = self.node_contexts(tree_tokens, parents, depths, history, lengths, generated, rows)
            width = ctx.shape[2]
            k = torch.arange(width, device=device)
            if self.repetition_penalty is not None:
                pad = self.pad_lengths[rows].to(device)
                counted = (k[None, None, :] >= pad[:, None, None]) & (k[None, None, :] < ctx_len[:, :, None])
                present = torch.zeros(batch, num_nodes, vocab + 1, dtype=torch.bool, device=device)
                present.scatter_(2, torch.where(counted, ctx, vocab), True)
                present = present[:, :, :vocab]
                penalised = torch.where(scores < 0, scores * self.repetition_penalty, scores / self.repetition_penalty)
                scores = torch.where(present, penalised, scores)
            banned = torch.zeros(batch, num_nodes, vocab + 1, dtype=torch.bool, device=device)
            if self.ngram > 0 and width >= self.ngram:
                n = self.ngram
                windows = ctx.unfold(2, n, 1)  # [B, T, width - n + 1, n]
                starts = torch.arange(windows.shape[2], device=device)
                whole = starts[None, None, :] + n <= ctx_len[:, :, None]  # the n-gram lies in the context
                if n == 1:
                    match = whole
                else:
                    tail = ctx.gather(2, (ctx_len[:, :, None] - (n - 1) + torch.arange(n - 1, device=device)).clamp(min=0))
                    match = whole & (windows[..., : n - 1] == tail[:, :, None, :]).all(-1)
                banned.scatter_(2, torch.where(match, windows[..., n - 1], vocab), True)
            for word in self.multi_bad:
                m = len(word) - 1
                prefix = torch.tensor(word[:-1], device=device)
                tail = ctx.gather(2, (ctx_len[:, :, None] - m + torch.arange(m, device=device)).clamp(min=0))
                ends_with = (ctx_len >= m) & (tail == prefix).all(-1)
                banned[:, :, word[-1]] |= ends_with
            scores = scores.masked_fill(banned[:, :, :vocab], neg_inf)
        if self.single_bad.numel():
            scores[:, :, self.single_bad] = neg_inf
        if self.min_length > 0 or self.min_new_tokens > 0:
            padded_len = self.prompt_ids.shape[1] + new_tokens
            block_eos = (padded_len < self.min_length) | (new_tokens < self.min_new_tokens)
            eos_scores = scores[:, :, self.eos]
            scores[:, :, self.eos] = torch.where(block_eos[:, :, None], neg_inf, eos_scores)
        if self.suppress.numel():
            scores[:, :, self.suppress] = neg_inf
        if self.begin_suppress.numel():
            first = (new_tokens == 0)[:, :, None]
            scores[:, :, self.begin_suppress] = torch.where(first, neg_inf, scores[:, :, self.begin_suppress])
        return scores
