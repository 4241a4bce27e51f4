"""The vLLM proposer (`specdec_kernels.integrations.vllm`).

Two parts:
- Bookkeeping tests without vLLM (every CI run, seconds): `FakeVllm` below drives the proposer
  with the inputs vLLM 0.32's `custom_class` hook passes (its persistent batch: token ids and
  lengths per row as numpy arrays, rows reused and condensed as requests come and go, the tokens
  each row accepted), verifying drafts greedily against a toy deterministic model.
- Real vLLM tests (`@needs_vllm`): vLLM's CPU build in its own venv (`tools/vllm_env.sh`) runs the
  default model offline in a subprocess. Skipped with the reason when the venv or the default
  model is absent, and unless SPECDEC_VLLM_TESTS=1 (CI has no network to install vLLM from PyPI:
  see docs/vllm.md); about a minute here where the venv exists.
"""

import ast
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from specdec_kernels.integrations import vllm as integ


# ----------------------------------------------------------------------------- a fake vLLM


def vllm_config(k=5, max_len=256, max_rows=4, additional=None):
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           model_config=SimpleNamespace(max_model_len=max_len),
                           scheduler_config=SimpleNamespace(max_num_seqs=max_rows),
                           additional_config=additional or {})


def periodic_model(period):
    """Greedy 'model': repeats the history's token `period` back (perfectly predictable)."""
    return lambda history: history[-period]


def noisy_model(vocab=3, seed=0):
    """Greedy 'model' over a tiny alphabet, pseudo-random: n-grams match often, drafts rarely hold."""
    def next_token(history):
        return random.Random(len(history) * 1009 + seed * 7 + int(history[-1])).randint(1, vocab)
    return next_token


class FakeVllm:
    """vLLM's persistent batch as the hook sees it: `token_ids_cpu [rows, max_len]` (int32),
    `num_tokens_no_spec [rows]`, per step the accepted tokens per row. New requests take the
    first free row; finished ones leave holes that are filled by moving the last rows down
    (vLLM's condense). A request with `chunks` > 0 spends that many steps prefilling
    (sampled []) before its first token."""

    def __init__(self, proposer, max_rows, max_len):
        self.proposer, self.max_len = proposer, max_len
        self.token_ids = np.zeros((max_rows, max_len), dtype=np.int32)
        self.num = np.zeros(max_rows, dtype=np.int32)
        self.rows = []  # per row: request dict
        self.waiting, self.done = [], {}
        self.draft_lengths = []

    def add(self, name, prompt, max_new, model, chunks=0):
        self.waiting.append(dict(name=name, prompt=list(prompt), max_new=max_new, model=model, chunks=chunks,
                                 out=[], drafts=[]))

    def _admit(self):
        while self.waiting and len(self.rows) < self.token_ids.shape[0]:
            req = self.waiting.pop(0)
            i = len(self.rows)
            self.rows.append(req)
            n = len(req["prompt"])
            self.token_ids[i, :n] = req["prompt"]
            self.token_ids[i, n:] = 7  # junk past the length, as stale rows hold
            self.num[i] = n

    def step(self):
        self._admit()
        sampled = []
        for i, req in enumerate(self.rows):
            if req["chunks"] > 0:
                req["chunks"] -= 1
                sampled.append([])
                continue
            history = list(self.token_ids[i, : self.num[i]])
            accepted = []
            for d in req["drafts"] + [None]:  # greedy verification: drafts while they match, then one more
                t = req["model"](history + accepted)
                accepted.append(t)
                if d is None or d != t or len(req["out"]) + len(accepted) >= req["max_new"]:
                    break
            accepted = accepted[: req["max_new"] - len(req["out"])]
            n = self.num[i]
            self.token_ids[i, n: n + len(accepted)] = accepted
            self.num[i] += len(accepted)
            req["out"] += accepted
            sampled.append(accepted)
        drafts = self.proposer.propose(sampled, self.num, self.token_ids, slot_mappings=None)
        assert len(drafts) == len(self.rows)
        for i, req in enumerate(self.rows):
            assert all(isinstance(t, int) for t in drafts[i])
            assert len(drafts[i]) <= self.proposer.k
            if not sampled[i]:
                assert drafts[i] == []
            req["drafts"] = drafts[i]
            self.draft_lengths.append(len(drafts[i]))
        # finished requests leave; the batch is condensed (last rows move into the holes)
        keep = [r for r in self.rows if len(r["out"]) < r["max_new"]]
        for r in self.rows:
            if len(r["out"]) >= r["max_new"]:
                self.done[r["name"]] = r["out"]
        self._condense(keep)
        return drafts

    def _condense(self, keep):
        rows = [r if r in keep else None for r in self.rows]
        last = len(rows) - 1
        for hole in [i for i, r in enumerate(rows) if r is None]:  # vLLM: each hole takes the last row
            while last >= 0 and rows[last] is None:
                last -= 1
            if last <= hole:
                break
            rows[hole], rows[last] = rows[last], None
            self.token_ids[hole], self.num[hole] = self.token_ids[last], self.num[last]
        self.rows = [r for r in rows if r is not None]

    def run(self, max_steps=2000):
        for _ in range(max_steps):
            if not self.rows and not self.waiting:
                return self.done
            self.step()
        raise AssertionError("did not finish")


def plain_outputs(requests):
    out = {}
    for name, prompt, max_new, model in requests:
        history = list(prompt)
        for _ in range(max_new):
            history.append(model(history))
        out[name] = history[len(prompt):]
    return out


def requests_mix():
    rng = np.random.default_rng(0)
    reqs = []
    for j in range(7):
        period = 3 + j % 4
        prompt = list(rng.integers(10, 50, size=5 + 3 * j))
        reqs.append((f"p{j}", prompt, 20 + 9 * j, periodic_model(period)))
    reqs.append(("noisy", [1, 2, 3, 1, 2], 40, noisy_model()))
    return reqs


def proposer_for(k=5, max_rows=4, max_len=256, **settings):
    settings.setdefault("check", True)
    return integ.SpecdecProposer(vllm_config(k, max_len, max_rows), settings=integ.ProposerSettings(**settings))


# ----------------------------------------------------------------------------- bookkeeping (no vLLM)


@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("max_rows", [1, 3, 8])
def test_outputs_counters_and_rows_match_vllm_shaped_inputs(adaptive, max_rows):
    reqs = requests_mix()
    proposer = proposer_for(max_rows=max_rows, adaptive=adaptive)
    fake = FakeVllm(proposer, max_rows, 256)
    for j, (name, prompt, max_new, model) in enumerate(reqs):
        fake.add(name, prompt, max_new, model, chunks=j % 3)
    done = fake.run()  # check=True: every step compares each row's slot history with the row
    assert done == plain_outputs(reqs)
    stats = proposer.stats()
    assert stats["new_requests"] == len(reqs)
    assert stats["accepted"] > 0 and 0 < stats["acceptance_rate"] <= 1
    assert stats["accepted"] <= stats["verified"] <= stats["drafted"]
    assert stats["accepted_per_depth"][0] >= stats["accepted_per_depth"][-1]
    if max_rows > 1:
        assert stats["moved_requests"] > 0  # condensing moved rows, and they kept their slots


def test_reused_row_starts_clean():
    """A request placed in the row (and slot) of a finished one sees nothing of it: no drafts
    from the old history, no acceptance counts, the index history its own."""
    proposer = proposer_for(max_rows=1)
    fake = FakeVllm(proposer, 1, 256)
    fake.add("a", [5, 6, 7, 8, 9, 5, 6, 7, 8, 9], 30, periodic_model(5))
    fake.run()
    slot_a = proposer.slot_of_row(0)
    assert proposer.acceptance.tried[slot_a].sum() > 0
    # b's prompt ends in tokens that a's history would continue; its own history has no repeat
    fake.add("b", [30, 31, 9], 3, lambda h: 40 + len(h))
    fake._admit()
    drafts = proposer.propose([[]], fake.num, fake.token_ids)  # prefill step: no token yet
    slot_b = proposer.slot_of_row(0)
    assert drafts == [[]]
    assert proposer.index.history(slot_b).tolist() == [30, 31, 9]
    assert float(proposer.acceptance.tried[slot_b].sum()) == 0.0
    assert float(proposer.acceptance.accepted[slot_b]) == 0.0
    fake.token_ids[0, 3] = 5  # b's first token: a's history continues 9 5 -> 6 7 8, b's has nothing
    fake.num[0] = 4
    assert proposer.propose([[5]], fake.num, fake.token_ids) == [[]]
    assert proposer.index.history(slot_b).tolist() == [30, 31, 9, 5]


def test_slots_are_recycled_when_all_are_taken():
    proposer = proposer_for(max_rows=2)
    fake = FakeVllm(proposer, 2, 128)
    reqs = [(f"r{j}", [j + 1, j + 2, j + 3], 6, periodic_model(2)) for j in range(9)]
    for r in reqs:
        fake.add(r[0], r[1], r[2], r[3])
    assert fake.run() == plain_outputs(reqs)
    assert proposer.stats()["new_requests"] == 9  # 9 requests through 4 slots


def test_adaptive_stops_drafting_where_drafts_fail():
    """Requests whose drafts are rejected get (almost) no drafts; predictable ones keep theirs."""
    def run(adaptive, model, n=150):
        proposer = proposer_for(k=5, max_rows=1, adaptive=adaptive, token_cost=0.3)
        fake = FakeVllm(proposer, 1, 512)
        fake.add("r", [1, 2, 3, 1, 2, 3, 2, 1], n, model)
        fake.run()
        return proposer.stats()

    # ~1 in 8 drafts holds: one draft adds 0.125 tokens for 0.3 of a step's cost, so none pays
    noisy_fixed, noisy_adaptive = run(False, noisy_model(vocab=8)), run(True, noisy_model(vocab=8))
    assert noisy_fixed["acceptance_rate"] < 0.3
    assert noisy_adaptive["drafted"] < 0.3 * noisy_fixed["drafted"]
    good = run(True, periodic_model(3))
    assert good["acceptance_rate"] > 0.9
    assert good["drafted"] / good["decode_rows"] > 3


def test_the_margin_keeps_many_requests_at_the_prior_plain():
    """Eight requests at once: a draft at the prior's estimate (0.6) is below the margin's
    break-even, so none drafts (where a closed batch gains nothing from drafts of that
    worth); without the margin they draft, and a single request drafts under the margin too.
    Outputs equal plain decoding's every time."""
    def run(rows, margin):
        proposer = proposer_for(k=5, max_rows=rows, draft_margin=margin)
        proposer.cost.ratio = lambda: 0.09  # the step-cost fit, fixed (the fake's CPU times are noise)
        fake = FakeVllm(proposer, rows, 256)
        reqs = [(f"r{j}", [1 + j, 2, 3, 1 + j, 2, 3, 2, 1], 30, periodic_model(3)) for j in range(rows)]
        for r in reqs:
            fake.add(*r)
        assert fake.run() == plain_outputs(reqs)
        return proposer.stats()

    assert run(8, 1.0)["drafted"] == 0
    assert run(8, 0.0)["drafted"] > 0
    single = run(1, 1.0)
    assert single["drafted"] > 0 and single["acceptance_rate"] > 0.7


def test_drafts_respect_max_model_len():
    proposer = proposer_for(k=5, max_rows=1, max_len=24, adaptive=False)
    fake = FakeVllm(proposer, 1, 24)
    fake.add("r", [1, 2, 3, 1, 2, 3], 17, periodic_model(3))
    fake.run()
    for length, draft in zip(range(6, 24), fake.draft_lengths):
        assert draft <= max(0, 24 - length - 1)


def test_extra_source_is_used_when_longer():
    class Source(integ.DraftSource):
        def __init__(self):
            self.events = []

        def start(self, slot, tokens):
            self.events.append(("start", slot, list(tokens)))

        def extend(self, slot, tokens):
            self.events.append(("extend", slot, list(tokens)))

        def finish(self, slot):
            self.events.append(("finish", slot))

        def propose(self, slots, k):
            return [[42] * k for _ in slots]

    proposer = proposer_for(k=3, max_rows=1, adaptive=False)
    source = Source()
    proposer.add_source(source)
    ids = np.zeros((1, 32), dtype=np.int32)
    ids[0, :3] = [1, 2, 3]
    num = np.array([3], dtype=np.int32)
    assert proposer.propose([[3]], num, ids) == [[42, 42, 42]]
    assert source.events == [("start", proposer.slot_of_row(0), [1, 2, 3])]
    ids[0, 3] = 42
    num[0] = 4
    proposer.propose([[42]], num, ids)
    assert source.events[-1] == ("extend", proposer.slot_of_row(0), [42])


def test_suffix_cache_drafts_a_request_from_an_earlier_one():
    """With the suffix cache, a second request with the first one's prompt drafts the first's
    output (finished, its slot reused); the n-gram index alone has nothing to match. Output
    equals plain decoding either way."""
    def run(cache_tokens):
        """(accepted, verified) draft tokens of the second request."""
        proposer = proposer_for(k=5, max_rows=1, adaptive=False, suffix_cache_tokens=cache_tokens)
        fake = FakeVllm(proposer, 1, 256)
        reqs = [(name, [3, 9, 27, 4], 60, noisy_model(vocab=40, seed=1)) for name in ("first", "again")]
        fake.add(*reqs[0])
        first = fake.run()
        before = proposer.stats()
        fake.add(*reqs[1])
        assert {**first, **fake.run()} == plain_outputs(reqs)
        after = proposer.stats()
        assert after["new_requests"] == 2
        return after["accepted"] - before["accepted"], after["verified"] - before["verified"]

    (accepted, verified), (cached_accepted, cached_verified) = run(0), run(4096)
    # the repeat's 59 tokens after its first, 6 per step at most (5 drafts + 1): drafted from
    # the first's output, nearly every draft holds
    assert cached_accepted >= 35 and cached_accepted >= 0.9 * cached_verified, (cached_accepted, cached_verified)
    assert accepted < 15


def test_suffix_source_follows_the_most_frequent_path():
    source = integ.SuffixCacheSource(num_slots=2, max_tokens=1024, min_prob=0.3)
    source.index.add([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 9, 9], [1, 2, 7, 7, 7]])
    source.start(0, np.array([8, 1, 2]))
    # after "1 2": 3 (3 of 4) then 4 (2 of 4) then 5 (2 of 4); "7" (1 of 4) is not taken
    assert source.propose([0], 5) == [[3, 4, 5]]
    strict = integ.SuffixCacheSource(num_slots=1, max_tokens=1024, min_prob=0.6)
    strict.index.add([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 9, 9], [1, 2, 7, 7, 7]])
    strict.start(0, np.array([8, 1, 2]))
    assert strict.propose([0], 5) == [[3]]  # 4 holds in 2 of 4 < 0.6
    source.extend(1, np.array([], dtype=np.int64))  # nothing appended: no error
    source.start(1, np.array([5]))
    assert source.propose([1], 3) == [[]]  # 5 is never followed by anything


def test_choose_lengths():
    rates = np.array([[0.9, 0.8, 0.7, 0.6], [0.2, 0.05, 0.01, 0.0]])
    counts = integ.choose_lengths(rates, np.array([4, 4]), 2, 0.05, 0.01)
    assert counts[0] == 4 and counts[1] <= 1
    assert integ.choose_lengths(rates, np.array([2, 0]), 2, 0.05, 0.01).tolist() == [2, 0]
    assert integ.choose_lengths(rates, np.array([4, 4]), 2, 5.0, 0.01).tolist() == [0, 0]  # tokens too dear
    assert integ.choose_lengths(np.zeros((0, 4)), np.zeros(0, dtype=np.int64), 0, 0.05, 0.0).shape == (0,)
    # At the fit's break-even (8 decoding rows, c1 / c0 = 0.089: ~0.42) a 0.45 draft pays
    # without a margin and not with draft_margin 0.5 (drafts charged 1.5 tokens); 0.9 pays both ways.
    near = np.array([[0.45]])
    assert integ.choose_lengths(near, np.array([1]), 8, 0.089, 0.01).tolist() == [1]
    assert integ.choose_lengths(near, np.array([1]), 8, 0.089, 0.01, draft_margin=0.5).tolist() == [0]
    assert integ.choose_lengths(np.array([[0.9]]), np.array([1]), 8, 0.089, 0.01, draft_margin=0.5).tolist() == [1]


def test_step_cost_fits_a_line():
    cost = integ.StepCost(token_cost=0.5)
    assert cost.ratio() == 0.5
    for tokens in [1, 5, 11, 3, 8, 2, 11, 1] * 20:
        cost.observe(tokens, 0.040 + 0.004 * tokens)
    assert abs(cost.ratio() - 0.1) < 0.02  # the prior (0.5) still pulls a little
    assert abs(cost.predict(6) - 0.064) < 1e-3


def test_settings_from_config_and_environment():
    env = {"SPECDEC_VLLM_MAX_N": "3", "SPECDEC_VLLM_ADAPTIVE": "0", "SPECDEC_VLLM_POLICY": "latest"}
    s = integ.ProposerSettings.from_sources({"max_n": 2, "token_cost": 0.1}, env)
    assert (s.max_n, s.adaptive, s.policy, s.token_cost) == (2, False, "latest", 0.1)
    with pytest.raises(ValueError, match="unknown settings"):
        integ.ProposerSettings.from_sources({"max_m": 2}, {})
    with pytest.raises(ValueError, match="SPECDEC_VLLM_MIN_N"):
        integ.ProposerSettings.from_sources({}, {"SPECDEC_VLLM_MIN_N": "two"})
    with pytest.raises(ValueError, match="policy"):
        integ.ProposerSettings(policy="first")
    with pytest.raises(ValueError, match="min_n"):
        integ.ProposerSettings(min_n=5, max_n=4)
    proposer = integ.SpecdecProposer(vllm_config(additional={"specdec": {"max_n": 2}}))
    assert proposer.settings.max_n == 2 and proposer.index.max_n == 2
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        integ.SpecdecProposer(vllm_config(k=0))


def _vllm_imports(path, *, top_level_only):
    """Line numbers of `import vllm...` / `from vllm... import` in a module (module level only, or anywhere)."""
    tree = ast.parse(Path(path).read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(n == "vllm" or n.startswith("vllm.") for n in names):
            found.append(node.lineno)
    return found


def test_importing_the_package_imports_no_vllm():
    """The proposer module imports no vLLM at all; the benchmark only inside the worker's functions
    (which run in the venv); importing the package or its CLI loads neither vLLM nor them."""
    import specdec_kernels.benchmarks.vllm as bench

    assert _vllm_imports(integ.__file__, top_level_only=False) == []
    assert _vllm_imports(bench.__file__, top_level_only=True) == []
    assert "vllm" not in sys.modules


# ----------------------------------------------------------------------------- real vLLM (venv)


def _real_vllm_skip_reason():
    from specdec_kernels.benchmarks import vllm as bench

    if os.environ.get("SPECDEC_VLLM_TESTS", "") != "1":
        return "real vLLM tests need vLLM's venv: run tools/vllm_env.sh, then set SPECDEC_VLLM_TESTS=1"
    if bench.venv_python() is None:
        return "no vLLM venv: run tools/vllm_env.sh (or set SPECDEC_VLLM_VENV)"
    try:
        from specdec_kernels.models import default_model_dir

        default_model_dir(verbose=False)
    except Exception as error:  # the default model's wheel or transformers missing
        return f"default model unavailable: {error}"
    return None


needs_vllm = pytest.mark.skipif(_real_vllm_skip_reason() is not None, reason=str(_real_vllm_skip_reason()))


@pytest.fixture(scope="module")
def real_prompts():
    from transformers import AutoTokenizer

    from specdec_kernels.models import default_model_dir
    from specdec_kernels.workloads import code_edit_prompts, fallback_code_edit

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir(verbose=False)))
    requests = code_edit_prompts(limit=3)
    if len(requests) < 3:
        requests = [fallback_code_edit()] * 3
    return str(default_model_dir(verbose=False)), [r.input_ids(tokenizer)[0].tolist() for r in requests]


@needs_vllm
def test_real_vllm_greedy_identity_acceptance_and_row_reuse(real_prompts):
    """vLLM with our proposer emits vLLM-without-speculation's greedy tokens, for concurrent
    requests of different lengths finishing at different steps; with 2 rows for 5 requests rows
    are reused (each reuse checked clean: check=True compares every row with its slot, every
    step), with and without the suffix cache; code-edit drafts are accepted."""
    from specdec_kernels.benchmarks import vllm as bench

    model, prompts = real_prompts
    prompts = [prompts[0], prompts[1][:120], prompts[2], prompts[0][:90], prompts[1]]
    limits = [60, 25, 44, 12, 33]  # finish at different steps (and EOS may end some earlier)
    runs = [{"name": "concurrent", "prompts": prompts, "max_tokens": limits, "concurrency": 5},
            {"name": "two_rows", "prompts": prompts, "max_tokens": limits[::-1], "concurrency": 5}]
    results = {}
    for method, rows in (("plain", 5), ("ours", 5), ("ours_2rows", 2), ("ours_suffix", 2)):
        settings = {"check": True, **({"suffix_cache_tokens": 1 << 16} if method == "ours_suffix" else {})}
        job = {"model": model, "method": method.split("_")[0], "k": 8,
               "engine": {"max_num_seqs": rows, "max_model_len": 1024},
               "specdec": settings if method.startswith("ours") else None,
               "runs": runs if method in ("plain", "ours") else runs[1:]}
        results[method] = bench.call_worker(job, timeout=1200)
    plain = {r["name"]: r["tokens"] for r in results["plain"]["runs"]}
    ours = {r["name"]: r["tokens"] for r in results["ours"]["runs"]}
    assert ours["concurrent"] == plain["concurrent"]
    assert results["ours_2rows"]["runs"][0]["tokens"] == plain["two_rows"]
    # the suffix cache: request 4 repeats the start of request 1, which finished earlier
    assert results["ours_suffix"]["runs"][0]["tokens"] == plain["two_rows"]
    assert results["ours_suffix"]["proposer_stats"]["settings"]["suffix_cache_tokens"] == 1 << 16
    lengths = [len(t) for t in plain["concurrent"]]
    assert len(set(lengths)) >= 3, lengths
    stats = results["ours"]["proposer_stats"]
    assert stats["accepted"] > 0 and stats["verified"] > 0
    spec = results["ours"]["runs"][0]["repeats"][0]["spec_metrics"]
    assert spec.get("spec_decode_num_accepted_tokens", 0) > 0
    assert results["ours_2rows"]["proposer_stats"]["new_requests"] >= 5
    print("lengths", lengths, "acceptance", stats["acceptance_rate"])


def test_bench_report_without_vllm(tmp_path, capsys):
    """The benchmark's bookkeeping on made-up rows: ratios, identity marks, fastest settings,
    the tables and the JSON shape (no vLLM, no timing)."""
    import argparse

    from specdec_kernels.benchmarks import vllm as bench

    args = argparse.Namespace(workloads=("code_edit",), methods=bench.METHODS, max_new_tokens=8, threads=1)
    rows, tokens = [], {}
    for method, tps, out in (("vllm_plain", 10.0, [[1, 2]]), ("vllm_ngram5", 20.0, [[1, 2]]),
                             ("vllm_ngram10", 15.0, [[1, 2]]), ("vllm_ours", 25.0, [[1, 3]]), ("generate", 12.0, [[1, 2]])):
        rows.append(bench._row(method, "code_edit", 1, [[0]], 1.0, tps, [1.0], args, tokens_per_cpu_s=tps / 2))
        tokens[(method, "code_edit", 1)] = out
    assert bench._compare(rows, tokens) is True  # vllm_ours differs from vllm_plain
    bench._add_ratios(rows)
    by = {r["config"]["method"]: r for r in rows}
    assert by["vllm_ours"]["identical_to_vllm_plain"] is False and by["vllm_ngram5"]["identical_to_vllm_plain"]
    assert by["vllm_ours"]["ratio_vs_vllm_plain"] == 2.5 and by["vllm_ours"]["ratio_vs_best_vllm_ngram"] == 1.25
    assert by["generate"]["cpu_ratio_vs_vllm_plain"] == 1.2
    assert bench._fastest(rows) == {"code_edit|1": {"method": "vllm_ours", "tokens_per_s": 25.0}}
    bench._print(rows, args)
    assert "DIFF" in capsys.readouterr().out
    assert bench.method_config("ngram", 5)["num_speculative_tokens"] == 5
    assert bench.method_config("ours", 7) == integ.speculative_config(7)
    with pytest.raises(ValueError):
        bench.method_config("eagle")
    # Method names: vllm_ngram<K>, vllm_ours<K> (K drafts), vllm_ours (--k's).
    assert [bench.vllm_method(m, 10) for m in ("vllm_plain", "vllm_ngram24", "vllm_ours", "vllm_ours16")] == \
        [("plain", None), ("ngram", 24), ("ours", 10), ("ours", 16)]
    assert all(bench.vllm_method(m, 10) is None for m in ("vllm_ngram", "vllm_ours0", "generate", "vllm_eagle"))
