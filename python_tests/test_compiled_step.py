"""`generate(..., compile=...)`: the tree-verify forward through torch.compile (loop/compiled.py).

Greedy output with compile on equals HF `generate` and compile off token for token (tiny
random models, batches whose rows finish early so the row bucket shrinks, trees whose width
changes bucket); sampled rows keep the target's distribution (chi-square); the forward traces
as one graph (no graph break); graphs are reused by later calls; compile time stays out of
what the planner learns; bad arguments are refused.

Each compiled graph costs seconds (inductor's C++ build), so the tests share their models
(module fixtures) and keep to few shape buckets. The default model's test compiles a 30-layer
model (minutes on 2 cores): it runs only with SPECDEC_SLOW_TESTS=1 (and the model installed).
"""

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("scipy.stats")

import specdec_kernels as sk  # noqa: E402
from specdec_kernels.loop import compiled, hf  # noqa: E402
from specdec_kernels.ops.tree import TokenTree  # noqa: E402
from test_generate import (SAMPLE_PROMPT, chi_square_pvalue, exact_pair_distribution,  # noqa: E402,F401
                           fresh_planner_memory, hf_greedy, left_pad, one_thread, own_cache_dir, planned,
                           repetitive_prompts, tiny_model)

slow = pytest.mark.skipif(os.environ.get("SPECDEC_SLOW_TESTS") != "1",
                          reason="compiles a full-size model (minutes): set SPECDEC_SLOW_TESTS=1")
EOS = 102  # an id the tiny target (seed 40) emits in 3 of the 4 rows, at different steps


@pytest.fixture(scope="module")
def target():
    return tiny_model(40)


@pytest.fixture(scope="module")
def draft():
    return tiny_model(41)


def test_buckets():
    assert [compiled.width_bucket(w) for w in (1, 2, 3, 5, 8, 9, 33, 64, 65, 130)] == \
        [1, 2, 4, 8, 8, 16, 64, 64, 128, 192]
    assert [compiled.rows_bucket(r) for r in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert [compiled.capacity_bucket(c) for c in (1, 256, 257)] == [256, 256, 512]


@pytest.mark.parametrize("kind", ["ngram_tree", "model_tree"])
def test_greedy_matches_hf_and_eager(target, draft, kind):
    """Batch 4 with left padding and an eos: rows finish at different steps (the row bucket
    shrinks 4 -> 2 -> 1), trees change width bucket; every token as HF and as eager."""
    ids, mask = left_pad(repetitive_prompts(4))
    # Fixed-size drafts (adaptive=False) keep the number of graphs (and the test's time) down.
    drafter = (lambda: sk.NgramDrafter(min_n=1, max_n=3, num_tokens=3, tree_width=2)) if kind == "ngram_tree" \
        else (lambda: sk.DraftModelDrafter(draft, tree_widths=(2, 1)))
    expected = hf_greedy(target, ids, mask, 20, eos_token_id=EOS)
    eager = sk.generate(target, ids, attention_mask=mask, drafter=drafter(), max_new_tokens=20, eos_token_id=EOS,
                        adaptive=False, compile=False)
    fast = sk.generate(target, ids, attention_mask=mask, drafter=drafter(), max_new_tokens=20, eos_token_id=EOS,
                       adaptive=False, compile=True)
    assert torch.equal(eager.sequences, expected)
    assert torch.equal(fast.sequences, expected)
    assert fast.stats.compiled and not eager.stats.compiled
    assert eager.stats.time_compile == 0.0
    assert len({t["rows"] for t in fast.stats.trace}) > 1, "no row finished early: the test lost its point"


@pytest.mark.parametrize("every", [1, 4])
def test_plain_decoding_matches_hf(target, monkeypatch, every):
    """Also with the stop check every 4 steps (as on a GPU): the static cache's lengths
    bound grows between checks, rows that finished run on as no-ops."""
    monkeypatch.setitem(sk.loop.generate.STOP_CHECK_EVERY, "cpu", every)
    ids, mask = left_pad(repetitive_prompts(3))
    out = sk.generate(target, ids, attention_mask=mask, max_new_tokens=12, compile=True)
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 12))
    eos = int(out.sequences[0, ids.shape[1] + 2])  # row 0 stops at its third token, mid-interval
    out = sk.generate(target, ids, attention_mask=mask, max_new_tokens=12, compile=True, eos_token_id=eos)
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 12, eos_token_id=eos))


def test_graphs_reused_across_calls(target):
    """A second call with the same model and shapes compiles nothing; the first one's
    compile time is reported once, apart from the steps the planner learned from."""
    fresh = tiny_model(42)  # a model no other test compiled for
    ids, mask = left_pad(repetitive_prompts(2))
    planner = planned(fresh)
    observed = []
    observe_time = planner.observe_time
    planner.observe_time = lambda seconds: (observed.append(seconds), observe_time(seconds))
    drafter = sk.NgramDrafter(num_tokens=3)
    first = sk.generate(fresh, ids, attention_mask=mask, drafter=drafter, max_new_tokens=10, compile=True,
                        adaptive=planner)
    assert first.stats.time_compile > 0
    compiling = [t for t in first.stats.trace if t["compiled_graph"]]
    assert compiling and sum(t["seconds"] for t in compiling) >= first.stats.time_compile
    # The planner saw every step but the first and those that compiled.
    assert len(observed) == sum(1 for t in first.stats.trace[1:] if not t["compiled_graph"])
    second = sk.generate(fresh, ids, attention_mask=mask, drafter=drafter, max_new_tokens=10, compile=True,
                         adaptive=planner)
    assert second.stats.time_compile == 0.0
    assert not any(t["compiled_graph"] for t in second.stats.trace)
    assert torch.equal(first.sequences, second.sequences)
    assert torch.equal(second.sequences, hf_greedy(fresh, ids, mask, 10))


def test_one_graph_no_break(target):
    """The traced forward is one graph (what fullgraph=True also enforces): our ops appear as
    torch.ops.specdec nodes through their fake implementations."""
    batch = 2
    with torch.inference_mode(), hf.use_tree_attention(target):
        forward = compiled.StaticForward("default")
        cache = forward.cache(target, batch, 48)
        hf.prefill(target, cache, torch.randint(1, 100, (batch, 48)), torch.tensor([20, 13]))
        tree = TokenTree(torch.randint(1, 100, (batch, 4)), torch.tensor([[-1, 0, 0, 1]] * batch))
        cache.static_forward, cache.static_seqlens = True, cache.seqlens.clone()
        try:
            explained = torch._dynamo.explain(compiled._tree_forward)(
                target, cache, tree.tokens, tree.position_ids(cache.seqlens), tree.mask(), cache.static_seqlens, False)
        finally:
            cache.static_forward = False
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    targets = {str(node.target) for graph in explained.graphs for node in graph.graph.nodes}
    assert any("specdec.tree_attention" in t for t in targets), sorted(targets)


def test_sampled_rows_exact(draft):
    """Sampled rows with compile on: the first two tokens' joint distribution is the
    target's (chi-square), with a draft model's chain verified by the compiled forward."""
    from test_generate import SMALL_VOCAB

    target = tiny_model(20, vocab=SMALL_VOCAB, hidden=32, logit_scale=8.0)
    small_draft = tiny_model(21, vocab=SMALL_VOCAB, hidden=32, logit_scale=8.0)
    rows = 1000
    ids = torch.tensor(SAMPLE_PROMPT).expand(rows, -1)
    out = sk.generate(target, ids, drafter=sk.DraftModelDrafter(small_draft, num_tokens=2), max_new_tokens=2,
                      temperature=1.0, seed=4321, adaptive=False, compile=True)
    assert out.stats.compiled
    pvalue = chi_square_pvalue(out.sequences[:, -2:], exact_pair_distribution(target, SAMPLE_PROMPT))
    assert pvalue > 1e-3, f"chi-square p = {pvalue}"
    assert out.stats.acceptance_per_depth[0] > 0.05  # drafts were verified, accepted and rejected


def test_same_seed_same_sample_compiled_or_not(target, draft):
    """Compiled and eager forwards give the same logits up to rounding, so one seed gives
    the same sampled tokens either way (on these models; ties at the rounding level aside)."""
    ids, mask = left_pad(repetitive_prompts(2))
    run = lambda c: sk.generate(target, ids, attention_mask=mask, drafter=sk.NgramDrafter(num_tokens=3),  # noqa: E731
                                max_new_tokens=10, temperature=0.8, seed=7, adaptive=False, compile=c).sequences
    assert torch.equal(run(True), run(False))


def test_bad_compile_arguments(target):
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="compile"):
        sk.generate(target, ids, max_new_tokens=2, compile="fastest")
    with pytest.raises(ValueError, match="kv_page_size"):
        sk.generate(target, ids, max_new_tokens=2, compile=True, kv_page_size=4)
    with pytest.raises(ValueError, match="CUDA"):
        sk.generate(target, ids, max_new_tokens=2, compile="reduce-overhead")
    assert compiled.resolve_mode("auto", torch.device("cpu"), False) is None  # the measured default: eager
    assert compiled.resolve_mode("auto", torch.device("cuda"), False) is None  # unverified on GPU: off


def test_static_cache_keeps_rows_in_place(target):
    """keep_rows moves the kept rows to the front of the same buffers (no new allocation:
    CUDA graphs keep their addresses) and the forward runs on the rows' bucket."""
    cache = compiled.StaticForward("default").cache(target, 5, 40)
    layer = cache.layers[0]
    assert layer.k_full.shape[0] == 8 and cache.bucket_rows == 8 and layer.k_buf.shape[0] == 5
    layer.k_full.copy_(torch.arange(8, dtype=layer.k_full.dtype)[:, None, None, None].expand_as(layer.k_full))
    cache.set_lengths(torch.tensor([3, 4, 5, 6, 7]))
    address = layer.k_full.data_ptr()
    cache.keep_rows(torch.tensor([4, 1]))
    assert layer.k_full.data_ptr() == address and cache.bucket_rows == 2
    assert layer.k_buf[:, 0, 0, 0].tolist() == [4.0, 1.0] and cache.seqlens.tolist() == [7, 4]


@slow
def test_default_model_greedy_matches_hf():
    """SmolLM2-135M-Instruct (when installed): compiled greedy output equals HF's and eager."""
    from specdec_kernels import models

    try:
        model, tokenizer = models.load_model(verbose=False)
    except (ModuleNotFoundError, ImportError, OSError) as error:
        pytest.skip(f"default model not available: {error}")
    torch.set_num_threads(max(torch.get_num_threads(), 2))
    text = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n# the same, iterative:\n"
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                              pad_token_id=tokenizer.eos_token_id)
    drafter = sk.NgramDrafter(num_tokens=4)
    out = sk.generate(model, ids, drafter=drafter, max_new_tokens=24, adaptive=False, compile=True)
    eager = sk.generate(model, ids, drafter=drafter, max_new_tokens=24, adaptive=False, compile=False)
    assert torch.equal(out.sequences, expected)
    assert torch.equal(eager.sequences, expected)


def test_family_with_a_graph_break_is_refused_clearly():
    """StableLM's decoder layers drop the forward kwargs, so its attention reads the tree
    metadata from a context variable, which dynamo cannot trace: compile=True says so
    (naming the family and compile=False) instead of running a broken graph."""
    from test_model_coverage import FAMILIES

    stablelm = next((f for f in FAMILIES if f.name == "StableLM" and f.available()), None)
    if stablelm is None:
        pytest.skip("this transformers has no StableLM")
    model = stablelm.build(0)
    ids, mask = left_pad(repetitive_prompts(2))
    with pytest.raises(compiled.CompileError, match=r"stablelm.*compile=False"):
        sk.generate(model, ids, attention_mask=mask, max_new_tokens=4, compile=True)
    out = sk.generate(model, ids, attention_mask=mask, max_new_tokens=4, compile=False)
    assert torch.equal(out.sequences, hf_greedy(model, ids, mask, 4))


@pytest.mark.parametrize("return_hidden", [True, (0, 2)], ids=["last", "layers"])
def test_hidden_states_match_eager(target, return_hidden):
    """Drafters that read the target's hidden states (heads) get the same states: the last
    layer's compiled (a padded tree step: 3 rows -> 4, 5 nodes -> 8), chosen layers' eagerly
    (transformers' output_hidden_states does not trace), both as hf.forward."""
    batch = 3
    history, lengths = torch.randint(1, 100, (batch, 40)), torch.tensor([20, 13, 30])
    tree = TokenTree(torch.randint(1, 100, (batch, 5)), torch.tensor([[-1, 0, 0, 1, 1]] * batch))
    with torch.inference_mode(), hf.use_tree_attention(target):
        forward = compiled.StaticForward("default")
        static_cache, eager_cache = forward.cache(target, batch, 48), hf.TreeKVCache.for_model(target, batch, 48)
        hf.prefill(target, static_cache, history, lengths)
        hf.prefill(target, eager_cache, history, lengths)
        positions = tree.position_ids(eager_cache.seqlens)
        logits, hidden = forward.forward(target, static_cache, tree.tokens, positions, tree.mask(), return_hidden=return_hidden)
        want_logits, want_hidden = hf.forward(target, eager_cache, tree.tokens, positions, tree.mask(), return_hidden=return_hidden)
    assert logits.shape == want_logits.shape and hidden.shape == want_hidden.shape
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-4, atol=1e-4)
    assert forward.compiled_steps == (1 if return_hidden is True else 0)
