"""`generate` on a paged KV cache (`generate(..., kv_page_size=N)`, `hf.TreeKVCache(page_size=N)`).

Greedy output on a paged cache equals HF `generate(do_sample=False)` and the dense cache token
for token (page sizes 1, 3 and 16, batches with left padding, chain and tree drafters, rows
finishing at different steps); sampled output equals the dense cache's for the same seed. The
cache itself: writes land where the block table says, compaction and keep_rows follow it,
tree-step logits match the dense cache's, and bad page sizes are refused by name.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import specdec_kernels as sk  # noqa: E402
from specdec_kernels.loop import hf  # noqa: E402
from test_generate import (  # noqa: E402,F401
    fresh_planner_memory,
    draft,
    hf_greedy,
    left_pad,
    one_thread,
    own_cache_dir,
    repetitive_prompts,
    target,
)

DRAFTERS = {
    "ngram_chain": lambda d: sk.NgramDrafter(min_n=1, max_n=4, num_tokens=5),
    "ngram_tree": lambda d: sk.NgramDrafter(min_n=1, max_n=3, num_tokens=4, tree_width=3),
    "model_tree": lambda d: sk.DraftModelDrafter(d, tree_widths=(2, 2, 1)),  # the draft's own cache stays dense
}


def logical(cache: hf.TreeKVCache, layer: int, which: int = 0) -> torch.Tensor:
    """[B, P * page_size, H, D]: layer `layer`'s keys (which=0) or values (1) in token order,
    gathered through the block table."""
    pool = cache.buffers()[2 * layer + which]
    pages = pool[cache.block_table.long()]  # [B, P, page_size, H, D]
    return pages.flatten(1, 2)


# ----------------------------------------------------------------------------- generate


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kind", ["ngram_chain", "ngram_tree"])
def test_paged_greedy_matches_hf_and_dense(target, kind, batch, page_size):
    ids, mask = left_pad(repetitive_prompts(batch))
    expected = hf_greedy(target, ids, mask, 24)
    dense = sk.generate(target, ids, attention_mask=mask, drafter=DRAFTERS[kind](None), max_new_tokens=24)
    paged = sk.generate(target, ids, attention_mask=mask, drafter=DRAFTERS[kind](None), max_new_tokens=24,
                        kv_page_size=page_size)
    assert torch.equal(paged.sequences, expected)
    assert torch.equal(paged.sequences, dense.sequences)
    assert paged.stats.tokens_per_step > 1.0  # drafts were accepted: compaction through the table ran


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_rows_leave_batch(target, page_size):
    """Rows stop at eos at different steps and leave the batch: the block table is re-indexed."""
    ids, mask = left_pad(repetitive_prompts(4))
    free = hf_greedy(target, ids, mask, 20)[:, ids.shape[1]:]
    eos = int(free[1, 6])
    expected = hf_greedy(target, ids, mask, 20, eos_token_id=eos)
    out = sk.generate(target, ids, attention_mask=mask, drafter=DRAFTERS["ngram_tree"](None), max_new_tokens=20,
                      eos_token_id=eos, kv_page_size=page_size, adaptive=False)
    assert torch.equal(out.sequences, expected)
    assert out.stats.new_tokens[1] <= 7 and len(set(out.stats.new_tokens)) > 1  # rows left at different steps


def test_paged_with_draft_model(target, draft):
    ids, mask = left_pad(repetitive_prompts(3))
    out = sk.generate(target, ids, attention_mask=mask, drafter=DRAFTERS["model_tree"](draft), max_new_tokens=16,
                      kv_page_size=3)
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 16))


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_compaction_moves(target, page_size):
    """The target as its own tree drafter (two children at depth 1): nearly every step accepts a
    path like [0, 1, 3], whose entries compaction must move through the block table (n-gram
    chains accept [0, 1, 2, ...], which needs no move). Skipping or misrouting those moves
    changes this output."""
    ids, mask = left_pad(repetitive_prompts(4))
    out = sk.generate(target, ids, attention_mask=mask, drafter=sk.DraftModelDrafter(target, tree_widths=(2, 2)),
                      max_new_tokens=24, kv_page_size=page_size, adaptive=False)
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 24))
    assert out.stats.tokens_per_step == 3.0  # every step accepted depth 2


def test_paged_single_token_prompts(target):
    """A one-token prompt leaves nothing to prefill: the first tree step runs on an empty paged
    cache (attention on the new states) and the next ones through the block table."""
    ids, mask = left_pad([[5], [7, 8, 9], [4]])
    for page_size in (1, 3):
        out = sk.generate(target, ids, attention_mask=mask, drafter=sk.NgramDrafter(), max_new_tokens=8,
                          kv_page_size=page_size)
        assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 8))


@pytest.mark.parametrize("adaptive", [False, True])
def test_paged_sampling_same_as_dense(target, adaptive):
    ids, mask = left_pad(repetitive_prompts(4))
    kwargs = dict(attention_mask=mask, max_new_tokens=16, temperature=1.0, top_p=0.9, seed=77, adaptive=adaptive)
    dense = sk.generate(target, ids, drafter=DRAFTERS["ngram_tree"](None), **kwargs)
    paged = sk.generate(target, ids, drafter=DRAFTERS["ngram_tree"](None), kv_page_size=3, **kwargs)
    assert torch.equal(paged.sequences, dense.sequences)
    assert paged.stats.steps == dense.stats.steps


def test_bad_page_sizes(target):
    ids, mask = left_pad(repetitive_prompts(2))
    for bad in (0, -2, 2.5, True, "16"):
        with pytest.raises(ValueError, match="kv_page_size"):
            sk.generate(target, ids, attention_mask=mask, max_new_tokens=2, kv_page_size=bad)
        with pytest.raises(ValueError, match="page_size"):
            hf.TreeKVCache(1, 1, 8, 1, 4, torch.float32, "cpu", page_size=bad)


def test_cli_kv_page_size_flag():
    from specdec_kernels.cli import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "x", "--kv-page-size", "16"])
    assert args.kv_page_size == 16
    assert build_parser().parse_args(["generate", "--prompt", "x"]).kv_page_size is None


# ----------------------------------------------------------------------------- the cache


def test_paged_cache_layout():
    """Pages are dealt interleaved between rows and in reverse: every page used once, no row's
    pages contiguous or ascending (so a kernel ignoring the table would read wrong slots)."""
    cache = hf.TreeKVCache(2, 3, 10, 2, 4, torch.float32, "cpu", page_size=4)
    table = cache.block_table
    assert table.dtype == torch.int32 and table.shape == (3, 3)
    assert sorted(table.flatten().tolist()) == list(range(9))
    assert all((row[1:] < row[:-1]).all() for row in table)
    assert cache.buffers()[0].shape == (9, 4, 2, 4) and len(cache.buffers()) == 4
    assert cache.attention_block_table() is None  # empty: forwards get the new states
    assert hf.TreeKVCache(2, 3, 10, 2, 4, torch.float32, "cpu").block_table is None  # dense by default


def test_paged_cache_writes_compacts_and_keeps_rows():
    """update() scatters through the block table; compact_ and keep_rows give the same logical
    cache as the dense TreeKVCache given the same calls."""
    torch.manual_seed(0)
    args = dict(num_layers=2, batch_size=3, capacity=20, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    dense, paged = hf.TreeKVCache(**args), hf.TreeKVCache(**args, page_size=3)
    for cache in (dense, paged):
        cache.set_lengths(torch.tensor([0, 0, 0]))
    prompt = torch.randn(2, 3, 2, 7, 4)  # [layer, B, H, T, D]
    tree = torch.randn(2, 3, 2, 5, 4)
    for cache in (dense, paged):
        for layer in range(2):
            k, v = cache.update(prompt[layer], -prompt[layer], layer)
            assert torch.equal(k, prompt[layer]) and torch.equal(v, -prompt[layer])  # empty: the new states
        cache.set_lengths(torch.tensor([7, 4, 6]))
        assert (cache.attention_block_table() is None) == (cache is dense)
        for layer in range(2):
            k, v = cache.update(tree[layer], -tree[layer], layer)
        if cache is paged:
            assert k.data_ptr() == paged.buffers()[2].data_ptr() and k.shape == (paged.buffers()[2].shape[0], 2, 3, 4)
    for layer in range(2):
        torch.testing.assert_close(logical(paged, layer)[:, :12], dense.layers[layer].k_buf[:, :12])
        torch.testing.assert_close(logical(paged, layer, 1)[:, :12], dense.layers[layer].v_buf[:, :12])
    accepted = torch.tensor([[0, 2, 3, -1, -1], [0, -1, -1, -1, -1], [0, 1, 4, -1, -1]], dtype=torch.int32)
    num_accepted = torch.tensor([2, 0, 2], dtype=torch.int32)
    for cache in (dense, paged):
        cache.accept(accepted, num_accepted, torch.tensor([3, 1, 2]))
    assert paged.seqlens.tolist() == dense.seqlens.tolist() == [10, 5, 8]
    for layer in range(2):
        for b, n in enumerate([10, 5, 8]):
            torch.testing.assert_close(logical(paged, layer)[b, :n], dense.layers[layer].k_buf[b, :n])
            torch.testing.assert_close(logical(paged, layer, 1)[b, :n], dense.layers[layer].v_buf[b, :n])
    pools = [buf.data_ptr() for buf in paged.buffers()]
    table = paged.block_table.clone()
    keep = torch.tensor([2, 0])
    for cache in (dense, paged):
        cache.keep_rows(keep)
    assert torch.equal(paged.block_table, table[keep]) and paged.seqlens.tolist() == [8, 10]
    assert [buf.data_ptr() for buf in paged.buffers()] == pools  # no K/V moved
    for b, n in enumerate([8, 10]):
        torch.testing.assert_close(logical(paged, 1)[b, :n], dense.layers[1].k_buf[b, :n])


def test_paged_tree_forward_logits_match_dense(target):
    """hf.forward of a token tree after a ragged prefill: the same logits on both caches."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 100, (n,), generator=g) for n in (12, 7, 10)]
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 5])
    tokens = torch.randint(1, 100, (3, parents.numel()), generator=g)
    tree = sk.TokenTree(tokens, parents)
    lengths = torch.tensor([len(p) for p in prompts])
    history = torch.zeros(3, 40, dtype=torch.long)
    for b, p in enumerate(prompts):
        history[b, : len(p)] = p
    tree.tokens[:, 0] = history[torch.arange(3), lengths - 1]
    logits = []
    with torch.no_grad(), hf.use_tree_attention(target):
        for page_size in (None, 5):
            cache = hf.TreeKVCache.for_model(target, 3, 40, page_size=page_size)
            hf.prefill(target, cache, history, lengths)
            positions = cache.seqlens.long()[:, None] + tree.depths
            logits.append(hf.forward(target, cache, tree.tokens, positions, tree.mask()))
        with pytest.raises(NotImplementedError, match="paged"):  # a plain forward cannot read the pages
            hf.forward(target, cache, tree.tokens[:, :2], positions[:, :2])
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)
