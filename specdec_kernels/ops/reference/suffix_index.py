"""Reference suffix cache, in plain Python: the algorithm of csrc/include/specdec/suffix_index.h
(read its header comment for the design), and `SuffixIndex(backend="python")` where the
compiled class is unavailable (slow, but the same results, bit for bit: the same hash, the
same chains, the same probe limits).

`SuffixIndex` here has the methods of the compiled `torch.classes.specdec.SuffixIndex` and
takes the same arguments, as the public `specdec_kernels.ops.suffix_index.SuffixIndex` passes
them to either (int64 CPU tensors of checked shapes); like the compiled class it checks
token ids, slots and counts.
"""

import torch

MAX_DEPTH = 32
ALL_ORDERS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
POSITION_LIMIT = (1 << 31) - 2
_M64 = (1 << 64) - 1
_HASH_MUL = 0x9E3779B97F4A7C15


def _bucket(h: int, k: int, table_bits: int) -> int:
    x = h ^ ((k * 0xD6E8FEB86659FD93) & _M64)  # splitmix64's finalizer, as the C++ does
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    x ^= x >> 31
    return x >> (64 - table_bits)


class _Slot:
    def __init__(self):
        self.last, self.length, self.tail = 0, 0, []  # tail: the last MAX_DEPTH tokens

    def copy(self):
        s = _Slot()
        s.last, s.length, s.tail = self.last, self.length, list(self.tail)
        return s


class SuffixCache:
    """The cache itself (the C++ SuffixCache); positions absolute, stored + 1 (0 = none)."""

    def __init__(self, max_tokens, max_depth, num_slots, max_candidates, max_probes, table_bits):
        self.orders = [k for k in ALL_ORDERS if k <= max_depth]
        self.max_tokens, self.max_candidates, self.max_probes = max_tokens, max_candidates, max_probes
        bits = 0
        while (1 << bits) < max_tokens:
            bits += 1
        self.table_bits = table_bits if table_bits > 0 else max(bits, 4)
        self.num_slots = num_slots
        self.clear()

    def clear(self):
        self.token, self.prev, self.next = {}, {}, {}  # absolute position -> value (dicts: no ring needed)
        self.chain = {}  # (position, order index) -> link
        self.head = {}  # (order index, bucket) -> position + 1
        self.begin = self.end = 0
        self.slots = [_Slot() for _ in range(self.num_slots)]
        self.add_slot = _Slot()

    def _evict(self):
        p = self.begin
        self.begin += 1
        for table in (self.token, self.prev, self.next):
            table.pop(p, None)
        for o in range(len(self.orders)):
            self.chain.pop((p, o), None)

    def buckets(self, slot: _Slot) -> list:
        out, h = [], 0
        for k in range(1, min(slot.length, self.orders[-1]) + 1):
            h = (h * _HASH_MUL + (slot.tail[-k] & 0xFFFFFFFF) + 1) & _M64
            if k == self.orders[len(out)]:
                out.append(_bucket(h, k, self.table_bits))
        return out

    def push(self, s: _Slot, token: int):
        if self.end >= POSITION_LIMIT:
            self.clear()
        if self.end - self.begin >= self.max_tokens:
            self._evict()
        p = self.end
        self.end += 1
        self.token[p], self.next[p] = token, 0
        linked = s.last != 0 and s.last - 1 >= self.begin
        self.prev[p] = s.last if linked else 0
        if linked and self.next[s.last - 1] == 0:
            self.next[s.last - 1] = p + 1
        s.tail = (s.tail + [token])[-MAX_DEPTH:]
        s.length += 1
        s.last = p + 1
        for o, b in enumerate(self.buckets(s)):
            self.chain[(p, o)] = self.head.get((o, b), 0)
            self.head[(o, b)] = p + 1

    def matches(self, p: int, s: _Slot, k: int) -> bool:
        for i in range(k):
            if p < self.begin or self.token[p] != s.tail[-1 - i]:
                return False
            if i + 1 == k:
                return True
            before = self.prev[p]
            if before == 0:
                return False
            p = before - 1
        return True

    def candidates(self, s: _Slot):
        """(match length, kept positions newest first)."""
        buckets = self.buckets(s)
        for o in range(len(buckets) - 1, -1, -1):
            k, kept = self.orders[o], []
            cand, probes = self.head.get((o, buckets[o]), 0), 0
            while cand != 0 and probes < self.max_probes:
                p = cand - 1
                if p < self.begin:
                    break
                probes += 1
                if self.next[p] != 0 and self.matches(p, s, k):
                    kept.append(p)
                    if len(kept) == self.max_candidates:
                        break
                cand = self.chain[(p, o)]
            if kept:
                return k, kept
        return 0, []

    def draft(self, slot_id: int, depth: int, max_nodes: int):
        """(tokens, parents, counts) lists of 1 + max_nodes, and the match length."""
        s = self.slots[slot_id]
        tokens, parents, counts = [-1] * (1 + max_nodes), [-1] * (1 + max_nodes), [0] * (1 + max_nodes)
        tokens[0] = s.tail[-1]
        match, kept = self.candidates(s)
        counts[0] = len(kept)
        if not kept or max_nodes == 0 or depth == 0:
            return tokens, parents, counts, match
        node_token, node_parent, node_count, children = [-1], [-1], [0], [{}]
        for p in kept:
            node, q = 0, self.next[p]
            for _ in range(depth):
                if q == 0:
                    break
                token = self.token[q - 1]
                child = children[node].get(token)
                if child is None:
                    child = len(node_token)
                    children[node][token] = child
                    node_token.append(token), node_parent.append(node), node_count.append(0), children.append({})
                node_count[child] += 1
                node, q = child, self.next[q - 1]
        order = sorted(range(1, len(node_token)), key=lambda i: -node_count[i])  # stable: ties by creation
        out_index = {0: 0}
        for i, n in enumerate(order[:max_nodes]):
            out_index[n] = i + 1
            tokens[i + 1], parents[i + 1], counts[i + 1] = node_token[n], out_index[node_parent[n]], node_count[n]
        return tokens, parents, counts, match


class SuffixIndex:
    """`SuffixCache` behind the compiled class's interface."""

    def __init__(self, max_tokens, max_depth, num_slots, max_candidates, max_probes, vocab_size, table_bits):
        self.cache = SuffixCache(max_tokens, max_depth, num_slots, max_candidates, max_probes, table_bits)
        self.vocab_size = vocab_size
        self._num_slots = num_slots

    def num_slots(self):
        return self._num_slots

    def reserve_slots(self, num_slots):
        if num_slots > self._num_slots:
            self.cache.slots += [_Slot() for _ in range(num_slots - self._num_slots)]
            self._num_slots = self.cache.num_slots = num_slots

    def cached(self):
        return self.cache.end - self.cache.begin

    def appended(self):
        return self.cache.end

    def memory_bytes(self):
        return 0  # not tracked for Python objects

    def length(self, slot):
        self._check_slot("SuffixIndex.length", "slot", slot)
        return self.cache.slots[slot].length

    def clear(self):
        self.cache.clear()

    def _check_slot(self, op, name, slot):
        if not 0 <= slot < self._num_slots:
            raise ValueError(f"{op}: {name} = {slot} is out of range [0, {self._num_slots})")

    def _check_tokens(self, op, name, tokens):
        limit = self.vocab_size if self.vocab_size > 0 else 2**31 - 1
        bad = [t for t in tokens if not 0 <= t < limit]
        if bad:
            raise ValueError(f"{op}: {name} holds token id {bad[0]}; expected ids in [0, {limit})")

    def _check_slots(self, op, slots, distinct):
        for r, s in enumerate(slots):
            if not 0 <= s < self._num_slots:
                raise ValueError(f"{op}: slots[{r}] = {s} is out of range [0, {self._num_slots})")
        if distinct and len(set(slots)) != len(slots):
            raise ValueError(f"{op}: slots appear twice; each slot may be appended once per call")

    def add(self, tokens, offsets):
        tokens, offsets = tokens.tolist(), offsets.tolist()
        self._check_tokens("SuffixIndex.add", "tokens", tokens)
        for a, b in zip(offsets[:-1], offsets[1:]):
            slot = _Slot()
            for t in tokens[a:b]:
                self.cache.push(slot, t)

    def start(self, slot, prompt):
        self._check_slot("SuffixIndex.start", "slot", slot)
        prompt = prompt.tolist()
        self._check_tokens("SuffixIndex.start", "prompt_tokens", prompt)
        self.cache.slots[slot] = _Slot()
        for t in prompt:
            self.cache.push(self.cache.slots[slot], t)

    def fork(self, slot, from_slot):
        self._check_slot("SuffixIndex.fork", "slot", slot)
        self._check_slot("SuffixIndex.fork", "from_slot", from_slot)
        self.cache.slots[slot] = self.cache.slots[from_slot].copy()

    def append(self, slots, tokens, counts):
        slots, rows, counts = slots.tolist(), tokens.tolist(), counts.tolist()
        self._check_slots("SuffixIndex.append", slots, True)
        width = tokens.shape[1]
        for r, c in enumerate(counts):
            if not 0 <= c <= width:
                raise ValueError(f"SuffixIndex.append: counts[{r}] = {c}; expected 0 <= counts[r] <= K = {width}")
            self._check_tokens("SuffixIndex.append", "accepted_tokens", rows[r][:c])
        for slot, row, c in zip(slots, rows, counts):
            for t in row[:c]:
                self.cache.push(self.cache.slots[slot], t)

    def draft(self, slots, depth, max_nodes):
        slots = slots.tolist()
        self._check_slots("SuffixIndex.draft", slots, False)
        for s in slots:
            if self.cache.slots[s].length < 1:
                raise ValueError(f"SuffixIndex.draft: slot {s} holds no tokens (start it with a prompt)")
        out = [self.cache.draft(s, depth, max_nodes) for s in slots]
        width = 1 + max_nodes
        tokens = torch.tensor([o[0] for o in out], dtype=torch.int64).view(len(slots), width)
        parents = torch.tensor([o[1] for o in out], dtype=torch.int64).view(len(slots), width)
        counts = torch.tensor([o[2] for o in out], dtype=torch.int32).view(len(slots), width)
        matches = torch.tensor([o[3] for o in out], dtype=torch.int32)
        return tokens, parents, counts, matches

    def append_and_draft(self, slots, tokens, counts, depth, max_nodes):
        self.append(slots, tokens, counts)
        return self.draft(slots, depth, max_nodes)
