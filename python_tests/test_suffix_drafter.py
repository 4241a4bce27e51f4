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


# ----------------------------------------------------------------------------- SourceGate


def chain_tree(root, tokens_per_row):
    """A TokenTree of one chain per row (ragged, -1 padded)."""
    from specdec_kernels.ops.tree import TokenTree

    width = 1 + max(len(t) for t in tokens_per_row)
    tokens = torch.full((len(root), width), -1, dtype=torch.int64)
    parents = torch.full_like(tokens, -1)
    for b, row in enumerate(tokens_per_row):
        tokens[b, 0] = root[b]
        for i, token in enumerate(row):
            tokens[b, i + 1], parents[b, i + 1] = token, i
    return TokenTree(tokens, parents)


def test_source_gate_counts_what_only_one_source_drafted():
    """A source adds the emitted tokens its nodes reach and no other asked source's do; a
    source not asked is not judged; rows that emitted nothing are not judged."""
    from specdec_kernels.loop.drafters import SourceGate

    gate = SourceGate([True, False, False, False])
    history = torch.tensor([[1, 2, 3, 10, 11, 12, 0], [1, 2, 3, 20, 21, 22, 0], [1, 2, 3, 30, 0, 0, 0]])
    before = torch.tensor([3, 3, 3])
    root = [3, 3, 3]
    trees = [chain_tree(root, [[10], [20], [30]]),  # the first token everywhere
             chain_tree(root, [[10, 11, 12], [20, 21], [30, 31]]),  # two more in row 0, one in row 1
             chain_tree(root, [[99], [98], [97]]),  # always wrong
             None]  # not asked
    assert gate.asked() == [True, True, True, True]  # warming up
    gate.observe(trees, history, before)
    gate.observe(trees, history, torch.tensor([6, 5, 3]))  # row 2 emitted nothing
    assert gate.added == [0.0, 3.0, 0.0, 0.0]
    assert gate.judged == [2.0, 2.0, 2.0, 0.0] and gate.seen == [2, 2, 2, 0]
    assert gate.rates()[1] == 1.5


def test_source_gate_skips_a_source_that_adds_nothing_and_probes_it():
    from specdec_kernels.loop.drafters import SourceGate

    gate = SourceGate([True, False, False], warmup=4, probe_every=5, min_rate=0.05)
    history = torch.arange(200)[None, :]
    asked_log = []
    for step in range(40):
        asked = gate.asked()
        asked_log.append(asked)
        length = 10 + 2 * step  # two tokens emitted per step: history[length], history[length + 1]
        trees = [chain_tree([length - 1], [[length]]) if asked[0] else None,
                 chain_tree([length - 1], [[length, length + 1]]) if asked[1] else None,  # adds the second token
                 chain_tree([length - 1], [[7]]) if asked[2] else None]  # never right
        gate.observe(trees, history, torch.tensor([length]))
    assert all(a[0] and a[1] for a in asked_log)
    skipped = [i for i, a in enumerate(asked_log) if not a[2]]
    assert skipped and min(skipped) >= 4  # judged on 4 rows first
    assert all(asked_log[i][2] for i in range(len(asked_log)) if (i + 1) % 5 == 0)  # probes
    assert gate.rates()[2] == 0.0 and gate.rates()[1] > 0.5
    twin = gate.cost_twin()  # a cost twin asks the optional sources at probes only
    assert [twin.asked() for _ in range(4)] == [[True, False, False]] * 4



def test_source_gate_walks_trees_along_the_emitted_tokens():
    """A tree's reach follows the emitted tokens through any branch: here the second child of
    the root, then its second child."""
    from specdec_kernels.loop.drafters import SourceGate
    from specdec_kernels.ops.tree import TokenTree

    gate = SourceGate([True, False])
    history = torch.tensor([[5, 6, 7, 8, 9]])
    tree = TokenTree(torch.tensor([[5, 1, 6, 2, 3, 7, 8]]), torch.tensor([[-1, 0, 0, 2, 2, 4, 4]]))
    # root 5 -> {1, 6}; 6 -> {2, 3}; 3 -> {7, 8}: no path 6, 7 ... (7 hangs under 3)
    fixed = TokenTree(torch.tensor([[5, 6, 7, 9]]), torch.tensor([[-1, 0, 1, 2]]))  # 6, 7, then wrong
    gate.observe([TokenTree(torch.tensor([[5]]), torch.tensor([[-1]])), tree], history, torch.tensor([1]))
    gate.observe([None, None], history, torch.tensor([4]))  # emitted 6, 7, 8
    assert gate.added == [0.0, 1.0]  # the tree holds 6 only
    gate.observe([TokenTree(torch.tensor([[5]]), torch.tensor([[-1]])), fixed], history, torch.tensor([1]))
    gate.observe([None, None], history, torch.tensor([4]))
    assert gate.added[1] == 1.0 * gate.decay + 2.0  # 6, 7
