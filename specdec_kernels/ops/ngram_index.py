"""Incremental n-gram index: `ngram_propose`'s answer per decoding step without rescanning.

A serving loop appends a few accepted tokens per sequence per step and asks for the next
draft. `ngram_propose` rescans the whole history each time (O(L) per row); `NgramIndex`
keeps one slot per running sequence and answers the same query in O(max_n + num_tokens),
after O(max_n) work per appended token:

    index = NgramIndex(num_slots=8, max_n=4)
    index.reset(0, prompt_ids)                                   # a new sequence in slot 0
    drafts, lens = index.propose([0], num_tokens=5)              # == ngram_propose(history)
    drafts, lens = index.append_and_propose([0], accepted, counts, num_tokens=5)

For every slot, `propose(..., min_n, max_n, num_tokens, policy)` returns exactly what
`ngram_propose(history[None], [len(history)], ...)` returns (same match rule: longest n,
earliest / latest start j <= N - n - 1), for max_n up to the index's max_n.

How: every distinct n-gram gets an exact integer id, looked up by the pair (id of its first
n - 1 tokens, its last token), so hash collisions cost a probe and never a wrong answer.
Per id the index keeps the first and latest end position that is followed by a token; the
current suffix's id then gives the earliest / latest match directly.

Backends: "cpu" is the compiled class `torch.classes.specdec.NgramIndex` (rows of one call
split over threads, GIL released); "python" is `specdec_kernels.ops.reference.NgramIndex`, the
same algorithm in plain Python, used when specdec_kernels._C is unavailable (slow, but the
same results). Both take the arguments this wrapper checks and normalises once.
Memory: about 40 bytes per distinct n-gram (<= max_n per token) plus 8 bytes per token.
An index is not thread-safe: call it from one thread at a time (its calls release the GIL).
"""

from typing import Optional, Sequence, Union

import torch

from . import _checks
from ._extension import has_compiled_class, host_index_backend
from .reference.ngram_index import NgramIndex as _ReferenceIndex

POLICIES = _checks.NGRAM_POLICIES

Slots = Union[int, Sequence[int], torch.Tensor]


def _cpu_int64(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.int64 and x.device.type == "cpu":
        return x
    return x.to(device="cpu", dtype=torch.int64)


def _has_compiled_class() -> bool:
    return has_compiled_class("NgramIndex")


class NgramIndex:
    """Per-sequence incremental n-gram index; `propose` equals `ngram_propose` on the history.

    Args:
        num_slots: how many sequences it tracks (slot ids 0 .. num_slots - 1).
        max_n: the longest n-gram indexed; `propose`'s max_n may not exceed it. Memory and
            append cost grow linearly with it.
        dtype: dtype of the returned draft tokens (int32 or int64).
        backend: None (compiled if available, else "python"), "cpu" or "python".
    """

    def __init__(
        self,
        num_slots: int,
        *,
        max_n: int = 4,
        dtype: torch.dtype = torch.int64,
        backend: Optional[str] = None,
        _hash_bits: int = 64,
    ):
        _checks.int_arg("num_slots", num_slots, minimum=1)
        _checks.int_arg("max_n", max_n, minimum=1)
        if max_n > 64:
            _checks.fail("max_n", f"expected max_n <= 64, got {max_n}")
        if dtype not in _checks.INT_DTYPES:
            _checks.fail("dtype", f"expected torch.int32 or torch.int64, got {dtype}")
        backend = host_index_backend("NgramIndex", backend)
        self.num_slots, self.max_n, self.dtype, self.backend = num_slots, max_n, dtype, backend
        if backend == "cpu":
            # _hash_bits < 64 keeps only that many hash bits: a test hook to force collisions.
            self._impl = torch.classes.specdec.NgramIndex(num_slots, max_n, _hash_bits)
        else:
            self._impl = _ReferenceIndex(num_slots, max_n)

    @staticmethod
    def has_compiled_backend() -> bool:
        """Whether backend "cpu" (the compiled index in specdec_kernels._C) is available."""
        return _has_compiled_class()

    # ------------------------------------------------------------------ inspection

    def length(self, slot: int) -> int:
        """Number of tokens in the slot's history."""
        self._check_slot("slot", slot)
        return self._impl.length(slot)

    def history(self, slot: int) -> torch.Tensor:
        """The slot's history as an int64 tensor (a copy)."""
        self._check_slot("slot", slot)
        return self._impl.history(slot)

    def memory_bytes(self) -> int:
        """Bytes held by the compiled index (0 for the Python backend: not tracked)."""
        return self._impl.memory_bytes()

    # ------------------------------------------------------------------ updates

    def reset(self, slot: int, prompt_tokens) -> None:
        """Start a new sequence in `slot` with history `prompt_tokens` (1-D int tensor or list of
        token ids >= 0; -1 is padding, never a token)."""
        self._check_slot("slot", slot)
        prompt = torch.as_tensor(prompt_tokens)
        if prompt.numel() == 0:
            prompt = prompt.to(torch.int64)
        _checks.tensor("prompt_tokens", prompt, dims=1, dtypes=_checks.INT_DTYPES)
        prompt = _cpu_int64(prompt)
        if _checks.checking_values():
            _checks.nonnegative_tokens("prompt_tokens", prompt)
        self._impl.reset(slot, prompt)

    def append(self, slots: Slots, accepted_tokens, counts=None) -> None:
        """Append `accepted_tokens[r, :counts[r]]` to slot `slots[r]` (slots distinct).

        accepted_tokens: int [R, K], ids >= 0 where appended (past counts[r]: ignored, e.g. -1);
        counts: int [R] in [0, K], None for all K.
        """
        self._impl.append(*self._rows(slots, accepted_tokens, counts))

    # ------------------------------------------------------------------ queries

    def propose(self, slots: Slots, *, min_n: int = 1, max_n: Optional[int] = None, num_tokens: int = 5,
                policy: str = "earliest"):
        """Draft per row for slot `slots[r]`: (draft_tokens [R, num_tokens] -1 padded, draft_lens int32 [R]).

        Same result as `ngram_propose` on each slot's history with these arguments; max_n
        defaults to (and may not exceed) the index's max_n.
        """
        max_n = self._check_query(min_n, max_n, num_tokens, policy)
        drafts, lens = self._impl.propose(self._slot_tensor(slots), min_n, max_n, num_tokens, policy)
        return _checks.as_dtype(drafts, self.dtype), lens

    def append_and_propose(self, slots: Slots, accepted_tokens, counts=None, *, min_n: int = 1,
                           max_n: Optional[int] = None, num_tokens: int = 5, policy: str = "earliest"):
        """`append(slots, accepted_tokens, counts)` then `propose(slots, ...)`, in one call."""
        max_n = self._check_query(min_n, max_n, num_tokens, policy)
        slots, tokens, counts = self._rows(slots, accepted_tokens, counts)
        drafts, lens = self._impl.append_and_propose(slots, tokens, counts, min_n, max_n, num_tokens, policy)
        return _checks.as_dtype(drafts, self.dtype), lens

    # ------------------------------------------------------------------ helpers

    def _check_slot(self, name, slot):
        _checks.int_arg(name, slot, minimum=0)
        if slot >= self.num_slots:
            _checks.fail(name, f"expected a slot in [0, {self.num_slots}), got {slot}")

    def _slot_tensor(self, slots) -> torch.Tensor:
        if isinstance(slots, int) and not isinstance(slots, bool):
            slots = [slots]
        slots = torch.as_tensor(slots)
        if slots.numel() == 0:
            slots = slots.to(torch.int64)
        _checks.tensor("slots", slots, dims=1, dtypes=_checks.INT_DTYPES)
        return _cpu_int64(slots)  # slot values: checked by the index (compiled or reference)

    def _rows(self, slots, accepted_tokens, counts):
        slots = self._slot_tensor(slots)
        tokens = torch.as_tensor(accepted_tokens)
        if tokens.numel() == 0 and tokens.dim() <= 1:  # [] or [[]]-like: no tokens at all
            tokens = tokens.reshape(slots.shape[0], 0).to(torch.int64)
        _checks.tensor("accepted_tokens", tokens, dims=2, dtypes=_checks.INT_DTYPES)
        _checks.shape("accepted_tokens", tokens, (slots.shape[0], tokens.shape[1]))
        if counts is None:
            counts = torch.full((slots.shape[0],), tokens.shape[1], dtype=torch.int64)
        counts = torch.as_tensor(counts)
        if counts.numel() == 0:  # [] is float32 to torch
            counts = counts.to(torch.int64)
        _checks.tensor("counts", counts, dims=1, dtypes=_checks.INT_DTYPES)
        _checks.shape("counts", counts, (slots.shape[0],))
        tokens, counts = _cpu_int64(tokens), _cpu_int64(counts)  # counts' range: checked by the index
        if _checks.checking_values() and tokens.shape[0] == counts.shape[0]:
            # Only the appended tokens: past counts[r] is padding (-1 from verify's outputs).
            _checks.nonnegative_tokens("accepted_tokens", tokens, counts.clamp(0, tokens.shape[1]))
        return slots, tokens, counts

    def _check_query(self, min_n, max_n, num_tokens, policy) -> int:
        max_n = self.max_n if max_n is None else max_n
        _checks.ngram_query(min_n, max_n, num_tokens, policy, max_n_limit=self.max_n)
        return max_n
