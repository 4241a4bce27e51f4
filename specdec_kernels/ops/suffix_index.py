"""Suffix cache: draft token trees from everything already seen, across sequences and calls.

One index over many token sequences: finished ones (`add`: earlier outputs, a code base,
documents) and live ones, one per slot, that grow as tokens are emitted (`start`, `append`).
For a slot it answers: which continuations followed the longest suffix of the slot's
sequence (up to `max_depth` tokens) anywhere in the cache, including the other live slots'
tokens as soon as they are appended (sibling drafting: n samples of one prompt draft from
each other) and the slot's own earlier tokens (prompt lookup)? The answer is a token tree,
the continuations of the newest `max_candidates` occurrences merged into a trie, with a count
per node (how many continuations pass through it: count / root count is the node's
empirical path probability):

    index = SuffixIndex(num_slots=8, max_tokens=1 << 20, vocab_size=49152)
    index.add([earlier_output_ids, other_ids])          # finished sequences
    index.start(0, prompt_ids)                          # a live sequence in slot 0
    index.fork(1, 0)                                    # slot 1: same prompt, cached once
    out = index.append_and_draft([0, 1], new_tokens, counts, num_tokens=16, max_nodes=32)
    out.tokens, out.parents, out.counts, out.match_lengths

`append_and_draft` appends every row's tokens first (rows see each other's), then drafts.

Cost and memory (design in csrc/include/specdec/suffix_index.h): hash chains per context
length in {1, 2, 3, 4, 6, 8, 12, 16, 24, 32} (those <= max_depth) over a fixed ring of
tokens. An appended token costs O(orders); a draft O(max_probes * matched length +
max_candidates * num_tokens); neither grows with the cache. Measured (bench/results/
suffix_index_cpu.json): ~1.3-1.9 us per row and step for append + draft at 64 rows with 1M
cached tokens (rows on cached text / half of them on novel text), ~0.25 of it the call
itself, most of the rest memory latency (the rows' lookups are interleaved to overlap it).
Memory is fixed at creation: 92 bytes per cached token with max_depth 32 (4 token + 8
sequence links + 4 per order for the chains + 4 per order for the hash heads), counted for
max_tokens rounded up to a power of two, plus 192 bytes per slot. The oldest tokens are
evicted first when max_tokens is reached (old sequences go whole before newer ones; one
evicted half-way keeps its tail).

Backends: "cpu" is the compiled class `torch.classes.specdec.SuffixIndex` (drafts of one call
split over threads, GIL released; appends serial, in row order); "python" is
`specdec_kernels.ops.reference.suffix_index.SuffixIndex`, the same algorithm in plain Python
(same results), used when specdec_kernels._C lacks the class. Not thread-safe: one caller at
a time.
"""

from typing import NamedTuple, Optional, Sequence, Union

import torch

from . import _checks
from ._extension import has_compiled_class, host_index_backend
from .reference.suffix_index import SuffixIndex as _ReferenceIndex

Slots = Union[int, Sequence[int], torch.Tensor]


class SuffixDraft(NamedTuple):
    """One draft per row: `tokens [R, 1 + max_nodes]` (node 0 the slot's last token, -1
    padding), `parents [R, 1 + max_nodes]` (topological, -1 root and padding), `counts int32
    [R, 1 + max_nodes]` (continuations through each node; the root's: occurrences found; 0
    padding), `match_lengths int32 [R]` (length of the matched suffix, 0: none found). Nodes
    come sorted by count, highest first (so a prefix of them is a tree)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    counts: torch.Tensor
    match_lengths: torch.Tensor


def _has_compiled_class() -> bool:
    return has_compiled_class("SuffixIndex")


def _int64(name: str, x, dims: int) -> torch.Tensor:
    if type(x) is torch.Tensor and x.dtype == torch.int64 and x.dim() == dims and x.device.type == "cpu":
        return x  # the common case in a decoding loop: no conversion, no call into torch
    x = torch.as_tensor(x)
    if x.numel() == 0 and not x.dtype.is_complex and x.dtype != torch.bool:
        x = x.to(torch.int64)  # [] is float32 to torch
    _checks.tensor(name, x, dims=dims, dtypes=_checks.INT_DTYPES)
    return x.to(device="cpu", dtype=torch.int64)


class SuffixIndex:
    """A cache of token sequences that drafts continuations of live slots (see the module).

    Args:
        num_slots: live sequences it tracks at once (slot ids 0 .. num_slots - 1).
        max_tokens: token budget; the oldest tokens are evicted beyond it.
        max_depth: longest suffix matched, in [1, 32].
        max_candidates: occurrences whose continuations make the tree (the newest ones).
        max_probes: chain entries visited per context length (bounds a lookup's cost).
        vocab_size: token ids must lie in [0, vocab_size) (None: they must fit in int32).
        backend: None (compiled if available, else "python"), "cpu" or "python".
    """

    def __init__(self, num_slots: int, *, max_tokens: int = 1 << 20, max_depth: int = 32, max_candidates: int = 8,
                 max_probes: int = 64, vocab_size: Optional[int] = None, backend: Optional[str] = None,
                 _table_bits: int = 0):
        _checks.int_arg("num_slots", num_slots, minimum=1)
        _checks.int_arg("max_tokens", max_tokens, minimum=1)
        if max_tokens > 1 << 30:
            _checks.fail("max_tokens", f"expected <= 2^30, got {max_tokens}")
        _checks.int_arg("max_depth", max_depth, minimum=1)
        if max_depth > 32:
            _checks.fail("max_depth", f"expected max_depth <= 32, got {max_depth}")
        _checks.int_arg("max_candidates", max_candidates, minimum=1)
        if max_candidates > 1024:
            _checks.fail("max_candidates", f"expected <= 1024, got {max_candidates}")
        _checks.int_arg("max_probes", max_probes, minimum=1)
        if vocab_size is not None:
            _checks.int_arg("vocab_size", vocab_size, minimum=1)
            if vocab_size > 2**31 - 1:
                _checks.fail("vocab_size", f"expected < 2^31, got {vocab_size}")
        backend = host_index_backend("SuffixIndex", backend)
        self.num_slots, self.max_tokens, self.max_depth = num_slots, max_tokens, max_depth
        self.vocab_size, self.backend = vocab_size, backend
        args = (max_tokens, max_depth, num_slots, max_candidates, max_probes, vocab_size or 0, _table_bits)
        self._impl = torch.classes.specdec.SuffixIndex(*args) if backend == "cpu" else _ReferenceIndex(*args)

    @staticmethod
    def has_compiled_backend() -> bool:
        """Whether backend "cpu" (the compiled index in specdec_kernels._C) is available."""
        return _has_compiled_class()

    # ------------------------------------------------------------------ inspection

    @property
    def cached_tokens(self) -> int:
        """Tokens the cache holds now (<= max_tokens)."""
        return self._impl.cached()

    @property
    def appended_tokens(self) -> int:
        """Tokens appended over the index's life (evicted ones included)."""
        return self._impl.appended()

    def memory_bytes(self) -> int:
        """Bytes held by the compiled index (fixed at creation; 0 for the Python backend)."""
        return self._impl.memory_bytes()

    def length(self, slot: int) -> int:
        """Tokens in the slot's live sequence."""
        _checks.int_arg("slot", slot)
        return self._impl.length(slot)

    def reserve_slots(self, num_slots: int) -> None:
        """At least `num_slots` slots from now on (never fewer); the cache is kept."""
        _checks.int_arg("num_slots", num_slots, minimum=1)
        self._impl.reserve_slots(num_slots)
        self.num_slots = self._impl.num_slots()

    def clear(self) -> None:
        """Forget every cached sequence (live slots become empty)."""
        self._impl.clear()

    # ------------------------------------------------------------------ updates

    def add(self, token_lists) -> None:
        """Cache finished sequences: a list of 1-D int tensors or lists of token ids."""
        if isinstance(token_lists, torch.Tensor):
            token_lists = [token_lists] if token_lists.dim() == 1 else list(token_lists)
        seqs = [_int64(f"token_lists[{i}]", s, 1) for i, s in enumerate(token_lists)]
        offsets = torch.tensor([0] + [int(s.numel()) for s in seqs], dtype=torch.int64).cumsum(0)
        flat = torch.cat(seqs) if seqs else torch.zeros(0, dtype=torch.int64)
        self._check_values("token_lists", flat)
        self._impl.add(flat, offsets)

    def start(self, slot: int, prompt_tokens) -> None:
        """Slot `slot` starts a new live sequence with `prompt_tokens` (1-D ints); the slot's
        previous sequence stays cached."""
        _checks.int_arg("slot", slot)
        prompt = _int64("prompt_tokens", prompt_tokens, 1)
        self._check_values("prompt_tokens", prompt)
        self._impl.start(slot, prompt)

    def fork(self, slot: int, from_slot: int) -> None:
        """Slot `slot` continues as a copy of `from_slot`'s live sequence (its tokens cached
        once, shared): n samples of one prompt start this way."""
        _checks.int_arg("slot", slot)
        _checks.int_arg("from_slot", from_slot)
        self._impl.fork(slot, from_slot)

    def append(self, slots: Slots, accepted_tokens, counts=None) -> None:
        """Append `accepted_tokens[r, :counts[r]]` to slot `slots[r]` (distinct slots), in row
        order. accepted_tokens: int [R, K] (past counts[r]: ignored, e.g. -1); counts: int [R]
        in [0, K], None for all K."""
        self._impl.append(*self._rows(slots, accepted_tokens, counts))

    # ------------------------------------------------------------------ queries

    def draft(self, slots: Slots, *, num_tokens: int = 16, max_nodes: int = 32) -> SuffixDraft:
        """A tree per row for slot `slots[r]` (slots may repeat): continuations up to
        `num_tokens` deep, the `max_nodes` nodes with the highest counts (see `SuffixDraft`)."""
        self._check_sizes(num_tokens, max_nodes)
        return SuffixDraft(*self._impl.draft(self._slot_tensor(slots), num_tokens, max_nodes))

    def append_and_draft(self, slots: Slots, accepted_tokens, counts=None, *, num_tokens: int = 16,
                         max_nodes: int = 32) -> SuffixDraft:
        """`append(slots, accepted_tokens, counts)` (every row) then `draft(slots, ...)`, one call."""
        self._check_sizes(num_tokens, max_nodes)
        return SuffixDraft(*self._impl.append_and_draft(*self._rows(slots, accepted_tokens, counts), num_tokens,
                                                        max_nodes))

    # ------------------------------------------------------------------ helpers

    def _check_values(self, name: str, tokens: torch.Tensor) -> None:
        if not _checks.checking_values() or tokens.numel() == 0:
            return
        low, high = int(tokens.min()), int(tokens.max())
        limit = self.vocab_size if self.vocab_size is not None else 2**31 - 1
        if low < 0 or high >= limit:
            bad = low if low < 0 else high
            _checks.fail(name, f"token id {bad} is outside [0, {limit})"
                         + (" (the vocabulary)" if self.vocab_size is not None else ""))

    @staticmethod
    def _check_sizes(num_tokens, max_nodes):
        _checks.int_arg("num_tokens", num_tokens, minimum=0)
        _checks.int_arg("max_nodes", max_nodes, minimum=0)

    @staticmethod
    def _slot_tensor(slots) -> torch.Tensor:
        if isinstance(slots, int) and not isinstance(slots, bool):
            slots = [slots]
        return _int64("slots", slots, 1)

    def _rows(self, slots, accepted_tokens, counts):
        if (type(slots) is torch.Tensor and type(accepted_tokens) is torch.Tensor and type(counts) is torch.Tensor
                and slots.dtype is torch.int64 and accepted_tokens.dtype is torch.int64 and counts.dtype is torch.int64
                and slots.dim() == 1 and accepted_tokens.dim() == 2 and counts.dim() == 1
                and slots.is_cpu and accepted_tokens.is_cpu and counts.is_cpu
                and len(slots) == len(accepted_tokens) == len(counts) and not _checks.checking_values()):
            return slots, accepted_tokens, counts  # a decoding loop's call: nothing to convert or check here
        slots = self._slot_tensor(slots)
        tokens = accepted_tokens if type(accepted_tokens) is torch.Tensor else torch.as_tensor(accepted_tokens)
        if tokens.numel() == 0 and tokens.dim() <= 1:
            tokens = tokens.reshape(slots.shape[0], 0).to(torch.int64)
        _checks.tensor("accepted_tokens", tokens, dims=2, dtypes=_checks.INT_DTYPES)
        _checks.shape("accepted_tokens", tokens, (slots.shape[0], tokens.shape[1]))
        tokens = _int64("accepted_tokens", tokens, 2)
        if counts is None:
            counts = torch.full((slots.shape[0],), tokens.shape[1], dtype=torch.int64)
        counts = _int64("counts", counts, 1)
        _checks.shape("counts", counts, (slots.shape[0],))
        if not _checks.checking_values():  # (the compiled index checks counts and ids itself)
            return slots, tokens, counts
        if counts.numel() and (int(counts.min()) < 0 or int(counts.max()) > tokens.shape[1]):
            _checks.fail("counts", f"expected 0 <= counts[r] <= K = {tokens.shape[1]}, got {counts.tolist()}")
        if tokens.numel():
            j = torch.arange(tokens.shape[1])
            appended = tokens[j[None, :] < counts[:, None]]
            self._check_values("accepted_tokens", appended)
        return slots, tokens, counts
