"""Adaptive speculation: the planner's decisions, the cost model, drafter budgets, and
losslessness with the planner on (greedy identity with HF, chi-square on sampling),
including rows that verify no drafts and pruned trees."""

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import specdec_kernels as sk  # noqa: E402
from specdec_kernels.loop import cost_model as cm  # noqa: E402
from specdec_kernels.loop.drafters import Draft, first_nodes, keep_nodes  # noqa: E402
from specdec_kernels.loop import planner as planner_module  # noqa: E402
from specdec_kernels.loop.planner import PROBE_AFTER, AcceptanceModel, Planner, choose_counts  # noqa: E402

from test_generate import (  # noqa: E402
    SAMPLE_PROMPT, SAMPLE_ROWS, VOCAB, chi_square_pvalue, exact_pair_distribution, hf_greedy, left_pad,
    repetitive_prompts, tiny_model,
)
# Shared fixtures (pytest uses fixtures found in the module's namespace): one intra-op thread
# for the module (autouse there), and the tiny target and draft models.
from test_generate import draft, one_thread, target  # noqa: E402,F401


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    """Cost models measured here go to a temporary cache, never the user's."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    cm._LOADED.clear()
    planner_module._LEARNED.clear()
    yield
    cm._LOADED.clear()
    planner_module._LEARNED.clear()


def flat_cost(model, seconds=1.0):
    """A cost model where verifying more nodes costs nothing."""
    return cm.CostModel(cm.identity(model), {1: ([1, 10_000], [seconds, seconds])})


def linear_cost(model, per_token):
    """Each token of a forward costs `per_token` on top of a fixed 1 s."""
    return cm.CostModel(cm.identity(model), {1: ([1, 10_000], [1.0 + per_token, 1.0 + per_token * 10_000])})


# ----------------------------------------------------------------------------- decisions


def test_zero_acceptance_drafts_nothing():
    gains = torch.zeros(4, 6)
    seconds = torch.linspace(1.0, 1.5, 7)
    assert choose_counts(gains, seconds).tolist() == [0, 0, 0, 0]
    # even when verification is free: nothing to gain, the cheaper plan wins the tie
    assert choose_counts(gains, torch.ones(7)).tolist() == [0, 0, 0, 0]


def test_free_verification_takes_the_full_budget():
    gains = torch.tensor([[0.9, 0.5, 0.2, 0.1], [0.3, 0.2, 0.0, 0.0]])
    counts = choose_counts(gains, torch.ones(5))
    assert counts.tolist() == [4, 2]  # every node with something to gain (row 1 has two)


def test_cost_against_gain():
    gains = torch.tensor([[0.9, 0.5, 0.2]], dtype=torch.float64)
    # goodput n=0: 1/1, n=1: 1.9/2 -> no drafts when a node doubles the step
    assert choose_counts(gains, torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [0]
    # 1/1, 1.9/1.1, 2.4/1.2 = 2.0, 2.6/1.3 = 2.0 (tie: the cheaper) -> 2
    assert choose_counts(gains, torch.tensor([1.0, 1.1, 1.2, 1.3], dtype=torch.float64)).tolist() == [2]


def test_batch_budget_goes_to_the_largest_gains():
    gains = torch.tensor([[0.9, 0.8, 0.7], [0.3, 0.1, 0.05], [0.85, 0.2, 0.0]])
    free = torch.ones(4)
    assert choose_counts(gains, free, max_batch_nodes=3).tolist() == [2, 0, 1]  # 0.9, 0.85, 0.8
    assert choose_counts(gains, free, max_batch_nodes=5).tolist() == [3, 1, 1]  # + 0.7, 0.3
    assert choose_counts(gains, free, max_batch_nodes=0).tolist() == [0, 0, 0]
    assert choose_counts(gains, free).tolist() == [3, 3, 2]


def test_min_gain_leaves_hopeless_rows_plain():
    gains = torch.tensor([[0.9, 0.9], [0.005, 0.001]])
    assert choose_counts(gains, torch.ones(3), min_gain=0.01).tolist() == [2, 0]


def test_bad_configuration():
    with pytest.raises(ValueError, match="max_batch_nodes"):
        Planner(max_batch_nodes=-1)
    with pytest.raises(ValueError, match="max_batch_nodes"):
        choose_counts(torch.zeros(1, 2), torch.ones(3), max_batch_nodes=-2)
    with pytest.raises(ValueError, match="step_seconds"):
        choose_counts(torch.zeros(1, 2), torch.ones(2))
    with pytest.raises(ValueError, match="min_gain"):
        Planner(min_gain=-0.1)
    with pytest.raises(ValueError, match="seconds"):
        cm.CostModel({}, {1: ([1, 2], [0.1, -1.0])})
    with pytest.raises(ValueError, match="increasing"):
        cm.CostModel({}, {1: ([4, 2], [0.1, 0.2])})
    with pytest.raises(ValueError, match="two or more"):
        cm.CostModel({}, {1: ([1], [0.1])})
    with pytest.raises(ValueError, match="row counts"):
        cm.CostModel({}, {0: ([1, 2], [0.1, 0.2])})
    with pytest.raises(ValueError, match="tables"):
        cm.DraftCost({}, {})
    with pytest.raises(ValueError, match="draft_cost"):
        Planner(draft_cost=0.01)
    with pytest.raises(ValueError, match="adaptive"):
        sk.generate(tiny_model(0), torch.ones(1, 3, dtype=torch.long), max_new_tokens=1, adaptive="yes")


def test_acceptance_model_learns_and_forgets():
    model = AcceptanceModel(rows=2, max_nodes=3, device="cpu", decay=0.8, prior=0.5)
    prior = model.rank_rates()
    assert torch.allclose(prior[0], torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64))
    ranks = torch.tensor([[-1, 0, 1, 2], [-1, 0, 1, 2]])
    on_path = torch.tensor([[True, True, True, True], [True, False, False, False]])
    for _ in range(10):
        model.update(ranks, on_path, None, torch.tensor([True, True]))
    rates = model.rank_rates()
    assert (rates[0] > 0.8).all() and (rates[1] < 0.15).all()
    for _ in range(40):  # no verification: back towards the prior (rows retry from time to time)
        model.update(torch.full_like(ranks, -1), on_path, None, torch.tensor([True, True]))
    assert torch.allclose(model.rank_rates(), prior, atol=1e-2)
    # scores: a node surer than its rank's usual is estimated higher, never above its parent
    model.update(ranks, on_path, torch.tensor([[1.0, 0.4, 0.2, 0.1]] * 2), torch.tensor([True, True]))
    est = model.estimates(torch.tensor([[0.8, 0.1, 0.1], [0.4, 0.2, 0.1]]))
    assert est[0, 0] > est[1, 0] and (est[:, 1:] <= est[:, :-1]).all()


def test_a_step_that_drafted_nothing_only_fades_the_counts():
    """Planner.observe after a root-only tree takes `decay_np` alone (a fast path): the same
    counts as the full update of that step, bit for bit."""
    def trained():
        model = AcceptanceModel(rows=2, max_nodes=3, device="cpu", decay=0.8, prior=0.5)
        ranks = torch.tensor([[-1, 0, 1, 2], [-1, 0, 1, -1]])
        on_path = torch.tensor([[True, True, False, False], [True, True, True, False]])
        model.update(ranks, on_path, torch.tensor([[1.0, 0.6, 0.3, 0.2]] * 2), torch.tensor([True, True]))
        return model

    full, fast = trained(), trained()
    full.update_np(np.full((2, 1), -1), np.ones((2, 1), dtype=bool), np.ones((2, 1)), np.array([True, False]),
                   np.zeros(2, dtype=bool), np.full((2, 1), -1))
    fast.decay_np()
    for name in ("hit", "tried", "score_sum", "accepted", "rejected"):
        assert torch.equal(getattr(full, name), getattr(fast, name)), name


def test_a_rejection_says_nothing_about_deeper_nodes():
    """Acceptance is learned per rank given the parent's: a chain rejected at depth 2 counts
    a miss at depth 2 only, so the deeper ranks keep what the row showed before."""
    model = AcceptanceModel(rows=2, max_nodes=4, device="cpu", prior=0.5)
    ranks = torch.tensor([[-1, 0, 1, 2, 3]] * 2)
    all_accepted = torch.ones(2, 5, dtype=torch.bool)
    for _ in range(8):
        model.update(ranks, all_accepted, None, torch.ones(2, dtype=torch.bool))
    before = model.conditional_rates()[0].clone()
    stopped = torch.tensor([[True, True, False, False, False], [True] * 5])  # row 0: depth 2 rejected
    model.update(ranks, stopped, None, torch.ones(2, dtype=torch.bool))
    after = model.conditional_rates()
    assert after[0, 1] < after[1, 1] - 0.1  # the rejected rank drops
    assert (after[0, 2:] > 0.7).all() and (after[0, 2:] >= before[2:] - 0.1).all()  # deeper ranks keep their rate
    # Tree parents: a node under a rejected sibling path is not counted as tried.
    parents = torch.tensor([[-1, 0, 0, 1, 2]])
    tree = AcceptanceModel(rows=1, max_nodes=4, device="cpu", prior=0.5)
    tree.update(torch.tensor([[-1, 0, 1, 2, 3]]), torch.tensor([[True, True, False, True, False]]), None,
                torch.ones(1, dtype=torch.bool), parents=parents)
    assert tree.tried[0, :4].tolist() == [1.0, 1.0, 1.0, 0.0]  # node 4's parent (node 2) was rejected


def test_accepting_rows_look_deeper():
    """A row that verifies only its first node and always accepts it: the unmeasured deeper
    ranks follow the row's per-token acceptance (the planner then tries them), they do not
    stay at the prior."""
    model = AcceptanceModel(rows=1, max_nodes=4, device="cpu", prior=0.5)
    before = model.rank_rates()[0]
    ranks, on_path = torch.tensor([[-1, 0]]), torch.tensor([[True, True]])
    for _ in range(10):
        model.update(ranks, on_path, None, torch.tensor([True]))
    after = model.rank_rates()[0]
    assert (after > before + 0.2).all() and after[3] > 0.6
    gains, seconds = after[None].float(), torch.tensor([1.0, 1.2, 1.3, 1.4, 1.5])
    assert choose_counts(before[None].float(), seconds).item() < choose_counts(gains, seconds).item() == 4


# ----------------------------------------------------------------------------- trees


def test_scores_count_at_face_value_until_history_says_otherwise():
    model = AcceptanceModel(2, 3, "cpu", prior=0.6)
    scores = torch.tensor([[0.9, 0.8, 0.7], [0.2, 0.1, 0.05]])
    assert torch.allclose(model.estimates(scores), scores.double())  # no history: the scores themselves
    # Row 0's confident drafts keep being rejected: its estimates fall below its scores.
    ranks = torch.tensor([[-1, 0, 1, 2]] * 2)
    for _ in range(6):
        model.update(ranks, torch.tensor([[True, False, False, False]] * 2), torch.cat([torch.ones(2, 1), scores], 1),
                     torch.ones(2, dtype=torch.bool))
    assert (model.estimates(scores)[0] < 0.5 * scores[0]).all()


def test_ngram_chain_scores_follow_the_match_length():
    # Row 0's last 3 tokens (7 8 9) occurred before; row 1 only its last token (5); row 2 nothing.
    history = torch.tensor([[7, 8, 9, 1, 2, 3, 4, 7, 8, 9], [5, 6, 1, 2, 3, 4, 8, 0, 0, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    lengths = torch.tensor([10, 10, 10])
    drafter = sk.NgramDrafter(num_tokens=4)
    unindexed = drafter.propose(history, lengths)  # the op path (no index: start() not called)
    drafter.start(history, lengths, 16)
    indexed = drafter.propose(history, lengths)
    for draft in (indexed, unindexed):
        assert draft.tree.tokens[0, 1:].tolist() == [1, 2, 3, 4] and draft.tree.tokens[1, 1:].tolist() == [6, 1, 2, 3]
        assert (draft.tree.parents[2, 1:] == -1).all()
        expected = sk.loop.drafters.match_scores(torch.tensor([3, 1, 0]), 4)
        assert torch.equal(draft.scores, expected)
    s = expected
    assert s[0, 1] > s[1, 1] and (s[:, 1:].diff(dim=1) <= 0).all() and (s[:, 0] == 1).all() and (s[2, 1:] == 0).all()
    assert abs(float(s[1, 1]) - 0.21) < 1e-6 and abs(float(s[0, 1]) - 0.6708) < 1e-4


def test_suffix_match_lengths_and_long_matches():
    """How far an n-gram match really reaches back: a copy in progress scores far above a
    chance 4-gram (both drafter paths measure it the same way)."""
    from specdec_kernels.loop.drafters import suffix_match_lengths
    history = torch.tensor([[1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 4, 0, 0], [7] * 13, [3, 1, 2, 5, 6, 8, 1, 2, 5, 0, 0, 0, 0]])
    lengths = torch.tensor([11, 5, 9])
    # Row 0: 1 2 3 4 occurred before, followed by 5; asking for 9 instead finds no such context.
    assert suffix_match_lengths(history, lengths, torch.tensor([5, 7, 6])).tolist() == [4, 4, 3]
    assert suffix_match_lengths(history, lengths, torch.tensor([9, 7, 4])).tolist() == [0, 4, 0]
    assert suffix_match_lengths(history, lengths, torch.tensor([5, 7, 6]), longest=2).tolist() == [2, 2, 2]
    # A 12-token copy against a 4-gram seen once: same max_n, very different scores.
    torch.manual_seed(0)
    copy = torch.randint(10, 100, (12,))
    rows = torch.stack([torch.cat([copy, torch.tensor([1, 2]), copy]),
                        torch.cat([torch.randint(100, 200, (8,)), copy[8:], torch.tensor([3, 4]), copy[8:12], torch.zeros(8, dtype=torch.long)])])
    lengths = torch.tensor([26, 18])
    drafter = sk.NgramDrafter(num_tokens=3)
    for indexed in (False, True):
        if indexed:
            drafter.start(rows, lengths, 32)
        draft = drafter.propose(rows, lengths)
        assert torch.equal(draft.scores, sk.loop.drafters.match_scores(torch.tensor([12, 4]), 3))
        assert draft.scores[0, 1] > 0.9 > 0.8 > draft.scores[1, 1]


def test_suffix_match_lengths_host_and_device_paths_agree():
    """The numpy path (CPU histories: only the first token's occurrences) and the torch path
    (GPU histories: every position) give the same lengths on random histories of few distinct
    tokens (many long runs), every `longest`, rows shorter than it, and first tokens absent."""
    from specdec_kernels.loop.drafters import _suffix_match_lengths_device, suffix_match_lengths
    gen = torch.Generator().manual_seed(5)
    for trial in range(40):
        rows, width = int(torch.randint(1, 5, (1,), generator=gen)), int(torch.randint(2, 90, (1,), generator=gen))
        history = torch.randint(0, 1 + trial % 4, (rows, width), generator=gen)
        lengths = torch.randint(1, width + 1, (rows,), generator=gen)
        first = torch.randint(0, 6, (rows,), generator=gen)
        for longest in (1, 3, 32):
            expected = _suffix_match_lengths_device(history, lengths, first, longest)
            assert torch.equal(suffix_match_lengths(history, lengths, first, longest), expected), (trial, longest)


def test_keep_nodes_renumbers_and_first_nodes_cuts():
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3], [-1, 0, 1, -1, -1, -1]])
    tokens = torch.tensor([[5, 10, 11, 12, 13, 14], [6, 20, 21, -1, -1, -1]])
    scores = torch.tensor([[1.0, 0.5, 0.4, 0.3, 0.2, 0.1], [1.0, 0.9, 0.8, 0, 0, 0]])
    draft = Draft(sk.TokenTree(tokens, parents), scores=scores)
    keep = torch.tensor([[True, False, True, False, True, False], [True, True, False, False, False, False]])
    pruned, new_index = keep_nodes(draft, keep)
    assert pruned.tree.tokens.tolist() == [[5, 11, 13], [6, 20, -1]]
    assert pruned.tree.parents.tolist() == [[-1, 0, 1], [-1, 0, -1]]
    assert pruned.scores[0].tolist() == pytest.approx([1.0, 0.4, 0.2])
    assert new_index[0, 4] == 2
    cut = first_nodes(draft, torch.tensor([2, 0]))
    assert cut.tree.parents.tolist() == [[-1, 0, 0], [-1, -1, -1]]
    assert cut.tree.tokens[1].tolist() == [6, -1, -1]


def test_drafters_honour_budgets(target, draft):
    ids, mask = left_pad(repetitive_prompts(3))
    lengths = mask.sum(1)
    history = torch.zeros(3, 80, dtype=torch.long)
    for b in range(3):
        history[b, : lengths[b]] = ids[b, ids.shape[1] - lengths[b] :]
    budget = torch.tensor([0, 2, 5])
    for drafter in (sk.NgramDrafter(num_tokens=6), sk.NgramDrafter(num_tokens=3, tree_width=3),
                    sk.MergedDrafter([sk.NgramDrafter(num_tokens=4), sk.NgramDrafter(num_tokens=2, max_n=2)])):
        drafter.start(history, lengths, 80)
        full = drafter.propose(history, lengths).tree.num_nodes - 1
        got = drafter.propose(history, lengths, budget=budget).tree.num_nodes - 1
        assert (got == torch.minimum(full, budget)).all(), (type(drafter).__name__, got, full)
    model_drafter = sk.DraftModelDrafter(draft, tree_widths=(2, 2, 1))
    calls = []
    handle = draft.register_forward_hook(lambda *args: calls.append(1))
    try:
        with sk.loop.hf.use_tree_attention(draft):
            model_drafter.start(history, lengths, 80)
            calls.clear()
            out = model_drafter.propose(history, lengths, budget=torch.tensor([0, 1, 2]))
            assert len(calls) == 1  # budget 2 = depth 1: the catch-up forward only, no expansion
            assert (out.tree.num_nodes - 1).tolist() == [0, 1, 2]
            assert out.scores is not None and (out.scores[:, 0] == 1).all()
            calls.clear()
            out = model_drafter.propose(history, lengths, budget=torch.tensor([0, 0, 0]))
            assert not calls and out.tree.tokens.shape[1] == 1  # nothing to draft: no forward
            out = model_drafter.propose(history, lengths, budget=torch.tensor([3, 9, 4]))
            tree = out.tree
            assert (tree.num_nodes - 1).tolist() == [3, 9, 4]
            real = tree.parents >= 0
            parent_scores = out.scores.gather(1, tree.parents.clamp(min=0))
            assert (out.scores[real] <= parent_scores[real] + 1e-6).all()  # path probabilities
    finally:
        handle.remove()
    shares = sk.MergedDrafter([sk.NgramDrafter(num_tokens=4), sk.NgramDrafter(num_tokens=2)]).split_budget(torch.tensor([0, 3, 6, 9]))
    assert [s.tolist() for s in shares] == [[0, 2, 4, 4], [0, 1, 2, 2]]


# ----------------------------------------------------------------------------- cost model


def test_cost_model_interpolates_and_refreshes():
    cost = cm.CostModel({"k": 1}, {1: ([1, 4, 16], [1.0, 1.0, 4.0])}, per_key=0.0)
    got = cost.forward_seconds(1, torch.tensor([1, 2, 4, 10, 16, 32]))
    assert torch.allclose(got, torch.tensor([1.0, 1.0, 1.0, 2.5, 4.0, 8.0], dtype=torch.float64))
    before = cost.step_seconds(2, torch.tensor([1, 2, 8]), prefix=cm.CAL_PREFIX)
    for _ in range(30):
        cost.observe(rows=2, width=8, prefix=cm.CAL_PREFIX, seconds=8.0)  # 16 tokens measured at 2x
    after = cost.step_seconds(2, torch.tensor([1, 2, 8]), prefix=cm.CAL_PREFIX)
    assert torch.allclose(after[2], 2 * before[2], rtol=1e-3)
    # One odd step (a hiccup, a drafter's catch-up) moves a fresh bucket a fifth of the way.
    fresh = cm.CostModel({"k": 1}, {1: ([1, 4, 16], [1.0, 1.0, 4.0])}, per_key=0.0)
    fresh.observe(rows=1, width=4, prefix=cm.CAL_PREFIX, seconds=3.0)  # 4 tokens measured at 3x
    assert float(fresh.step_seconds(1, torch.tensor([4]), prefix=cm.CAL_PREFIX)[0]) == pytest.approx(1.4)
    # A step is judged with its drafting: one that took what forward + drafting predict
    # leaves its bucket where it was (measured step times include drafting).
    steady = cm.CostModel({"k": 1}, {1: ([1, 4, 16], [1.0, 1.0, 4.0])}, per_key=0.0)
    for _ in range(10):
        steady.observe(rows=1, width=4, prefix=cm.CAL_PREFIX, seconds=1.5, draft_seconds=0.5)
    assert float(steady.step_seconds(1, torch.tensor([4]), cm.CAL_PREFIX, 0.5)[0]) == pytest.approx(1.5)


def test_cost_model_corrects_drafting_apart():
    """A step's measured drafting is taken out of what the forward's buckets learn, and the
    drafting's own cost model learns it: drafting that runs 4x its calibration scales the
    drafting's predictions only, and a plain step's prediction stays the forward's (one ratio
    over both would have doubled it: 3 s measured against 1.5 predicted)."""
    cost = cm.CostModel({"k": 1}, {1: ([1, 4, 16], [1.0, 1.0, 4.0])}, per_key=0.0)
    drafting = cm.DraftCost({"k": 1}, {1: ([1, 4], [0.5, 0.5])})
    for _ in range(40):
        cost.observe(rows=1, width=4, prefix=cm.CAL_PREFIX, seconds=3.0, draft_seconds=2.0)
        drafting.observe(rows=1, nodes=3, seconds=2.0)
    paid = float(drafting.seconds_np(1, np.array([3.0]), corrected=True)[0])
    assert paid == pytest.approx(2.0, rel=1e-3) and float(drafting.seconds_np(1, np.array([3.0]))[0]) == 0.5
    assert float(drafting.seconds_np(1, np.array([0.0]), corrected=True)[0]) == 0.0  # no drafting, no cost
    assert float(cost.step_seconds(1, torch.tensor([4]), cm.CAL_PREFIX, paid)[0]) == pytest.approx(3.0, rel=1e-3)
    assert float(cost.step_seconds(1, torch.tensor([1]), cm.CAL_PREFIX, 0.0)[0]) == pytest.approx(1.0, rel=1e-3)
    # A slow forward is the forward's: its bucket's ratio moves, the drafting's does not.
    for _ in range(40):
        cost.observe(rows=1, width=16, prefix=cm.CAL_PREFIX, seconds=10.0, draft_seconds=2.0)
    assert float(cost.step_seconds(1, torch.tensor([16]), cm.CAL_PREFIX, paid)[0]) == pytest.approx(10.0, rel=1e-3)
    assert float(cost.step_seconds(1, torch.tensor([4]), cm.CAL_PREFIX, paid)[0]) == pytest.approx(3.0, rel=1e-3)


def test_cost_model_reads_multi_row_steps_from_their_tables():
    """A step of R rows x W nodes comes from what R-row steps measured, not from R * W
    tokens of a 1-row chain; between measured row counts linear in the rows, past the last
    the widest table at the same token count."""
    cost = cm.CostModel({"k": 1}, {1: ([1, 2, 4, 8], [1.0, 1.0, 1.2, 1.5]), 8: ([1, 2], [2.0, 3.0])})
    assert cost.forward_seconds(8, torch.tensor([1, 2, 4])).tolist() == [2.0, 3.0, 5.0]  # past width 2: its slope
    assert float(cost.forward_seconds(1, torch.tensor([8]))[0]) == 1.5  # the 1-row chain of 8 tokens is cheaper
    t = 3 / 7
    expected = [(1 - t) * 1.0 + t * 2.0, (1 - t) * 1.0 + t * 3.0]
    assert torch.allclose(cost.forward_seconds(4, torch.tensor([1, 2])), torch.tensor(expected, dtype=torch.float64))
    assert float(cost.forward_seconds(16, torch.tensor([1]))[0]) == 3.0  # 16 tokens on the 8-row table
    assert cost.rows == [1, 8]
    again = cm.CostModel.from_dict(json.loads(json.dumps(cost.to_dict())))
    assert again.to_dict() == cost.to_dict()


def test_calibration_times_each_row_count(target):
    cost = cm.calibrate(target, rows=(1, 2, 4), max_tokens=8, repeats=1, verbose=False)
    assert cost.rows == [1, 2, 4]
    assert [cost.tables[r].x.tolist() for r in cost.rows] == [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4], [1, 2]]
    # every width up to 8 tokens (the products' kernels change there), then doubling
    assert cm.table_widths(8) == [1, 2, 4, 8, 16] and cm.table_widths(1) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128]
    assert cm.table_widths(2) == [1, 2, 3, 4, 8, 16, 32, 64] and cm.table_widths(3) == [1, 2, 4, 8, 16, 32]
    assert cm.table_widths(1, max_tokens=4) == [1, 2, 3, 4] and cm.table_widths(16, max_tokens=128) == [1, 2, 4, 8]
    for curve in cost.tables.values():  # never falling with the width
        assert bool((curve.y[1:] >= curve.y[:-1]).all())


def test_draft_cost_interpolates():
    cost = cm.DraftCost({"k": 1}, {1: ([1, 2, 4], [0.01, 0.02, 0.03]), 2: ([1, 2, 4], [0.02, 0.03, 0.05])})
    got = cost.seconds(1, torch.tensor([0, 1, 3, 4, 9]))
    assert torch.allclose(got, torch.tensor([0.0, 0.01, 0.025, 0.03, 0.03], dtype=torch.float64))  # flat past its size
    assert float(cost.seconds(2, torch.tensor([2]))[0]) == pytest.approx(0.03)
    assert float(cost.seconds(4, torch.tensor([1]))[0]) == pytest.approx(0.04)  # past 2 rows: the last slope
    assert float(cost.seconds(3, torch.tensor([0]))[0]) == 0.0  # no drafting, no cost
    free = cm.DraftCost({"k": 1}, {1: ([5], [0.002])})  # a free drafter: its full size, whatever the budget
    assert free.seconds(1, torch.tensor([0, 1, 5])).tolist() == [0.0, 0.002, 0.002]


def _budget(target, drafter, cost, draft_seconds, rows=8):
    """Planner.budget at `rows` rows (prior acceptance 0.6 per rank) with the drafting
    costing `draft_seconds` per step."""
    draft_cost = cm.DraftCost(cm.draft_identity(target, drafter), {rows: ([1, drafter.max_nodes], [draft_seconds] * 2)})
    planner = Planner(cost, draft_cost=draft_cost)
    planner.start(target, rows, drafter.max_nodes, "cpu", drafter)
    return planner.budget(prefix=cm.CAL_PREFIX), planner.drafting


def test_drafting_cost_decides_whether_to_draft(target, draft):
    """The gap docs/loop.md measured at batch 8: forwards of 45 / 55 / 78 ms at widths 1 /
    2 / 3 and an 18 ms head. 8 rows accepting 0.6 of a first node: (8 + 4.8) / 55 ms beats
    8 / 45 ms, but not once drafting's 18 ms is paid (12.8 / 73 ms); a 1 ms drafter still
    drafts."""
    drafter = sk.DraftModelDrafter(draft, num_tokens=2)
    cost = cm.CostModel(cm.identity(target), {8: ([1, 2, 3], [0.045, 0.055, 0.078])})
    counts, drafting = _budget(target, drafter, cost, 0.018)
    assert counts.tolist() == [0] * 8 and not drafting
    counts, drafting = _budget(target, drafter, cost, 0.001)
    assert counts.tolist() == [1] * 8 and drafting


def test_a_row_that_stopped_drafting_probes(target, draft):
    """A prior too low to draft (as a short earlier call may leave it): PROBE_AFTER steps
    draft nothing, then one node per row is drafted and verified whatever its estimate; a
    probe that is accepted brings drafting back."""
    drafter = sk.DraftModelDrafter(draft, num_tokens=2)
    cost = cm.CostModel(cm.identity(target), {2: ([1, 2, 3], [0.045, 0.055, 0.078])})
    draft_cost = cm.DraftCost(cm.draft_identity(target, drafter), {2: ([1, 2], [0.01, 0.01])})
    planner = Planner(cost, draft_cost=draft_cost, prior=0.02)
    planner.start(target, 2, drafter.max_nodes, "cpu", drafter)
    budgets = [planner.budget(prefix=cm.CAL_PREFIX).tolist() for _ in range(PROBE_AFTER)]
    assert budgets == [[0, 0]] * (PROBE_AFTER - 1) + [[1, 1]] and planner.drafting
    history, lengths = torch.randint(0, 50, (2, 12)), torch.tensor([12, 12])
    drafter.start(history, lengths, 32)
    kept = planner.select(drafter.propose(history, lengths, None, torch.tensor([1, 1])), prefix=cm.CAL_PREFIX)
    assert ((kept.tree.parents >= 0).sum(1) == 1).all()  # verified, though a 0.02 estimate would be pruned
    # The probe's node accepted in both rows: the rows draft again at once.
    node = int((kept.tree.parents[0] >= 0).nonzero()[0])
    out = SimpleNamespace(accepted_nodes=torch.tensor([[0, node], [0, node]]), num_accepted=torch.tensor([1, 1]))
    planner.observe(out, torch.ones(2, dtype=torch.bool))
    assert planner.budget(prefix=cm.CAL_PREFIX).tolist() == [1, 1] and planner.drafting


def test_observe_counts_the_first_depth_whatever_the_path_length(target, draft):
    """A chain of 3 whose first node is accepted and second rejected: rank 0 was tried and hit,
    rank 1 tried and missed, rank 2 not tried (its parent was rejected); then a step that
    rejects the first node: rank 0 tried again, not hit. (The accepted path's padding entries
    once overwrote the root's mark, so rank 0 counted only when the whole chain was accepted.)"""
    drafter = sk.DraftModelDrafter(draft, num_tokens=3)
    cost = cm.CostModel(cm.identity(target), {1: ([1, 4], [0.01, 0.01])})
    draft_cost = cm.DraftCost(cm.draft_identity(target, drafter), {1: ([1, 3], [1e-6, 1e-6])})
    planner = Planner(cost, draft_cost=draft_cost, decay=0.5)
    planner.start(target, 1, drafter.max_nodes, "cpu", drafter)
    chain = Draft(sk.TokenTree.chain(torch.tensor([7]), torch.tensor([[8, 9, 10]])))  # no scores: the rates decide
    for accepted, want_tried, want_hit in (([0, 1, -1, -1], [1, 1, 0], [1, 0, 0]),
                                           ([0, -1, -1, -1], [1.5, 0.5, 0], [0.5, 0, 0])):
        kept = planner.select(chain, prefix=cm.CAL_PREFIX)
        assert kept.tree.parents.tolist() == [[-1, 0, 1, 2]]  # free to verify: the whole chain
        path = torch.tensor([accepted])
        planner.observe(SimpleNamespace(accepted_nodes=path, num_accepted=(path >= 0).sum(1) - 1),
                        torch.ones(1, dtype=torch.bool))
        acceptance = planner.acceptance
        assert acceptance.tried[0, :3].tolist() == want_tried and acceptance.hit[0, :3].tolist() == want_hit


class CountingDrafter(sk.DraftModelDrafter):
    """A draft-model chain that counts the proposals asked of it."""

    def __init__(self, draft):
        super().__init__(draft, num_tokens=3)
        self.proposals = 0

    def propose(self, history, lengths, sampling=None, budget=None):
        self.proposals += 1
        return super().propose(history, lengths, sampling, budget)


@pytest.mark.parametrize("draft_seconds", [1e-6, 100.0])
def test_a_drafter_that_costs_more_than_it_saves_is_not_asked(target, draft, draft_seconds):
    ids, mask = left_pad(repetitive_prompts(2))
    drafter = CountingDrafter(draft)
    draft_cost = cm.DraftCost(cm.draft_identity(target, drafter), {1: ([1, 3], [draft_seconds] * 2)})
    out = sk.generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=10,
                      adaptive=Planner(flat_cost(target), draft_cost=draft_cost))
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 10))
    if draft_seconds > 1:  # 100 s of drafting against 1 s forwards (nodes free): plain decoding, asked
        # only for the probe every PROBE_AFTER idle steps
        assert drafter.proposals == out.stats.steps // PROBE_AFTER == 1 and out.stats.steps >= 9
    else:
        assert drafter.proposals > 0 and out.stats.nodes_per_step > 0


class SlowDrafter(CountingDrafter):
    """A draft-model chain whose every proposal also sleeps 50 ms."""

    def propose(self, history, lengths, sampling=None, budget=None):
        time.sleep(0.05)
        return super().propose(history, lengths, sampling, budget)


def test_generate_reports_drafting_apart(target, draft):
    """The loop measures each step's drafting apart: a drafter calibrated at 10 ms that takes
    50 ms more in the loop raises the drafting's predictions, not the plain step's (a 20 ms
    forward calibrated; the tiny target's real one takes a few ms). One ratio over both would
    have put a plain step at ~36 ms: (50 + a few) / (20 + 10) times 20."""
    ids, mask = left_pad(repetitive_prompts(2))
    drafter = SlowDrafter(draft)
    cost = flat_cost(target, seconds=0.02)
    draft_cost = cm.DraftCost(cm.draft_identity(target, drafter), {2: ([1, 3], [0.01, 0.01])})
    planner = Planner(cost, draft_cost=draft_cost, min_gain=0.0)
    out = sk.generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=12, adaptive=planner)
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 12))
    assert drafter.proposals >= 2  # (the first step is not learnt from: it also catches up on the prompt)
    plain = float(cost.step_seconds(2, torch.tensor([1]), cm.CAL_PREFIX, 0.0)[0])
    drafting = float(draft_cost.seconds_np(2, np.array([1.0]), corrected=True)[0])
    assert plain < 0.015 and drafting > 0.015
    assert float(draft_cost.seconds_np(2, np.array([1.0]))[0]) == 0.01  # the calibration itself is kept


class Skipping(Planner):
    """Every other step drafts nothing (a batch budget of 0 nodes): the drafter is not asked."""

    calls = 0

    def budget(self, prefix, remaining=None):
        self.max_batch_nodes = 0 if self.calls % 2 else None
        self.calls += 1
        return super().budget(prefix, remaining)


@pytest.mark.parametrize("kind", ["ngram_tree", "model_chain", "model_tree", "merged"])
def test_drafters_catch_up_after_skipped_steps(target, draft, kind):
    ids, mask = left_pad(repetitive_prompts(3))
    out = sk.generate(target, ids, attention_mask=mask, drafter=PLANNED[kind](draft), max_new_tokens=16,
                      adaptive=Skipping(flat_cost(target)))
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 16))
    widths = [step["width"] for step in out.stats.trace]
    assert widths[1::2] == [1] * len(widths[1::2]) and max(widths[::2]) > 1


def test_cost_model_key_names_the_attention_backend(target, monkeypatch):
    """A table measured with one tree-attention backend is not reused with another (on a GPU
    the reference, Triton and CUDA kernels cost very differently)."""
    from specdec_kernels.ops import _extension

    default = cm.identity(target)
    assert default["attention"] == _extension.available_backends("tree_attention", "cpu")[0]
    monkeypatch.setattr(_extension, "available_backends", lambda op, device_type: ["triton", "reference"])
    other = cm.identity(target)
    assert other["attention"] == "triton" and other != default


def test_cost_model_cached_per_model_and_device(target, tmp_path, capsys):
    path = tmp_path / "cost.json"
    first = cm.CostModel.for_model(target, path=path, verbose=True)
    assert "measuring" in capsys.readouterr().err and path.exists()
    assert json.loads(path.read_text())["key"] == cm.identity(target)
    again = cm.CostModel.for_model(target, path=path, verbose=True)
    assert capsys.readouterr().err == "" and again.to_dict() == first.to_dict()  # read, not measured
    assert first.rows == list(cm.ROWS)
    # a file from another device (or model): measured again, never used
    data = json.loads(path.read_text())
    data["key"]["device"] = "cuda:NVIDIA H100:sm90"
    for table in data["tables"].values():
        table["seconds"] = [1e-9] * len(table["seconds"])
    path.write_text(json.dumps(data))
    fresh = cm.CostModel.for_model(target, path=path, verbose=True)
    err = capsys.readouterr().err
    assert "measured for" in err and "measuring" in err
    assert fresh.key == cm.identity(target) and float(fresh.tables[1].y[0]) > 1e-9
    path.write_text("{not json")
    assert cm.CostModel.for_model(target, path=path, verbose=False).key == cm.identity(target)
    # another model's identity differs (its shapes)
    assert cm.identity(tiny_model(0, hidden=32))["config"] != cm.identity(target)["config"]
    # a planner handed another model's cost model refuses it
    other = cm.CostModel(cm.identity(tiny_model(0, hidden=32)), {1: ([1, 2], [1.0, 1.0])})
    ids, mask = left_pad(repetitive_prompts(1))
    with pytest.raises(ValueError, match="cost_model"):
        sk.generate(target, ids, drafter=sk.NgramDrafter(), max_new_tokens=2, adaptive=Planner(other))


def test_draft_cost_cached_per_drafter_identity(target, draft, tmp_path, capsys):
    drafter = sk.DraftModelDrafter(draft, num_tokens=3)
    key = cm.draft_identity(target, drafter)
    assert key["drafter"]["drafter"] == "DraftModelDrafter" and key["model"] == cm.identity(target)["model"]
    path = tmp_path / "draft.json"
    first = cm.DraftCost.for_drafter(target, drafter, path=path, verbose=True)
    assert "measuring the drafter" in capsys.readouterr().err
    assert json.loads(path.read_text())["key"] == key
    assert first.rows == list(cm.ROWS) and first.tables[1].x.tolist() == [1, 2, 3]
    again = cm.DraftCost.for_drafter(target, drafter, path=path, verbose=True)
    assert capsys.readouterr().err == "" and again.to_dict() == first.to_dict()  # read, not measured
    # Keyed by what sets the cost, never by object: an equal drafter (another object) shares
    # the file; other sizes, kinds or draft-model shapes do not; drafter files sit beside the
    # target's.
    assert cm.draft_identity(target, sk.DraftModelDrafter(draft, num_tokens=3)) == key
    others = [sk.DraftModelDrafter(draft, num_tokens=2), sk.DraftModelDrafter(draft, tree_widths=(2, 1, 1)),
              sk.DraftModelDrafter(tiny_model(5, hidden=32), num_tokens=3), sk.NgramDrafter(num_tokens=3)]
    keys = [cm.draft_identity(target, d) for d in others]
    assert all(k != key for k in keys) and len({json.dumps(k, sort_keys=True) for k in keys}) == len(keys)
    assert cm.default_path(key).parent == cm.default_path(cm.identity(target)).parent
    assert cm.default_path(key) != cm.default_path(cm.identity(target))
    # A free drafter is timed at its full size (generate never gives it a budget), and its
    # calibration leaves its own state alone (a suffix cache stays empty).
    suffix = sk.SuffixDrafter()
    free = cm.calibrate_drafter(target, suffix, rows=(1, 2), repeats=1, verbose=False)
    assert free.tables[2].x.tolist() == [suffix.max_nodes] and suffix.cached_tokens == 0
    # A planner handed another drafter's cost refuses it.
    ids, mask = left_pad(repetitive_prompts(1))
    with pytest.raises(ValueError, match="draft_cost"):
        sk.generate(target, ids, drafter=sk.NgramDrafter(), max_new_tokens=2, adaptive=Planner(draft_cost=first))


def test_sampled_plans_reproducible_across_processes(target, draft):
    """Sampled calls plan from the calibrated costs alone, which the first call measures and
    caches: a later process (here: the in-process cache cleared) reads the same numbers and
    makes the same trees, whatever greedy calls learned from step times in between."""
    ids, mask = left_pad(repetitive_prompts(3))

    def sampled():
        out = sk.generate(target, ids, attention_mask=mask, drafter=sk.DraftModelDrafter(draft, num_tokens=3),
                          max_new_tokens=12, temperature=0.8, seed=11)
        return out.sequences, [(s["rows"], s["width"]) for s in out.stats.trace]

    first = sampled()  # measures the target and the drafter, and caches both
    files = sorted(p.name for p in (cm.default_path(cm.identity(target)).parent).iterdir())
    assert any("-draft-" in name for name in files) and len(files) == 2
    sk.generate(target, ids, attention_mask=mask, drafter=sk.DraftModelDrafter(draft, num_tokens=3), max_new_tokens=12)
    same = sampled()  # same process, after a greedy call refreshed the costs from step times
    assert torch.equal(same[0], first[0]) and same[1] == first[1]
    cm._LOADED.clear()  # a new process: the costs come from the files
    again = sampled()
    assert torch.equal(again[0], first[0]) and again[1] == first[1]


# ----------------------------------------------------------------------------- the loop


PLANNED = {
    "ngram_chain": lambda d: sk.NgramDrafter(num_tokens=5),
    "ngram_tree": lambda d: sk.NgramDrafter(num_tokens=4, max_n=3, tree_width=3),
    "model_chain": lambda d: sk.DraftModelDrafter(d, num_tokens=3),
    "model_tree": lambda d: sk.DraftModelDrafter(d, tree_widths=(2, 2, 1)),
    "merged": lambda d: sk.MergedDrafter([sk.NgramDrafter(num_tokens=4), sk.DraftModelDrafter(d, tree_widths=(2, 1))]),
}


@pytest.mark.parametrize("kind", list(PLANNED))
def test_greedy_identity_with_pruning_and_plain_rows(target, draft, kind):
    """A batch node budget smaller than the rows' trees: some rows verify nothing, others a
    pruned tree; output still equals HF greedy."""
    ids, mask = left_pad(repetitive_prompts(4))
    expected = hf_greedy(target, ids, mask, 20)
    planner = Planner(flat_cost(target), max_batch_nodes=3)
    out = sk.generate(target, ids, attention_mask=mask, drafter=PLANNED[kind](draft), max_new_tokens=20, adaptive=planner)
    assert torch.equal(out.sequences, expected)
    assert all(round(step["nodes_per_row"] * step["rows"]) <= 3 for step in out.stats.trace)
    assert out.stats.nodes_per_step > 0
    assert any(step["nodes_per_row"] < 1 for step in out.stats.trace)  # some rows drafted nothing


def test_expensive_verification_means_plain_decoding(target):
    ids, mask = left_pad(repetitive_prompts(2))
    out = sk.generate(target, ids, attention_mask=mask, drafter=sk.NgramDrafter(), max_new_tokens=10,
                      adaptive=Planner(linear_cost(target, per_token=100.0)))
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 10))
    assert out.stats.nodes_per_step == 0 and out.stats.steps == 10
    fixed = sk.generate(target, ids, attention_mask=mask, drafter=sk.NgramDrafter(num_tokens=5), max_new_tokens=10, adaptive=False)
    assert torch.equal(fixed.sequences, out.sequences) and fixed.stats.nodes_per_step > 0
    assert len(fixed.stats.trace) == fixed.stats.steps
    assert {"rows", "width", "nodes_per_row", "accepted_per_row", "seconds"} <= set(fixed.stats.trace[0])


def test_free_verification_keeps_the_full_tree(target):
    ids, mask = left_pad(repetitive_prompts(2))
    fixed = sk.generate(target, ids, attention_mask=mask, drafter=sk.NgramDrafter(num_tokens=5), max_new_tokens=16, adaptive=False)
    planned = sk.generate(target, ids, attention_mask=mask, drafter=sk.NgramDrafter(num_tokens=5), max_new_tokens=16,
                          adaptive=Planner(flat_cost(target), min_gain=0.0))
    assert torch.equal(planned.sequences, fixed.sequences)
    # Every useful node verified: the same steps. Only drafts deeper than a row's remaining
    # tokens could emit are left out (the last steps).
    assert planned.stats.steps == fixed.stats.steps
    nodes = [(p["nodes_per_row"], f["nodes_per_row"]) for p, f in zip(planned.stats.trace, fixed.stats.trace)]
    assert all(p <= f for p, f in nodes) and nodes[0][0] == nodes[0][1] and nodes[-1][0] < nodes[-1][1]


def test_next_call_starts_from_what_the_last_accepted(target):
    ids, mask = left_pad(repetitive_prompts(2))
    planner = Planner(flat_cost(target))
    sk.generate(target, ids, attention_mask=mask, drafter=sk.NgramDrafter(), max_new_tokens=12, adaptive=planner)
    (learned,) = planner_module._LEARNED.values()
    assert 0.05 <= learned <= 0.95 and learned != planner.prior
    planner.start(target, 3, 5, "cpu", sk.NgramDrafter())
    assert planner.acceptance.prior == learned
    tree = sk.NgramDrafter(tree_width=2)
    planner.start(target, 3, tree.max_nodes, "cpu", tree)  # another kind of drafter: the default
    assert planner.acceptance.prior == planner.prior


@pytest.fixture(scope="module")
def small_pair():
    from test_generate import SMALL_VOCAB

    return (tiny_model(20, vocab=SMALL_VOCAB, hidden=32, logit_scale=8.0),
            tiny_model(21, vocab=SMALL_VOCAB, hidden=32, logit_scale=8.0))


@pytest.mark.parametrize("kind", ["ngram_tree", "model_chain", "model_tree", "merged"])
def test_sampling_exact_with_pruning_and_plain_rows(small_pair, kind):
    """Chi-square with the planner cutting trees: half the rows' node budget for the batch,
    so some rows verify nothing and the others keep part of their (sampled or deterministic)
    tree."""
    target, draft = small_pair
    ids = torch.tensor(SAMPLE_PROMPT).expand(SAMPLE_ROWS, -1)
    drafter = PLANNED[kind](draft)
    # Drafting priced at a flat 1 ms (not measured: the 2,000 rows would extrapolate the
    # measured 4- and 8-row timings 500-fold, and timing noise then decided whether any node
    # paid against the flat 1 s step).
    draft_cost = cm.DraftCost(cm.draft_identity(target, drafter), {1: ([1, drafter.max_nodes], [1e-3, 1e-3])})
    planner = Planner(flat_cost(target), draft_cost=draft_cost, max_batch_nodes=SAMPLE_ROWS // 2)
    out = sk.generate(target, ids, drafter=drafter, max_new_tokens=2, temperature=1.0, seed=4321, adaptive=planner)
    pvalue = chi_square_pvalue(out.sequences[:, -2:], exact_pair_distribution(target, SAMPLE_PROMPT))
    assert pvalue > 1e-3, f"{kind}: chi-square p = {pvalue}"
    first = out.stats.trace[0]
    assert 0 < first["nodes_per_row"] <= 0.5 + 1e-9  # pruned: at most half a node per row on average
    assert out.stats.acceptance_per_depth[0] > 0.02


class HiddenRecorder(sk.NgramDrafter):
    """An n-gram drafter that records the hidden states generate hands it."""

    needs_hidden_states = True

    def __init__(self, target):
        super().__init__(num_tokens=3)
        self.target, self.seen = target, []

    def start(self, history, lengths, capacity):
        super().start(history, lengths, capacity)
        self.seen = []  # per call (so the cost calibration's twin records into its own list)

    def observe(self, hidden_states, accepted_nodes=None, num_accepted=None):
        self.seen.append((hidden_states.clone(), accepted_nodes, num_accepted))


def test_hidden_states_reach_drafters_that_ask(target):
    ids, mask = left_pad(repetitive_prompts(2))
    recorder = HiddenRecorder(target)
    out = sk.generate(target, ids, attention_mask=mask, drafter=recorder, max_new_tokens=8)
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 8))
    prefill, *steps = recorder.seen
    lengths = mask.sum(1)
    assert prefill[0].shape == (2, int(lengths.max()) - 1, 64) and prefill[1] is None
    assert len(steps) == out.stats.steps and all(a is not None and n is not None for _, a, n in steps)
    # the prefill's hidden states are the LM head's input: lm_head of them gives the model's logits
    row = 1
    n = int(lengths[row]) - 1
    with torch.no_grad():
        logits = target(ids[row : row + 1, ids.shape[1] - n - 1 : -1]).logits[0]
        torch.testing.assert_close(target.lm_head(prefill[0][row, :n]), logits, atol=1e-4, rtol=1e-4)
