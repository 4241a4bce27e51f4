"""`SuffixDrafter`, `default_drafter`'s suffix cache and `generate(num_return_sequences=n)`
on tiny random models (CPU): greedy equal to HF, HF's row order, per-row seeds, drafts
against a brute-force search of what was seen, and chi-square exactness of sampled rows
drafted from the cache (siblings included)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("scipy.stats")

import specdec_kernels as sk  # noqa: E402
from specdec_kernels.loop.drafters import ScoredMergedDrafter, SuffixDrafter  # noqa: E402
from test_generate import (SAMPLE_PROMPT, SMALL_VOCAB, chi_square_pvalue, exact_pair_distribution,  # noqa: E402
                           hf_greedy, left_pad, planned, repetitive_prompts, tiny_model)


@pytest.fixture(autouse=True, scope="module")
def one_thread_and_own_cache(tmp_path_factory):
    """One intra-op thread (tiny kernels), and the planner's measurements kept out of the user's cache."""
    import os

    threads, old = torch.get_num_threads(), os.environ.get("SPECDEC_CACHE_DIR")
    torch.set_num_threads(1)
    os.environ["SPECDEC_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield
    torch.set_num_threads(threads)
    if old is None:
        os.environ.pop("SPECDEC_CACHE_DIR", None)
    else:
        os.environ["SPECDEC_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def target():
    return tiny_model(0)


@pytest.fixture(scope="module")
def small_target():
    return tiny_model(20, vocab=SMALL_VOCAB, hidden=32, logit_scale=8.0)


DRAFTERS = {
    "suffix": lambda: SuffixDrafter(),
    "suffix_small": lambda: SuffixDrafter(num_tokens=3, max_nodes=5, max_candidates=2),
    "merged": lambda: ScoredMergedDrafter([sk.NgramDrafter(num_tokens=8), SuffixDrafter()]),
}


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_greedy_matches_hf_with_num_return_sequences(target, kind, n):
    """Greedy rows equal HF's greedy output (HF refuses greedy with n > 1: each of our n
    copies equals it), in HF's order, twice through one drafter (the second call drafts from
    the first's outputs)."""
    ids, mask = left_pad(repetitive_prompts(2))
    expected = hf_greedy(target, ids, mask, 24).repeat_interleave(n, 0)
    drafter = DRAFTERS[kind]()
    for _ in range(2):
        out = sk.generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=24, num_return_sequences=n)
        assert torch.equal(out.sequences, expected)
    assert out.stats.tokens_per_step > 1.5  # the second call copies the first's outputs


def test_default_drafter_has_suffix_cache(target):
    ids, mask = left_pad(repetitive_prompts(2))
    drafter = sk.default_drafter(target)
    assert isinstance(drafter.suffix_cache, SuffixDrafter)
    out = sk.generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=16)
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 16))
    assert drafter.suffix_cache.cached_tokens > 0
    assert sk.default_drafter(target).suffix_cache.cached_tokens == 0  # a new object shares nothing
    drafter.suffix_cache.clear()
    assert drafter.suffix_cache.cached_tokens == 0
    assert sk.default_drafter(target, suffix_cache=False).suffix_cache is None


def test_sampled_row_order_and_per_row_seeds(target):
    """Row b * n + i holds prompt b; rows differ; an int seed reproduces the output (with
    the same cache contents: a fresh drafter each time)."""
    ids, mask = left_pad(repetitive_prompts(2))
    run = lambda: sk.generate(target, ids, attention_mask=mask, drafter=SuffixDrafter(), max_new_tokens=12,  # noqa: E731
                              temperature=1.0, seed=5, num_return_sequences=4).sequences
    out = run()
    assert out.shape[0] == 8
    assert torch.equal(out[:, : ids.shape[1]], ids.repeat_interleave(4, 0))
    assert len({tuple(r) for r in out[:, ids.shape[1]:].tolist()}) > 4
    assert torch.equal(run(), out)
    seeds = torch.arange(8, dtype=torch.int64) * 7 + 1
    out = sk.generate(target, ids, attention_mask=mask, max_new_tokens=6, temperature=1.0, seed=seeds,
                      num_return_sequences=4)
    assert out.sequences.shape[0] == 8
    with pytest.raises(ValueError, match="seed"):
        sk.generate(target, ids, attention_mask=mask, max_new_tokens=2, temperature=1.0, seed=seeds[:2],
                    num_return_sequences=4)
    with pytest.raises(ValueError, match="num_return_sequences"):
        sk.generate(target, ids, attention_mask=mask, max_new_tokens=2, num_return_sequences=0)


def test_generation_config_num_return_sequences(target):
    """HF reads n from the generation config too; so do we."""
    ids, mask = left_pad(repetitive_prompts(2))
    out = sk.generate(target, ids, attention_mask=mask, max_new_tokens=4, do_sample=True, num_return_sequences=3,
                      seed=1)
    assert out.sequences.shape[0] == 6


def brute_force_tree(seen, row, depth, max_candidates):
    """The continuations (as tuples) of the newest max_candidates earlier occurrences of the
    longest suffix (orders of the index) of `row` in the sequences `seen` (oldest first;
    `row` itself last), and the match length."""
    from specdec_kernels.ops.reference.suffix_index import ALL_ORDERS

    positions = [(s, i) for s, seq in enumerate(seen) for i in range(len(seq))]
    for k in reversed([k for k in ALL_ORDERS if k <= len(row)]):
        found = [(s, i) for s, i in reversed(positions)
                 if i + 1 < len(seen[s]) and i + 1 >= k and seen[s][i + 1 - k : i + 1] == row[-k:]]
        if found:
            return [tuple(seen[s][i + 1 : i + 1 + depth]) for s, i in found[:max_candidates]], k
    return [], 0


def test_drafts_match_brute_force_over_added_sequences():
    """With finished sequences added, a row's draft is the trie of the brute force's
    continuations, with their counts, and scores that follow the counts."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    seen = [torch.randint(0, 4, (int(torch.randint(5, 40, (), generator=gen)),), generator=gen).tolist()
            for _ in range(6)]
    drafter = SuffixDrafter(num_tokens=4, max_nodes=64, max_candidates=5)
    drafter.add(seen)
    row = torch.randint(0, 4, (9,), generator=gen)
    drafter.start(row[None], torch.tensor([9]), 32)
    draft = drafter.propose(row[None], torch.tensor([9]))
    continuations, match = brute_force_tree(seen + [row.tolist()], row.tolist(), 4, 5)
    counts = {}
    for c in continuations:
        for d in range(1, len(c) + 1):
            counts[c[:d]] = counts.get(c[:d], 0) + 1
    tree = draft.tree
    got = {tuple(tree.path_tokens(0, i)[1:]): float(draft.scores[0, i]) for i in range(1, tree.tokens.shape[1])
           if tree.parents[0, i] >= 0}
    assert set(got) == set(counts)
    for path, score in got.items():  # a node scores more where more continuations pass
        for other, other_score in got.items():
            if len(path) == len(other) and counts[path] > counts[other]:
                assert score > other_score
    assert match > 0 or not counts


SAMPLE_ROWS = 2000


@pytest.mark.parametrize("adaptive", ["fixed", "planned"])
@pytest.mark.parametrize("kind", ["suffix", "merged_default"])
def test_sampling_exact_with_sibling_drafts(small_target, kind, adaptive):
    """2000 sampled rows as 250 prompts x 8 siblings drafting from each other and from a
    cache pre-filled with random texts: the first two tokens' joint distribution is the
    target's (chi-square)."""
    prompt = torch.tensor(SAMPLE_PROMPT)
    n = 8
    gen = torch.Generator().manual_seed(7)
    noise = [torch.randint(0, SMALL_VOCAB, (30,), generator=gen).tolist() for _ in range(20)]
    if kind == "suffix":
        drafter = SuffixDrafter(num_tokens=3, max_nodes=6)
        drafter.add(noise)
    else:
        drafter = sk.default_drafter(small_target)
        drafter.suffix_cache.add(noise)
    ids = prompt.expand(SAMPLE_ROWS // n, -1)
    out = sk.generate(small_target, ids, drafter=drafter, max_new_tokens=2, temperature=1.0, seed=4321,
                      num_return_sequences=n, adaptive=planned(small_target) if adaptive == "planned" else False)
    pvalue = chi_square_pvalue(out.sequences[:, -2:], exact_pair_distribution(small_target, SAMPLE_PROMPT))
    assert pvalue > 1e-3, f"{kind}: chi-square p = {pvalue}"
    assert out.stats.acceptance_per_depth[0] > 0.05  # drafts accepted and rejected


def test_sampling_exact_drafting_from_an_earlier_calls_samples(small_target):
    """A prompt with no n-gram inside: the drafts come from an earlier call's 8 samples of it
    (the same drafter object), distributed like the target's, so many are accepted; the
    2000 rows of the second call keep the target's distribution."""
    prompt = [5, 1, 7, 2, 6]
    n = 10
    drafter = SuffixDrafter(num_tokens=2, max_nodes=4)
    sk.generate(small_target, torch.tensor([prompt]), drafter=drafter, max_new_tokens=3, temperature=1.0, seed=1,
                num_return_sequences=8, adaptive=False)
    ids = torch.tensor(prompt).expand(SAMPLE_ROWS // n, -1)
    out = sk.generate(small_target, ids, drafter=drafter, max_new_tokens=2, temperature=1.0, seed=99,
                      num_return_sequences=n, adaptive=False)
    pvalue = chi_square_pvalue(out.sequences[:, -2:], exact_pair_distribution(small_target, prompt))
    assert pvalue > 1e-3, f"chi-square p = {pvalue}"
    assert out.stats.acceptance_per_depth[0] > 0.2  # the earlier samples are good drafts


def test_cli_parses_num_return_sequences():
    from specdec_kernels.cli import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "x", "--num-return-sequences", "4", "--temperature", "0.7"])
    assert args.num_return_sequences == 4
    assert build_parser().parse_args(["generate", "--prompt", "x"]).num_return_sequences == 1


def test_bench_best_of_n_and_stream(target, tmp_path):
    """`specdec bench e2e --num-return-sequences N` rows (HF and ours, B * N rows each; greedy
    cells skipped) and the `--stream` runner on a tiny model, cache filling along the stream."""
    pytest.importorskip("matplotlib")
    from conftest import WordTokenizer
    from specdec_kernels import workloads
    from specdec_kernels.benchmarks import e2e
    from specdec_kernels.benchmarks.e2e import stream

    text = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"
    requests = {"code_edit": [workloads.Request("code_edit", f"r{i}", text * 2 + str(i), chat=False) for i in range(2)]}
    tokenizer = WordTokenizer(target.config.vocab_size)
    rows = e2e.run(target, tokenizer, requests, methods=("hf", "ours_default_nocache", "ours_default", "ours_suffix"),
                   batch_sizes=(1,), temperatures=(0.0, 0.7), max_new_tokens=4, prompts_per_workload=2,
                   profile_kernels=False, progress=False, num_return_sequences=3)
    for r in rows:
        if r["config"]["temperature"] == 0:
            assert "skipped" in r
        else:
            assert r["config"]["num_return_sequences"] == 3 and r["new_tokens"] == 2 * 3 * 4, r
    results = stream.run_stream(target, tokenizer, requests["code_edit"], max_new_tokens=6, progress=False)
    summary = stream.summarise(results)
    assert all(s["outputs_equal_first_method"] for s in summary.values())
    cached = [r["cached_tokens_before"] for r in results["ours_default"]]
    assert cached[0] == 0 and cached[1] > 0
    assert stream.plot_stream(results, tmp_path / "s.png", "t") is not None


# ----------------------------------------------------------------------------- SourceJudge


def chain_draft(root, tokens_per_row, scores=None):
    """A Draft of one chain per row (ragged, -1 padded), scored `scores[b]` per node (path
    score scores[b] ** depth) or unscored."""
    from specdec_kernels.loop.drafters import Draft
    from specdec_kernels.ops.tree import TokenTree

    width = 1 + max(len(t) for t in tokens_per_row)
    tokens = torch.full((len(root), width), -1, dtype=torch.int64)
    parents = torch.full_like(tokens, -1)
    for b, row in enumerate(tokens_per_row):
        tokens[b, 0] = root[b]
        for i, token in enumerate(row):
            tokens[b, i + 1], parents[b, i + 1] = token, i
    tree = TokenTree(tokens, parents)
    if scores is None:
        return Draft(tree)
    depth = tree.depths.clamp(min=0).float()
    return Draft(tree, None, torch.tensor(scores, dtype=torch.float32)[:, None] ** depth)


def test_source_judge_counts_what_only_one_source_drafted_and_first_picks():
    """A source adds the emitted tokens its tree reaches and no other asked source's does; its
    first pick is judged against the first emitted token (an optional source's only where no
    other asked source picked the same token); a source not asked is not judged; rows that
    emitted nothing are not judged."""
    from specdec_kernels.loop.drafters import MERGE, PROBE, SourceJudge

    judge = SourceJudge([True, False, False, False], prior=1.0)
    history = torch.tensor([[1, 2, 3, 10, 11, 12, 0], [1, 2, 3, 20, 21, 22, 0], [1, 2, 3, 30, 0, 0, 0]])
    root = [3, 3, 3]
    drafts = [chain_draft(root, [[10], [20], [30]], [0.5, 0.5, 0.5]),  # the first token everywhere
              chain_draft(root, [[10, 11, 12], [20, 21], [30, 31]], [0.9, 0.9, 0.9]),  # two more in row 0, one in row 1
              chain_draft(root, [[99], [98], [97]], [0.8, 0.8, 0.8]),  # always wrong
              None]  # not asked
    assert judge.plan() == [MERGE, PROBE, PROBE, PROBE]  # optional sources are probed while warming up
    judge.observe(drafts, history, torch.tensor([3, 3, 3]))
    judge.observe([None] * 4, history, torch.tensor([6, 5, 3]))  # row 2 emitted nothing
    assert judge.added == [0.0, 3.0, 0.0, 0.0]
    assert judge.judged == [2.0, 2.0, 2.0, 0.0] and judge.seen == [2, 2, 2, 0]
    assert judge.rates()[1] == 1.5
    # Source 1 picked what the required source 0 picked in every row: none of its picks count.
    assert judge.first_hits == [2.0, 0.0, 0.0, 0.0]
    assert [round(x, 5) for x in judge.first_scores] == [1.0, 0.0, 1.6, 0.0]
    factors = judge.factors()  # (hits + 1) / (scores + 1)
    assert abs(factors[0] - 1.5) < 1e-6 and factors[1] == 1.0 and abs(factors[2] - 1 / 2.6) < 1e-6
    assert factors[3] == 1.0
    # Scores scale by the factor, first-level scores capped at 1.
    scaled = judge.scaled(0, drafts[0])
    assert torch.allclose(scaled[:, 1], torch.full((3,), 0.75)) and torch.all(scaled[:, 0] == 1.0)
    scaled = judge.scaled(2, drafts[2])  # factor 1 / 2.6
    assert torch.allclose(scaled[0, 1:], torch.tensor([0.8]) / 2.6, atol=1e-6)
    # An optional source's own picks count: right in row 0 where the required one was wrong.
    judge = SourceJudge([True, False], prior=1.0)
    own = [chain_draft(root, [[77], [20], [30]], [0.5, 0.5, 0.5]), chain_draft(root, [[10], [20], [31]], [0.9] * 3)]
    judge.observe(own, history, torch.tensor([3, 3, 3]))
    judge.observe([None] * 2, history, torch.tensor([6, 5, 4]))
    assert judge.first_hits == [2.0, 1.0]  # source 1: row 0 (its own, right), row 2 (its own, wrong); row 1 shared
    assert [round(x, 5) for x in judge.first_scores] == [1.5, 1.8]
    scaled = judge.scaled(0, chain_draft(root, [[10, 11, 12]] * 3, [0.9] * 3))  # 0.9 * 1.5 would exceed 1
    assert torch.allclose(scaled[:, 1:], torch.tensor([1.0, 0.9, 0.81]).expand(3, -1), atol=1e-6)


def test_source_judge_merges_a_source_that_adds_and_probes_one_that_does_not():
    from specdec_kernels.loop.drafters import MERGE, PROBE, SKIP, SourceJudge

    judge = SourceJudge([True, False, False], warmup=4, probe_every=5, min_rate=0.05)
    history = torch.arange(200)[None, :]
    plans = []
    for step in range(40):
        plan = judge.plan()
        plans.append(plan)
        length = 10 + 2 * step  # two tokens emitted per step: history[length], history[length + 1]
        drafts = [chain_draft([length - 1], [[length]]),
                  None if plan[1] == SKIP else chain_draft([length - 1], [[length, length + 1]]),  # adds the second
                  None if plan[2] == SKIP else chain_draft([length - 1], [[7]])]  # never right
        judge.observe(drafts, history, torch.tensor([length]))
    assert all(p[0] == MERGE for p in plans)
    assert all(p[1] == PROBE for p in plans[:5]) and all(p[1] == MERGE for p in plans[6:])
    assert all(p[2] == PROBE for p in plans[:5])
    assert all(p[2] == (PROBE if (i + 1) % 5 == 0 else SKIP) for i, p in enumerate(plans[6:], start=6))
    assert judge.rates()[2] == 0.0 and judge.rates()[1] > 0.5
    twin = judge.cost_twin()  # a cost twin probes optional sources only
    assert [twin.plan() for _ in range(5)] == [[MERGE, SKIP, SKIP]] * 4 + [[MERGE, PROBE, PROBE]]


def test_source_judge_walks_trees_along_the_emitted_tokens():
    """A tree's reach follows the emitted tokens through any branch; a first pick is the
    highest-scored depth-1 node."""
    from specdec_kernels.loop.drafters import Draft, SourceJudge
    from specdec_kernels.ops.tree import TokenTree

    judge = SourceJudge([True, False])
    history = torch.tensor([[5, 6, 7, 8, 9]])
    # root 5 -> {1, 6}; 6 -> {2, 3}; 3 -> {7, 8}: the path 6, 7 is not there (7 hangs under 3)
    tree = Draft(TokenTree(torch.tensor([[5, 1, 6, 2, 3, 7, 8]]), torch.tensor([[-1, 0, 0, 2, 2, 4, 4]])), None,
                 torch.tensor([[1.0, 0.2, 0.7, 0.3, 0.3, 0.1, 0.1]]))
    fixed = Draft(TokenTree(torch.tensor([[5, 6, 7, 9]]), torch.tensor([[-1, 0, 1, 2]])))  # 6, 7, then wrong
    root_only = Draft(TokenTree(torch.tensor([[5]]), torch.tensor([[-1]])))
    judge.observe([root_only, tree], history, torch.tensor([1]))
    judge.observe([None, None], history, torch.tensor([4]))  # emitted 6, 7, 8
    assert judge.added == [0.0, 1.0] and judge.first_hits == [0.0, 1.0] and abs(judge.first_scores[1] - 0.7) < 1e-6
    judge.observe([root_only, fixed], history, torch.tensor([1]))
    judge.observe([None, None], history, torch.tensor([4]))
    assert judge.added[1] == 1.0 * judge.decay + 2.0  # 6, 7
