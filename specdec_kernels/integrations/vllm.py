"""Our drafters inside vLLM: a proposer for vLLM's `custom_class` speculative-decoding hook.

    from vllm import LLM
    llm = LLM(model_dir, speculative_config={
        "method": "custom_class",
        "model": "specdec_kernels.integrations.vllm.SpecdecProposer",
        "num_speculative_tokens": 10},                      # the most drafts per request and step
        additional_config={"specdec": {"max_n": 4}})        # our settings (optional, see below)

What runs where. vLLM schedules, runs the model and verifies the drafts with its own rejection
sampler (chains only: it has no tree verification; no draft probabilities: our drafts are
deterministic, so greedy output equals vLLM without speculation and sampled output keeps the
target's distribution). None of our kernels run inside vLLM. This class only drafts, on the host:
- one incremental `NgramIndex` slot per running request: each step only the tokens a request
  appended cross into the index, and a draft costs O(max_n + k), not a rescan of the history;
- a per-request draft length from our acceptance model (`loop.planner.AcceptanceModel`: decayed
  acceptance per depth, learned from how many of its drafts each request accepted, read from
  the tokens vLLM hands back) and a step-cost model of vLLM (seconds = c0 + c1 * tokens in the
  step, fitted online from the CPU time between calls, prior `token_cost`): each step the drafts go
  where they maximise the batch's expected tokens per second, a drafted token charged
  (1 + `draft_margin`) tokens' cost, and a request whose drafts do not pay gets none (plain
  decoding) until its estimate recovers (counts decay toward the prior);
- optionally (`suffix_cache_tokens` > 0) the cross-request suffix cache, `SuffixCacheSource`:
  one `SuffixIndex` over every request's prompt and output, kept after a request finishes, so a
  request drafts from what earlier and concurrent requests produced (agents repeating tool
  calls, edits of one file, parallel samples of one prompt); off by default (see the settings).
  Other sources attach with `add_source` (see `DraftSource`).

Requests and rows. The hook gives no request ids: each step vLLM passes its persistent batch's
rows (`token_ids_cpu [max_num_reqs, max_model_len]`, `num_tokens_no_spec [max_num_reqs]`,
`sampled_token_ids`: per row, the tokens accepted this step), and rows move when requests finish
(vLLM condenses the batch) or are preempted. A row keeps the slot it had if that slot's history
is still a prefix of the row's tokens (compared in full: exact; ~6 us per 1000 tokens measured here); else the
row takes the live or parked slot whose history is such a prefix (a moved or resumed request),
else a fresh slot, reset with the row's tokens (a new request starts clean: its own history,
no drafts pending, acceptance counts at the prior). Slots not seen in a step are parked, and
reused least recently seen first.

Settings: the dict `additional_config["specdec"]` (vLLM's `speculative_config` refuses unknown
keys), else environment variables `SPECDEC_VLLM_<NAME>` (upper case), else the defaults of
`ProposerSettings`. Counters: `SpecdecProposer.stats()`; every live proposer of this process is
in `proposers()` (vLLM's engine runs in this process with VLLM_ENABLE_V1_MULTIPROCESSING=0), and
`stats_path` writes them as JSON when the process exits (any engine process).

This module imports no vLLM: the constructor reads the attributes of the `VllmConfig` it gets,
so the bookkeeping is tested without vLLM (python_tests/test_vllm.py) on inputs shaped like vLLM's.
"""

import atexit
import json
import os
import threading
import time
import weakref
from dataclasses import asdict, dataclass, fields
from typing import List, Optional, Sequence

import numpy as np
import torch

from ..loop.planner import AcceptanceModel
from ..ops.ngram_index import NgramIndex
from ..ops.suffix_index import SuffixIndex

CONFIG_KEY = "specdec"
ENV_PREFIX = "SPECDEC_VLLM_"
PROPOSER_PATH = "specdec_kernels.integrations.vllm.SpecdecProposer"

_LIVE = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def proposers() -> list:
    """Every live `SpecdecProposer` of this process (tests and benchmarks read their stats)."""
    with _LIVE_LOCK:
        return list(_LIVE)


def speculative_config(num_speculative_tokens: int = 10) -> dict:
    """The `speculative_config` dict that makes vLLM draft with `SpecdecProposer`."""
    return {"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": int(num_speculative_tokens)}


def _parse_bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{name}: expected a boolean (1/0, true/false), got {value!r}")


@dataclass
class ProposerSettings:
    """`SpecdecProposer`'s settings (additional_config["specdec"] or SPECDEC_VLLM_<NAME>).

    min_n, max_n: n-gram lengths matched (longest first), as `ngram_propose`.
    policy: "earliest" or "latest" match of the longest n-gram.
    adaptive: per-request draft lengths from the acceptance and step-cost models; False:
        every request drafts what the n-gram match gives, up to num_speculative_tokens.
    token_cost: prior of the step-cost model: seconds of one more token in a step over the
        seconds of a step's fixed part (c1 / c0); measured online as steps run.
    decay, prior: of the acceptance model (decay per step; prior per-token acceptance). Each
        finished request's acceptance moves the prior of the next ones (kept in [0.05, 0.95]).
    min_gain: a draft whose estimated acceptance is at most this is never proposed.
    draft_margin: a drafted token is charged (1 + draft_margin) decode tokens' cost when the
        lengths are chosen: vLLM verifies drafts with more than a decode token's work (the
        rejection sampler, the spec-decode metadata, tokens of requests that finish anyway),
        which the fit of whole steps spreads over every token; at 0 the requests drafted at
        the fit's break-even (~0.4 acceptance on chat at 8 requests) and ran 4-5% below vLLM
        without speculation.
    check: after every step, compare every row's index history with vLLM's tokens (slow;
        tests): a mismatch raises RuntimeError.
    stats_path: write `stats()` of every proposer as JSON there when the process exits.
    clock: what the step-cost model measures between calls: "cpu" (this process's CPU time;
        robust to other load on a shared host; vLLM's CPU build) or "wall" (GPU engines).
    suffix_cache_tokens: > 0 attaches a `SuffixCacheSource` holding that many tokens (92 bytes
        each) across requests; 0 (the default): none. Not on by default: its gain inside vLLM
        has not been measured on a quiet machine yet.
    suffix_min_prob: the suffix cache's draft follows the most frequent continuation while its
        empirical path probability (occurrences through the node / occurrences of the matched
        suffix) stays at least this.
    """

    min_n: int = 1
    max_n: int = 4
    policy: str = "earliest"
    adaptive: bool = True
    token_cost: float = 0.05
    decay: float = 0.8
    prior: float = 0.6
    min_gain: float = 0.01
    draft_margin: float = 1.0
    check: bool = False
    stats_path: str = ""
    clock: str = "cpu"
    suffix_cache_tokens: int = 0
    suffix_min_prob: float = 0.3

    def __post_init__(self):
        for name in ("min_n", "max_n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if self.min_n > self.max_n:
            raise ValueError(f"min_n: expected min_n <= max_n, got {self.min_n} > {self.max_n}")
        if self.max_n > 64:
            raise ValueError(f"max_n: expected max_n <= 64, got {self.max_n}")
        if self.clock not in ("cpu", "wall"):
            raise ValueError(f"clock: expected 'cpu' or 'wall', got {self.clock!r}")
        if self.policy not in ("earliest", "latest"):
            raise ValueError(f"policy: expected 'earliest' or 'latest', got {self.policy!r}")
        if not 0.0 < self.token_cost <= 10.0:
            raise ValueError(f"token_cost: expected a value in (0, 10], got {self.token_cost}")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay: expected a value in [0, 1), got {self.decay}")
        if not 0.0 < self.prior < 1.0:
            raise ValueError(f"prior: expected a value in (0, 1), got {self.prior}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain: expected a value in [0, 1), got {self.min_gain}")
        if not 0.0 <= self.draft_margin <= 10.0:
            raise ValueError(f"draft_margin: expected a value in [0, 10], got {self.draft_margin}")
        if isinstance(self.suffix_cache_tokens, bool) or self.suffix_cache_tokens < 0:
            raise ValueError(f"suffix_cache_tokens: expected an int >= 0, got {self.suffix_cache_tokens!r}")
        if not 0.0 < self.suffix_min_prob <= 1.0:
            raise ValueError(f"suffix_min_prob: expected a value in (0, 1], got {self.suffix_min_prob}")

    @classmethod
    def from_sources(cls, config: Optional[dict] = None, environ=None) -> "ProposerSettings":
        """Defaults, overridden by SPECDEC_VLLM_<NAME> variables, overridden by `config`
        (additional_config["specdec"]). Unknown keys in `config` raise ValueError."""
        environ = os.environ if environ is None else environ
        config = dict(config or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ValueError(f"additional_config['{CONFIG_KEY}']: unknown settings {unknown}; known: {sorted(known)}")
        values = {}
        for name, field in known.items():
            if name in config:
                raw, where = config[name], f"additional_config['{CONFIG_KEY}']['{name}']"
            elif ENV_PREFIX + name.upper() in environ:
                raw, where = environ[ENV_PREFIX + name.upper()], ENV_PREFIX + name.upper()
            else:
                continue
            kind = field.type if isinstance(field.type, type) else type(field.default)
            try:
                if kind is bool:
                    values[name] = _parse_bool(where, raw)
                elif kind is int:
                    if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                        raise ValueError
                    values[name] = int(raw)
                elif kind is float:
                    values[name] = float(raw)
                else:
                    values[name] = str(raw)
            except (TypeError, ValueError):
                raise ValueError(f"{where}: expected {kind.__name__}, got {raw!r}") from None
        return cls(**values)


class DraftSource:
    """Interface of an extra draft source beside the n-gram index (e.g. a cross-request suffix
    cache). The proposer calls `start(slot, tokens)` when a request takes a slot (its whole
    history), `extend(slot, tokens)` with the tokens a request appended, `finish(slot)` when the
    slot is given to another request, and `propose(slots, k)` for the decoding rows: one list
    of at most k tokens per slot, continuing that slot's history. Per row the proposer keeps a
    source's draft unless the n-gram draft is longer (the last source's of equal length)."""

    def start(self, slot: int, tokens: np.ndarray) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def extend(self, slot: int, tokens: np.ndarray) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def finish(self, slot: int) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def propose(self, slots: Sequence[int], k: int) -> List[List[int]]:  # pragma: no cover - interface
        raise NotImplementedError


class SuffixCacheSource(DraftSource):
    """The cross-request suffix cache as a `DraftSource`: one `SuffixIndex` slot per proposer
    slot. A request's prompt and every token it gains go in; when its slot is given to another
    request, its sequence stays cached (evicted oldest first past `max_tokens`), so later
    requests draft from it. vLLM verifies chains, so each draft is the tree's most frequent
    path: from the matched suffix, the child with the most occurrences, while its empirical
    path probability (its count / the root's) is at least `min_prob`.

    num_slots: the proposer's slots; max_tokens: cache budget (92 bytes per token).
    """

    def __init__(self, num_slots: int, max_tokens: int, min_prob: float = 0.3, max_nodes: int = 64):
        self.index = SuffixIndex(num_slots, max_tokens=max_tokens)
        self.min_prob = float(min_prob)
        self.max_nodes = int(max_nodes)

    def start(self, slot: int, tokens: np.ndarray) -> None:
        self.index.start(slot, torch.from_numpy(np.asarray(tokens, dtype=np.int64)))

    def extend(self, slot: int, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.size:
            self.index.append([slot], torch.from_numpy(tokens)[None], torch.tensor([tokens.size]))

    def finish(self, slot: int) -> None:
        """Nothing to do: the sequence stays cached; the slot's next `start` begins a new one."""

    def propose(self, slots: Sequence[int], k: int) -> List[List[int]]:
        draft = self.index.draft(list(slots), num_tokens=k, max_nodes=max(self.max_nodes, k))
        tokens, parents, counts = draft.tokens.numpy(), draft.parents.numpy(), draft.counts.numpy()
        return [self._best_path(tokens[r], parents[r], counts[r], k) for r in range(len(slots))]

    def _best_path(self, tokens: np.ndarray, parents: np.ndarray, counts: np.ndarray, k: int) -> List[int]:
        root = int(counts[0])
        path, node = [], 0
        # Nodes come sorted by count, highest first: a node's first child in that order is its
        # most frequent one.
        while len(path) < k:
            children = np.flatnonzero((parents == node) & (counts > 0))
            if children.size == 0 or counts[children[0]] < self.min_prob * root:
                break
            node = int(children[0])
            path.append(int(tokens[node]))
        return path


class StepCost:
    """Seconds of a vLLM step as c0 + c1 * tokens, from decayed least squares over measured
    decode steps, pulled toward the prior ratio c1 / c0 = token_cost where the steps measured so
    far vary too little in size to tell (information = decayed weight * relative variance of
    the token counts). Only the ratio matters to the choice of draft lengths."""

    def __init__(self, token_cost: float, decay: float = 0.98, prior_weight: float = 1.0):
        self.prior_ratio, self.decay, self.prior_weight = token_cost, decay, prior_weight
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.observations = 0

    def observe(self, tokens: float, seconds: float) -> None:
        d = self.decay
        self.w, self.sx, self.sy = self.w * d + 1, self.sx * d + tokens, self.sy * d + seconds
        self.sxx, self.sxy = self.sxx * d + tokens * tokens, self.sxy * d + tokens * seconds
        self.observations += 1

    def predict(self, tokens: float) -> Optional[float]:
        """Predicted seconds of a step with `tokens` tokens (None before any observation)."""
        if self.w <= 0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        c0 = my / (1 + self.ratio() * mx)
        return c0 * (1 + self.ratio() * tokens)

    def ratio(self) -> float:
        """c1 / c0: the cost of one more token relative to the step's fixed part."""
        if self.w <= 1:
            return self.prior_ratio
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var <= 1e-9 or mx <= 0:
            return self.prior_ratio
        slope = (self.sxy / self.w - mx * my) / var
        intercept = my - slope * mx
        if intercept <= 0 or slope <= 0:
            fitted = self.prior_ratio if slope <= 0 else 1.0 / max(mx, 1.0)  # all cost per token
        else:
            fitted = slope / intercept
        info = self.w * var / (mx * mx)
        ratio = (info * fitted + self.prior_weight * self.prior_ratio) / (info + self.prior_weight)
        return float(min(max(ratio, 1e-4), 10.0))


def choose_lengths(rates: np.ndarray, available: np.ndarray, decode_rows: int, token_cost: float,
                   min_gain: float, draft_margin: float = 0.0) -> np.ndarray:
    """Draft lengths that maximise a vLLM step's expected tokens per second.

    vLLM runs every request's chain flat in one batch (no padding to the widest row, unlike our
    tree loop's `planner.choose_counts`), so a step's cost is c0 + c1 * tokens: the rows'
    drafts compete for one budget. Expected tokens = decode_rows + sum of the chosen drafts'
    acceptance probabilities; seconds ∝ 1 + token_cost * (decode_rows + (1 + draft_margin) *
    drafts). With equal cost per draft, the best set is a prefix of all drafts sorted by
    probability (per row a prefix, as a row's probabilities do not increase with depth).

    rates: float [R, K] P(draft at depth j accepted), non-increasing per row; available: int [R]
    drafts each row has (n-gram match length, capped); returns int64 [R].
    """
    rows, depth = rates.shape
    if rows == 0 or depth == 0:
        return np.zeros(rows, dtype=np.int64)
    ranks = np.arange(depth)[None, :]
    gains = np.where((ranks < available[:, None]) & (rates > min_gain), rates, 0.0)
    flat = gains.ravel()
    order = np.argsort(-flat, kind="stable")
    sorted_gains = flat[order]
    useful = int((sorted_gains > 0).sum())
    if useful == 0:
        return np.zeros(rows, dtype=np.int64)
    n = np.arange(useful + 1)
    expected = decode_rows + np.concatenate([[0.0], np.cumsum(sorted_gains[:useful])])
    goodput = expected / (1.0 + token_cost * (decode_rows + (1.0 + draft_margin) * n))
    best = int(np.flatnonzero(goodput >= goodput.max() * (1 - 1e-9))[0])
    counts = np.zeros(rows, dtype=np.int64)
    np.add.at(counts, order[:best] // depth, 1)
    return counts


class SpecdecProposer:
    """vLLM `custom_class` proposer drafting with our incremental n-gram index, per-request
    adaptive lengths and optional extra sources (module docstring).

    vllm_config: vLLM's `VllmConfig` (read: speculative_config.num_speculative_tokens,
    model_config.max_model_len, scheduler_config.max_num_seqs, additional_config["specdec"]).
    settings: a `ProposerSettings` instead of the config's / environment's (tests).
    """

    def __init__(self, vllm_config, *, settings: Optional[ProposerSettings] = None):
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        if self.k < 1:
            raise ValueError(f"num_speculative_tokens: expected >= 1, got {self.k}")
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.max_rows = int(vllm_config.scheduler_config.max_num_seqs)
        if settings is None:
            extra = getattr(vllm_config, "additional_config", None) or {}
            mine = extra.get(CONFIG_KEY, {}) if isinstance(extra, dict) else {}
            if not isinstance(mine, dict):
                raise ValueError(f"additional_config['{CONFIG_KEY}']: expected a dict, got {type(mine).__name__}")
            settings = ProposerSettings.from_sources(mine)
        self.settings = s = settings
        # Slots: the running requests plus as many parked ones (moved, preempted, finished).
        self.num_slots = 2 * self.max_rows
        self.index = NgramIndex(self.num_slots, max_n=s.max_n)
        self.acceptance = AcceptanceModel(self.num_slots, self.k, "cpu", decay=s.decay, prior=s.prior)
        self.cost = StepCost(s.token_cost)
        self.sources: List[DraftSource] = []
        if s.suffix_cache_tokens > 0:
            self.sources.append(SuffixCacheSource(self.num_slots, s.suffix_cache_tokens, s.suffix_min_prob))
        # Our copy of each slot's tokens, int32 like vLLM's token_ids_cpu (compared without a cast)
        self._history = [np.zeros(0, dtype=np.int32) for _ in range(self.num_slots)]  # valid [:length]
        self._length = np.zeros(self.num_slots, dtype=np.int64)
        self._pending = [np.zeros(0, dtype=np.int64) for _ in range(self.num_slots)]  # drafts in flight
        self._last_seen = np.full(self.num_slots, -1, dtype=np.int64)  # step a slot was last in the batch
        self._used = np.zeros(self.num_slots, dtype=bool)  # holds a request (live or parked)
        self._row_slot = np.full(self.max_rows, -1, dtype=np.int64)
        self._step = 0
        self._last_call: Optional[float] = None
        self._last_tokens: Optional[int] = None  # tokens the step now running was planned with
        self._alpha_sum, self._alpha_count = 0.0, 0
        self.counters = dict(steps=0, decode_rows=0, drafted=0, verified=0, accepted=0, rows_with_drafts=0,
                             new_requests=0, moved_requests=0, propose_seconds=0.0, step_seconds=0.0,
                             timed_steps=0)
        self.accepted_per_depth = np.zeros(self.k, dtype=np.int64)
        self.verified_per_depth = np.zeros(self.k, dtype=np.int64)
        with _LIVE_LOCK:
            _LIVE.add(self)
        if s.stats_path:
            path = s.stats_path
            atexit.register(_write_stats, weakref.ref(self), path)

    # ------------------------------------------------------------------ vLLM's hook

    def load_model(self, model=None, *args, **kwargs) -> None:
        """vLLM calls this with the target model; n-gram drafting needs no model."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **kwargs):
        """One list of draft tokens (0 .. k) per row of vLLM's batch.

        sampled_token_ids: per row, the tokens vLLM accepted this step (empty: the row did not
        sample, e.g. a prompt still being prefilled in chunks); num_tokens_no_spec: numpy [>= R]
        tokens per row (the sampled ones included); token_ids_cpu: numpy [>= R, max_model_len].
        """
        start = time.perf_counter()
        rows = len(sampled_token_ids)
        if rows > self.max_rows:
            raise ValueError(f"sampled_token_ids: {rows} rows, more than max_num_seqs={self.max_rows}")
        self._observe_step_time(time.process_time() if self.settings.clock == "cpu" else start, sampled_token_ids)
        self._step += 1
        lengths = np.asarray(num_tokens_no_spec[:rows], dtype=np.int64)
        slots = self._assign_slots(rows, lengths, token_ids_cpu)
        decoding = [i for i in range(rows) if len(sampled_token_ids[i]) > 0 and lengths[i] < self.max_model_len]
        self._learn(decoding, slots, sampled_token_ids)
        drafts = self._draft(rows, decoding, slots, lengths)
        if self.settings.check:
            self.check_rows(rows, lengths, token_ids_cpu)
        c = self.counters
        c["steps"] += 1
        c["decode_rows"] += len(decoding)
        c["drafted"] += sum(len(d) for d in drafts)
        c["rows_with_drafts"] += sum(1 for d in drafts if d)
        self._last_tokens = len(decoding) + sum(len(d) for d in drafts)
        self._planned_rows = len(decoding)
        c["propose_seconds"] += time.perf_counter() - start
        return drafts

    # ------------------------------------------------------------------ bookkeeping

    def add_source(self, source: DraftSource) -> None:
        """Attach an extra draft source (see `DraftSource`); live requests are given to it now."""
        self.sources.append(source)
        for slot in np.flatnonzero(self._used):
            source.start(int(slot), self._history[slot][: self._length[slot]])

    def _matches(self, slot: int, row: np.ndarray, length: int) -> bool:
        known = int(self._length[slot])
        if known > length:
            return False
        history = self._history[slot]
        quick = min(known, 8)
        if quick and not np.array_equal(row[:quick], history[:quick]):
            return False
        return bool(np.array_equal(row[:known], history[:known]))

    def _free_slot(self, claimed: set) -> int:
        """A slot for a new request: a free one, else the parked one seen longest ago (never one
        claimed by a row of this step)."""
        free = np.flatnonzero(~self._used)
        if free.size:
            return int(free[0])
        parked = np.array([s for s in np.flatnonzero(self._used) if int(s) not in claimed], dtype=np.int64)
        if not parked.size:  # cannot happen: slots = 2 * rows
            raise RuntimeError("SpecdecProposer: no free slot")
        return int(parked[np.argmin(self._last_seen[parked])])

    def _release(self, slot: int) -> None:
        """The slot's request is gone: remember its acceptance for the prior, clear everything."""
        if self._used[slot]:
            alpha = float(self.acceptance.alpha()[slot])
            if self.acceptance.tried[slot].sum() > 0:
                self._alpha_sum += alpha
                self._alpha_count += 1
                self.acceptance.prior = min(max(self._alpha_sum / self._alpha_count, 0.05), 0.95)
            for source in self.sources:
                source.finish(slot)
        for counts in (self.acceptance.hit, self.acceptance.tried, self.acceptance.score_sum):
            counts[slot] = 0
        self.acceptance.accepted[slot] = 0
        self.acceptance.rejected[slot] = 0
        self._length[slot] = 0
        self._pending[slot] = np.zeros(0, dtype=np.int64)
        self._used[slot] = False

    def _store(self, slot: int, row: np.ndarray, start: int, end: int) -> None:
        history = self._history[slot]
        if history.shape[0] < end:
            grown = np.zeros(max(end, 2 * history.shape[0], 64), dtype=np.int32)
            grown[:start] = history[:start]
            self._history[slot] = history = grown
        history[start:end] = row[start:end]
        self._length[slot] = end

    def _assign_slots(self, rows: int, lengths: np.ndarray, token_ids_cpu) -> np.ndarray:
        """Each row's slot (module docstring), with the tokens appended since the last step
        passed to the index (and the sources)."""
        slots = np.full(rows, -1, dtype=np.int64)
        claimed = set()
        previous = self._row_slot[:rows]
        for i in range(rows):  # the slot the row had: the common case
            slot = int(previous[i])
            if slot >= 0 and self._used[slot] and slot not in claimed and \
                    self._matches(slot, token_ids_cpu[i], int(lengths[i])):
                slots[i] = slot
                claimed.add(slot)
        new_rows = []
        for i in np.flatnonzero(slots < 0):
            found = -1
            for slot in np.flatnonzero(self._used):  # a moved or resumed request
                slot = int(slot)
                if slot not in claimed and self._matches(slot, token_ids_cpu[i], int(lengths[i])) \
                        and self._length[slot] > 0:
                    found = slot
                    break
            if found >= 0:
                slots[i] = found
                claimed.add(found)
                self.counters["moved_requests"] += 1
            else:
                new_rows.append(int(i))
        for i in new_rows:  # a new request: a clean slot with its whole history
            slot = self._free_slot(claimed)
            self._release(slot)
            self._used[slot] = True
            length = int(lengths[i])
            self._store(slot, token_ids_cpu[i], 0, length)
            self.index.reset(slot, torch.from_numpy(self._history[slot][:length].astype(np.int64)))
            for source in self.sources:
                source.start(slot, self._history[slot][:length])
            slots[i] = slot
            claimed.add(slot)
            self.counters["new_requests"] += 1
        # Append what the continuing rows gained since the last step.
        growing = [(int(i), int(slots[i])) for i in range(rows) if lengths[i] > self._length[slots[i]]]
        if growing:
            gained = [int(lengths[i] - self._length[s]) for i, s in growing]
            width = max(gained)
            tokens = np.full((len(growing), width), -1, dtype=np.int64)
            for r, (i, s) in enumerate(growing):
                known, n = int(self._length[s]), int(lengths[i])
                tokens[r, : n - known] = token_ids_cpu[i, known:n]
                self._store(s, token_ids_cpu[i], known, n)
                for source in self.sources:
                    source.extend(s, self._history[s][known:n])
            self.index.append([s for _, s in growing], torch.from_numpy(tokens), torch.tensor(gained))
        self._row_slot[:] = -1
        self._row_slot[:rows] = slots
        self._last_seen[slots] = self._step
        self._gained = {int(s): g for (_, s), g in zip(growing, gained)} if growing else {}
        return slots

    def _learn(self, decoding: list, slots: np.ndarray, sampled_token_ids) -> None:
        """Update the acceptance model from the drafts each decoding row had in flight."""
        k = self.k
        ranks = torch.full((self.num_slots, k + 1), -1, dtype=torch.int64)
        on_path = torch.zeros((self.num_slots, k + 1), dtype=torch.bool)
        on_path[:, 0] = True
        active = torch.zeros(self.num_slots, dtype=torch.bool)
        rejected = torch.zeros(self.num_slots, dtype=torch.bool)
        any_verified = False
        for i in decoding:
            slot = int(slots[i])
            pending = self._pending[slot]
            self._pending[slot] = np.zeros(0, dtype=np.int64)
            got = len(sampled_token_ids[i])
            if pending.size == 0 or self._gained.get(slot) != got:
                continue
            new = self._history[slot][self._length[slot] - got: self._length[slot]]
            accepted = got - 1
            if accepted >= pending.size:  # every draft accepted (vLLM verified them all)
                verified, accepted = pending.size, pending.size
            elif np.array_equal(new[:got], pending[:got]):  # drafts cut by vLLM's scheduler
                verified, accepted = accepted, accepted
            else:
                verified = pending.size
            if verified == 0:
                continue
            any_verified = True
            active[slot] = True
            ranks[slot, 1: verified + 1] = torch.arange(verified)
            on_path[slot, 1: accepted + 1] = True
            rejected[slot] = accepted < verified
            self.counters["verified"] += verified
            self.counters["accepted"] += accepted
            self.verified_per_depth[:verified] += 1
            self.accepted_per_depth[:accepted] += 1
        if any_verified or self.settings.adaptive:
            self.acceptance.update(ranks, on_path, None, active, rejected)

    def _draft(self, rows: int, decoding: list, slots: np.ndarray, lengths: np.ndarray) -> list:
        drafts = [[] for _ in range(rows)]
        if not decoding:
            return drafts
        s = self.settings
        dslots = [int(slots[i]) for i in decoding]
        tokens, lens = self.index.propose(dslots, min_n=s.min_n, max_n=s.max_n, num_tokens=self.k, policy=s.policy)
        tokens, lens = tokens.numpy(), lens.numpy().astype(np.int64)
        candidates = [tokens[r, : lens[r]] for r in range(len(decoding))]
        for source in self.sources:
            for r, extra in enumerate(source.propose(dslots, self.k)):
                extra = np.asarray(extra, dtype=np.int64)[: self.k]
                # Ties go to the source: the suffix cache matches suffixes of up to 32 tokens, the
                # n-gram index of max_n.
                if extra.size >= candidates[r].size:
                    candidates[r] = extra
        room = np.array([max(0, self.max_model_len - int(lengths[i]) - 1) for i in decoding], dtype=np.int64)
        available = np.minimum(np.array([c.size for c in candidates], dtype=np.int64), np.minimum(room, self.k))
        if s.adaptive:
            rates = self.acceptance.rank_rates()[dslots].numpy()
            counts = choose_lengths(rates, available, len(decoding), self.cost.ratio(), s.min_gain, s.draft_margin)
        else:
            counts = available
        for r, i in enumerate(decoding):
            draft = candidates[r][: counts[r]]
            self._pending[dslots[r]] = draft.copy()
            drafts[i] = draft.tolist()
        return drafts

    def _observe_step_time(self, now: float, sampled_token_ids) -> None:
        """The CPU time of this process since the last call is the step vLLM just ran, planned
        with _last_tokens tokens; only pure decode steps with the same rows count (a prefill's
        tokens are unknown). CPU time, not wall time: on a shared host, other processes' load
        stretched wall steps at random and the fit with them (c1 / c0 came out 0.46 at 8
        requests, so we drafted too little); threads add CPU time in proportion, and only the
        ratio c1 / c0 is used. On a GPU the forward need not show in host CPU time: there
        use clock="wall"."""
        last, tokens = self._last_call, self._last_tokens
        self._last_call = now
        if last is None or tokens is None or tokens == 0:
            return
        seconds = now - last
        decoding = sum(1 for t in sampled_token_ids if len(t) > 0)
        if decoding != len(sampled_token_ids) or decoding != getattr(self, "_planned_rows", -1):
            return
        predicted = self.cost.predict(tokens)
        if predicted is not None and seconds > 5 * predicted:  # the engine idled between calls
            return
        self.cost.observe(tokens, seconds)
        self.counters["step_seconds"] += seconds
        self.counters["timed_steps"] += 1

    # ------------------------------------------------------------------ inspection

    def slot_of_row(self, row: int) -> int:
        """The slot row `row` had in the last step (-1: none)."""
        return int(self._row_slot[row])

    def check_rows(self, rows: int, lengths, token_ids_cpu) -> None:
        """Raise RuntimeError unless every row's slot holds exactly the row's tokens, in our
        mirror and in the index."""
        for i in range(rows):
            slot = int(self._row_slot[i])
            n = int(lengths[i])
            if slot < 0 or self._length[slot] != n:
                raise RuntimeError(f"SpecdecProposer: row {i} has slot {slot} of length "
                                   f"{self._length[slot] if slot >= 0 else None}, vLLM has {n} tokens")
            row = np.asarray(token_ids_cpu[i, :n])
            if not np.array_equal(self._history[slot][:n], row) or \
                    not np.array_equal(self.index.history(slot).numpy(), row):
                raise RuntimeError(f"SpecdecProposer: row {i}'s slot {slot} history differs from vLLM's tokens")

    def stats(self) -> dict:
        """Counters since construction: steps, decode_rows, drafted, verified, accepted (draft
        tokens), rows_with_drafts, new_requests, moved_requests, propose_seconds, acceptance
        per depth, the step-cost model's ratio and mean measured step."""
        c = dict(self.counters)
        c["acceptance_rate"] = c["accepted"] / c["verified"] if c["verified"] else None
        c["mean_accepted_per_decode_row"] = c["accepted"] / c["decode_rows"] if c["decode_rows"] else None
        c["accepted_per_depth"] = self.accepted_per_depth.tolist()
        c["verified_per_depth"] = self.verified_per_depth.tolist()
        c["token_cost_ratio"] = self.cost.ratio()
        c["mean_step_seconds"] = c["step_seconds"] / c["timed_steps"] if c["timed_steps"] else None
        c["propose_share"] = (c["propose_seconds"] / c["steps"]) / c["mean_step_seconds"] \
            if c["timed_steps"] and c["steps"] else None
        c["settings"] = asdict(self.settings)
        c["num_speculative_tokens"] = self.k
        c["ngram_backend"] = self.index.backend
        return c


def _write_stats(ref, path: str) -> None:
    proposer = ref()
    if proposer is None:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(proposer.stats(), f, indent=1)
    except OSError:
        pass
