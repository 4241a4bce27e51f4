"""Reference incremental n-gram index, in plain Python: the algorithm of
csrc/include/specdec/ngram_index.h, and `NgramIndex(backend="python")` where the compiled
class is unavailable (slow, but the same results).

Every distinct n-gram gets an exact integer id, looked up by the pair (id of its first n - 1
tokens, its last token). Per id the index keeps the first and the latest end position that is
followed by a token; the id of the n-gram ending at the last token then gives the earliest /
latest match of the current suffix directly.

`NgramIndex` here has the methods of the compiled `torch.classes.specdec.NgramIndex` and
takes the same arguments, as the public `specdec_kernels.NgramIndex` passes them to either
(int64 CPU tensors of checked shapes); like the compiled class, it checks the values that
index its own storage (slots in range and distinct when appending, counts in range).
"""

import torch


class HistoryIndex:
    """One sequence's history and its n-gram ids."""

    def __init__(self, max_n: int):
        self.max_n = max_n
        self.clear()

    def clear(self):
        self.tokens = []
        self.ids = {}  # (prev id, token) -> id; prev id -1 for 1-grams
        self.first = []  # per id: smallest end e <= N - 2, or -1
        self.latest = []
        self.current = [-1] * self.max_n  # current[n - 1]: id of the n-gram ending at N - 1

    def _id(self, prev: int, token: int) -> int:
        key = (prev, token)
        found = self.ids.get(key)
        if found is None:
            found = self.ids[key] = len(self.first)
            self.first.append(-1)
            self.latest.append(-1)
        return found

    def push(self, token: int):
        pos = len(self.tokens)
        # The n-grams ending at the old last token are now followed by `token`.
        for k in range(min(self.max_n, pos)):
            i = self.current[k]
            if self.first[i] < 0:
                self.first[i] = pos - 1
            self.latest[i] = pos - 1
        for n in range(min(self.max_n, pos + 1), 1, -1):
            self.current[n - 1] = self._id(self.current[n - 2], token)
        self.current[0] = self._id(-1, token)
        self.tokens.append(token)

    def propose(self, min_n, max_n, num_tokens, latest) -> list:
        num = len(self.tokens)
        for n in range(min(max_n, num - 1), max(min_n, 1) - 1, -1):
            i = self.current[n - 1]
            if self.first[i] >= 0:
                start = (self.latest[i] if latest else self.first[i]) + 1
                return self.tokens[start : start + num_tokens]
        return []


class NgramIndex:
    """`num_slots` HistoryIndex objects behind the compiled class's interface."""

    def __init__(self, num_slots: int, max_n: int):
        self._slots = [HistoryIndex(max_n) for _ in range(num_slots)]

    def _check_slots(self, slots: list, *, distinct: bool) -> list:
        if any(s < 0 or s >= len(self._slots) for s in slots):
            raise ValueError(f"slots: expected slots in [0, {len(self._slots)}), got {slots}")
        if distinct and len(set(slots)) != len(slots):
            raise ValueError(f"slots: expected distinct slots when appending, got {slots}")
        return slots

    def length(self, slot: int) -> int:
        return len(self._slots[slot].tokens)

    def history(self, slot: int) -> torch.Tensor:
        return torch.tensor(self._slots[slot].tokens, dtype=torch.int64)

    def memory_bytes(self) -> int:
        return 0  # not tracked for Python objects

    def reset(self, slot: int, prompt: torch.Tensor) -> None:
        history = self._slots[slot]
        history.clear()
        for token in prompt.tolist():
            history.push(token)

    def append(self, slots: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        slots = self._check_slots(slots.tolist(), distinct=True)
        counts = counts.tolist()
        if any(c < 0 or c > tokens.shape[1] for c in counts):
            raise ValueError(f"counts: expected 0 <= counts[r] <= K = {tokens.shape[1]}, got {counts}")
        for slot, row, count in zip(slots, tokens.tolist(), counts):
            for token in row[:count]:
                self._slots[slot].push(token)

    def propose(self, slots: torch.Tensor, min_n: int, max_n: int, num_tokens: int, policy: str):
        """(drafts int64 [R, num_tokens], -1 padded; lens int32 [R])."""
        slots = self._check_slots(slots.tolist(), distinct=False)
        drafts = torch.full((len(slots), num_tokens), -1, dtype=torch.int64)
        lens = torch.zeros(len(slots), dtype=torch.int32)
        for r, slot in enumerate(slots):
            proposal = self._slots[slot].propose(min_n, max_n, num_tokens, policy == "latest")
            if proposal:
                drafts[r, : len(proposal)] = torch.tensor(proposal, dtype=torch.int64)
            lens[r] = len(proposal)
        return drafts, lens

    def append_and_propose(self, slots, tokens, counts, min_n, max_n, num_tokens, policy):
        self.append(slots, tokens, counts)
        return self.propose(slots, min_n, max_n, num_tokens, policy)
